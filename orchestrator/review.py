"""Manual review: what is parked, why, the evidence — and an operator's decision, ledgered.

A transaction lands in ``manual_review`` when nothing automatic may decide: a lookup that stays
unavailable past its budget, a dedup window gone, a refused compensation, a refused step after
the pivot. A committed transaction can wait too, when its outbox event is parked. An operator
reads the evidence (provider answers, attempts, the ledger), decides what really happened to the
parked effect, and records it with a reason. The decision is a ledger row like any other
(operator and reason in its detail); the transaction then continues on the normal path — commit,
or compensate — picked up by the next worker pass. Nothing is ever edited silently.

What a decision means, per kind of effect:

- a forward step: ``confirmed`` — it happened (the provider's id with ``--remote-id``); the saga
  goes on forward. ``failed`` — it never happened; the saga turns back and compensates.
- a reversal (compensation): ``confirmed`` — the reversal is settled outside the engine (done by
  hand, or written off by the person deciding: the reason says which); the saga goes on
  reversing the rest and ends compensated. ``failed`` is refused: a reversal that did not
  happen leaves the forward effect standing, and nothing automatic can follow from that.
- a step after the pivot (``retriable``): it may not turn the saga back, so only ``confirmed``
  (done by hand) is accepted; the saga goes on forward.
- an outbox event of a committed saga: ``confirmed`` (it was delivered) or ``failed`` (it was
  not, and will not be); the transaction stays committed either way.

So every parked effect has a decision that moves its saga on to a terminal state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledger import effects, events, transactions
from ledger.effects import Effect, EffectKind
from ledger.errors import LeaseLost
from ledger.events import LedgerEntry
from ledger.states import EffectState, TxState
from orchestrator.engine import Orchestrator
from orchestrator.errors import IdentifierInvalid, NotResolvable, TransactionNotFound

EXCERPT_ROWS = 12
#: Most transactions ``review list`` shows at once (``--limit``); the rest are counted.
PAGE_MAX = 200
#: The provider id an operator records lives in the effect's own column: never longer than it.
REMOTE_ID_MAX = effects.REMOTE_ID_MAX
#: An operator's reason is kept whole in the ledger row, up to this many characters.
REASON_MAX = effects.OPERATOR_REASON_MAX
#: The operator's name is part of the lease owner written while the decision lands.
OPERATOR_PREFIX = "operator:"
OPERATOR_MAX = transactions.LEASE_OWNER_MAX - len(OPERATOR_PREFIX)


@dataclass(frozen=True)
class ParkedEffect:
    """One effect waiting for a person, with what the provider said about it."""

    kind: str
    key: str
    name: str
    provider: str
    action: str
    attempts: int
    lookups: int
    last_error: str | None
    #: The ``--as`` values ``resolve`` accepts for it (see the module's docstring).
    decisions: tuple[str, ...]


@dataclass(frozen=True)
class ParkedTransaction:
    """A transaction waiting for a person (parked, or committed with a parked outbox event)
    with its evidence."""

    tx_id: str
    saga: str
    status: str
    reason: dict[str, Any] | None
    parked: list[ParkedEffect]
    ledger: list[LedgerEntry]


async def _decisions(orch: Orchestrator, digest: str, e: Effect) -> tuple[str, ...]:
    confirmed, failed = EffectState.CONFIRMED.value, EffectState.FAILED.value
    try:
        await _check_may_fail(orch, digest, e)
    except IdentifierInvalid:
        return (confirmed,)
    return (confirmed, failed)


async def show(orch: Orchestrator, tx_id: str) -> ParkedTransaction:
    """The evidence of one transaction (parked or not)."""
    view = await orch.get(tx_id)
    ledger = await orch.ledger(tx_id)
    digest = view.tx.definition_digest
    parked = [
        ParkedEffect(
            e.kind.value,
            e.key,
            e.name,
            e.provider,
            e.action,
            e.attempts,
            e.lookups,
            e.last_error,
            await _decisions(orch, digest, e),
        )
        for e in [*view.operations, *view.compensations, *view.outbox]
        if e.state is EffectState.MANUAL_REVIEW
    ]
    reason = view.tx.error if isinstance(view.tx.error, dict) else None
    return ParkedTransaction(
        tx_id, view.tx.saga_name, view.tx.status.value, reason, parked, ledger[-EXCERPT_ROWS:]
    )


@dataclass(frozen=True)
class ParkedPage:
    """One page of what waits for a person, and how many wait in all."""

    items: list[ParkedTransaction]
    skip: int
    total: int

    @property
    def more(self) -> int:
        """How many come after this page."""
        return max(0, self.total - self.skip - len(self.items))


async def list_parked(orch: Orchestrator, *, limit: int = 50, skip: int = 0) -> ParkedPage:
    """Transactions in manual_review and committed ones whose outbox event is parked, oldest
    first: ``limit`` of them from ``skip`` on, with the total so nothing is left out unsaid."""
    if not 1 <= limit <= PAGE_MAX:
        raise IdentifierInvalid(f"--limit must be 1 to {PAGE_MAX}", details={"field": "limit"})
    if skip < 0:
        raise IdentifierInvalid("--skip must be 0 or more", details={"field": "skip"})
    async with orch.store.read() as conn:
        rows = await transactions.parked(conn, limit=limit, skip=skip)
        total = await transactions.count_parked(conn)
    return ParkedPage([await show(orch, r.tx_id) for r in rows], skip, total)


def _check_text(field: str, given: str, limit: int, what: str) -> None:
    if len(given) > limit:
        raise IdentifierInvalid(
            f"{what} is longer than {limit} characters", details={"field": field}
        )


def _check_decision(
    as_state: str, reason: str, operator: str, remote_id: str | None
) -> EffectState:
    """Refuse bad input before anything is read or written; returns the decided state."""
    if as_state not in (EffectState.CONFIRMED.value, EffectState.FAILED.value):
        raise IdentifierInvalid("--as must be confirmed or failed", details={"field": "as"})
    for field, given in (("reason", reason), ("operator", operator)):
        if not given.strip():
            raise IdentifierInvalid(
                "a reason and an operator are required", details={"field": field}
            )
    # Limits refused, never cut: a decision is recorded as given or not at all.
    _check_text("reason", reason, REASON_MAX, "the reason")
    _check_text("operator", operator, OPERATOR_MAX, "the operator")
    to_state = EffectState(as_state)
    if remote_id is not None:
        if to_state is EffectState.FAILED:
            # A failed effect has no provider id; recording the decision without it would drop
            # what the operator typed without a word.
            raise IdentifierInvalid(
                "--remote-id names the provider's effect: give it with --as confirmed only",
                details={"field": "remote_id"},
            )
        if not remote_id.strip():
            # An empty id would be replaced by a made-up one: say so instead.
            raise IdentifierInvalid(
                "--remote-id is empty: give the provider's id, or leave the option out",
                details={"field": "remote_id"},
            )
        _check_text("remote_id", remote_id, REMOTE_ID_MAX, "--remote-id")
    return to_state


async def _check_may_fail(orch: Orchestrator, digest: str, target: Effect) -> None:
    """``failed`` only where something automatic can follow (see the module's docstring)."""
    if target.kind is EffectKind.COMPENSATION:
        raise IdentifierInvalid(
            "a reversal cannot be resolved as failed: the forward effect would stand with "
            "nothing left to undo it. Settle it by hand and resolve it --as confirmed",
            details={"field": "as"},
        )
    if target.kind is EffectKind.OPERATION and await _is_retriable(orch, digest, target.name):
        raise IdentifierInvalid(
            "a step after the pivot may not turn the saga back: do it by hand and resolve it "
            "--as confirmed",
            details={"field": "as"},
        )


async def _is_retriable(orch: Orchestrator, digest: str, step: str) -> bool:
    # The definition the transaction runs (pinned by digest), not whatever has its name now.
    definition = await orch._definition(digest)
    return bool(definition.step(step).get("retriable"))


async def resolve(
    orch: Orchestrator,
    tx_id: str,
    op: str,
    *,
    as_state: str,
    reason: str,
    operator: str,
    remote_id: str | None = None,
) -> TxState:
    """Record an operator's decision on a parked effect (named by step/event name or key) and
    hand the transaction back to the workers; returns its status afterwards."""
    to_state = _check_decision(as_state, reason, operator, remote_id)
    view = await orch.get(tx_id)
    candidates = [
        e
        for e in [*view.operations, *view.compensations, *view.outbox]
        if e.state is EffectState.MANUAL_REVIEW and op in (e.key, e.name)
    ]
    if len(candidates) != 1:
        raise NotResolvable(details={"tx_id": tx_id, "op": op})
    target = candidates[0]
    if to_state is EffectState.FAILED:
        await _check_may_fail(orch, view.tx.definition_digest, target)
    owner = f"{OPERATOR_PREFIX}{operator}"
    async with orch.store.transaction() as work:
        chain = await events.chain_of(work.conn, tx_id)
        await effects.resolve(
            work,
            chain,
            target.kind,
            target.key,
            to_state,
            operator=operator,
            reason=reason,
            remote_id=remote_id,
        )
        if view.tx.status is TxState.MANUAL_REVIEW and target.kind is not EffectKind.OUTBOX:
            resume = (
                TxState.COMPENSATING
                if target.kind is EffectKind.COMPENSATION
                else TxState.EXECUTING
            )
            txc = transactions.TxClaim(tx_id, view.tx.fence, TxState.MANUAL_REVIEW, owner)
            try:
                await transactions.transition(
                    work,
                    chain,
                    txc,
                    resume,
                    action="operator_resume",
                    release=True,
                    retry_in_ms=0,
                    detail={"operator": operator, "op": target.key},
                    clear_error=True,
                )
                await work.send_writes()  # its LeaseLost must be raised here, not at commit
            except LeaseLost:
                raise NotResolvable(details={"tx_id": tx_id, "op": op}) from None
            return resume
    return view.tx.status


async def exists(orch: Orchestrator, tx_id: str) -> bool:
    """True when the transaction exists."""
    try:
        await orch.get(tx_id)
    except TransactionNotFound:
        return False
    return True
