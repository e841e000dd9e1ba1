"""Status enums and the allowed-transition tables: the one place that says which edge exists.

Every write in :mod:`ledger` checks its edge here before it touches a row
(:func:`check_tx_transition`, :func:`check_effect_transition`); the orchestrator decides
*which* edge to take, this module decides whether the edge exists at all. A transition the
table lacks is a bug and raises :class:`~ledger.errors.InvalidTransition`, never a silent
overwrite.

The hot path (a saga's writes and ledger rows) reads a member's string as ``member._value_``,
the attribute :mod:`enum` stores it in, rather than ``member.value``: on Python 3.11 ``.value``
is a descriptor written in Python, about 0.25 µs a read, and a saga read it some 60 times
(``docs/benchmarks-log.md``, item 43). Both give the same ``str``.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Final

from ledger.errors import InvalidTransition


class TxState(StrEnum):
    """Lifecycle of one saga transaction."""

    STAGED = "staged"  # plan persisted, awaiting a person's confirmation
    PREPARED = "prepared"  # plan persisted and confirmed; nothing has crossed the boundary
    EXECUTING = "executing"  # forward steps are running (some may be in doubt)
    VALIDATING = "validating"  # every forward op confirmed; post-conditions being checked
    COMMITTED = "committed"  # terminal: all effects confirmed and validated
    COMPENSATING = "compensating"  # reverse plan persisted; reversals running
    COMPENSATED = "compensated"  # terminal: every confirmed reversible effect reversed
    FAILED = "failed"  # terminal: ended with no effect ever confirmed
    MANUAL_REVIEW = "manual_review"  # parked with evidence until an operator resolves it


class EffectState(StrEnum):
    """Shared state machine of an operation, a compensation step and an outbox event."""

    PENDING = "pending"  # intent durable, never claimed: the provider has not seen it
    EXECUTING = "executing"  # claimed; the provider may have been called
    UNKNOWN = "unknown"  # called, outcome not known: lookup before anything else
    CONFIRMED = "confirmed"  # the provider's answer (or an operator) proves the effect
    FAILED = "failed"  # the provider said no, or proved it never happened
    MANUAL_REVIEW = "manual_review"  # budget exhausted or undecidable: a person decides
    SKIPPED = "skipped"  # a forward step never reached because the saga turned back


TX_TERMINAL: Final = frozenset({TxState.COMMITTED, TxState.COMPENSATED, TxState.FAILED})
EFFECT_TERMINAL: Final = frozenset({EffectState.CONFIRMED, EffectState.FAILED, EffectState.SKIPPED})

TX_TRANSITIONS: Final[Mapping[TxState, frozenset[TxState]]] = {
    TxState.STAGED: frozenset(
        {
            TxState.PREPARED,  # staged -- person confirmed --> prepared
            TxState.EXECUTING,  # staged -- confirmed, first claim in the same commit --> executing
            TxState.FAILED,  # staged -- rejected / released, nothing was ever sent --> failed
        }
    ),
    TxState.PREPARED: frozenset(
        {
            TxState.EXECUTING,  # prepared -- first claim --> executing
            TxState.FAILED,  # prepared -- abandoned before any call --> failed
        }
    ),
    TxState.EXECUTING: frozenset(
        {
            TxState.VALIDATING,  # executing -- every forward op confirmed --> validating
            TxState.COMPENSATING,  # executing -- failed after confirmed effects --> compensating
            TxState.FAILED,  # executing -- definite failure, nothing confirmed --> failed
            TxState.MANUAL_REVIEW,  # executing -- undecidable / budget spent --> manual_review
        }
    ),
    TxState.VALIDATING: frozenset(
        {
            TxState.COMMITTED,  # validating -- post-conditions hold --> committed
            TxState.COMPENSATING,  # validating -- post-condition failed --> compensating
            TxState.MANUAL_REVIEW,  # validating -- failed, effect irreversible --> manual_review
        }
    ),
    TxState.COMPENSATING: frozenset(
        {
            TxState.COMPENSATED,  # compensating -- every reversal confirmed --> compensated
            TxState.FAILED,  # compensating -- forward effects all proved absent --> failed
            TxState.MANUAL_REVIEW,  # compensating -- reversal budget exhausted --> manual_review
        }
    ),
    TxState.MANUAL_REVIEW: frozenset(
        {
            TxState.EXECUTING,  # manual_review -- operator resolved an op --> executing
            TxState.VALIDATING,  # manual_review -- operator confirmed the last op --> validating
            TxState.COMPENSATING,  # manual_review -- operator resolved as failed --> compensating
            TxState.COMPENSATED,  # manual_review -- last reversal confirmed --> compensated
            TxState.FAILED,  # manual_review -- nothing happened --> failed
        }
    ),
    TxState.COMMITTED: frozenset(),
    TxState.COMPENSATED: frozenset(),
    TxState.FAILED: frozenset(),
}

EFFECT_TRANSITIONS: Final[Mapping[EffectState, frozenset[EffectState]]] = {
    EffectState.PENDING: frozenset(
        {
            EffectState.EXECUTING,  # pending -- claim --> executing
            EffectState.SKIPPED,  # pending -- saga turned back before reaching it --> skipped
        }
    ),
    EffectState.EXECUTING: frozenset(
        {
            EffectState.EXECUTING,  # executing -- lease expired, re-claimed --> executing
            EffectState.CONFIRMED,  # executing -- provider confirmed / lookup found --> confirmed
            EffectState.FAILED,  # executing -- provider rejected --> failed
            EffectState.UNKNOWN,  # executing -- timeout / lost response --> unknown
            EffectState.MANUAL_REVIEW,  # executing -- undecidable / budget spent --> manual_review
        }
    ),
    EffectState.UNKNOWN: frozenset(
        {
            EffectState.EXECUTING,  # unknown -- reconcile claim (lookup first) --> executing
            EffectState.MANUAL_REVIEW,  # unknown -- budget exhausted --> manual_review
        }
    ),
    EffectState.MANUAL_REVIEW: frozenset(
        {
            EffectState.CONFIRMED,  # manual_review -- operator: it happened --> confirmed
            EffectState.FAILED,  # manual_review -- operator: it never happened --> failed
        }
    ),
    EffectState.CONFIRMED: frozenset(),
    EffectState.FAILED: frozenset(),
    EffectState.SKIPPED: frozenset(),
}

#: Transaction statuses a recovering worker may pick up: in flight, nobody holding a live lease.
RESUMABLE: Final = frozenset(
    {TxState.PREPARED, TxState.EXECUTING, TxState.VALIDATING, TxState.COMPENSATING}
)
#: States from which a claim may take an effect (derived, so the claim CAS and the table agree).
CLAIMABLE: Final = frozenset(
    s for s, nxt in EFFECT_TRANSITIONS.items() if EffectState.EXECUTING in nxt
)
#: States in which the provider may already hold the effect: a claim from here looks up first.
MAYBE_SENT: Final = frozenset({EffectState.EXECUTING, EffectState.UNKNOWN})


def check_tx_transition(from_state: TxState, to_state: TxState) -> None:
    """Raise :class:`InvalidTransition` unless ``from_state -> to_state`` is a transaction edge."""
    if to_state not in TX_TRANSITIONS[from_state]:
        raise InvalidTransition("transaction", from_state.value, to_state.value)


def check_effect_transition(from_state: EffectState, to_state: EffectState) -> None:
    """Raise :class:`InvalidTransition` unless ``from_state -> to_state`` is an effect edge."""
    if to_state not in EFFECT_TRANSITIONS[from_state]:
        raise InvalidTransition("effect", from_state.value, to_state.value)
