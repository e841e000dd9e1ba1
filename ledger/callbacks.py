"""Repository of callback runs: webhook deliveries owed for an execution's outcome.

Callbacks are enqueued in the same transaction that finishes the execution, so an outcome is never
committed without the deliveries it owes (nor a delivery without its outcome). A delivery worker
claims and sends them later. Enqueueing is idempotent per (execution, event, target): the unique
key refuses a second row, so a retried finish, or a recovering worker finishing the same
execution again, never sends a callback twice.

Delivery is at least once, bounded: a worker claims a run (``running``, a lease, ``fence`` and
``attempts`` one higher), sends it, and records the outcome under that fence. A run is sent at
most :data:`MAX_ATTEMPTS` times; a worker that lost its lease cannot record over the next holder.
The receiver's guarantee is the stable run id it can deduplicate on, not exactly-once sending.

State machine (``callback_runs.state``)::

    pending --claim_due--> running        (due: next_attempt_at NULL or reached)
    running --record(delivered)--> delivered
    running --record(failed, attempts left)--> pending   (due after the backoff)
    running --record(failed, 5th attempt / permanent)--> failed
    running --claim_due (lease expired, attempts left)--> running   (fence + 1)
    running --claim_due (lease expired, no attempt left)--> failed
    pending / failed (attempts left) / running (lease expired) --requeue--> pending
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, case, literal, null, or_, select, true, update
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import Select
from sqlalchemy.sql.elements import ColumnElement

from ledger import dialects
from ledger.ids import time_ordered_id
from ledger.schema import callback_runs, commands, executions
from ledger.store import Store, Work


@dataclass(frozen=True, slots=True)
class CallbackRunRow:
    """One ``callback_runs`` row as stored."""

    run_id: str
    execution_id: str
    event: str
    target: str
    payload: Any
    state: str
    attempts: int
    lease_owner: str | None
    lease_until: int | None
    fence: int
    next_attempt_at: int | None
    last_error: str | None
    created_at: int
    updated_at: int


def _row(row: Row[Any]) -> CallbackRunRow:
    m = row._mapping
    return CallbackRunRow(
        run_id=m["run_id"],
        execution_id=m["execution_id"],
        event=m["event"],
        target=m["target"],
        payload=m["payload"],
        state=m["state"],
        attempts=int(m["attempts"]),
        lease_owner=m["lease_owner"],
        lease_until=m["lease_until"],
        fence=int(m["fence"]),
        next_attempt_at=m["next_attempt_at"],
        last_error=m["last_error"],
        created_at=int(m["created_at"]),
        updated_at=int(m["updated_at"]),
    )


async def enqueue(
    work: Work,
    *,
    execution_id: str,
    event: str,
    targets: Iterable[str],
    payload: Mapping[str, Any],
) -> list[str]:
    """One ``pending`` run per target (due at once); the run ids of the rows this call created,
    in target order. Targets already enqueued for this execution and event are skipped, so a
    repeated call returns ``[]`` and changes nothing (duplicate targets count once)."""
    created: list[str] = []
    body = dict(payload)
    for target in dict.fromkeys(targets):  # ordered de-duplication
        run_id = time_ordered_id()
        values = {
            "run_id": run_id,
            "execution_id": execution_id,
            "event": event,
            "target": target,
            "payload": body,
            "state": "pending",
            "attempts": 0,
            "lease_owner": None,
            "lease_until": None,
            "fence": 0,
            "next_attempt_at": None,
            "last_error": None,
            "created_at": work.now_ms,
            "updated_at": work.now_ms,
        }
        stmt = dialects.insert_ignore(work.store.dialect, callback_runs, values).returning(
            callback_runs.c.run_id
        )
        if (await work.conn.execute(stmt)).first() is not None:
            created.append(run_id)
    return created


async def for_execution(conn: AsyncConnection, execution_id: str) -> list[CallbackRunRow]:
    """Every run owed for the execution, oldest first (audit views and tests)."""
    stmt = (
        select(callback_runs)
        .where(callback_runs.c.execution_id == execution_id)
        .order_by(callback_runs.c.created_at, callback_runs.c.event, callback_runs.c.target)
    )
    return [_row(r) for r in await conn.execute(stmt)]


# -- delivery: claim, record, operator requeue ----------------------------------------------------

#: A run is sent at most this many times; the CHECK constraint ``attempts <= 5`` backs it up.
MAX_ATTEMPTS = 5

#: ``last_error`` is our own short text (a status code, an exception type name), never a body.
_ERROR_LIMIT = 200


def _due(now: ColumnElement[int]) -> ColumnElement[bool]:
    """Claimable: pending and due, or running under a lease that expired (its holder died) with
    an attempt left. Leases are judged by the database clock, never by a worker's."""
    c = callback_runs.c
    return or_(
        and_(c.state == "pending", or_(c.next_attempt_at.is_(None), c.next_attempt_at <= now)),
        and_(c.state == "running", c.lease_until < now, c.attempts < MAX_ATTEMPTS),
    )


