"""Repository of callback runs: webhook deliveries owed for an execution's outcome.

Callbacks are enqueued in the same transaction that finishes the execution, so an outcome is never
committed without the deliveries it owes (nor a delivery without its outcome). A delivery worker
claims and sends them later. Enqueueing is idempotent per (execution, event, target): the unique
key refuses a second row, so a retried finish, or a recovering worker finishing the same
execution again, never sends a callback twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import dialects
from ledger.schema import callback_runs
from ledger.store import Work


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
        run_id = uuid.uuid4().hex
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
