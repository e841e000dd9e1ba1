"""Repository of saga transactions: insert, lease-claim, fenced status transitions.

The transaction row carries its own lease and fence: whoever drives a saga (the caller of
``execute`` or a recovering worker) holds it, and every status change is fenced by it, so two
workers can never both decide "commit" or "compensate" for the same transaction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
    and_,
    bindparam,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.dml import Insert, ReturningUpdate, Update

from ledger import dialects, events
from ledger.errors import LeaseLost
from ledger.frozen import quick_init, replacer
from ledger.schema import (
    Json,
    column_length,
    outbox,
    transactions,
    transactions_due,
    transactions_live,
)
from ledger.states import RESUMABLE, TX_TERMINAL, EffectState, TxState, check_tx_transition
from ledger.store import Chain, Work


@dataclass(frozen=True, slots=True)
class TxRecord:
    """One transaction row as stored."""

    tx_id: str
    definition_digest: str
    saga_name: str
    business_key: str | None
    inputs: Any
    status: TxState
    lease_owner: str | None
    lease_until: int | None
    fence: int
    attempts: int
    next_attempt_at: int | None
    error: Any
    execution_id: str | None
    created_at: int
    updated_at: int
    #: Extra template scope frozen at prepare (query results of a command), or ``None``.
    context: Any = None

    @property
    def terminal(self) -> bool:
        """Committed, compensated or failed."""
        return self.status in TX_TERMINAL


@quick_init
@dataclass(frozen=True, slots=True)
class TxClaim:
    """The lease on a transaction: its fence guards every status change of the holder."""

    tx_id: str
    fence: int
    status: TxState
    owner: str


_replace_claim = replacer(TxClaim)  # dataclasses.replace, cheaper (ledger.frozen)


def _record(row: Row[Any]) -> TxRecord:
    m = row._mapping
    return TxRecord(
        tx_id=m["tx_id"],
        definition_digest=m["definition_digest"],
        saga_name=m["saga_name"],
        business_key=m["business_key"],
        inputs=m["inputs"],
        status=TxState(m["status"]),
        lease_owner=m["lease_owner"],
        lease_until=m["lease_until"],
        fence=int(m["fence"]),
        attempts=int(m["attempts"]),
        next_attempt_at=m["next_attempt_at"],
        error=m["error"],
        execution_id=m["execution_id"],
        created_at=int(m["created_at"]),
        updated_at=int(m["updated_at"]),
        context=m["context"],
    )


def _insert_leased(now: ColumnElement[int]) -> Insert:
    """A new transaction leased to its creator (the lease on the database clock)."""
    return transactions.insert().values(lease_until=now + bindparam("p_lease_ms", type_=BigInteger))


def _transition_statement(
    now: ColumnElement[int], error_change: int, drop_lease: bool, schedule: int
) -> Update:
    values: dict[str, Any] = {
        "status": bindparam("p_status"),
        "updated_at": bindparam("p_updated_at", type_=BigInteger),
    }
    if error_change == 1:
        values["error"] = bindparam("p_error", type_=Json)
    elif error_change == 2:
        values["error"] = None
    if drop_lease:
        values["lease_owner"] = None
        values["lease_until"] = None
    if schedule == 1:
        values["next_attempt_at"] = now + bindparam("p_retry_in_ms", type_=BigInteger)
    elif schedule == 2:
        values["next_attempt_at"] = None
    return (
        update(transactions)
        .where(
            transactions.c.tx_id == bindparam("p_tx_id"),
            transactions.c.fence == bindparam("p_fence", type_=BigInteger),
            transactions.c.status == bindparam("p_from"),
        )
        .values(values)
    )


async def insert(
    work: Work,
    chain: Chain,
    *,
    tx_id: str,
    definition_digest: str,
    saga_name: str,
    inputs: Mapping[str, Any],
    owner: str | None,
    lease_ms: int,
    business_key: str | None = None,
    execution_id: str | None = None,
    context: Mapping[str, Any] | None = None,
    start: bool = True,
    staged: bool = False,
) -> TxClaim:
    """Persist a prepared transaction, leased to ``owner``; with ``start`` also move it to
    ``executing`` (one row, two ledger entries: prepare and start share the commit).

    ``owner=None`` enqueues it: no lease, due at once, for whichever worker claims it first.

    With ``staged`` the plan is persisted unleased in ``staged``: nothing runs until a person
    confirms it (:func:`claim_staged`); recovery never picks it up."""
    if staged:
        return await _insert_staged(
            work,
            chain,
            tx_id=tx_id,
            definition_digest=definition_digest,
            saga_name=saga_name,
            inputs=inputs,
            business_key=business_key,
            execution_id=execution_id,
            context=context,
        )
    status = TxState.EXECUTING if start else TxState.PREPARED
    if start:
        check_tx_transition(TxState.PREPARED, TxState.EXECUTING)
    if owner is None:
        # Enqueued: no holder yet and due at once; the first worker's claim takes fence 1.
        stmt: Insert = work.statement("transactions.insert", lambda _now: transactions.insert())
        lease: dict[str, Any] = {"lease_owner": None, "lease_until": None, "fence": 0}
    else:
        stmt = work.statement("transactions.insert_leased", _insert_leased)
        lease = {"lease_owner": owner, "p_lease_ms": lease_ms, "fence": 1}
    await work.write(
        stmt,
        {
            **lease,
            "tx_id": tx_id,
            "definition_digest": definition_digest,
            "saga_name": saga_name,
            "business_key": business_key,
            "inputs": dict(inputs),
            "status": status._value_,
            "attempts": 1 if owner is not None else 0,
            "next_attempt_at": None,
            "error": None,
            "execution_id": execution_id,
            "context": dict(context) if context is not None else None,
            "created_at": work.now_ms,
            "updated_at": work.now_ms,
        },
        row=("transactions", tx_id),
    )
    work.log(
        chain,
        action="prepare",
        to_state=TxState.PREPARED._value_,
        detail={
            "saga": saga_name,
            "definition": definition_digest,
            "owner": owner,
            "fence": lease["fence"],
        },
    )
    if start:
        work.log(
            chain, action="start", from_state=TxState.PREPARED._value_, to_state=status._value_
        )
    return TxClaim(tx_id=tx_id, fence=int(lease["fence"]), status=status, owner=owner or "")


async def _insert_staged(
    work: Work,
    chain: Chain,
    *,
    tx_id: str,
    definition_digest: str,
    saga_name: str,
    inputs: Mapping[str, Any],
    business_key: str | None,
    execution_id: str | None,
    context: Mapping[str, Any] | None,
) -> TxClaim:
    await work.conn.execute(
        transactions.insert().values(
            tx_id=tx_id,
            definition_digest=definition_digest,
            saga_name=saga_name,
            business_key=business_key,
            inputs=dict(inputs),
            status=TxState.STAGED.value,
            lease_owner=None,
            lease_until=None,
            fence=0,
            attempts=0,
            next_attempt_at=None,
            error=None,
            execution_id=execution_id,
            context=dict(context) if context is not None else None,
            created_at=work.now_ms,
            updated_at=work.now_ms,
        )
    )
    work.log(
        chain,
        action="stage",
        to_state=TxState.STAGED.value,
        detail={"saga": saga_name, "definition": definition_digest},
    )
    return TxClaim(tx_id=tx_id, fence=0, status=TxState.STAGED, owner="")


async def claim_staged(
    work: Work, chain: Chain, tx_id: str, *, owner: str, lease_ms: int, action: str = "confirm"
) -> TxClaim | None:
    """Compare-and-set ``staged → executing`` with a fresh lease: the person's confirmation.

    ``None`` when the transaction is not (or no longer) staged: confirmed twice, or released."""
    check_tx_transition(TxState.STAGED, TxState.EXECUTING)
    now = work.db_now
    stmt = (
        update(transactions)
        .where(transactions.c.tx_id == tx_id, transactions.c.status == TxState.STAGED.value)
        .values(
            status=TxState.EXECUTING.value,
            fence=transactions.c.fence + 1,
            lease_owner=owner,
            lease_until=now + literal(lease_ms),
            attempts=transactions.c.attempts + 1,
            updated_at=work.now_ms,
        )
        .returning(transactions.c.fence)
    )
    row = (await work.conn.execute(stmt)).first()
    if row is None:
        return None
    fence = int(row.fence)
    work.log(
        chain,
        action=action,
        from_state=TxState.STAGED.value,
        to_state=TxState.EXECUTING.value,
        detail={"fence": fence, "owner": owner},
    )
    return TxClaim(tx_id=tx_id, fence=fence, status=TxState.EXECUTING, owner=owner)


async def release_staged(work: Work, chain: Chain, tx_id: str, *, error: Mapping[str, Any]) -> bool:
    """``staged → failed``: the plan was rejected or released; nothing was ever sent."""
    check_tx_transition(TxState.STAGED, TxState.FAILED)
    stmt = (
        update(transactions)
        .where(transactions.c.tx_id == tx_id, transactions.c.status == TxState.STAGED.value)
        .values(status=TxState.FAILED.value, error=dict(error), updated_at=work.now_ms)
    )
    if (await work.conn.execute(stmt)).rowcount != 1:
        return False
    work.log(
        chain,
        action="release",
        from_state=TxState.STAGED.value,
        to_state=TxState.FAILED.value,
        detail={"error": dict(error)},
    )
    return True


async def claim(
    work: Work,
    chain: Chain,
    tx_id: str,
    *,
    owner: str,
    lease_ms: int,
    due_only: bool = True,
) -> TxClaim | None:
    """Compare-and-set lease on a resumable transaction whose lease expired (database clock)."""
    now = work.db_now
    conditions = [
        transactions.c.tx_id == tx_id,
        transactions.c.status.in_([s.value for s in RESUMABLE]),
        or_(transactions.c.lease_until.is_(None), transactions.c.lease_until <= now),
    ]
    if due_only:
        conditions.append(
            or_(transactions.c.next_attempt_at.is_(None), transactions.c.next_attempt_at <= now)
        )
    stmt = (
        update(transactions)
        .where(and_(*conditions))
        .values(
            fence=transactions.c.fence + 1,
            lease_owner=owner,
            lease_until=now + literal(lease_ms),
            attempts=transactions.c.attempts + 1,
            updated_at=work.now_ms,
        )
        .returning(transactions.c.status, transactions.c.fence)
    )
    row = (await work.conn.execute(stmt)).first()
    if row is None:
        return None
    status, fence = TxState(row.status), int(row.fence)
    work.log(
        chain,
        action="claim",
        from_state=status.value,
        to_state=status.value,
        detail={"fence": fence, "owner": owner},
    )
    return TxClaim(tx_id=tx_id, fence=fence, status=status, owner=owner)


async def transition(
    work: Work,
    chain: Chain,
    txc: TxClaim,
    to_state: TxState,
    *,
    action: str,
    via: Sequence[TxState] = (),
    error: Mapping[str, Any] | None = None,
    release: bool = False,
    retry_in_ms: int | None = None,
    detail: Mapping[str, Any] | None = None,
    clear_error: bool = False,
) -> TxClaim:
    """Fenced status change ``txc.status -> *via -> to_state`` in one UPDATE (one ledger row per
    edge). ``release`` drops the lease; ``retry_in_ms`` schedules the next recovery attempt."""
    path = [txc.status, *via, to_state]
    for a, b in pairwise(path):
        check_tx_transition(a, b)
    params: dict[str, Any] = {
        "p_tx_id": txc.tx_id,
        "p_fence": txc.fence,
        "p_from": txc.status._value_,
        "p_status": to_state._value_,
        "p_updated_at": work.now_ms,
    }
    # error: set (1), cleared (2) or left alone (0)
    error_change = 1 if error is not None else 2 if clear_error else 0
    if error is not None:
        params["p_error"] = dict(error)
    drop_lease = release or to_state in TX_TERMINAL
    # next attempt: scheduled (1), cleared (2) or left alone (0)
    schedule = 1 if retry_in_ms is not None else 2 if to_state in TX_TERMINAL else 0
    if retry_in_ms is not None:
        params["p_retry_in_ms"] = retry_in_ms
    stmt = work.statement(
        ("transactions.transition", error_change, drop_lease, schedule),
        lambda now: _transition_statement(now, error_change, drop_lease, schedule),
    )
    await work.write(
        stmt,
        params,
        lost=LeaseLost(f"transaction {txc.tx_id}", txc.fence),
        row=("transactions", txc.tx_id),
    )
    for index, (a, b) in enumerate(pairwise(path)):
        last = index == len(path) - 2
        work.log(
            chain,
            action=action if last else str(b._value_),
            from_state=a._value_,
            to_state=b._value_,
            detail=(
                {**(detail or {}), **({"error": dict(error)} if error else {})} if last else None
            ),
        )
    return _replace_claim(txc, status=to_state)


async def release(work: Work, txc: TxClaim, *, retry_in_ms: int | None) -> None:
    """Give the lease back without a status change; recovery may pick it up after
    ``retry_in_ms`` (``None``: immediately)."""
    values: dict[str, Any] = {
        "lease_owner": None,
        "lease_until": None,
        "updated_at": work.now_ms,
        "next_attempt_at": (work.db_now + literal(retry_in_ms))
        if retry_in_ms is not None
        else None,
    }
    stmt = (
        update(transactions)
        .where(transactions.c.tx_id == txc.tx_id, transactions.c.fence == txc.fence)
        .values(values)
    )
    if (await work.conn.execute(stmt)).rowcount != 1:
        raise LeaseLost(f"transaction {txc.tx_id}", txc.fence)


async def renew(work: Work, txc: TxClaim, *, lease_ms: int) -> None:
    """Heartbeat on the transaction lease; :class:`LeaseLost` if another holder has it."""
    stmt = (
        update(transactions)
        .where(transactions.c.tx_id == txc.tx_id, transactions.c.fence == txc.fence)
        .values(lease_until=work.db_now + literal(lease_ms))
    )
    if (await work.conn.execute(stmt)).rowcount != 1:
        raise LeaseLost(f"transaction {txc.tx_id}", txc.fence)


@dataclass(frozen=True, slots=True)
class ClaimedTx:
    """A transaction a worker claimed, with its ledger chain positioned for the holder."""

    txc: TxClaim
    chain: Chain


def _due_condition(now: ColumnElement[int]) -> list[ColumnElement[bool]]:
    return [
        # In-flight statuses as literal equalities (schema.one_of_literals), read through
        # ``ix_transactions_status_next``.
        transactions_due(),
        or_(transactions.c.lease_until.is_(None), transactions.c.lease_until <= now),
        or_(transactions.c.next_attempt_at.is_(None), transactions.c.next_attempt_at <= now),
    ]


async def claim_due(work: Work, *, owner: str, lease_ms: int, limit: int) -> list[ClaimedTx]:
    """Claim up to ``limit`` due transactions in one statement (``SKIP LOCKED`` on PostgreSQL,
    so N workers take disjoint batches instead of queueing on the same rows)."""
    dialect = work.store.dialect

    def build(now: ColumnElement[int]) -> ReturningUpdate[Any]:
        picked = (
            select(transactions.c.tx_id)
            .where(*_due_condition(now))
            .order_by(transactions.c.next_attempt_at, transactions.c.created_at)
            .limit(bindparam("p_limit", type_=Integer))
        )
        if dialect == "postgresql":
            # A CTE is evaluated once: with ``IN (SELECT … LIMIT n FOR UPDATE SKIP LOCKED)``
            # the planner may re-run the subquery per row and claim far more than ``n``.
            due = dialects.skip_locked(picked, dialect).cte("due")
            target = transactions.c.tx_id == due.c.tx_id
        else:
            target = transactions.c.tx_id.in_(picked.scalar_subquery())
        return (
            update(transactions)
            .where(target, *_due_condition(now))
            .values(
                fence=transactions.c.fence + 1,
                lease_owner=bindparam("p_owner"),
                lease_until=now + bindparam("p_lease_ms", type_=BigInteger),
                attempts=transactions.c.attempts + 1,
                updated_at=bindparam("p_updated_at", type_=BigInteger),
            )
            .returning(transactions.c.tx_id, transactions.c.status, transactions.c.fence)
        )

    # Built once per store (every claim pass of a worker runs it).
    stmt = work.statement("tx.claim_due", build)
    params = {
        "p_limit": limit,
        "p_owner": owner,
        "p_lease_ms": lease_ms,
        "p_updated_at": work.now_ms,
    }
    rows = (await work.conn.execute(stmt, params)).all()
    chains = await events.chains_of(work.conn, [r.tx_id for r in rows])
    claimed: list[ClaimedTx] = []
    for row in rows:
        chain = chains[row.tx_id]
        status, fence = TxState(row.status), int(row.fence)
        work.log(
            chain,
            action="claim",
            from_state=status.value,
            to_state=status.value,
            detail={"fence": fence, "owner": owner},
        )
        claimed.append(ClaimedTx(TxClaim(row.tx_id, fence, status, owner), chain))
    return claimed


_GET_MANY = select(transactions).where(
    transactions.c.tx_id.in_(bindparam("p_tx_ids", expanding=True))
)


async def get_many(conn: AsyncConnection, tx_ids: Sequence[str]) -> dict[str, TxRecord]:
    """The transactions of ``tx_ids`` that exist, by id, in one statement."""
    if not tx_ids:
        return {}
    rows = (await conn.execute(_GET_MANY, {"p_tx_ids": list(tx_ids)})).all()
    return {row.tx_id: _record(row) for row in rows}


async def get(conn: AsyncConnection, tx_id: str) -> TxRecord | None:
    """One transaction by id."""
    row = (await conn.execute(select(transactions).where(transactions.c.tx_id == tx_id))).first()
    return _record(row) if row is not None else None


async def live_by_business_key(conn: AsyncConnection, business_key: str) -> TxRecord | None:
    """The transaction currently holding ``business_key`` (not failed, not compensated)."""
    stmt = select(transactions).where(
        transactions.c.business_key == business_key,
        transactions_live(),  # as uq_transactions_business_key_live says it: that index serves
    )
    row = (await conn.execute(stmt)).first()
    return _record(row) if row is not None else None


async def due(conn: AsyncConnection, now: ColumnElement[int], *, limit: int = 100) -> list[str]:
    """Ids of resumable transactions with no live lease whose next attempt is due."""
    stmt = (
        select(transactions.c.tx_id)
        .where(*_due_condition(now))
        .order_by(transactions.c.next_attempt_at, transactions.c.created_at)
        .limit(limit)
    )
    return list((await conn.execute(stmt)).scalars().all())


async def count_resumable(conn: AsyncConnection) -> int:
    """Transactions in flight (a recovery pass may pick them up), counted through
    ``ix_transactions_status_next`` on their four statuses: the count costs the work in hand,
    not the history."""
    stmt = select(func.count()).select_from(transactions).where(transactions_due())
    return int((await conn.execute(stmt)).scalar_one())


async def count_by_status(conn: AsyncConnection) -> dict[str, int]:
    """Number of transactions per status."""
    stmt = select(transactions.c.status, func.count()).group_by(transactions.c.status)
    return {str(s): int(n) for s, n in (await conn.execute(stmt)).all()}


#: Longest lease owner a transaction row holds.
LEASE_OWNER_MAX = column_length(transactions.c.lease_owner)


def _parked() -> ColumnElement[bool]:
    """Waiting for a person: the transaction is parked, or it committed and an outbox event of
    it is (the saga is done; only the event waits)."""
    events_parked = select(outbox.c.tx_id).where(outbox.c.state == EffectState.MANUAL_REVIEW.value)
    return or_(
        transactions.c.status == TxState.MANUAL_REVIEW.value,
        transactions.c.tx_id.in_(events_parked),
    )


async def parked(conn: AsyncConnection, *, limit: int, skip: int = 0) -> list[TxRecord]:
    """Transactions waiting for a person (:func:`_parked`), oldest first."""
    stmt = (
        select(transactions)
        .where(_parked())
        .order_by(transactions.c.created_at, transactions.c.tx_id)
        .offset(skip)
        .limit(limit)
    )
    return [_record(row) for row in (await conn.execute(stmt)).all()]


async def count_parked(conn: AsyncConnection) -> int:
    """How many transactions wait for a person (:func:`_parked`)."""
    stmt = select(func.count()).select_from(transactions).where(_parked())
    return int((await conn.execute(stmt)).scalar_one())


async def in_status(conn: AsyncConnection, status: TxState, *, limit: int = 100) -> list[TxRecord]:
    """Transactions in ``status``, oldest first."""
    stmt = (
        select(transactions)
        .where(transactions.c.status == status.value)
        .order_by(transactions.c.created_at)
        .limit(limit)
    )
    return [_record(row) for row in (await conn.execute(stmt)).all()]
