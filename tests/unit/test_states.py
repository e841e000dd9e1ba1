"""Every pair of states against the transition tables."""

from __future__ import annotations

import itertools

import pytest

from ledger.errors import InvalidTransition
from ledger.states import (
    CLAIMABLE,
    EFFECT_TERMINAL,
    EFFECT_TRANSITIONS,
    MAYBE_SENT,
    TX_TERMINAL,
    TX_TRANSITIONS,
    EffectState,
    TxState,
    check_effect_transition,
    check_tx_transition,
)

# The edges the design allows, written out independently of the table under test.
TX_EDGES = {
    ("staged", "prepared"),
    ("staged", "executing"),
    ("staged", "failed"),
    ("prepared", "executing"),
    ("prepared", "failed"),
    ("executing", "validating"),
    ("executing", "compensating"),
    ("executing", "failed"),
    ("executing", "manual_review"),
    ("validating", "committed"),
    ("validating", "compensating"),
    ("validating", "manual_review"),
    ("compensating", "compensated"),
    ("compensating", "failed"),
    ("compensating", "manual_review"),
    ("manual_review", "executing"),
    ("manual_review", "validating"),
    ("manual_review", "compensating"),
    ("manual_review", "compensated"),
    ("manual_review", "failed"),
}
EFFECT_EDGES = {
    ("pending", "executing"),
    ("pending", "skipped"),
    ("executing", "executing"),
    ("executing", "confirmed"),
    ("executing", "failed"),
    ("executing", "unknown"),
    ("executing", "manual_review"),
    ("unknown", "executing"),
    ("unknown", "manual_review"),
    ("manual_review", "confirmed"),
    ("manual_review", "failed"),
}


@pytest.mark.parametrize(("a", "b"), list(itertools.product(TxState, TxState)))
def test_tx_pair(a: TxState, b: TxState) -> None:
    if (a.value, b.value) in TX_EDGES:
        check_tx_transition(a, b)
    else:
        with pytest.raises(InvalidTransition):
            check_tx_transition(a, b)


@pytest.mark.parametrize(("a", "b"), list(itertools.product(EffectState, EffectState)))
def test_effect_pair(a: EffectState, b: EffectState) -> None:
    if (a.value, b.value) in EFFECT_EDGES:
        check_effect_transition(a, b)
    else:
        with pytest.raises(InvalidTransition):
            check_effect_transition(a, b)


def test_terminal_states_have_no_way_out() -> None:
    assert all(not TX_TRANSITIONS[s] for s in TX_TERMINAL)
    assert all(not EFFECT_TRANSITIONS[s] for s in EFFECT_TERMINAL)


def test_unknown_never_becomes_failed_without_a_claim() -> None:
    # Only a provider's answer (after a claim) or an operator (from manual_review) decides.
    assert EffectState.FAILED not in EFFECT_TRANSITIONS[EffectState.UNKNOWN]
    assert EffectState.CONFIRMED not in EFFECT_TRANSITIONS[EffectState.UNKNOWN]


def test_claimable_and_maybe_sent() -> None:
    assert {EffectState.PENDING, EffectState.EXECUTING, EffectState.UNKNOWN} == CLAIMABLE
    assert {EffectState.EXECUTING, EffectState.UNKNOWN} == MAYBE_SENT
