"""Repository of executions: the audit record of one run of a stored command.

An execution is written before anything runs (status ``running``, or ``staged`` when it waits for
an approval) and finished once with its outcome, so a run that crashed half-way is still visible.
It is not a saga: its transaction (``tx_id``) has its own ledger; nothing here writes ledger rows.

Finished executions are pruned after a retention period. Their idempotency reservations, callback
runs and agent-toolbox rows (``staged_actions``, ``staged_changes``: an agent-confirmed or approved
execution that finished keeps them) go with them in the same transaction, so no reservation
outlives the execution it names and no dependent points at a deleted row (each of those tables
references ``executions.execution_id`` by foreign key).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from ledger.schema import (
    callback_runs,
    commands,
    executions,
    idempotency_reservations,
    staged_actions,
    staged_changes,
)
from ledger.store import Work

#: Outcomes that end an execution for good: only these are ever pruned. ``staged`` waits for an
#: approval, ``running`` may still be recovered and ``manual_review`` waits for an operator.
PRUNABLE = ("succeeded", "failed")

#: Ids deleted per statement: well under SQLite's and asyncpg's bind-parameter limits.
_PRUNE_CHUNK = 500

_TIMESTAMPS = frozenset({"created_at", "updated_at"})
_COLUMNS = frozenset(executions.c.keys()) - _TIMESTAMPS
_REQUIRED = frozenset(c.name for c in executions.c if not c.nullable and c.name not in _TIMESTAMPS)
#: What :func:`finish` may not change: the identity of the run and its creation time.
_IMMUTABLE = frozenset({"execution_id", "command_id", "created_at", "updated_at", "status"})


@dataclass(frozen=True, slots=True)
class ExecutionRow:
    """One ``executions`` row as stored."""

    execution_id: str
    command_id: str
    command_digest: str
    tx_id: str | None
    status: str
    invoker_kind: str
    invoker_id: str
    actor_bucket: str
    idempotency_key: str | None
    origin: str
    input_snapshot: Any
    authorization_snapshot: Any
    steps: Any
    result_refs: Any
    error_code: str | None
    error: str | None
    response: Any
    lifecycle_snapshot: Any
    staged_change_id: str | None
    room_id: str | None
    duration_ms: int | None
    created_at: int
    updated_at: int


_FIELDS = tuple(f.name for f in fields(ExecutionRow))


def _row(row: Row[Any]) -> ExecutionRow:
    # By field name, not ``**row``: a column added to the table later must not break readers.
    m = row._mapping
    return ExecutionRow(**{name: m[name] for name in _FIELDS})


async def insert(work: Work, **columns: Any) -> None:
    """Record a new execution; ``created_at`` and ``updated_at`` are the work's clock.

    Unknown and missing required columns raise :class:`TypeError` before any SQL, so a caller's
    typo is not reported as an opaque NOT NULL violation from the database.
    """
    unknown = set(columns) - _COLUMNS
    if unknown:
        raise TypeError(f"executions.insert got unknown columns {sorted(unknown)}")
    missing = _REQUIRED - set(columns)
    if missing:
        raise TypeError(f"executions.insert is missing columns {sorted(missing)}")
    await work.conn.execute(
        executions.insert().values(**columns, created_at=work.now_ms, updated_at=work.now_ms)
    )


async def get(conn: AsyncConnection, execution_id: str) -> ExecutionRow | None:
    """The execution, or ``None``."""
    stmt = select(executions).where(executions.c.execution_id == execution_id)
    row = (await conn.execute(stmt)).first()
    return _row(row) if row is not None else None


async def by_tx(conn: AsyncConnection, tx_id: str) -> ExecutionRow | None:
    """The execution that started transaction ``tx_id`` (the saga engine knows only the tx)."""
    stmt = (
        select(executions)
        .where(executions.c.tx_id == tx_id)
        .order_by(executions.c.created_at.desc(), executions.c.execution_id.desc())
        .limit(1)
    )
    row = (await conn.execute(stmt)).first()
    return _row(row) if row is not None else None


async def get_for_update(work: Work, execution_id: str) -> ExecutionRow | None:
    """Re-read the execution inside the write transaction that will finish it.

    PostgreSQL locks the row (``FOR UPDATE``) so two finishers (the caller and a recovering
    worker) serialise and the second sees the first one's status; SQLite's write transaction
    already excludes every other writer.
    """
    stmt = select(executions).where(executions.c.execution_id == execution_id)
    if work.store.dialect == "postgresql":
        stmt = stmt.with_for_update()
    row = (await work.conn.execute(stmt)).first()
    return _row(row) if row is not None else None


async def list_(
    conn: AsyncConnection, *, command_id: str, skip: int = 0, limit: int = 50
) -> list[ExecutionRow]:
    """A page of the command's executions, newest first; ``execution_id`` breaks ties so a page
    boundary inside one millisecond neither repeats nor skips a row."""
    stmt = (
        select(executions)
        .where(executions.c.command_id == command_id)
        .order_by(executions.c.created_at.desc(), executions.c.execution_id.desc())
        .offset(skip)
        .limit(limit)
    )
    return [_row(r) for r in await conn.execute(stmt)]


async def staged_of(conn: AsyncConnection, command_id: str) -> list[ExecutionRow]:
    """The command's executions still ``staged`` (plans waiting for a person), oldest first;
    read through ``ix_executions_command_created``."""
    stmt = (
        select(executions)
        .where(executions.c.command_id == command_id, executions.c.status == "staged")
        .order_by(executions.c.created_at, executions.c.execution_id)
    )
    return [_row(r) for r in await conn.execute(stmt)]


async def finish(work: Work, execution_id: str, *, status: str, **changes: Any) -> None:
    """Set the outcome: ``status``, the given columns and ``updated_at``.

    Raises :class:`LookupError` when there is no such execution: an outcome recorded for a row
    that does not exist would be silently lost. Identity columns cannot be changed.
    """
    unknown = set(changes) - _COLUMNS
    if unknown:
        raise TypeError(f"executions.finish got unknown columns {sorted(unknown)}")
    refused = set(changes) & _IMMUTABLE
    if refused:
        raise TypeError(f"executions.finish cannot change {sorted(refused)}")
    stmt = (
        update(executions)
        .where(executions.c.execution_id == execution_id)
        .values(**changes, status=status, updated_at=work.now_ms)
        .returning(executions.c.execution_id)
    )
    if (await work.conn.execute(stmt)).first() is None:
        raise LookupError(f"no execution {execution_id!r}")


def of_tenant(tenant: str) -> ColumnElement[bool]:
    """An execution of one of ``tenant``'s commands (tenants may share one database; an
    execution is its command's tenant's, through ``command_id``)."""
    return executions.c.command_id.in_(
        select(commands.c.command_id).where(commands.c.tenant == tenant)
    )


async def prune(work: Work, *, cutoff_ms: int, tenant: str | None = None) -> int:
    """Delete finished (``succeeded`` / ``failed``) executions created before ``cutoff_ms``, with
    their callback runs, staged actions, staged changes and the idempotency reservations naming
    them; the number of executions deleted. ``staged``, ``running`` and ``manual_review`` rows
    are kept whatever their age. ``tenant``: only that tenant's executions (``None``: every
    tenant's, for whoever holds the database).

    The victims are selected first (locked on PostgreSQL, so a callback enqueued concurrently for
    one of them waits for this transaction instead of failing its foreign key), then deleted by id
    in chunks; dependents go before the executions they reference.
    """
    stmt = select(executions.c.execution_id).where(
        executions.c.status.in_(PRUNABLE), executions.c.created_at < cutoff_ms
    )
    if tenant is not None:
        stmt = stmt.where(of_tenant(tenant))
    if work.store.dialect == "postgresql":
        stmt = stmt.with_for_update()
    victims = [str(v) for v in (await work.conn.execute(stmt)).scalars()]
    for start in range(0, len(victims), _PRUNE_CHUNK):
        chunk = victims[start : start + _PRUNE_CHUNK]
        for dependent in (callback_runs, staged_actions, staged_changes):
            await work.conn.execute(delete(dependent).where(dependent.c.execution_id.in_(chunk)))
        await work.conn.execute(
            delete(idempotency_reservations).where(
                idempotency_reservations.c.execution_id.in_(chunk)
            )
        )
        await work.conn.execute(delete(executions).where(executions.c.execution_id.in_(chunk)))
    return len(victims)


async def agent_window(
    conn: AsyncConnection, room_id: str, *, tenant: str, limit: int
) -> list[ExecutionRow]:
    """The room's latest agent-confirmed executions of ``tenant``'s commands, newest first (the
    delivery window's scan).

    Only executions keyed ``agent-confirmed:…`` carry a delivery marker; manual REST executions
    never do, so they are not in the window. Room ids are not unique across tenants sharing a
    database, so the tenant (its commands') bounds the scan: another tenant's room of the same
    id neither shows its markers here nor fills this window."""
    stmt = (
        select(executions)
        .join(commands, commands.c.command_id == executions.c.command_id)
        .where(
            executions.c.room_id == room_id,
            executions.c.origin == "agent",
            executions.c.idempotency_key.like("agent-confirmed:%"),
            commands.c.tenant == tenant,
        )
        .order_by(executions.c.created_at.desc(), executions.c.execution_id.desc())
        .limit(limit)
    )
    return [_row(r) for r in await conn.execute(stmt)]
