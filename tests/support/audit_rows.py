"""Build commands-layer rows directly through the repositories (no command service needed).

A command row first (``saga_digest=None``: no saga definition is needed), then executions of it,
then what hangs off an execution: callback runs, reservations, staged actions and changes.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from ledger import callbacks, commands, executions, reservations
from ledger.schema import staged_actions, staged_changes
from ledger.store import Store

DIGEST = "a" * 64


async def seed_command(store: Store, command_id: str = "c1") -> None:
    async with store.transaction() as work:
        await commands.insert(
            work,
            command_id=command_id,
            tenant="acme",
            name=f"refund-{command_id}",
            scope_kind="company",
            scope_id="acme",
            tag_id=None,
            version=2,
            mode="execute",
            definition={"format": "agent-txn/command@1", "steps": [{"id": "s1"}]},
            digest=DIGEST,
            saga_digest=None,
            created_by="u1",
        )


async def seed_execution(
    store: Store,
    execution_id: str,
    *,
    status: str = "succeeded",
    command_id: str = "c1",
    **overrides: Any,
) -> None:
    columns: dict[str, Any] = {
        "execution_id": execution_id,
        "command_id": command_id,
        "command_digest": DIGEST,
        "status": status,
        "invoker_kind": "user",
        "invoker_id": "u1",
        "actor_bucket": "user:u1",
        "origin": "manual",
        "input_snapshot": {"order": execution_id},
        "authorization_snapshot": {"version": 1},
    }
    columns.update(overrides)
    async with store.transaction() as work:
        await executions.insert(work, **columns)


async def seed_callbacks(
    store: Store, execution_id: str, targets: list[str], *, event: str = "succeeded"
) -> list[str]:
    """Pending runs for ``targets``; their run ids."""
    async with store.transaction() as work:
        return await callbacks.enqueue(
            work,
            execution_id=execution_id,
            event=event,
            targets=targets,
            payload={"event": event, "execution_id": execution_id, "status": event},
        )


async def seed_dependents(store: Store, execution_id: str, key: str) -> None:
    """An idempotency reservation, a staged action and a staged change naming the execution."""
    async with store.transaction() as work:
        assert await reservations.reserve(
            work,
            command_id="c1",
            bucket="user:u1",
            key=key,
            execution_id=execution_id,
            ttl_ms=86_400_000,
        )
        now = work.now_ms
        await work.conn.execute(
            staged_actions.insert().values(
                token_sha256=(execution_id * 64)[:64],
                execution_id=execution_id,
                command_id="c1",
                digest=DIGEST,
                room_id=None,
                language="en",
                invoker_kind="user",
                invoker_id="u1",
                state="executed",
                created_at=now,
                expires_at=now + 1,
                updated_at=now,
            )
        )
        await work.conn.execute(
            staged_changes.insert().values(
                staged_change_id=f"sc-{execution_id}",
                execution_id=execution_id,
                command_id="c1",
                digest=DIGEST,
                requested_by="u1",
                state="approved",
                created_at=now,
                updated_at=now,
            )
        )


async def count(store: Store, table: Any, *where: Any) -> int:
    async with store.read() as conn:
        stmt = select(func.count()).select_from(table).where(*where)
        return int((await conn.execute(stmt)).scalar_one())
