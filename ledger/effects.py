"""Repository of effects: operations, compensation steps and outbox events.

The three tables share one state machine (:class:`~ledger.states.EffectState`) and one set of
columns, so one set of functions serves all three, selected by :class:`EffectKind`.

* :func:`claim` is a compare-and-set: ``UPDATE … WHERE state IN claimable AND lease expired …
  RETURNING``. It increments the fence and judges the lease by the database clock. The row's old
  state is kept in ``claimed_from`` (SQL evaluates every SET expression against the old row), so
  the caller learns in the same statement whether the provider may have seen the effect already.
* :func:`record` and :func:`renew` are fenced: ``WHERE key = :k AND fence = :f``. Zero rows means
  another holder claimed the row after our lease expired: :class:`~ledger.errors.LeaseLost`.
* Every state change appends its ledger row to the same :class:`~ledger.store.Work`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
    String,
    Table,
    and_,
    bindparam,
    case,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.dml import Insert, ReturningUpdate, Update
from sqlalchemy.sql.selectable import Select

from ledger.errors import LeaseLost
from ledger.frozen import quick_init, replacer
from ledger.schema import (
    Json,
    column_length,
    compensation_steps,
    effects_unsettled,
    operations,
    outbox,
    transactions,
)
from ledger.states import CLAIMABLE, MAYBE_SENT, EffectState, check_effect_transition
from ledger.store import Chain, Store, Work

#: Longest provider id an effect can hold (its ``remote_id`` column).
REMOTE_ID_MAX = column_length(operations.c.remote_id)
#: Longest operator reason an ``operator_resolve`` ledger row keeps.
OPERATOR_REASON_MAX = 1000


class EffectKind(StrEnum):
    """Which of the three effect tables a row lives in."""

    OPERATION = "operation"
    COMPENSATION = "compensation"
    OUTBOX = "outbox"


_TABLES: dict[EffectKind, Table] = {
    EffectKind.OPERATION: operations,
    EffectKind.COMPENSATION: compensation_steps,
    EffectKind.OUTBOX: outbox,
}
_KEY_COLUMN = {
    EffectKind.OPERATION: "op_key",
    EffectKind.COMPENSATION: "op_key",
    EffectKind.OUTBOX: "event_key",
}
_NAME_COLUMN = {
    EffectKind.OPERATION: "step",
    EffectKind.COMPENSATION: "step",
    EffectKind.OUTBOX: "kind",
}


def table_of(kind: EffectKind) -> Table:
    """The table holding effects of ``kind``."""
    return _TABLES[kind]


def _key(kind: EffectKind) -> ColumnElement[str]:
    return _TABLES[kind].c[_KEY_COLUMN[kind]]


@quick_init
@dataclass(frozen=True, slots=True)
class Effect:
    """One effect row as stored."""

    kind: EffectKind
    key: str
    tx_id: str
    name: str
    provider: str
    action: str
    ordinal: int
    payload: Any
    payload_sha256: str | None
    state: EffectState
    claimed_from: EffectState | None
    lease_owner: str | None
    lease_until: int | None
    fence: int
    attempts: int
    lookups: int
    first_attempt_at: int | None
    next_attempt_at: int | None
    remote_id: str | None
    result: Any
    last_error: str | None
    forward_op_key: str | None = None


#: ``dataclasses.replace`` for :class:`Effect`, at a third of its cost (``ledger.frozen``).
replace_effect = replacer(Effect)


@quick_init
@dataclass(frozen=True, slots=True)
class NewEffect:
    """An effect to plan. ``payload`` may be ``None`` when it is rendered just before its claim."""

    key: str
    tx_id: str
    name: str
    provider: str
    action: str
    ordinal: int
    payload: Any = None
    payload_sha256: str | None = None
    forward_op_key: str | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class Claim:
    """Proof of a successful claim: the fence every later write of this holder must carry."""

    kind: EffectKind
    key: str
    tx_id: str
    name: str
    provider: str
    action: str
    fence: int
    previous: EffectState
    attempts: int
    lookups: int
    first_attempt_at: int | None
    payload: Any
    payload_sha256: str | None
    owner: str
    lease_until: int | None = None
    lease_ms: int = 0

    @property
    def claimed_at_ms(self) -> int | None:
        """The database clock at the claim (its lease end minus the lease), if known."""
        return None if self.lease_until is None else self.lease_until - self.lease_ms

    @property
    def maybe_sent(self) -> bool:
        """The provider may already hold this effect: look it up before any apply."""
        return self.previous in MAYBE_SENT


def _effect(kind: EffectKind, row: Row[Any]) -> Effect:
    m = row._mapping
    return Effect(
        kind=kind,
        key=m[_KEY_COLUMN[kind]],
        tx_id=m["tx_id"],
        name=m[_NAME_COLUMN[kind]],
        provider=m["provider"],
        action=m["action"],
        ordinal=m["ordinal"],
        payload=m["payload"],
        payload_sha256=m["payload_sha256"],
        state=EffectState(m["state"]),
        claimed_from=EffectState(m["claimed_from"]) if m["claimed_from"] else None,
        lease_owner=m["lease_owner"],
        lease_until=m["lease_until"],
        fence=int(m["fence"]),
        attempts=int(m["attempts"]),
        lookups=int(m["lookups"]),
        first_attempt_at=m["first_attempt_at"],
        next_attempt_at=m["next_attempt_at"],
        remote_id=m["remote_id"],
        result=m["result"],
        last_error=m["last_error"],
        forward_op_key=m.get("forward_op_key"),
    )


def _claim_from_row(kind: EffectKind, row: Row[Any], owner: str, lease_ms: int) -> Claim:
    e = _effect(kind, row)
    assert e.claimed_from is not None  # set by every claim
    return Claim(
        kind=kind,
        key=e.key,
        tx_id=e.tx_id,
        name=e.name,
        provider=e.provider,
        action=e.action,
        fence=e.fence,
        previous=e.claimed_from,
        attempts=e.attempts,
        lookups=e.lookups,
        first_attempt_at=e.first_attempt_at,
        payload=e.payload,
        payload_sha256=e.payload_sha256,
        owner=owner,
        lease_until=e.lease_until,
        lease_ms=lease_ms,
    )


def _insert_claimed(now: ColumnElement[int], kind: EffectKind) -> Insert:
    """The plan's first effect, inserted already claimed (its lease on the database clock)."""
    return (
        _TABLES[kind]
        .insert()
        .values(lease_until=now + bindparam("p_lease_ms", type_=BigInteger), first_attempt_at=now)
    )


