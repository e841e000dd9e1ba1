"""Business keys and idempotency keys held by someone else: the answer names a holder that
exists, says whether a retry can help, and nothing is written (both backends).

A plan whose commit was rolled back because another transaction holds its business key must
never be answered as if it had landed (a proposal, a staged change, an execution id nobody can
read back); a key lost in a race names the execution that won it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import func, select

from ledger import action_settings
from ledger.schema import (
    executions,
    idempotency_reservations,
    ledger,
    staged_actions,
    staged_changes,
    transactions,
)
from orchestrator import errors
from orchestrator.authz import Caller
from orchestrator.commands import CommandService
from orchestrator.definitions import StoredCommand
from tests.support.commands import add_user, order_command
from tests.support.world import World

ORDER = {"order_id": "42", "sku": "sku-1", "amount": 1200}
BY_ORDER = {"$concat": ["order:", {"$ref": "inputs.order_id"}]}
TABLES = (
    executions,
    idempotency_reservations,
    transactions,
    ledger,
    staged_actions,
    staged_changes,
)


async def _counts(world: World) -> dict[str, int]:
    async with world.orch.store.read() as conn:
        return {
            t.name: (await conn.execute(select(func.count()).select_from(t))).scalar_one()
            for t in TABLES
        }


async def _setup(world: World) -> tuple[CommandService, Caller, str]:
    svc = world.orch.commands
    alice = await add_user(world.orch, "alice")
    info = await svc.create(alice, order_command(business_key=BY_ORDER))
    return svc, alice, str(info["command_id"])


async def _require_approval(world: World) -> None:
    async with world.orch.store.transaction() as work:
        await action_settings.put(
            work, "payments", "charge", requires_approval=True, approval_policy=None
        )


async def _tx_of(world: World, execution_id: str | None) -> str:
    async with world.orch.store.read() as conn:
        stmt = select(transactions.c.tx_id).where(transactions.c.execution_id == execution_id)
        return str((await conn.execute(stmt)).scalar_one())


async def _assert_names_the_first(world: World, caught: errors.AgentTxnError, first: Any) -> None:
    """Not retryable, and it says which transaction and execution already ran."""
    assert caught.code == "business_key_committed"
    assert caught.http_status == 409 and not caught.retryable
    envelope = caught.envelope()
    assert envelope["error"] == "business_key_committed" and envelope["retryable"] is False
    assert envelope["details"] == {
        "business_key": "order:42",
        "tx_id": await _tx_of(world, first.execution_id),
        "execution_id": first.execution_id,
    }


# -- a committed holder (findings: "still in flight", retryable forever) ------------------------


async def test_execute_against_a_committed_business_key_is_final_and_names_the_first(
    world: World,
) -> None:
    svc, alice, command_id = await _setup(world)
    first = await svc.execute(alice, command_id, ORDER, idempotency_key="first")
    assert first.status_code == 200
    before = await _counts(world)
    with pytest.raises(errors.AgentTxnError) as caught:
        await svc.execute(alice, command_id, {**ORDER, "amount": 5}, idempotency_key="second")
    await _assert_names_the_first(world, caught.value, first)
    assert await _counts(world) == before
    assert (await world.shop.counts())["payments.charge"] == 1
    # The execution it names exists and is readable by its invoker.
    got = await svc.execution(alice, command_id, str(first.execution_id))
    assert got["status"] == "succeeded"


async def test_an_in_flight_holder_is_still_the_retryable_conflict(world: World) -> None:
    svc, alice, command_id = await _setup(world)
    await _require_approval(world)
    with pytest.raises(errors.ApprovalRequired) as staged:
        await svc.execute(alice, command_id, ORDER, idempotency_key="first")
    staged_execution = staged.value.execution_id  # type: ignore[attr-defined]
    before = await _counts(world)
    with pytest.raises(errors.BusinessKeyConflict) as caught:
        await svc.execute(alice, command_id, ORDER, idempotency_key="second")
    assert caught.value.retryable and caught.value.http_status == 409
    assert caught.value.envelope()["details"] == {
        "business_key": "order:42",
        "tx_id": await _tx_of(world, staged_execution),
        "execution_id": staged_execution,
    }
    assert await _counts(world) == before


# -- staging a plan that did not land ------------------------------------------------------------


async def test_an_approval_gated_execute_never_names_a_plan_that_did_not_land(
    world: World,
) -> None:
    svc, alice, command_id = await _setup(world)
    first = await svc.execute(alice, command_id, ORDER, idempotency_key="first")
    await _require_approval(world)  # from now on a charge waits for an approver
    before = await _counts(world)
    with pytest.raises(errors.AgentTxnError) as caught:
        await svc.execute(alice, command_id, ORDER, idempotency_key="second")
    # Before: 409 approval_required naming a staged change and an execution never written.
    assert not isinstance(caught.value, errors.ApprovalRequired)
    await _assert_names_the_first(world, caught.value, first)
    assert await _counts(world) == before
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_an_agent_prepare_never_proposes_a_plan_that_did_not_land(world: World) -> None:
    svc, alice, command_id = await _setup(world)
    first = await svc.execute(alice, command_id, ORDER, idempotency_key="first")
    before = await _counts(world)
    with pytest.raises(errors.AgentTxnError) as caught:
        # Before: a proposal and a confirmation token for a plan that was rolled back.
        await world.orch.agent.prepare(alice, command_id, ORDER)
    await _assert_names_the_first(world, caught.value, first)
    assert await _counts(world) == before
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_a_stage_that_did_not_land_is_refused_before_any_caller_row_counts(
    world: World,
) -> None:
    """``stage`` itself checks that its plan landed: its caller's ``extra`` rows rolled back
    with it, so nothing may be answered from them."""
    svc, alice, command_id = await _setup(world)
    await svc.execute(alice, command_id, ORDER)
    wrote: list[str] = []

    async def extra(execution_id: str, _work: Any) -> None:
        wrote.append(execution_id)

    async with world.orch.store.read() as conn:
        row = await svc._visible(conn, command_id)
        principal = await svc._principal(conn, alice, row)
    stored = StoredCommand.from_stored(row.definition)
    prepared = await svc._prepare(row, stored, principal, alice, ORDER, "manual")
    with pytest.raises(errors.AgentTxnError) as caught:
        await svc.stage(prepared, alice, key=None, takeover=None, origin="manual", extra=extra)
    assert caught.value.code == "business_key_committed"
    assert len(wrote) == 1  # the extra rows were written, then rolled back with the plan
    async with world.orch.store.read() as conn:
        n = (
            await conn.execute(
                select(func.count())
                .select_from(executions)
                .where(executions.c.execution_id == wrote[0])
            )
        ).scalar_one()
    assert n == 0


# -- an idempotency key lost in a race ------------------------------------------------------------


async def test_a_key_lost_in_a_race_names_the_execution_that_holds_it(world: World) -> None:
    svc, alice, command_id = await _setup(world)
    # Both requests pass the key check (nobody holds it yet) before either applies.
    both_checked = asyncio.Barrier(2)

    async def after_validation() -> None:
        await both_checked.wait()

    svc.between_validation_and_apply = after_validation
    results = await asyncio.gather(
        svc.execute(alice, command_id, ORDER, idempotency_key="same"),
        svc.execute(alice, command_id, ORDER, idempotency_key="same"),
        return_exceptions=True,
    )
    wins = [r for r in results if not isinstance(r, BaseException)]
    losses = [r for r in results if isinstance(r, BaseException)]
    assert len(wins) == 1 and len(losses) == 1, results
    lost = losses[0]
    assert isinstance(lost, errors.IdempotencyInProgress) and lost.retryable
    named = str(lost.details["execution_id"])
    # Before: the loser's own, never-written id.
    assert named == wins[0].execution_id
    got = await svc.execution(alice, command_id, named)
    assert got["execution_id"] == named
    assert (await world.shop.counts())["payments.charge"] == 1
    svc.between_validation_and_apply = None
    replay = await svc.execute(alice, command_id, ORDER, idempotency_key="same")
    assert replay.replayed and replay.execution_id == named