def _exhausted(now: ColumnElement[int]) -> ColumnElement[bool]:
    """Running under an expired lease with no attempt left: the holder died during the 5th."""
    c = callback_runs.c
    return and_(c.state == "running", c.lease_until < now, c.attempts >= MAX_ATTEMPTS)


async def _retire_exhausted(work: Work) -> None:
    # Claiming it again would be a 6th attempt; whether the 5th reached the receiver is unknown,
    # and "at most 5 attempts" is the promise, so the run ends failed.
    await work.conn.execute(
        update(callback_runs)
        .where(_exhausted(work.db_now))
        .values(
            state="failed",
            lease_owner=None,
            lease_until=None,
            last_error="lease_expired",
            updated_at=work.now_ms,
        )
    )


def _has_due_statement(now: ColumnElement[int]) -> Select[tuple[str]]:
    return select(callback_runs.c.run_id).where(or_(_due(now), _exhausted(now))).limit(1)


async def has_due(store: Store, conn: AsyncConnection) -> bool:
    """Whether anything is claimable: a read, so an idle worker pass takes no write lock.

    Every worker pass asks, so the statement is built once (:meth:`Store.statement`): building
    the ``or_`` of both conditions and keying it for SQLAlchemy's cache cost more client CPU
    than running it against an empty table."""
    stmt = store.statement(_has_due_statement, _has_due_statement)
    return (await conn.execute(stmt)).first() is not None


async def claim_due(work: Work, *, owner: str, lease_ms: int, limit: int) -> list[CallbackRunRow]:
    """Claim up to ``limit`` due runs for ``owner``: each becomes ``running`` under a lease of
    ``lease_ms`` (database clock) with ``fence`` and ``attempts`` one higher, oldest first.

    The claim is one compare-and-set statement; on PostgreSQL the candidates are picked with
    ``FOR UPDATE SKIP LOCKED`` in a CTE (evaluated once), so N workers take disjoint batches.
    The fence a claim returns is what :func:`record` must present: a worker whose lease expired
    and whose run was claimed again cannot record over the new holder.
    """
    if limit < 1:
        return []
    await _retire_exhausted(work)
    now = work.db_now
    c = callback_runs.c
    picked = select(c.run_id).where(_due(now)).order_by(c.created_at, c.run_id).limit(limit)
    if work.store.dialect == "postgresql":
        due = dialects.skip_locked(picked, work.store.dialect).cte("due_callbacks")
        target = c.run_id == due.c.run_id
    else:
        target = c.run_id.in_(picked.scalar_subquery())
    stmt = (
        update(callback_runs)
        .where(target, _due(now))
        .values(
            state="running",
            lease_owner=owner,
            lease_until=now + literal(lease_ms),
            fence=c.fence + 1,
            attempts=c.attempts + 1,
            updated_at=work.now_ms,
        )
        .returning(*callback_runs.c)
    )
    rows = [_row(r) for r in await work.conn.execute(stmt)]
    return sorted(rows, key=lambda r: (r.created_at, r.run_id))