def _claim_statement(
    kind: EffectKind,
    now: ColumnElement[int],
    *,
    with_payload: bool,
    due_only: bool,
    tx_fenced: bool,
) -> ReturningUpdate[Any]:
    table = _TABLES[kind]
    values: dict[str, Any] = {
        **_claimed(table, now),
        "claimed_from": table.c.state,
        "attempts": table.c.attempts + 1,
        "first_attempt_at": case(
            (table.c.first_attempt_at.is_(None), now), else_=table.c.first_attempt_at
        ),
    }
    if with_payload:
        values["payload"] = case(
            (table.c.payload_sha256.is_(None), bindparam("p_payload", type_=Json)),
            else_=table.c.payload,
        )
        values["payload_sha256"] = case(
            (table.c.payload_sha256.is_(None), bindparam("p_payload_sha256", type_=String)),
            else_=table.c.payload_sha256,
        )
    conditions = [
        _key(kind) == bindparam("p_key"),
        table.c.state.in_([s.value for s in CLAIMABLE]),
        or_(table.c.state != EffectState.EXECUTING.value, table.c.lease_until <= now),
    ]
    if due_only:
        conditions.append(or_(table.c.next_attempt_at.is_(None), table.c.next_attempt_at <= now))
    if tx_fenced:
        conditions.append(_tx_fence_holds(table))
    return update(table).where(and_(*conditions)).values(values).returning(*table.c)


def _claimed(table: Table, now: ColumnElement[int]) -> dict[str, Any]:
    """What every claim sets: executing, the next fence, the claimer's lease (database clock)."""
    return {
        "state": EffectState.EXECUTING.value,
        "fence": table.c.fence + 1,
        "lease_owner": bindparam("p_owner"),
        "lease_until": now + bindparam("p_lease_ms", type_=BigInteger),
        "updated_at": bindparam("p_updated_at", type_=BigInteger),
    }


