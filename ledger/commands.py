"""Repository of stored commands (the commands layer's named, versioned saga definitions).

A command is edited in place, so every edit is a compare-and-set on its ``digest``: two editors
who both read version A cannot both overwrite it, the second one learns that the row moved and
must re-read. Deletion is soft (``deleted_at``) because executions keep pointing at the command
for their audit trail. Nothing here writes ledger rows: commands are not sagas.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import ColumnElement, and_, false, or_, select
from sqlalchemy import update as sql_update
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.schema import commands
from ledger.store import Work

#: Columns :func:`update` may change; identity, authorship and timestamps are not edits.
MUTABLE_COLUMNS = frozenset(
    {
        "name",
        "scope_kind",
        "scope_id",
        "tag_id",
        "version",
        "mode",
        "definition",
        "digest",
        "saga_digest",
    }
)


@dataclass(frozen=True, slots=True)
class CommandRow:
    """One ``commands`` row as stored."""

    command_id: str
    tenant: str
    name: str
    scope_kind: str
    scope_id: str
    tag_id: str | None
    version: int
    mode: str
    definition: Any
    digest: str
    saga_digest: str | None
    created_by: str
    created_at: int
    updated_at: int
    deleted_at: int | None

    @property
    def deleted(self) -> bool:
        """Soft-deleted: kept for the executions that name it, invisible to everything else."""
        return self.deleted_at is not None


_FIELDS = tuple(f.name for f in fields(CommandRow))


def _row(row: Row[Any]) -> CommandRow:
    # By field name, not ``**row``: a column added to the table later must not break readers.
    m = row._mapping
    return CommandRow(**{name: m[name] for name in _FIELDS})


async def insert(
    work: Work,
    *,
    command_id: str,
    tenant: str,
    name: str,
    scope_kind: str,
    scope_id: str,
    tag_id: str | None,
    version: int,
    mode: str,
    definition: Mapping[str, Any],
    digest: str,
    saga_digest: str | None,
    created_by: str,
) -> CommandRow:
    """Store a new command; the row comes back as the database holds it (RETURNING)."""
    stmt = (
        commands.insert()
        .values(
            command_id=command_id,
            tenant=tenant,
            name=name,
            scope_kind=scope_kind,
            scope_id=scope_id,
            tag_id=tag_id,
            version=version,
            mode=mode,
            definition=dict(definition),
            digest=digest,
            saga_digest=saga_digest,
            created_by=created_by,
            created_at=work.now_ms,
            updated_at=work.now_ms,
            deleted_at=None,
        )
        .returning(*commands.c)
    )
    return _row((await work.conn.execute(stmt)).one())


async def get(
    conn: AsyncConnection, command_id: str, *, include_deleted: bool = False
) -> CommandRow | None:
    """The command, or ``None``; soft-deleted ones only with ``include_deleted`` (audit views)."""
    stmt = select(commands).where(commands.c.command_id == command_id)
    if not include_deleted:
        stmt = stmt.where(commands.c.deleted_at.is_(None))
    row = (await conn.execute(stmt)).first()
    return _row(row) if row is not None else None


async def list_(
    conn: AsyncConnection,
    *,
    tenant: str,
    skip: int = 0,
    limit: int = 50,
    company: bool = True,
    rooms: Collection[str] | None = None,
) -> list[CommandRow]:
    """A page of the tenant's live commands, newest first (``command_id`` breaks ties, so pages
    are stable even when several commands share a millisecond).

    ``company=False`` leaves out company-scoped commands; ``rooms``, when given, keeps only the
    room-scoped commands of those rooms. The page is cut after that filter, so a caller's
    visible commands page in the database."""
    mounted: list[ColumnElement[bool]] = []
    if company:
        mounted.append(commands.c.scope_kind == "company")
    if rooms is None:
        mounted.append(commands.c.scope_kind == "room")
    elif rooms:
        mounted.append(and_(commands.c.scope_kind == "room", commands.c.scope_id.in_(rooms)))
    stmt = (
        select(commands)
        .where(
            commands.c.tenant == tenant,
            commands.c.deleted_at.is_(None),
            or_(*mounted) if mounted else false(),
        )
        .order_by(commands.c.created_at.desc(), commands.c.command_id.desc())
        .offset(skip)
        .limit(limit)
    )
    return [_row(r) for r in await conn.execute(stmt)]


async def rooms_in_use(conn: AsyncConnection, *, tenant: str, among: Collection[str]) -> set[str]:
    """Which of the rooms ``among`` have a live command of the tenant mounted in them."""
    if not among:
        return set()
    stmt = (
        select(commands.c.scope_id)
        .where(
            commands.c.tenant == tenant,
            commands.c.deleted_at.is_(None),
            commands.c.scope_kind == "room",
            commands.c.scope_id.in_(among),
        )
        .distinct()
    )
    return {str(v) for v in (await conn.execute(stmt)).scalars()}


async def update(
    work: Work, command_id: str, *, expected_digest: str, **changes: Any
) -> CommandRow | None:
    """Compare-and-set edit: apply ``changes`` only while the row still has ``expected_digest``.

    ``None`` when the command is missing, soft-deleted or was edited since the caller read it
    (its digest moved); the caller re-reads instead of overwriting someone else's edit.
    ``updated_at`` is bumped. Unknown or immutable columns are a programming error.
    """
    refused = set(changes) - MUTABLE_COLUMNS
    if refused:
        raise ValueError(f"commands.update cannot change {sorted(refused)}")
    values = dict(changes)
    if "definition" in values:
        values["definition"] = dict(values["definition"])
    stmt = (
        sql_update(commands)
        .where(
            commands.c.command_id == command_id,
            commands.c.digest == expected_digest,
            commands.c.deleted_at.is_(None),
        )
        .values(**values, updated_at=work.now_ms)
        .returning(*commands.c)
    )
    row = (await work.conn.execute(stmt)).first()
    return _row(row) if row is not None else None


async def soft_delete(work: Work, command_id: str) -> bool:
    """Mark the command deleted; ``False`` when it is missing or already deleted (so the first
    deletion's timestamp is the one kept)."""
    stmt = (
        sql_update(commands)
        .where(commands.c.command_id == command_id, commands.c.deleted_at.is_(None))
        .values(deleted_at=work.now_ms, updated_at=work.now_ms)
        .returning(commands.c.command_id)
    )
    return (await work.conn.execute(stmt)).first() is not None


async def lock_for_apply(work: Work, command_id: str) -> CommandRow | None:
    """Re-read the live command inside the write transaction that acts on it.

    PostgreSQL takes a row lock (``SELECT … FOR UPDATE``), so a concurrent edit or delete waits
    until this transaction ends and the digest the caller checks stays the one it applies.
    SQLite needs no lock: the write transaction (``BEGIN IMMEDIATE``) already excludes every
    other writer. ``None`` when the command is missing or soft-deleted.
    """
    stmt = select(commands).where(
        commands.c.command_id == command_id, commands.c.deleted_at.is_(None)
    )
    if work.store.dialect == "postgresql":
        stmt = stmt.with_for_update()
    row = (await work.conn.execute(stmt)).first()
    return _row(row) if row is not None else None
