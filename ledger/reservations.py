"""Repository of idempotency reservations: one key, one execution.

A caller that sends ``Idempotency-Key: k`` for command ``c`` reserves ``(c, actor bucket, k)``
before it runs anything; a second request with the same key finds the reservation and is answered
with the first execution instead of running the command again. The primary key is the lock: the
insert either wins or is ignored (``ON CONFLICT DO NOTHING``), so two concurrent requests cannot
both believe they hold the key, on either backend.

``expires_at`` is on the client clock (``work.now_ms + ttl_ms``), like every other timestamp the
commands layer writes; callers judge expiry against ``work.now_ms`` and take an expired key over
with :func:`replace`, a compare-and-set on the execution the caller saw holding it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import dialects
from ledger.schema import idempotency_reservations as reservations
from ledger.store import Work


@dataclass(frozen=True, slots=True)
class ReservationRow:
    """One ``idempotency_reservations`` row as stored."""

    command_id: str
    actor_bucket: str
    key: str
    execution_id: str
    expires_at: int
    created_at: int

    def expired(self, now_ms: int) -> bool:
        """The holder's time is up at ``now_ms`` (client clock): the key may be taken over."""
        return self.expires_at <= now_ms


def _row(row: Row[Any]) -> ReservationRow:
    m = row._mapping
    return ReservationRow(
        command_id=m["command_id"],
        actor_bucket=m["actor_bucket"],
        key=m["key"],
        execution_id=m["execution_id"],
        expires_at=int(m["expires_at"]),
        created_at=int(m["created_at"]),
    )


def _pk(command_id: str, bucket: str, key: str) -> tuple[Any, ...]:
    return (
        reservations.c.command_id == command_id,
        reservations.c.actor_bucket == bucket,
        reservations.c.key == key,
    )


async def get(
    conn: AsyncConnection, command_id: str, bucket: str, key: str
) -> ReservationRow | None:
    """The reservation of ``key`` in ``bucket`` for the command, or ``None``."""
    stmt = select(reservations).where(*_pk(command_id, bucket, key))
    row = (await conn.execute(stmt)).first()
    return _row(row) if row is not None else None


async def _insert(
    work: Work, *, command_id: str, bucket: str, key: str, execution_id: str, ttl_ms: int
) -> bool:
    values = {
        "command_id": command_id,
        "actor_bucket": bucket,
        "key": key,
        "execution_id": execution_id,
        "expires_at": work.now_ms + ttl_ms,
        "created_at": work.now_ms,
    }
    # RETURNING instead of rowcount: it says "inserted" the same way on both drivers.
    stmt = dialects.insert_ignore(work.store.dialect, reservations, values).returning(
        reservations.c.execution_id
    )
    return (await work.conn.execute(stmt)).first() is not None


async def reserve(
    work: Work, *, command_id: str, bucket: str, key: str, execution_id: str, ttl_ms: int
) -> bool:
    """Take the key for ``execution_id``; ``False`` when it is already held (by anyone, expired
    or not: taking over an expired key is :func:`replace`, which needs the holder's id)."""
    return await _insert(
        work,
        command_id=command_id,
        bucket=bucket,
        key=key,
        execution_id=execution_id,
        ttl_ms=ttl_ms,
    )


async def release(work: Work, *, command_id: str, bucket: str, key: str, execution_id: str) -> None:
    """Give the key back, but only if it still names ``execution_id``: a holder whose
    reservation was already taken over must not delete its successor's."""
    await work.conn.execute(
        delete(reservations).where(
            *_pk(command_id, bucket, key), reservations.c.execution_id == execution_id
        )
    )


async def replace(
    work: Work,
    *,
    command_id: str,
    bucket: str,
    key: str,
    old_execution_id: str,
    execution_id: str,
    ttl_ms: int,
) -> bool:
    """Take over a key the caller saw held by ``old_execution_id`` (expired, or its execution
    failed); ``True`` when ``execution_id`` holds it now.

    Compare-and-set on the holder: of two requests taking over the same stale key only one
    matches ``old_execution_id``. If the old holder released the key in the meantime (the row is
    gone) the key is free and is reserved afresh, again with one winner. ``False`` when another
    execution holds it by now. Expiry is the caller's judgement, not re-checked here.
    """
    stmt = (
        update(reservations)
        .where(*_pk(command_id, bucket, key), reservations.c.execution_id == old_execution_id)
        .values(
            execution_id=execution_id,
            expires_at=work.now_ms + ttl_ms,
            created_at=work.now_ms,
        )
        .returning(reservations.c.execution_id)
    )
    if (await work.conn.execute(stmt)).first() is not None:
        return True
    return await _insert(
        work,
        command_id=command_id,
        bucket=bucket,
        key=key,
        execution_id=execution_id,
        ttl_ms=ttl_ms,
    )