def _tx_fence_holds(table: Table) -> ColumnElement[bool]:
    """The effect belongs to transaction ``p_tx_id`` and that transaction still carries the
    claimer's fence (``p_tx_fence``).

    Why an uncorrelated scalar subquery keyed by a parameter, not ``EXISTS`` correlated on
    ``table.tx_id``: PostgreSQL turns the correlated form into a join, and the generic plan a
    prepared statement settles on after five executions is made once, from the table sizes of
    that moment. Planned on a young database (or one never analyzed) it joined a *sequential
    scan* of ``transactions``, kept for the connection's life, so every claim read the whole
    table: the bench's throughput fell with N and its server CPU per saga grew (measured in
    ``docs/benchmarks-log.md``, item 32). Keyed by ``p_tx_id``, the lookup is an ``InitPlan`` on the
    primary key in every plan; ``table.tx_id = p_tx_id`` keeps the check exactly what the
    correlated one said."""
    tx_id = bindparam("p_tx_id", type_=String)
    current = select(transactions.c.fence).where(transactions.c.tx_id == tx_id).scalar_subquery()
    return and_(table.c.tx_id == tx_id, current == bindparam("p_tx_fence", type_=BigInteger))


def is_fresh(e: Effect) -> bool:
    """``e`` (a holder's cached row) was never attempted: pending, never claimed, not scheduled.

    Its claim then has one outcome the holder can predict — fence + 1, attempt 1, nothing sent
    before — so :func:`claim_fresh` can write it blind instead of reading it back."""
    return (
        e.state is EffectState.PENDING
        and e.attempts == 0
        and e.first_attempt_at is None
        and e.next_attempt_at is None
    )


def _claim_fresh_statement(
    kind: EffectKind, now: ColumnElement[int], *, set_payload: bool, stored: bool
) -> Update:
    """:func:`_claim_statement` for a row whose every column the claim reads is known: the
    ``WHERE`` pins them (so the ``SET`` has one outcome) and there is no ``RETURNING``."""
    table = _TABLES[kind]
    values: dict[str, Any] = {
        **_claimed(table, now),
        "claimed_from": EffectState.PENDING.value,
        "attempts": 1,
        "first_attempt_at": now,
    }
    if set_payload:
        values["payload"] = bindparam("p_payload", type_=Json)
        values["payload_sha256"] = bindparam("p_payload_sha256", type_=String)
    return (
        update(table)
        .where(
            _key(kind) == bindparam("p_key"),
            table.c.state == EffectState.PENDING.value,
            table.c.fence == bindparam("p_fence", type_=BigInteger),
            table.c.attempts == 0,
            table.c.first_attempt_at.is_(None),
            table.c.next_attempt_at.is_(None),
            (
                table.c.payload_sha256 == bindparam("p_stored_sha256", type_=String)
                if stored
                else table.c.payload_sha256.is_(None)
            ),
            _tx_fence_holds(table),
        )
        .values(values)
    )


def _record_statement(
    kind: EffectKind,
    now: ColumnElement[int],
    retry: bool,
    with_remote_id: bool,
    with_result: bool,
    with_error: bool,
) -> Update:
    table = _TABLES[kind]
    values: dict[str, Any] = {
        "state": bindparam("p_state"),
        "lease_owner": None,
        "lease_until": None,
        "lookups": table.c.lookups + bindparam("p_lookups", type_=BigInteger),
        "next_attempt_at": (now + bindparam("p_retry_in_ms", type_=BigInteger) if retry else None),
        "updated_at": bindparam("p_updated_at", type_=BigInteger),
    }
    if with_remote_id:
        values["remote_id"] = bindparam("p_remote_id", type_=String)
    if with_result:
        values["result"] = bindparam("p_result", type_=Json)
    if with_error:
        values["last_error"] = bindparam("p_error", type_=String)
    return (
        update(table)
        .where(
            _key(kind) == bindparam("p_key"),
            table.c.fence == bindparam("p_fence", type_=BigInteger),
            table.c.state == EffectState.EXECUTING.value,
        )
        .values(values)
    )


