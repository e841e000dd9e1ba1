"""Repository of saga definitions, content-addressed by digest.

A transaction pins the digest of the exact definition it was prepared with; a recovering worker in
another process reads that definition back instead of trusting whatever code it runs now, so an
edited saga never re-plans a transaction that is already in flight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import dialects
from ledger.schema import saga_definitions
from ledger.store import Work


async def put(work: Work, *, digest: str, name: str, definition: Mapping[str, Any]) -> None:
    """Store a definition under its digest (idempotent: the same digest is the same content)."""
    stmt = dialects.insert_ignore(
        work.store.dialect,
        saga_definitions,
        {"digest": digest, "name": name, "definition": dict(definition), "created_at": work.now_ms},
    )
    await work.conn.execute(stmt)


async def get(conn: AsyncConnection, digest: str) -> dict[str, Any] | None:
    """The stored definition with ``digest``, or ``None``."""
    stmt = select(saga_definitions.c.definition).where(saga_definitions.c.digest == digest)
    value = (await conn.execute(stmt)).scalar_one_or_none()
    return dict(value) if value is not None else None
