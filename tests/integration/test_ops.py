"""Operator jobs (:mod:`orchestrator.ops`) on both backends: retention prune, callback requeue,
and who counts as an operator.

Pinned here: prune deletes only succeeded and failed records created before the 180-day cutoff,
takes their reservations, callback runs, staged actions and staged changes along, keeps staged,
running, manual-review and young records whatever else they hold, never touches the ledger (rows
and hash chain unchanged), and answers exactly ``{pruned, retention_days: 180, cutoff}``;
requeue validates its limits and counts what it changed; ``is_operator`` needs the exact grant.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select

from fault_injection.sagas import order, order_saga
from ledger import events
from ledger import principals as repo
from ledger.schema import (
    callback_runs,
    executions,
    idempotency_reservations,
    ledger,
    staged_actions,
    staged_changes,
    transactions,
)
from ledger.states import TxState
from ledger.store import Store
from orchestrator import ops
from orchestrator.authz import Caller, load_principal
from orchestrator.errors import RequestInvalid
from tests.support.audit_rows import (
    count,
    seed_callbacks,
    seed_command,
    seed_dependents,
    seed_execution,
)
from tests.support.world import World

DAY_S = 86_400


@pytest.fixture
async def store(world: World) -> Store:
    await seed_command(world.orch.store)
    return world.orch.store


async def _ids(store: Store) -> set[str]:
    async with store.read() as conn:
        return set((await conn.execute(select(executions.c.execution_id))).scalars())


async def _dependents(store: Store, execution_id: str) -> dict[str, int]:
    return {
        table.name: await count(store, table, table.c.execution_id == execution_id)
        for table in (callback_runs, idempotency_reservations, staged_actions, staged_changes)
    }


# -- prune ----------------------------------------------------------------------------------------


async def test_prune_deletes_old_finished_records_with_their_dependents_and_keeps_the_rest(
    store: Store,
) -> None:
    for status in ("succeeded", "failed", "staged", "running", "manual_review"):
        await seed_execution(store, f"old-{status}", status=status)
        await seed_dependents(store, f"old-{status}", key=f"k-old-{status}")
        await seed_callbacks(store, f"old-{status}", ["http://127.0.0.1:9/hook"])
    store.advance_clock(181 * DAY_S)
    for status in ("succeeded", "failed"):
        await seed_execution(store, f"young-{status}", status=status)
        await seed_dependents(store, f"young-{status}", key=f"k-young-{status}")
        await seed_callbacks(store, f"young-{status}", ["http://127.0.0.1:9/hook"])
    full = {"callback_runs": 1, "idempotency_reservations": 1, "staged_actions": 1,
            "staged_changes": 1}  # fmt: skip

    result = await ops.prune(store)

    assert result["pruned"] == 2
    kept = {"old-staged", "old-running", "old-manual_review", "young-succeeded", "young-failed"}
    assert await _ids(store) == kept
    for execution_id in ("old-succeeded", "old-failed"):
        assert set((await _dependents(store, execution_id)).values()) == {0}, execution_id
    for execution_id in kept:
        assert await _dependents(store, execution_id) == full, execution_id
    assert (await ops.prune(store))["pruned"] == 0  # nothing old and finished is left


async def test_prune_never_touches_the_ledger(world: World, store: Store) -> None:
    result = await world.orch.execute(order_saga(), order("o-1"), tx_id="tx-1")
    assert result.status is TxState.COMMITTED
    await seed_execution(store, "e-tx", status="succeeded", tx_id="tx-1")
    async with store.read() as conn:
        before = [tuple(r) for r in await conn.execute(select(ledger).order_by(ledger.c.seq))]
    assert len(before) > 3
    store.advance_clock(181 * DAY_S)

    assert (await ops.prune(store))["pruned"] == 1

    assert await _ids(store) == set()
    async with store.read() as conn:
        after = [tuple(r) for r in await conn.execute(select(ledger).order_by(ledger.c.seq))]
        assert await events.verify(conn) == []
    assert after == before
    assert await count(store, transactions, transactions.c.tx_id == "tx-1") == 1
    assert (await world.orch.result("tx-1")).status is TxState.COMMITTED


async def test_prune_answers_exactly_pruned_retention_days_and_the_cutoff(store: Store) -> None:
    now_ms = 1_790_000_000_123
    result = await ops.prune(store, now_ms=now_ms)
    assert result == {
        "pruned": 0,
        "retention_days": 180,
        "cutoff": "2026-03-25T14:13:20.123Z",
    }
    cutoff = datetime.fromisoformat(result["cutoff"].replace("Z", "+00:00"))
    assert cutoff == datetime.fromtimestamp(now_ms / 1000, tz=UTC) - timedelta(days=180)


async def test_prune_cutoff_is_exclusive_by_created_at(store: Store) -> None:
    await seed_execution(store, "edge", status="failed")
    async with store.read() as conn:
        stmt = select(executions.c.created_at).where(executions.c.execution_id == "edge")
        created = int((await conn.execute(stmt)).scalar_one())
    exactly = created + 180 * DAY_S * 1000
    assert (await ops.prune(store, now_ms=exactly))["pruned"] == 0  # created at the cutoff: kept
    assert (await ops.prune(store, now_ms=exactly + 1))["pruned"] == 1


@pytest.mark.parametrize("days", [0, -1, True, 1.5])
async def test_prune_refuses_a_retention_that_is_not_a_positive_integer(
    store: Store, days: Any
) -> None:
    await seed_execution(store, "e", status="succeeded")
    with pytest.raises(RequestInvalid) as excinfo:
        await ops.prune(store, now_ms=store.now_ms() + 10**12, retention_days=days)
    assert excinfo.value.details == {
        "errors": [{"field": "retention_days", "problem": "must be an integer >= 1"}]
    }
    assert await _ids(store) == {"e"}


# -- requeue --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fields"),
    [
        ({"limit": 0}, ["limit"]),
        ({"limit": 2001}, ["limit"]),
        ({"limit": True}, ["limit"]),
        ({"limit": "5"}, ["limit"]),
        ({"older_than_seconds": -1}, ["older_than_seconds"]),
        ({"older_than_seconds": math.nan}, ["older_than_seconds"]),
        ({"older_than_seconds": -1, "limit": 0}, ["older_than_seconds", "limit"]),
    ],
)
async def test_requeue_refuses_out_of_range_arguments(
    store: Store, kwargs: dict[str, Any], fields: list[str]
) -> None:
    await seed_execution(store, "e1")
    await seed_callbacks(store, "e1", ["http://127.0.0.1:9/hook"])
    store.advance_clock(3_600)
    with pytest.raises(RequestInvalid) as excinfo:
        await ops.requeue_callbacks(store, **kwargs)
    assert [e["field"] for e in excinfo.value.details["errors"]] == fields
    assert excinfo.value.http_status == 422
    # Refused before anything changed: the stale run is still there to republish.
    assert (await ops.requeue_callbacks(store))["republished"] == 1


@pytest.mark.parametrize("limit", [1, 2000])
async def test_requeue_accepts_the_limit_bounds(store: Store, limit: int) -> None:
    await seed_execution(store, "e1")
    await seed_callbacks(store, "e1", [f"http://127.0.0.1:9/{i}" for i in range(3)])
    store.advance_clock(301)
    result = await ops.requeue_callbacks(store, limit=limit)
    assert result == {"republished": min(limit, 3), "retried": 0, "reclaimed": 0}


async def test_requeue_defaults_to_runs_older_than_300_seconds(store: Store) -> None:
    await seed_execution(store, "e1")
    await seed_callbacks(store, "e1", ["http://127.0.0.1:9/hook"])
    store.advance_clock(200)
    assert await ops.requeue_callbacks(store) == {"republished": 0, "retried": 0, "reclaimed": 0}
    store.advance_clock(101)
    assert (await ops.requeue_callbacks(store, older_than_seconds=1_000))["republished"] == 0
    assert (await ops.requeue_callbacks(store))["republished"] == 1


# -- operators ------------------------------------------------------------------------------------


async def _principal(store: Store, principal_id: str, *grants: tuple[str, str, str]) -> Any:
    async with store.transaction() as work:
        await repo.add_principal(
            work, principal_id=principal_id, tenant="acme", kind="user", name=principal_id
        )
        for provider, action, permission in grants:
            await repo.grant(
                work,
                principal_id=principal_id,
                provider=provider,
                action=action,
                permission=permission,
            )
    async with store.read() as conn:
        return await load_principal(
            conn, Caller.user(principal_id), tenant="acme", scope_kind="company", scope_id="acme"
        )


async def test_an_operator_holds_manage_on_agent_txn_ops(store: Store) -> None:
    assert ops.is_operator(await _principal(store, "op", ("agent-txn", "ops", "manage")))
    assert ops.is_operator(await _principal(store, "all", ("agent-txn", "*", "manage")))
    for i, grant in enumerate(
        [
            ("agent-txn", "ops", "execute"),
            ("agent-txn", "ops", "read"),
            ("agent-txn", "ops", "approve"),
            ("agent-txn", "other", "manage"),
            ("payments", "ops", "manage"),
            ("payments", "*", "manage"),
        ]
    ):
        assert not ops.is_operator(await _principal(store, f"p{i}", grant)), grant
    assert not ops.is_operator(await _principal(store, "nobody"))