async def insert(
    work: Work,
    chain: Chain,
    kind: EffectKind,
    new: Sequence[NewEffect],
    *,
    claim_first: tuple[str, int] | None = None,
) -> Claim | None:
    """Plan ``new`` effects (state ``pending``) in one statement.

    With ``claim_first=(owner, lease_ms)`` the first effect is inserted already claimed (fence 1):
    persisting the plan and the first claim share one commit, and the intent is still durable
    before any provider call because the caller only calls after this commit.
    """
    if not new:
        return None
    table = _TABLES[kind]
    rows: list[dict[str, Any]] = []
    for index, e in enumerate(new):
        claimed = claim_first is not None and index == 0
        row: dict[str, Any] = {
            _KEY_COLUMN[kind]: e.key,
            "tx_id": e.tx_id,
            _NAME_COLUMN[kind]: e.name,
            "provider": e.provider,
            "action": e.action,
            "ordinal": e.ordinal,
            "payload": e.payload,
            "payload_sha256": e.payload_sha256,
            "state": (EffectState.EXECUTING if claimed else EffectState.PENDING)._value_,
            "claimed_from": EffectState.PENDING._value_ if claimed else None,
            "lease_owner": claim_first[0] if claimed and claim_first else None,
            "fence": 1 if claimed else 0,
            "attempts": 1 if claimed else 0,
            "lookups": 0,
            "next_attempt_at": None,
            "remote_id": None,
            "result": None,
            "last_error": None,
            "updated_at": work.now_ms,
        }
        if kind is EffectKind.COMPENSATION:
            row["forward_op_key"] = e.forward_op_key
        if not claimed:
            row["lease_until"] = None
            row["first_attempt_at"] = None
        rows.append(row)
    # A claimed first row's lease is judged by the database clock: one single-row INSERT whose
    # clock expressions are part of a statement built once. The plain rows go as one executemany
    # of a fixed statement (a multi-VALUES ``insert().values([...])`` is recompiled every saga).
    plain = rows
    if claim_first is not None:
        first_row = {**rows[0], "p_lease_ms": claim_first[1]}
        stmt = work.statement(
            ("effects.insert_claimed", kind), lambda now: _insert_claimed(now, kind)
        )
        await work.write(stmt, first_row, row=(kind._value_, new[0].key))
        plain = rows[1:]
    if plain:
        await work.write_many(
            work.statement(("effects.insert", kind), lambda _now: table.insert()),
            plain,
            [(kind._value_, e.key) for e in new[len(rows) - len(plain) :]],
        )
    for e in new:
        work.log(
            chain,
            action="plan",
            subject=e.key,
            to_state=EffectState.PENDING._value_,
            detail={
                "kind": kind._value_,
                "name": e.name,
                "provider": e.provider,
                "action": e.action,
            },
        )
    if claim_first is None:
        return None
    first = new[0]
    return _logged(
        work,
        chain,
        Claim(
            kind=kind,
            key=first.key,
            tx_id=first.tx_id,
            name=first.name,
            provider=first.provider,
            action=first.action,
            fence=1,
            previous=EffectState.PENDING,
            attempts=1,
            lookups=0,
            first_attempt_at=None,
            payload=first.payload,
            payload_sha256=first.payload_sha256,
            owner=claim_first[0],
        ),
    )


def _logged(work: Work, chain: Chain, claim_: Claim) -> Claim:
    """``claim_`` after its ledger row (every way of claiming writes the same one)."""
    work.log(
        chain,
        action="claim",
        subject=claim_.key,
        from_state=claim_.previous._value_,
        to_state=EffectState.EXECUTING._value_,
        detail={"fence": claim_.fence, "owner": claim_.owner, "attempt": claim_.attempts},
    )
    return claim_


async def claim(
    work: Work,
    chain: Chain,
    kind: EffectKind,
    key: str,
    *,
    owner: str,
    lease_ms: int,
    payload: Any = None,
    payload_sha256: str | None = None,
    due_only: bool = True,
    tx_fence: int | None = None,
) -> Claim | None:
    """Compare-and-set claim; ``None`` when the row is not claimable (owned, terminal, not due).

    With ``tx_fence`` the claim also requires the transaction's lease to still carry that
    fence: a driver that lost the transaction to another holder cannot start a new effect.

    A payload given here is stored only if the row has none yet: the first rendering is frozen,
    and the caller compares the returned ``payload_sha256`` with its own before any apply.
    """
    with_payload = payload_sha256 is not None
    stmt = work.statement(
        ("effects.claim", kind, with_payload, due_only, tx_fence is not None),
        lambda now: _claim_statement(
            kind, now, with_payload=with_payload, due_only=due_only, tx_fenced=tx_fence is not None
        ),
    )
    params: dict[str, Any] = {
        "p_key": key,
        "p_owner": owner,
        "p_lease_ms": lease_ms,
        "p_updated_at": work.now_ms,
    }
    if with_payload:
        params["p_payload"] = payload
        params["p_payload_sha256"] = payload_sha256
    if tx_fence is not None:
        params["p_tx_fence"] = tx_fence
        params["p_tx_id"] = chain.tx_id
    row = (await work.conn.execute(stmt, params)).first()
    if row is None:
        return None
    return _logged(work, chain, _claim_from_row(kind, row, owner, lease_ms))


