"""A stale lease holder records nothing: our store refuses its fence, and so does the provider."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fault_injection.holding import HoldingProvider
from ledger import effects, events
from ledger.effects import EffectKind
from ledger.errors import LeaseLost
from ledger.states import EffectState, TxState
from orchestrator.crashpoints import SimulatedCrash
from providers.contract import FencedOut
from tests.support.sagas import order, order_saga
from tests.support.world import World

#: A worker frozen by a long GC pause (imported by the HTTP adapter's tests too).
PausingProvider = HoldingProvider


async def test_paused_worker_is_fenced_at_store_and_provider(world: World) -> None:
    paused = PausingProvider(world.shop.payments, "charge")
    stale = await world.engine(call_timeout_seconds=30)
    stale.register_provider(paused)
    task = asyncio.create_task(stale.execute(order_saga(), order("42"), budget_seconds=0))
    await asyncio.wait_for(paused.reached.wait(), 10)

    # The stale worker's lease runs out; a healthy one takes the transaction over and finishes.
    healthy = await world.engine()
    healthy.store.advance_clock(stale.settings.lease_seconds + 1)
    await healthy.drain(timeout_seconds=10)
    tx_id = (await _only_tx(healthy)).tx_id
    assert (await healthy.result(tx_id)).status is TxState.COMMITTED

    paused.gate.set()  # the stale worker wakes up and sends its apply with fence 1
    stale_result = await asyncio.wait_for(task, 10)

    assert stale_result.status is TxState.COMMITTED  # it reports what the new holder did
    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (1, 1)
    charge = (await world.shop.effects("payments.charge"))[0]
    outcomes = [c.outcome for c in await world.shop.calls(key=charge.key)]
    assert outcomes[-1] == "fenced_out"  # the provider refused the lower fence
    assert await healthy.verify_ledger() == []


async def test_stale_fence_cannot_record(world: World) -> None:
    world.orch.crashpoints.arm("prepare.after_commit")
    with pytest.raises(SimulatedCrash):
        await world.orch.execute(order_saga(), order("42"))
    tx_id = (await _only_tx(world.orch)).tx_id
    async with world.orch.store.read() as conn:
        first = (await effects.for_tx(conn, EffectKind.OPERATION, tx_id))[0]
    assert first.state is EffectState.EXECUTING and first.fence == 1

    other = await world.engine()
    other.store.advance_clock(60)
    async with other.store.transaction() as work:
        chain = await events.chain_of(work.conn, tx_id)
        newer = await effects.claim(
            work, chain, EffectKind.OPERATION, first.key, owner="other", lease_ms=30_000
        )
    assert newer is not None and newer.fence == 2 and newer.maybe_sent

    stale_claim = effects.Claim(
        kind=EffectKind.OPERATION,
        key=first.key,
        tx_id=tx_id,
        name=first.name,
        provider=first.provider,
        action=first.action,
        fence=1,
        previous=EffectState.PENDING,
        attempts=1,
        lookups=0,
        first_attempt_at=None,
        payload=first.payload,
        payload_sha256=first.payload_sha256,
        owner=world.orch.settings.worker_id,
    )
    with pytest.raises(LeaseLost):
        async with world.orch.store.transaction() as work:
            chain = await events.chain_of(work.conn, tx_id)
            await effects.record(
                work, chain, stale_claim, EffectState.CONFIRMED, action="apply", remote_id="x"
            )
    # The provider refuses the lower fence once it has seen the newer one.
    answer = await world.shop.inventory.apply(
        "reserve", key=first.key, payload=first.payload, fence=2
    )
    stale_answer = await world.shop.inventory.apply(
        "reserve", key=first.key, payload=first.payload, fence=1
    )
    assert not isinstance(answer, FencedOut)
    assert isinstance(stale_answer, FencedOut) and stale_answer.highest_fence == 2
    assert (await world.shop.counts())["inventory.reserve"] == 1


async def _only_tx(orch: Any) -> Any:
    from sqlalchemy import select

    from ledger import transactions
    from ledger.schema import transactions as table

    async with orch.store.read() as conn:
        tx_id = (await conn.execute(select(table.c.tx_id))).scalar_one()
        return await transactions.get(conn, tx_id)
