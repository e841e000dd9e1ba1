"""Repositories of staged plans: an agent's confirmation state and approvals waiting for a person.

Both hold a plan that is persisted but not running (its transaction is ``staged``). Each moves
out of ``pending`` exactly once, by compare-and-set, so two confirmations of one plan (a person
saying "yes" twice, two approvers clicking at once) can never run it twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.schema import staged_actions, staged_changes
from ledger.store import Work


@dataclass(frozen=True, slots=True)
class StagedActionRow:
    """An agent's staged action (the token is stored only as its SHA-256)."""

    token_sha256: str
    execution_id: str
    command_id: str
    digest: str
    room_id: str | None
    language: str
    invoker_kind: str
    invoker_id: str
    state: str
    created_at: int
    expires_at: int
    updated_at: int


@dataclass(frozen=True, slots=True)
class StagedChangeRow:
    """A plan frozen for an approver."""

    staged_change_id: str
    execution_id: str
    command_id: str
    digest: str
    requested_by: str
    state: str
    decided_by: str | None
    reason: str | None
    decided_at: int | None
    created_at: int
    updated_at: int


def _action(row: Row[Any]) -> StagedActionRow:
    return StagedActionRow(**dict(row._mapping))


def _change(row: Row[Any]) -> StagedChangeRow:
    return StagedChangeRow(**dict(row._mapping))


async def insert_action(
    work: Work,
    *,
    token_sha256: str,
    execution_id: str,
    command_id: str,
    digest: str,
    room_id: str | None,
    language: str,
    invoker_kind: str,
    invoker_id: str,
    ttl_ms: int,
) -> None:
    """Persist the confirmation state of a freshly staged action (``pending``)."""
    await work.conn.execute(
        staged_actions.insert().values(
            token_sha256=token_sha256,
            execution_id=execution_id,
            command_id=command_id,
            digest=digest,
            room_id=room_id,
            language=language,
            invoker_kind=invoker_kind,
            invoker_id=invoker_id,
            state="pending",
            created_at=work.now_ms,
            expires_at=work.now_ms + ttl_ms,
            updated_at=work.now_ms,
        )
    )


async def get_action(conn: AsyncConnection, token_sha256: str) -> StagedActionRow | None:
    """The staged action with that token hash, or ``None``."""
    stmt = select(staged_actions).where(staged_actions.c.token_sha256 == token_sha256)
    row = (await conn.execute(stmt)).first()
    return _action(row) if row is not None else None


async def action_of(conn: AsyncConnection, execution_id: str) -> StagedActionRow | None:
    """The staged action behind an execution, or ``None``."""
    stmt = select(staged_actions).where(staged_actions.c.execution_id == execution_id)
    row = (await conn.execute(stmt)).first()
    return _action(row) if row is not None else None


async def expired_actions(
    conn: AsyncConnection, *, invoker_kind: str, invoker_id: str, now_ms: int, limit: int
) -> list[StagedActionRow]:
    """A person's pending staged actions whose confirmation window has passed, oldest first."""
    stmt = (
        select(staged_actions)
        .where(
            staged_actions.c.invoker_kind == invoker_kind,
            staged_actions.c.invoker_id == invoker_id,
            staged_actions.c.state == "pending",
            staged_actions.c.expires_at <= now_ms,
        )
        .order_by(staged_actions.c.expires_at)
        .limit(limit)
    )
    return [_action(r) for r in await conn.execute(stmt)]


async def move_action(work: Work, token_sha256: str, *, from_state: str, to_state: str) -> bool:
    """Compare-and-set the action's state; ``False`` if it was no longer ``from_state``."""
    stmt = (
        update(staged_actions)
        .where(
            staged_actions.c.token_sha256 == token_sha256,
            staged_actions.c.state == from_state,
        )
        .values(state=to_state, updated_at=work.now_ms)
    )
    return bool((await work.conn.execute(stmt)).rowcount == 1)


async def insert_change(
    work: Work,
    *,
    staged_change_id: str,
    execution_id: str,
    command_id: str,
    digest: str,
    requested_by: str,
) -> None:
    """Persist a plan waiting for approval (``pending``)."""
    await work.conn.execute(
        staged_changes.insert().values(
            staged_change_id=staged_change_id,
            execution_id=execution_id,
            command_id=command_id,
            digest=digest,
            requested_by=requested_by,
            state="pending",
            decided_by=None,
            reason=None,
            decided_at=None,
            created_at=work.now_ms,
            updated_at=work.now_ms,
        )
    )


async def get_change(conn: AsyncConnection, staged_change_id: str) -> StagedChangeRow | None:
    """The staged change with that id, or ``None``."""
    stmt = select(staged_changes).where(staged_changes.c.staged_change_id == staged_change_id)
    row = (await conn.execute(stmt)).first()
    return _change(row) if row is not None else None


async def decide_change(
    work: Work, staged_change_id: str, *, to_state: str, decided_by: str, reason: str | None
) -> bool:
    """``pending → approved | rejected`` by compare-and-set; ``False`` if already decided."""
    stmt = (
        update(staged_changes)
        .where(
            staged_changes.c.staged_change_id == staged_change_id,
            staged_changes.c.state == "pending",
        )
        .values(
            state=to_state,
            decided_by=decided_by,
            reason=reason,
            decided_at=work.now_ms,
            updated_at=work.now_ms,
        )
    )
    return bool((await work.conn.execute(stmt)).rowcount == 1)
