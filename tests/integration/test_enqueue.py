"""``Orchestrator.enqueue``: the plan persisted for the workers, nothing attempted.

What could break: an enqueued saga's first step looked up (or applied twice) by the worker
that takes it, the same tx_id enqueued twice making two sagas, bad inputs leaving rows, two
workers racing for the same enqueued saga. Effects are counted in the shop's own database.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select

from ledger import transactions as tx_repo
from ledger.schema import operations, transactions
from ledger.states import EffectState, TxState
from orchestrator import errors
from tests.support.sagas import order, order_saga
from tests.support.world import ONE_PASS_CALL_TIMEOUT_S, World


async def _rows(world: World) -> tuple[int, int]:
    async with world.orch.store.read() as conn:
        txs = (await conn.execute(select(func.count()).select_from(transactions))).scalar_one()
        ops = (await conn.execute(select(func.count()).select_from(operations))).scalar_one()
    return int(txs), int(ops)


async def test_enqueue_persists_the_plan_in_one_commit_and_calls_nothing(world: World) -> None:
    saga = order_saga()
    await world.orch.register(saga)
    before = world.orch.store.stats.snapshot()

    queued = await world.orch.enqueue(saga, order("42"))

    assert queued.status is TxState.EXECUTING
    assert world.orch.store.stats.commits - before.commits == 1
    assert await world.shop.calls() == []
    view = await world.orch.get(queued.tx_id)
    assert [op.state for op in view.operations] == [EffectState.PENDING, EffectState.PENDING]
    assert await world.orch.verify_ledger() == []


async def test_a_worker_applies_the_first_step_without_a_lookup(world: World) -> None:
    queued = await world.orch.enqueue(order_saga(), order("42"))
    worker = await world.engine()

    await worker.drain(timeout_seconds=10)

    assert (await worker.result(queued.tx_id)).status is TxState.COMMITTED
    calls = [(c.call, c.action) for c in await world.shop.calls()]
    # Pending means never sent: the worker applies at once, it looks nothing up.
    assert [call for call, _ in calls] == ["apply", "apply", "apply"]
    counts = await world.shop.counts()
    assert (counts["inventory.reserve"], counts["payments.charge"], counts["email.send"]) == (
        1,
        1,
        1,
    )


async def test_the_same_tx_id_enqueues_once(world: World) -> None:
    first = await world.orch.enqueue(order_saga(), order("42"), tx_id="order-42")
    again = await world.orch.enqueue(order_saga(), order("42"), tx_id="order-42")
    assert again.tx_id == first.tx_id
    assert await _rows(world) == (1, 2)
    with pytest.raises(errors.IdempotencyPayloadMismatch):
        await world.orch.enqueue(order_saga(), order("42", amount=999), tx_id="order-42")
    await world.orch.drain(timeout_seconds=10)
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_bad_inputs_are_refused_before_anything_is_written(world: World) -> None:
    with pytest.raises(errors.InputInvalid):
        await world.orch.enqueue(order_saga(), {"order_id": "42", "sku": "sku-1", "amount": "lots"})
    with pytest.raises(errors.IdentifierInvalid):
        await world.orch.enqueue(order_saga(), order("42"), tx_id="  ")
    assert await _rows(world) == (0, 0)


async def test_two_workers_share_enqueued_sagas_and_each_effect_happens_once(
    world: World,
) -> None:
    queued = [await world.orch.enqueue(order_saga(), order(str(i))) for i in range(12)]
    workers = [await world.engine(), await world.engine()]

    await asyncio.gather(*(w.drain(timeout_seconds=20, limit=3) for w in workers))

    for q in queued:
        assert (await world.orch.result(q.tx_id)).status is TxState.COMMITTED
    counts = await world.shop.counts()
    assert (counts["inventory.reserve"], counts["payments.charge"], counts["email.send"]) == (
        12,
        12,
        12,
    )
    assert not [c for c in await world.shop.calls() if c.call == "lookup"]


async def _reads_of_one_recovery_pass(world: World, sagas: int) -> int:
    """Statements through SQLAlchemy's cursor (reads and claims with RETURNING: the hot path's
    writes take none) while one recovery pass drives ``sagas`` enqueued sagas to the end."""
    from sqlalchemy import event

    saga = order_saga()
    queued = [await world.orch.enqueue(saga, order(f"r{sagas}-{n}")) for n in range(sagas)]
    worker = await world.engine(call_timeout_seconds=ONE_PASS_CALL_TIMEOUT_S)
    await worker.register(saga)
    seen: list[str] = []

    def on_cursor(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if not statement.startswith(("BEGIN", "PRAGMA", "SAVEPOINT", "RELEASE")):
            seen.append(statement)

    engine = worker.store.engine.sync_engine
    event.listen(engine, "before_cursor_execute", on_cursor)
    try:
        report = await worker.recover(limit=16)
    finally:
        event.remove(engine, "before_cursor_execute", on_cursor)
    assert report.transactions == sagas
    for q in queued:
        assert (await worker.result(q.tx_id)).status is TxState.COMMITTED
    return len(seen)


async def test_a_recovery_pass_loads_its_whole_batch_with_the_claim(world: World) -> None:
    # The claim, the batch's chains and its runs (the transactions and each effect table) are
    # read once per pass, whatever its size; every drive after that only writes.
    assert await _reads_of_one_recovery_pass(world, 2) == await _reads_of_one_recovery_pass(
        world, 6
    )


async def test_each_claim_takes_its_own_limit_owner_and_lease(world: World) -> None:
    # The claim statement is built once per store; every call binds its own values.
    orch = world.orch
    for n in range(5):
        await orch.enqueue(order_saga(), order(f"lim-{n}"), tx_id=f"lim-{n}")
    async with orch.store.transaction() as work:
        first = await tx_repo.claim_due(work, owner="w-a", lease_ms=60_000, limit=2)
    async with orch.store.transaction() as work:
        second = await tx_repo.claim_due(work, owner="w-b", lease_ms=120_000, limit=3)
    assert (len(first), len(second)) == (2, 3)
    assert {c.txc.tx_id for c in first}.isdisjoint({c.txc.tx_id for c in second})
    async with orch.store.read() as conn:
        rows = (
            await conn.execute(
                select(transactions.c.tx_id, transactions.c.lease_owner, transactions.c.lease_until)
            )
        ).all()
    owners = {r.tx_id: r.lease_owner for r in rows}
    assert sorted(owners[c.txc.tx_id] for c in first + second) == ["w-a"] * 2 + ["w-b"] * 3
    until = {r.tx_id: r.lease_until for r in rows}
    a = max(until[c.txc.tx_id] for c in first)
    b = min(until[c.txc.tx_id] for c in second)
    assert b - a > 50_000  # the second claim's lease is its own 120 s, not the first's 60 s