async def claim_fresh(
    work: Work,
    chain: Chain,
    known: Effect,
    *,
    owner: str,
    lease_ms: int,
    tx_fence: int,
    payload: Any = None,
    payload_sha256: str | None = None,
) -> Claim:
    """:func:`claim` of an effect the caller holds an exact cached row of, one that
    :func:`is_fresh` accepts, as a blind fenced write (no ``RETURNING``, no read back).

    The claim's outcome follows from ``known``: the statement's ``WHERE`` requires the row to
    still be exactly that (state, fence, attempts, schedule, stored fingerprint) and the
    transaction to still carry ``tx_fence``. If anything moved, nothing is written and
    :class:`LeaseLost` is raised (on PostgreSQL at the next statement or the commit, see
    :meth:`Work.write`): the caller's view is stale, so it must stop rather than act on it. The
    whole local transaction is rolled back; everything it undoes is recovered from the ledger's
    durable state like any other lost lease.

    ``first_attempt_at`` and ``lease_until`` are the database clock's and are not read back:
    the returned claim leaves them ``None``, as the first claim of a plan does (a first attempt
    is never outside its dedup window)."""
    assert is_fresh(known), known
    set_payload = payload_sha256 is not None and known.payload_sha256 is None
    stored = known.payload_sha256 is not None
    stmt = work.statement(
        ("effects.claim_fresh", known.kind, set_payload, stored),
        lambda now: _claim_fresh_statement(known.kind, now, set_payload=set_payload, stored=stored),
    )
    params: dict[str, Any] = {
        "p_key": known.key,
        "p_fence": known.fence,
        "p_owner": owner,
        "p_lease_ms": lease_ms,
        "p_updated_at": work.now_ms,
        "p_tx_fence": tx_fence,
        "p_tx_id": known.tx_id,
    }
    if set_payload:
        params["p_payload"] = payload
        params["p_payload_sha256"] = payload_sha256
    if stored:
        params["p_stored_sha256"] = known.payload_sha256
    await work.write(
        stmt,
        params,
        lost=LeaseLost(f"{known.kind._value_} {known.key} (changed under its holder)", tx_fence),
        row=(known.kind._value_, known.key),
    )
    return _logged(
        work,
        chain,
        Claim(
            kind=known.kind,
            key=known.key,
            tx_id=known.tx_id,
            name=known.name,
            provider=known.provider,
            action=known.action,
            fence=known.fence + 1,
            previous=EffectState.PENDING,
            attempts=1,
            lookups=known.lookups,
            first_attempt_at=None,
            payload=payload if set_payload else known.payload,
            payload_sha256=payload_sha256 if set_payload else known.payload_sha256,
            owner=owner,
            lease_ms=lease_ms,
        ),
    )


async def record(
    work: Work,
    chain: Chain,
    claim_: Claim,
    to_state: EffectState,
    *,
    action: str,
    remote_id: str | None = None,
    result: Any = None,
    error: str | None = None,
    retry_in_ms: int | None = None,
    lookups: int = 0,
    detail: Mapping[str, Any] | None = None,
    may_be_taken: bool = False,
) -> None:
    """Fenced write of the holder's outcome; raises :class:`LeaseLost` if the fence is stale.

    ``may_be_taken``: a stale fence is not an error; the write and its ledger row then change
    nothing, and ``work`` commits anyway (a record riding on another transaction,
    :mod:`ledger.riders`). Whoever holds the effect now appended to its chain when it claimed
    it, so the row's link is taken exactly when the fence is stale."""
    check_effect_transition(EffectState.EXECUTING, to_state)
    params: dict[str, Any] = {
        "p_key": claim_.key,
        "p_fence": claim_.fence,
        "p_state": to_state._value_,
        "p_lookups": lookups,
        "p_updated_at": work.now_ms,
    }
    if retry_in_ms is not None:
        params["p_retry_in_ms"] = retry_in_ms
    if remote_id is not None:
        params["p_remote_id"] = remote_id
    if result is not None:
        params["p_result"] = result
    if error is not None:
        params["p_error"] = error[:1000]
    shape = (
        retry_in_ms is not None,
        remote_id is not None,
        result is not None,
        error is not None,
    )
    stmt = work.statement(
        ("effects.record", claim_.kind, shape),
        lambda now: _record_statement(claim_.kind, now, *shape),
    )
    lost = None if may_be_taken else LeaseLost(f"{claim_.kind._value_} {claim_.key}", claim_.fence)
    await work.write(stmt, params, lost=lost, row=(claim_.kind._value_, claim_.key))
    log_detail: dict[str, Any] = {"fence": claim_.fence, **(detail or {})}
    if remote_id is not None:
        log_detail["remote_id"] = remote_id
    if error is not None:
        log_detail["error"] = error[:500]
    link: dict[str, Any] = {
        "action": action,
        "subject": claim_.key,
        "from_state": EffectState.EXECUTING._value_,
        "to_state": to_state._value_,
        "detail": log_detail,
    }
    if may_be_taken:
        await work.log_unless_taken(chain, link)
    else:
        work.log(chain, **link)


