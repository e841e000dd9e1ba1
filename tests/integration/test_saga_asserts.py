"""Author asserts between effects and the result projection, on both backends.

Judged against the fake shop's own database: an assert that guards a step means that step's
effect never reaches the provider, and every confirmed effect before it is reversed.
"""

from __future__ import annotations

from typing import Any

from ledger.states import TxState
from orchestrator.expressions import eq, ref
from tests.support.sagas import order, order_saga
from tests.support.world import World


def _definition(**extra: Any) -> dict[str, Any]:
    data = order_saga().definition()
    data.update(extra)
    return data


async def test_an_assert_before_a_step_stops_it_and_reverses_what_ran(world: World) -> None:
    guard = {
        "name": "reserved_enough",
        "expr": eq(ref("steps.reserve.result.quantity"), 99),  # the shop reserved 1
        "message": "Not   enough\nstock reserved.",
        "before": "charge",
    }
    definition = await world.orch.register(_definition(asserts=[guard]))
    result = await world.orch.execute(definition.name, order("a-1"))
    assert result.status is TxState.COMPENSATED
    assert result.error is not None and result.error.code == "assertion_failed"
    assert result.error.step == "reserved_enough"
    assert result.error.reason == guard["message"]
    counts = await world.shop.counts()
    assert counts["payments.charge"] == 0  # the guarded step never reached the provider
    assert counts["inventory.reserve"] == 1 and counts["inventory.release"] == 1
    assert counts["email.send"] == 0


async def test_a_true_assert_lets_the_saga_commit(world: World) -> None:
    guard = {
        "name": "one_reserved",
        "expr": eq(ref("steps.reserve.result.quantity"), 1),
        "message": "x",
        "before": "charge",
    }
    definition = await world.orch.register(_definition(asserts=[guard]))
    result = await world.orch.execute(definition.name, order("a-2"))
    assert result.committed
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_a_trailing_assert_runs_in_validation_and_reverses_every_step(world: World) -> None:
    guard = {"name": "never", "expr": False, "message": "no", "before": None}
    definition = await world.orch.register(_definition(asserts=[guard]))
    result = await world.orch.execute(definition.name, order("a-3"))
    assert result.status is TxState.COMPENSATED
    assert result.error is not None and result.error.code == "assertion_failed"
    counts = await world.shop.counts()
    assert counts["payments.refund"] == 1 and counts["inventory.release"] == 1


async def test_the_result_projection_is_returned_on_commit(world: World) -> None:
    projection = {"charge": ref("steps.charge.remote_id"), "sku": ref("inputs.sku")}
    definition = await world.orch.register(_definition(result=projection))
    result = await world.orch.execute(definition.name, order("a-4"))
    assert result.committed
    assert result.output == {"charge": result.remote_ids["charge"], "sku": "sku-1"}


async def test_an_oversized_result_turns_the_saga_back(world: World) -> None:
    tight = await world.engine(max_output_bytes=10)
    projection = {"charge": ref("steps.charge.remote_id"), "sku": ref("inputs.sku")}
    definition = await tight.register(_definition(result=projection))
    result = await tight.execute(definition.name, order("a-5"))
    assert result.status is TxState.COMPENSATED
    assert result.error is not None and result.error.code == "output_limit_exceeded"
    counts = await world.shop.counts()
    assert counts["payments.charge"] == 1 and counts["payments.refund"] == 1
