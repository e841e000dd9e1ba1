"""Repository of principals, their grants and their room memberships (the commands layer).

A command runs with its caller's own rights, never the author's (seed 000: "no definer rights"),
so every check the engine makes reads these three tables:

* ``principals`` — who: tenant, kind (``user`` / ``client``), verified / disabled flags, a soft
  delete, and an optional API key stored only as its SHA-256 (a leaked table leaks no key);
* ``grants`` — what: one row per (principal, provider, action, permission), ``action = '*'``
  meaning every action of the provider, with an optional amount cap and readable result fields;
* ``room_members`` — where: leaving a room sets ``left_at`` instead of deleting the row, so a
  membership's history survives and re-joining is an update of the same row.

This module only stores and reads; deciding what a row permits is ``orchestrator.authz``'s job.
Booleans are INTEGER 0/1 on both backends and come back as ``bool``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, delete, func, select, update
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import dialects
from ledger.schema import PERMISSIONS, PRINCIPAL_KINDS, grants, principals, room_members
from ledger.store import Work

#: ``grants.action`` value that covers every action of the provider.
ANY_ACTION = "*"
#: The largest cap ``grants.max_amount`` holds: a signed 64-bit ``BIGINT`` on both backends
#: (SQLite's INTEGER too). A larger one failed in the driver, with the statement in the error.
MAX_AMOUNT = 2**63 - 1


@dataclass(frozen=True, slots=True)
class PrincipalRow:
    """One ``principals`` row."""

    principal_id: str
    tenant: str
    kind: str
    name: str
    verified: bool
    disabled: bool
    api_key_sha256: str | None
    created_at: int
    deleted_at: int | None

    @property
    def alive(self) -> bool:
        """Not soft-deleted."""
        return self.deleted_at is None


@dataclass(frozen=True, slots=True)
class GrantRow:
    """One ``grants`` row; ``readable_fields`` is ``None`` for "every result field"."""

    grant_id: str
    principal_id: str
    provider: str
    action: str
    permission: str
    max_amount: int | None
    amount_field: str | None
    readable_fields: tuple[str, ...] | None
    created_at: int


@dataclass(frozen=True, slots=True)
class MembershipRow:
    """One ``room_members`` row; a member only while ``left_at`` is ``None``."""

    room_id: str
    principal_id: str
    language: str | None
    joined_at: int
    left_at: int | None

    @property
    def current(self) -> bool:
        """Still a member (has not left)."""
        return self.left_at is None


def _principal(row: Row[Any]) -> PrincipalRow:
    m = row._mapping
    return PrincipalRow(
        principal_id=m["principal_id"],
        tenant=m["tenant"],
        kind=m["kind"],
        name=m["name"],
        verified=bool(m["verified"]),
        disabled=bool(m["disabled"]),
        api_key_sha256=m["api_key_sha256"],
        created_at=int(m["created_at"]),
        deleted_at=None if m["deleted_at"] is None else int(m["deleted_at"]),
    )


def _grant(row: Row[Any]) -> GrantRow:
    m = row._mapping
    fields = m["readable_fields"]
    return GrantRow(
        grant_id=m["grant_id"],
        principal_id=m["principal_id"],
        provider=m["provider"],
        action=m["action"],
        permission=m["permission"],
        max_amount=None if m["max_amount"] is None else int(m["max_amount"]),
        amount_field=m["amount_field"],
        readable_fields=None if fields is None else tuple(str(f) for f in fields),
        created_at=int(m["created_at"]),
    )


def _membership(row: Row[Any]) -> MembershipRow:
    m = row._mapping
    return MembershipRow(
        room_id=m["room_id"],
        principal_id=m["principal_id"],
        language=m["language"],
        joined_at=int(m["joined_at"]),
        left_at=None if m["left_at"] is None else int(m["left_at"]),
    )


_insert = dialects.upsert_insert


# -- principals ---------------------------------------------------------------------------------


async def add_principal(
    work: Work,
    *,
    principal_id: str,
    tenant: str,
    kind: str,
    name: str,
    verified: bool = True,
    disabled: bool = False,
    api_key_sha256: str | None = None,
) -> PrincipalRow:
    """Create a principal; an existing id raises :class:`~ledger.errors.DuplicateKey` at commit.

    ``api_key_sha256`` is the key's digest, never the key: the caller generates and shows the key.
    """
    if kind not in PRINCIPAL_KINDS:
        raise ValueError(f"kind must be one of {', '.join(PRINCIPAL_KINDS)}, not {kind!r}")
    row = PrincipalRow(
        principal_id=principal_id,
        tenant=tenant,
        kind=kind,
        name=name,
        verified=verified,
        disabled=disabled,
        api_key_sha256=api_key_sha256,
        created_at=work.now_ms,
        deleted_at=None,
    )
    await work.conn.execute(
        principals.insert().values(
            principal_id=principal_id,
            tenant=tenant,
            kind=kind,
            name=name,
            verified=int(verified),
            disabled=int(disabled),
            api_key_sha256=api_key_sha256,
            created_at=work.now_ms,
            deleted_at=None,
        )
    )
    return row


async def get_principal(conn: AsyncConnection, principal_id: str) -> PrincipalRow | None:
    """The principal with that id, deleted or not (callers decide what a deleted row means)."""
    stmt = select(principals).where(principals.c.principal_id == principal_id)
    row = (await conn.execute(stmt)).first()
    return _principal(row) if row is not None else None


async def by_api_key(conn: AsyncConnection, sha256: str) -> PrincipalRow | None:
    """The principal whose API key hashes to ``sha256`` (the column is unique)."""
    stmt = select(principals).where(principals.c.api_key_sha256 == sha256)
    row = (await conn.execute(stmt)).first()
    return _principal(row) if row is not None else None


async def list_principals(
    conn: AsyncConnection, *, tenant: str | None = None
) -> list[PrincipalRow]:
    """Every principal (of ``tenant``, if given), deleted ones included, by tenant and id."""
    stmt = select(principals).order_by(principals.c.tenant, principals.c.principal_id)
    if tenant is not None:
        stmt = stmt.where(principals.c.tenant == tenant)
    return [_principal(row) for row in (await conn.execute(stmt)).all()]


async def set_flags(
    work: Work,
    principal_id: str,
    *,
    verified: bool | None = None,
    disabled: bool | None = None,
    deleted: bool | None = None,
) -> bool:
    """Change the given flags (``None`` = leave as is); ``False`` when there is no such principal.

    ``deleted=True`` stamps ``deleted_at`` once (a second delete keeps the first time);
    ``deleted=False`` restores the principal.
    """
    values: dict[str, Any] = {}
    if verified is not None:
        values["verified"] = int(verified)
    if disabled is not None:
        values["disabled"] = int(disabled)
    if deleted is not None:
        values["deleted_at"] = (
            func.coalesce(principals.c.deleted_at, work.now_ms) if deleted else None
        )
    where = principals.c.principal_id == principal_id
    if not values:
        found = await work.conn.execute(select(principals.c.principal_id).where(where))
        return found.first() is not None
    result = await work.conn.execute(update(principals).where(where).values(**values))
    return bool(result.rowcount)


# -- grants -------------------------------------------------------------------------------------


async def grant(
    work: Work,
    *,
    principal_id: str,
    provider: str,
    action: str,
    permission: str,
    max_amount: int | None = None,
    amount_field: str | None = None,
    readable_fields: Iterable[str] | None = None,
) -> str:
    """Give (or re-shape) a permission; returns the grant's id.

    Upsert on (principal, provider, action, permission): granting again replaces the cap and the
    readable fields and keeps the original ``grant_id``, so there is never more than one grant to
    reason about per permission.
    """
    if permission not in PERMISSIONS:
        raise ValueError(f"permission must be one of {', '.join(PERMISSIONS)}, not {permission!r}")
    if max_amount is not None and not 0 <= max_amount <= MAX_AMOUNT:
        raise ValueError(f"max_amount must be from 0 to {MAX_AMOUNT}")
    fields = None if readable_fields is None else sorted(set(readable_fields))
    stmt = _insert(work.store.dialect, grants).values(
        grant_id=uuid.uuid4().hex,
        principal_id=principal_id,
        provider=provider,
        action=action,
        permission=permission,
        max_amount=max_amount,
        amount_field=amount_field,
        readable_fields=fields,
        created_at=work.now_ms,
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[
            grants.c.principal_id,
            grants.c.provider,
            grants.c.action,
            grants.c.permission,
        ],
        set_={
            "max_amount": stmt.excluded.max_amount,
            "amount_field": stmt.excluded.amount_field,
            "readable_fields": stmt.excluded.readable_fields,
        },
    ).returning(grants.c.grant_id)
    return str((await work.conn.execute(stmt)).scalar_one())


async def revoke(
    work: Work, principal_id: str, provider: str, action: str, permission: str
) -> bool:
    """Remove one grant; ``False`` when there was none (revoking is exact: ``*`` is not a glob)."""
    result = await work.conn.execute(
        delete(grants).where(
            grants.c.principal_id == principal_id,
            grants.c.provider == provider,
            grants.c.action == action,
            grants.c.permission == permission,
        )
    )
    return bool(result.rowcount)


async def grants_of(conn: AsyncConnection, principal_id: str) -> list[GrantRow]:
    """Every grant of the principal, by provider, action and permission."""
    stmt = (
        select(grants)
        .where(grants.c.principal_id == principal_id)
        .order_by(grants.c.provider, grants.c.action, grants.c.permission)
    )
    return [_grant(row) for row in (await conn.execute(stmt)).all()]


# -- room memberships ---------------------------------------------------------------------------


async def join_room(
    work: Work, room_id: str, principal_id: str, language: str | None = None
) -> MembershipRow:
    """Make the principal a member of the room; re-joining after leaving clears ``left_at``.

    A re-join starts a new membership (``joined_at`` = now); joining a room one is still in keeps
    the original ``joined_at``. A ``None`` language keeps the one already recorded.
    """
    stmt = _insert(work.store.dialect, room_members).values(
        room_id=room_id,
        principal_id=principal_id,
        language=language,
        joined_at=work.now_ms,
        left_at=None,
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[room_members.c.room_id, room_members.c.principal_id],
        set_={
            "language": func.coalesce(stmt.excluded.language, room_members.c.language),
            "joined_at": case(
                (room_members.c.left_at.is_(None), room_members.c.joined_at),
                else_=stmt.excluded.joined_at,
            ),
            "left_at": None,
        },
    ).returning(*room_members.c)
    row = (await work.conn.execute(stmt)).one()
    return _membership(row)


async def leave_room(work: Work, room_id: str, principal_id: str) -> bool:
    """End a current membership (``left_at`` = now); ``False`` when the principal was not in it."""
    result = await work.conn.execute(
        update(room_members)
        .where(
            room_members.c.room_id == room_id,
            room_members.c.principal_id == principal_id,
            room_members.c.left_at.is_(None),
        )
        .values(left_at=work.now_ms)
    )
    return bool(result.rowcount)


async def membership(
    conn: AsyncConnection, room_id: str, principal_id: str
) -> MembershipRow | None:
    """The principal's membership row for the room (current or past), or ``None``."""
    stmt = select(room_members).where(
        room_members.c.room_id == room_id, room_members.c.principal_id == principal_id
    )
    row = (await conn.execute(stmt)).first()
    return _membership(row) if row is not None else None


async def memberships_of(conn: AsyncConnection, principal_id: str) -> list[MembershipRow]:
    """Every room the principal is or was in, by room id."""
    stmt = (
        select(room_members)
        .where(room_members.c.principal_id == principal_id)
        .order_by(room_members.c.room_id)
    )
    return [_membership(row) for row in (await conn.execute(stmt)).all()]