async def renew(work: Work, claim_: Claim, *, lease_ms: int) -> None:
    """Heartbeat: extend the lease of a claim still held; :class:`LeaseLost` if it is not."""
    table = _TABLES[claim_.kind]
    stmt = (
        update(table)
        .where(
            _key(claim_.kind) == claim_.key,
            table.c.fence == claim_.fence,
            table.c.state == EffectState.EXECUTING.value,
        )
        .values(lease_until=work.db_now + literal(lease_ms))
    )
    if (await work.conn.execute(stmt)).rowcount != 1:
        raise LeaseLost(f"{claim_.kind.value} {claim_.key}", claim_.fence)


async def release(work: Work, chain: Chain, claim_: Claim) -> None:
    """Give a claim back unused: the lease ends now, so the next claimer takes it at once.

    The state stays ``executing`` (the table has no way back to ``pending``), so that claimer
    looks up first — cheap, and right, since nothing but this process knows it never called.
    """
    table = _TABLES[claim_.kind]
    stmt = (
        update(table)
        .where(
            _key(claim_.kind) == claim_.key,
            table.c.fence == claim_.fence,
            table.c.state == EffectState.EXECUTING.value,
        )
        .values(lease_until=work.db_now, updated_at=work.now_ms)
    )
    if (await work.conn.execute(stmt)).rowcount != 1:
        raise LeaseLost(f"{claim_.kind.value} {claim_.key}", claim_.fence)
    work.log(
        chain,
        action="release",
        subject=claim_.key,
        from_state=EffectState.EXECUTING.value,
        to_state=EffectState.EXECUTING.value,
        detail={"fence": claim_.fence},
    )


async def skip_pending(work: Work, chain: Chain, kind: EffectKind, keys: Sequence[str]) -> None:
    """Mark never-reached effects ``skipped`` (the caller holds the transaction's lease)."""
    if not keys:
        return
    check_effect_transition(EffectState.PENDING, EffectState.SKIPPED)
    table = _TABLES[kind]
    stmt = (
        update(table)
        .where(_key(kind).in_(list(keys)), table.c.state == EffectState.PENDING.value)
        .values(state=EffectState.SKIPPED.value, updated_at=work.now_ms)
        .returning(_key(kind))
    )
    skipped = set((await work.conn.execute(stmt)).scalars().all())
    for key in keys:
        if key in skipped:
            work.log(
                chain,
                action="skip",
                subject=key,
                from_state=EffectState.PENDING.value,
                to_state=EffectState.SKIPPED.value,
            )


async def resolve(
    work: Work,
    chain: Chain,
    kind: EffectKind,
    key: str,
    to_state: EffectState,
    *,
    operator: str,
    reason: str,
    remote_id: str | None = None,
) -> None:
    """An operator's decision on a parked effect (``manual_review`` → confirmed / failed)."""
    check_effect_transition(EffectState.MANUAL_REVIEW, to_state)
    table = _TABLES[kind]
    values: dict[str, Any] = {"state": to_state.value, "updated_at": work.now_ms}
    if to_state is EffectState.CONFIRMED:
        values["remote_id"] = remote_id or f"operator:{key}"
    stmt = (
        update(table)
        .where(_key(kind) == key, table.c.state == EffectState.MANUAL_REVIEW.value)
        .values(values)
    )
    if (await work.conn.execute(stmt)).rowcount != 1:
        raise LeaseLost(f"{kind.value} {key}", 0)
    work.log(
        chain,
        action="operator_resolve",
        subject=key,
        from_state=EffectState.MANUAL_REVIEW.value,
        to_state=to_state.value,
        detail={
            "operator": operator,
            "reason": reason[:OPERATOR_REASON_MAX],
            "remote_id": values.get("remote_id"),
        },
    )


