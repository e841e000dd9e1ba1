"""Approvals: an action that needs approval stages the frozen plan; an approver runs or releases
it, exactly once. Effects are counted in the fake shop's own database."""

from __future__ import annotations

import asyncio

import pytest

from ledger import action_settings
from orchestrator import errors
from orchestrator.commands import CommandService
from tests.support.commands import add_user, order_command
from tests.support.world import World

ORDER = {"order_id": "42", "sku": "sku-1", "amount": 1200}


async def _setup(
    world: World, policy: dict[str, object] | None = None
) -> tuple[CommandService, object, object, str]:
    async with world.orch.store.transaction() as work:
        await action_settings.put(
            work, "payments", "charge", requires_approval=True, approval_policy=policy
        )
    svc = world.orch.commands
    alice = await add_user(world.orch, "alice")
    approver = await add_user(world.orch, "approver", permissions=("approve", "read"))
    info = await svc.create(alice, order_command())
    return svc, alice, approver, info["command_id"]


async def _stage(svc: CommandService, caller: object, command_id: str, key: str) -> str:
    with pytest.raises(errors.ApprovalRequired) as caught:
        await svc.execute(caller, command_id, ORDER, idempotency_key=key)  # type: ignore[arg-type]
    assert caught.value.http_status == 409
    return str(caught.value.details["staged_change_id"])


async def test_approval_stages_then_the_approver_runs_the_frozen_plan_once(world: World) -> None:
    svc, alice, approver, command_id = await _setup(world)
    change = await _stage(svc, alice, command_id, "k")
    assert (await world.shop.counts())["inventory.reserve"] == 0  # nothing ran yet
    record = (await svc.executions(alice, command_id))[0]  # type: ignore[arg-type]
    assert record["status"] == "staged" and record["staged_change_id"] == change
    # The same key replays the staged answer instead of staging twice.
    assert await _stage(svc, alice, command_id, "k") == change
    outcome = await svc.approve(approver, change)  # type: ignore[arg-type]
    assert outcome.status_code == 200 and outcome.body["status"] == "succeeded"
    assert outcome.execution_id == record["execution_id"]
    with pytest.raises(errors.StagedChangeDecided):
        await svc.approve(approver, change)  # type: ignore[arg-type]
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_two_approvers_at_once_run_it_once(world: World) -> None:
    svc, alice, approver, command_id = await _setup(world)
    second = await add_user(world.orch, "approver2", permissions=("approve", "read"))
    change = await _stage(svc, alice, command_id, "k2")
    results = await asyncio.gather(
        svc.approve(approver, change),  # type: ignore[arg-type]
        svc.approve(second, change),  # type: ignore[arg-type]
        return_exceptions=True,
    )
    wins = [r for r in results if not isinstance(r, BaseException)]
    assert len(wins) == 1, results
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_the_invoker_alone_cannot_approve_by_default(world: World) -> None:
    svc, alice, _approver, command_id = await _setup(world)
    change = await _stage(svc, alice, command_id, "k3")
    # Alice even holds every grant but "approve": add it; the policy still refuses her.
    await add_user(world.orch, "alice-approver", permissions=("approve",))
    with pytest.raises(errors.PrincipalNotAuthorized):
        await svc.approve(alice, change)  # type: ignore[arg-type]


async def test_a_policy_may_let_the_invoker_approve(world: World) -> None:
    svc, alice, _approver, command_id = await _setup(world, policy={"separate_approver": False})
    self_approver = await add_user(
        world.orch, "solo", permissions=("manage", "execute", "read", "approve")
    )
    info = await svc.create(self_approver, order_command(name="order_solo"))
    change = await _stage(svc, self_approver, info["command_id"], "k4")
    outcome = await svc.approve(self_approver, change)  # type: ignore[arg-type]
    assert outcome.status_code == 200
    del alice, command_id


async def test_a_rejection_releases_the_plan_and_its_key(world: World) -> None:
    svc, alice, approver, command_id = await _setup(world)
    change = await _stage(svc, alice, command_id, "k5")
    view = await svc.reject(approver, change, reason="not   today")  # type: ignore[arg-type]
    assert view["status"] == "failed" and view["error_code"] == "approval_rejected"
    assert (await world.shop.counts())["inventory.reserve"] == 0
    # The key is free again: the same request stages a new change.
    assert await _stage(svc, alice, command_id, "k5") != change
    with pytest.raises(errors.StagedChangeDecided):
        await svc.approve(approver, change)  # type: ignore[arg-type]


async def test_a_command_edited_after_staging_cannot_be_approved(world: World) -> None:
    svc, alice, approver, command_id = await _setup(world)
    change = await _stage(svc, alice, command_id, "k6")
    await svc.update(alice, command_id, order_command(description="edited"))  # type: ignore[arg-type]
    with pytest.raises(errors.SourceAuthorityChanged):
        await svc.approve(approver, change)  # type: ignore[arg-type]
    assert (await world.shop.counts())["inventory.reserve"] == 0


async def test_an_approver_without_the_approve_grant_is_refused(world: World) -> None:
    svc, alice, _approver, command_id = await _setup(world)
    bystander = await add_user(world.orch, "bystander", permissions=("read",))
    change = await _stage(svc, alice, command_id, "k7")
    with pytest.raises(errors.PrincipalNotAuthorized):
        await svc.approve(bystander, change)  # type: ignore[arg-type]
