"""Through the agent toolbox, on both backends: the proposal shows the amount a query fixed at
prepare, and that is the amount the confirmed plan charges (checked in the fake shop)."""

from __future__ import annotations

from ledger import principals
from orchestrator.authz import Caller
from tests.support.commands import add_user
from tests.support.world import World
from tests.unit.test_proposal_queries import RESTOCK_FEE

AVAILABLE = 99990  # the stock the query reads: distinctive, so "in text" is not a coincidence


async def test_the_proposal_shows_the_queried_amount_that_is_charged(world: World) -> None:
    await world.shop.seed_stock({"sku-7": AVAILABLE})
    await add_user(
        world.orch,
        "alice",
        actions=(("inventory", "stock"), ("payments", "charge"), ("payments", "refund")),
    )
    async with world.orch.store.transaction() as work:
        await principals.join_room(work, "room-1", "alice", language="en")
    alice = Caller(principal_id="alice", kind="user", auth="jwt", room_id="room-1", ai=True)
    info = await world.orch.commands.create(alice, RESTOCK_FEE)

    staged = await world.orch.agent.prepare(alice, info["command_id"], {"sku": "sku-7"})
    assert f"amount: {AVAILABLE}" in staged["proposal"]

    result = await world.orch.agent.execute_staged_action(alice, staged["confirmation_token"])
    assert result["status"] == "succeeded"
    assert (await world.shop.counts())["payments.charge"] == 1
    charges = await world.shop.charges()
    assert [c["amount"] for c in charges] == [AVAILABLE]  # what the person saw was charged