async def get(conn: AsyncConnection, kind: EffectKind, key: str) -> Effect | None:
    """One effect by key."""
    row = (await conn.execute(select(_TABLES[kind]).where(_key(kind) == key))).first()
    return _effect(kind, row) if row is not None else None


async def for_tx(conn: AsyncConnection, kind: EffectKind, tx_id: str) -> list[Effect]:
    """Every effect of ``kind`` in a transaction, in plan order."""
    table = _TABLES[kind]
    stmt = select(table).where(table.c.tx_id == tx_id).order_by(table.c.ordinal)
    return [_effect(kind, row) for row in (await conn.execute(stmt)).all()]


@functools.cache
def _for_txs_statement(kind: EffectKind) -> Select[Any]:
    # Built once: a worker runs it every claim pass, and building and cache-keying a fresh
    # select cost more client CPU than the query.
    table = _TABLES[kind]
    return (
        select(table)
        .where(table.c.tx_id.in_(bindparam("p_tx_ids", expanding=True)))
        .order_by(table.c.tx_id, table.c.ordinal)
    )


async def for_txs(
    conn: AsyncConnection, kind: EffectKind, tx_ids: Sequence[str]
) -> dict[str, list[Effect]]:
    """:func:`for_tx` of several transactions in one statement (every id gets a list)."""
    found: dict[str, list[Effect]] = {tx_id: [] for tx_id in tx_ids}
    if not tx_ids:
        return found
    stmt = _for_txs_statement(kind)
    for row in (await conn.execute(stmt, {"p_tx_ids": list(tx_ids)})).all():
        found[row.tx_id].append(_effect(kind, row))
    return found


def _due_statement(kind: EffectKind, now: ColumnElement[int]) -> Select[Any]:
    table = _TABLES[kind]
    return (
        select(table)
        .where(
            effects_unsettled(table),  # as ``ix_<table>_due`` says it (schema.one_of_literals)
            or_(table.c.state != EffectState.EXECUTING.value, table.c.lease_until <= now),
            or_(table.c.next_attempt_at.is_(None), table.c.next_attempt_at <= now),
        )
        .order_by(table.c.next_attempt_at, table.c.tx_id)
        .limit(bindparam("p_limit", type_=Integer))
    )


async def due(
    conn: AsyncConnection, kind: EffectKind, store: Store, *, limit: int = 100
) -> list[Effect]:
    """Effects a recovery pass could claim now (pending, in doubt and due, or lease expired),
    by ``store``'s clock.

    The statement is built once per store (:meth:`Store.statement`): every recovery pass of
    every worker runs it, idle ones included, and building and cache-keying a fresh select
    cost more client CPU than running it (an idle pass took 1.14 ms of CPU on SQLite before,
    ``docs/benchmarks-log.md`` item 71)."""
    stmt = store.statement(("effects.due", kind), functools.partial(_due_statement, kind))
    return [_effect(kind, row) for row in (await conn.execute(stmt, {"p_limit": limit})).all()]


async def count_unsettled(conn: AsyncConnection, kind: EffectKind) -> int:
    """Effects still pending, executing or in doubt (not terminal, not parked)."""
    table = _TABLES[kind]
    stmt = select(func.count()).select_from(table).where(effects_unsettled(table))
    return int((await conn.execute(stmt)).scalar_one())


async def oldest_unsettled_age_ms(
    conn: AsyncConnection, kind: EffectKind, now: ColumnElement[int]
) -> int | None:
    """How long the oldest pending / executing / in-doubt effect has waited (ms), if any."""
    table = _TABLES[kind]
    stmt = select(now - func.min(table.c.updated_at)).where(effects_unsettled(table))
    value = (await conn.execute(stmt)).scalar_one_or_none()
    return int(value) if value is not None else None


async def count_by_state(conn: AsyncConnection, kind: EffectKind) -> dict[str, int]:
    """Number of effects of ``kind`` per state."""
    table = _TABLES[kind]
    stmt = select(table.c.state, func.count()).group_by(table.c.state)
    return {str(state): int(n) for state, n in (await conn.execute(stmt)).all()}
