"""Repository of per-action settings: whether a provider action needs an approval, and how.

Settings rows are optional: an action without one has the defaults (no approval). ``revision``
counts content changes, so a staged execution can record the revision it was judged under and an
approver can tell that the rules changed since. ``locked_for`` names one operation (say, a
settings migration) that holds the action exclusively; :func:`lock` / :func:`unlock` are
compare-and-sets on it.

The upsert in :func:`put` is portable: UPDATE first, INSERT … ON CONFLICT DO NOTHING when there
was no row, UPDATE again if a concurrent writer inserted it in between. That avoids a second
dialect-specific ``ON CONFLICT DO UPDATE`` beside :func:`ledger.dialects.insert_ignore`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import dialects
from ledger.schema import action_settings
from ledger.store import Work


@dataclass(frozen=True, slots=True)
class ActionSettingsRow:
    """One ``action_settings`` row as stored (``requires_approval`` as a bool)."""

    provider: str
    action: str
    requires_approval: bool
    approval_policy: Any
    locked_for: str | None
    revision: int
    updated_at: int


def _row(row: Row[Any]) -> ActionSettingsRow:
    m = row._mapping
    return ActionSettingsRow(
        provider=m["provider"],
        action=m["action"],
        requires_approval=bool(m["requires_approval"]),
        approval_policy=m["approval_policy"],
        locked_for=m["locked_for"],
        revision=int(m["revision"]),
        updated_at=int(m["updated_at"]),
    )


def _key(provider: str, action: str) -> tuple[Any, ...]:
    return (action_settings.c.provider == provider, action_settings.c.action == action)


async def get(conn: AsyncConnection, provider: str, action: str) -> ActionSettingsRow | None:
    """The settings of ``provider.action``, or ``None`` (the defaults apply)."""
    row = (await conn.execute(select(action_settings).where(*_key(provider, action)))).first()
    return _row(row) if row is not None else None


async def all_(conn: AsyncConnection) -> list[ActionSettingsRow]:
    """Every settings row, by provider then action (a stable order for listings)."""
    stmt = select(action_settings).order_by(action_settings.c.provider, action_settings.c.action)
    return [_row(r) for r in await conn.execute(stmt)]


async def _insert_default(
    work: Work, provider: str, action: str, **values: Any
) -> ActionSettingsRow | None:
    """Insert a row (defaults overridden by ``values``); ``None`` when one exists already."""
    row = {
        "provider": provider,
        "action": action,
        "requires_approval": 0,
        "approval_policy": None,
        "locked_for": None,
        "revision": 1,
        "updated_at": work.now_ms,
        **values,
    }
    stmt = dialects.insert_ignore(work.store.dialect, action_settings, row).returning(
        *action_settings.c
    )
    inserted = (await work.conn.execute(stmt)).first()
    return _row(inserted) if inserted is not None else None


async def put(
    work: Work,
    provider: str,
    action: str,
    *,
    requires_approval: bool,
    approval_policy: Mapping[str, Any] | None,
) -> ActionSettingsRow:
    """Create or replace the settings of ``provider.action``; the revision starts at 1 and goes
    up by one on every put, so anything judged under an older revision can tell. The lock is not
    consulted here: callers holding or checking it do so with :func:`lock`."""
    policy = dict(approval_policy) if approval_policy is not None else None
    stmt = (
        update(action_settings)
        .where(*_key(provider, action))
        .values(
            requires_approval=int(requires_approval),
            approval_policy=policy,
            revision=action_settings.c.revision + 1,
            updated_at=work.now_ms,
        )
        .returning(*action_settings.c)
    )
    row = (await work.conn.execute(stmt)).first()
    if row is not None:
        return _row(row)
    inserted = await _insert_default(
        work, provider, action, requires_approval=int(requires_approval), approval_policy=policy
    )
    if inserted is not None:
        return inserted
    # A concurrent put created the row between our UPDATE and INSERT: update that one.
    return _row((await work.conn.execute(stmt)).one())


async def lock(work: Work, provider: str, action: str, operation: str) -> bool:
    """Let ``operation`` hold ``provider.action``; ``True`` when it holds it now (re-locking by the
    same operation is idempotent), ``False`` when another operation does. An action without a
    settings row gets one with the defaults, so the lock has a row to live on."""
    await _insert_default(work, provider, action)
    stmt = (
        update(action_settings)
        .where(
            *_key(provider, action),
            or_(action_settings.c.locked_for.is_(None), action_settings.c.locked_for == operation),
        )
        .values(locked_for=operation)
        .returning(action_settings.c.locked_for)
    )
    return (await work.conn.execute(stmt)).first() is not None


async def unlock(work: Work, provider: str, action: str, operation: str) -> bool:
    """Release the lock if ``operation`` holds it; ``False`` otherwise (never breaks another
    operation's lock)."""
    stmt = (
        update(action_settings)
        .where(*_key(provider, action), action_settings.c.locked_for == operation)
        .values(locked_for=None)
        .returning(action_settings.c.provider)
    )
    return (await work.conn.execute(stmt)).first() is not None
