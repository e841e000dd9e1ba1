"""Manual review: what is parked, why, the evidence — and an operator's decision, ledgered.

A transaction lands in ``manual_review`` when nothing automatic may decide: a lookup that stays
unavailable past its budget, a dedup window gone, a refused compensation. An operator reads the
evidence (provider answers, attempts, the ledger), decides what really happened to the parked
effect, and records it with a reason. The decision is a ledger row like any other (operator and
reason in its detail); the transaction then continues on the normal path — commit, or
compensate — picked up by the next worker pass. Nothing is ever edited silently.
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


@dataclass(frozen=True)
class ParkedTransaction:
    """A transaction in manual_review with its evidence."""

    tx_id: str
    saga: str
    reason: dict[str, Any] | None
    parked: list[ParkedEffect]
    ledger: list[LedgerEntry]


def _parked(rows: list[Effect]) -> list[ParkedEffect]:
    return [
        ParkedEffect(
            e.kind.value, e.key, e.name, e.provider, e.action, e.attempts, e.lookups, e.last_error
        )
        for e in rows
        if e.state is EffectState.MANUAL_REVIEW
    ]


async def show(orch: Orchestrator, tx_id: str) -> ParkedTransaction:
    """The evidence of one transaction (parked or not)."""
    view = await orch.get(tx_id)
    ledger = await orch.ledger(tx_id)
    parked = _parked(view.operations) + _parked(view.compensations) + _parked(view.outbox)
    reason = view.tx.error if isinstance(view.tx.error, dict) else None
    return ParkedTransaction(tx_id, view.tx.saga_name, reason, parked, ledger[-EXCERPT_ROWS:])


async def list_parked(orch: Orchestrator, *, limit: int = 100) -> list[ParkedTransaction]:
    """Every transaction in manual_review (oldest first), plus committed ones whose outbox
    event is parked."""
    async with orch.store.read() as conn:
        rows = await transactions.in_status(conn, TxState.MANUAL_REVIEW, limit=limit)
    return [await show(orch, r.tx_id) for r in rows]


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
    if as_state not in (EffectState.CONFIRMED.value, EffectState.FAILED.value):
        raise IdentifierInvalid("--as must be confirmed or failed", details={"field": "as"})
    for field, given in (("reason", reason), ("operator", operator)):
        if not given.strip():
            raise IdentifierInvalid(
                "a reason and an operator are required", details={"field": field}
            )
    to_state = EffectState(as_state)
    if remote_id is not None and to_state is EffectState.FAILED:
        # A failed effect has no provider id; recording the decision without it would drop
        # what the operator typed without a word.
        raise IdentifierInvalid(
            "--remote-id names the provider's effect: give it with --as confirmed only",
            details={"field": "remote_id"},
        )
    view = await orch.get(tx_id)
    candidates = [
        e
        for e in [*view.operations, *view.compensations, *view.outbox]
        if e.state is EffectState.MANUAL_REVIEW and op in (e.key, e.name)
    ]
    if len(candidates) != 1:
        raise NotResolvable(details={"tx_id": tx_id, "op": op})
    target = candidates[0]
    owner = f"operator:{operator}"[:128]
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