async def record(
    work: Work,
    run_id: str,
    *,
    fence: int,
    delivered: bool,
    error: str | None,
    retry_in_ms: int | None,
) -> bool:
    """Record the outcome of the attempt claimed with ``fence``; ``False`` (nothing written)
    when the run is no longer ``running`` under that fence: another worker reclaimed it, or an
    operator's requeue took it back, and the newer holder's outcome is the one that counts.

    ``delivered`` ends the run. Otherwise it goes back to ``pending``, due ``retry_in_ms`` later
    by the database clock, unless this was attempt :data:`MAX_ATTEMPTS` or ``retry_in_ms`` is
    ``None`` (the target can never accept it), which end it ``failed``. ``error`` is stored
    truncated; callers pass a status code or an exception type name, never a response body.
    """
    c = callback_runs.c
    values: dict[str, Any] = {"lease_owner": None, "lease_until": None, "updated_at": work.now_ms}
    if delivered:
        values.update(state="delivered", next_attempt_at=None, last_error=None)
    else:
        values["last_error"] = (error or "error")[:_ERROR_LIMIT]
        if retry_in_ms is None:
            values.update(state="failed", next_attempt_at=None)
        else:
            last = c.attempts >= MAX_ATTEMPTS
            values["state"] = case((last, "failed"), else_="pending")
            values["next_attempt_at"] = case(
                (last, null()), else_=work.db_now + literal(max(0, retry_in_ms))
            )
    stmt = (
        update(callback_runs)
        .where(c.run_id == run_id, c.fence == fence, c.state == "running")
        .values(**values)
        .returning(c.run_id)
    )
    return (await work.conn.execute(stmt)).first() is not None


REQUEUE_KINDS = ("republished", "retried", "reclaimed")


def _executions_of(tenant: str) -> Select[tuple[str]]:
    """Execution ids of ``tenant``'s commands (tenants may share one database)."""
    return (
        select(executions.c.execution_id)
        .join(commands, commands.c.command_id == executions.c.command_id)
        .where(commands.c.tenant == tenant)
    )


async def requeue(
    work: Work, *, older_than_ms: int, limit: int, tenant: str | None = None
) -> dict[str, int]:
    """Operator recovery of lost deliveries, at most ``limit`` runs in all, oldest first (of
    ``tenant``'s executions only, or of every tenant's for ``None``):

    * ``republished``: ``pending`` runs not touched for ``older_than_ms`` are made due now
      (a backoff that an operator wants cut short, or rows no worker has looked at);
    * ``retried``: ``failed`` runs that still have an attempt left (failed early, e.g. their
      target was refused outright) go back to ``pending``, due now — whatever their age, since
      a failure is final until somebody asks;
    * ``reclaimed``: ``running`` runs whose lease expired and that were not touched for
      ``older_than_ms`` go back to ``pending`` with the fence moved, so the lost holder can never
      record over the next attempt. A run whose 5th attempt was lost this way ends ``failed``
      instead (the next claim retires it): requeue never grants a 6th attempt.

    ``updated_at`` is the client clock (it is what wrote it); leases are judged by the database
    clock. Attempts are never reset: the 5-attempt promise holds across requeues.
    """
    c = callback_runs.c
    now = work.db_now
    # Clamped so an absurd age cannot overflow BIGINT: older than the epoch is older than all.
    cutoff = work.now_ms - min(max(0, older_than_ms), work.now_ms)
    conditions: dict[str, ColumnElement[bool]] = {
        "republished": and_(c.state == "pending", c.updated_at < cutoff),
        "retried": and_(c.state == "failed", c.attempts < MAX_ATTEMPTS),
        "reclaimed": and_(
            c.state == "running",
            c.lease_until < now,
            c.updated_at < cutoff,
            c.attempts < MAX_ATTEMPTS,
        ),
    }
    counts = dict.fromkeys(REQUEUE_KINDS, 0)
    if limit < 1:
        return counts
    mine = true() if tenant is None else c.execution_id.in_(_executions_of(tenant))
    picked = (
        select(c.run_id)
        .where(or_(*conditions.values()), mine)
        .order_by(c.updated_at, c.run_id)
        .limit(limit)
    )
    picked = dialects.skip_locked(picked, work.store.dialect)
    ids = [str(v) for v in (await work.conn.execute(picked)).scalars()]
    if not ids:
        return counts
    common = {
        "state": "pending",
        "next_attempt_at": None,
        "lease_owner": None,
        "lease_until": None,
        "updated_at": work.now_ms,
    }
    for kind, condition in conditions.items():
        values: dict[str, Any] = dict(common)
        if kind == "reclaimed":
            values["fence"] = c.fence + 1
        stmt = (
            update(callback_runs)
            .where(c.run_id.in_(ids), condition)
            .values(**values)
            .returning(c.run_id)
        )
        counts[kind] = len((await work.conn.execute(stmt)).all())
    return counts
