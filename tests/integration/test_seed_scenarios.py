"""The seven fault-injection assertions of seed 003 ("故障驗收"), on SQLite and PostgreSQL.

Every count is read from the fake provider's own database (``shop.counts()``), never from our
bookkeeping: that is the only evidence of how many times money moved.
"""

from __future__ import annotations

import asyncio

import pytest

from ledger.states import EffectState, TxState
from orchestrator.crashpoints import SimulatedCrash
from providers.fake.faults import FaultKind, FaultRule
from tests.support.sagas import order, order_saga
from tests.support.world import World


def _step(name: str):  # type: ignore[no-untyped-def]
    return lambda ctx: ctx.get("name") == name


async def _recover_elsewhere(world: World) -> None:
    """A fresh engine, after the crashed one's leases expired, drains all work."""
    worker = await world.engine()
    worker.store.advance_clock(world.orch.settings.lease_seconds + 1)
    await worker.drain(timeout_seconds=10)


async def test_crash_before_call_looks_up_before_apply(world: World) -> None:
    world.orch.crashpoints.arm("effect.before_apply", when=_step("charge"))
    with pytest.raises(SimulatedCrash):
        await world.orch.execute(order_saga(), order("42"))
    await world.orch.abandon()
    assert (await world.shop.counts())["payments.charge"] == 0

    await _recover_elsewhere(world)

    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (1, 1)
    charge = (await world.shop.effects("payments.charge"))[0]
    calls = [c.call for c in await world.shop.calls(key=charge.key)]
    assert calls == ["lookup", "apply"]  # lookup-before-apply: the recovering worker asked first


async def test_effect_committed_response_lost(world: World) -> None:
    world.shop.faults.add(FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge"))
    result = await world.orch.execute(order_saga(), order("42"))
    await world.orch.drain(timeout_seconds=10)

    assert result.status is TxState.COMMITTED
    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (1, 1)
    view = await world.orch.get(result.tx_id)
    charge = next(o for o in view.operations if o.name == "charge")
    assert charge.state is EffectState.CONFIRMED and charge.lookups == 1
    transitions = [
        (e.from_state, e.to_state)
        for e in await world.orch.ledger(result.tx_id)
        if e.subject == charge.key
    ]
    assert ("executing", "unknown") in transitions  # the lost response was recorded as unknown


async def test_response_lost_left_to_workers_when_budget_is_zero(world: World) -> None:
    world.shop.faults.add(FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge"))
    result = await world.orch.execute(order_saga(), order("42"), budget_seconds=0)
    assert result.in_doubt and result.error is not None and result.error.code == "in_doubt"

    await world.orch.drain(timeout_seconds=10)
    assert (await world.orch.result(result.tx_id)).status is TxState.COMMITTED
    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (1, 1)


async def test_response_received_then_crash_before_local_commit(world: World) -> None:
    world.orch.crashpoints.arm("effect.after_apply", when=_step("charge"))
    with pytest.raises(SimulatedCrash):
        await world.orch.execute(order_saga(), order("42"))
    await world.orch.abandon()
    assert (await world.shop.counts())["payments.charge"] == 1  # it happened, we never recorded it

    await _recover_elsewhere(world)

    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (1, 1)
    charge = (await world.shop.effects("payments.charge"))[0]
    assert [c.call for c in await world.shop.calls(key=charge.key)] == ["apply", "lookup"]


async def test_concurrent_workers_on_the_same_transaction(world: World) -> None:
    world.orch.crashpoints.arm("prepare.after_commit")
    with pytest.raises(SimulatedCrash):
        await world.orch.execute(order_saga(), order("42"))
    await world.orch.abandon()

    workers = [await world.engine(), await world.engine()]
    for w in workers:
        w.store.advance_clock(60)
    await asyncio.gather(*(w.drain(timeout_seconds=10) for w in workers))

    counts = await world.shop.counts()
    assert (counts["inventory.reserve"], counts["payments.charge"], counts["email.send"]) == (
        1,
        1,
        1,
    )
    async with workers[0].store.read() as conn:
        from ledger import transactions

        rows = await transactions.in_status(conn, TxState.COMMITTED)
    assert len(rows) == 1


async def test_compensation_replay_with_lost_refund_and_release(world: World) -> None:
    before = await world.shop.stock("sku-1")
    for provider, action in (("payments", "refund"), ("inventory", "release")):
        world.shop.faults.add(FaultRule(FaultKind.LOSE_RESPONSE, provider=provider, action=action))
    # The post-condition fails after both effects are confirmed: the saga must turn back.
    result = await world.orch.execute(order_saga(max_amount=1000), order("42", amount=1500))
    await world.orch.drain(timeout_seconds=10)

    final = await world.orch.result(result.tx_id)
    assert final.status is TxState.COMPENSATED
    assert final.error is not None and final.error.code == "validation_failed"
    counts = await world.shop.counts()
    assert (counts["payments.refund"], counts["inventory.release"], counts["email.send"]) == (
        1,
        1,
        0,
    )
    # The provider's own state is back where it was, not just "answered success".
    assert await world.shop.stock("sku-1") == before
    charges = await world.shop.charges()
    assert [c["refunded"] for c in charges] == [1500]


async def test_compensation_unknown_past_budget_goes_to_manual_review(world: World) -> None:
    world.shop.faults.add(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="refund", times=None)
    )
    world.shop.faults.add(
        FaultRule(FaultKind.LOOKUP_UNAVAILABLE, provider="payments", action="refund", times=None)
    )
    result = await world.orch.execute(order_saga(max_amount=1000), order("42", amount=1500))
    await world.orch.drain(timeout_seconds=10)

    view = await world.orch.get(result.tx_id)
    assert view.tx.status is TxState.MANUAL_REVIEW
    refund = next(c for c in view.compensations if c.action == "refund")
    assert refund.state is EffectState.MANUAL_REVIEW
    assert refund.attempts <= world.orch.settings.compensation_attempts
    assert (await world.shop.counts())["payments.refund"] == 1  # deduplicated, never doubled
    ledger = await world.orch.ledger(result.tx_id)
    assert ledger[-1].to_state == "manual_review" and ledger[-1].detail["error"]["reason"]


async def test_no_email_before_the_local_commit(world: World) -> None:
    world.orch.crashpoints.arm("commit.before_commit")
    with pytest.raises(SimulatedCrash):
        await world.orch.execute(order_saga(), order("42"))
    await world.orch.abandon()
    counts = await world.shop.counts()
    # Both effects are confirmed at the provider, the commit never landed: no email exists.
    assert (counts["payments.charge"], counts["email.send"]) == (1, 0)

    await _recover_elsewhere(world)

    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (1, 1)
    email = (await world.shop.effects("email.send"))[0]
    charge = (await world.shop.effects("payments.charge"))[0]
    assert email.created_at >= charge.created_at
