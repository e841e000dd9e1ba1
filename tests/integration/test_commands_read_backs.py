"""Records that vanish between a commit and its read-back (``ops prune``, a concurrent delete)
answer a registered error or what was committed, never an ``AssertionError`` (a 500).

Each test runs the real path and prunes right after the commit that finished the record, with
the cutoff pushed past it, on SQLite and PostgreSQL.
"""

from __future__ import annotations

from typing import Any

import pytest

from ledger import action_settings, staged
from orchestrator import errors, ops
from orchestrator.authz import Caller
from orchestrator.engine import Orchestrator
from tests.support.commands import add_user, order_command
from tests.support.world import World

ORDER = {"order_id": "42", "sku": "sku-1", "amount": 1200}
DAY_MS = 24 * 3600 * 1000


async def _prune_everything_finished(orch: Orchestrator) -> None:
    """What ``agent-txn ops prune`` does, with a cutoff every record so far falls before."""
    result = await ops.prune(orch.store, now_ms=orch.store.now_ms() + 2 * DAY_MS, retention_days=1)
    assert result["pruned"] >= 1


def _prune_after(monkeypatch: pytest.MonkeyPatch, orch: Orchestrator, name: str) -> None:
    """Wrap ``orch.<name>`` so its commit is followed at once by a prune."""
    original = getattr(orch, name)

    async def then_prune(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        await _prune_everything_finished(orch)
        return result

    monkeypatch.setattr(orch, name, then_prune)


async def _staged_change(world: World, **changes: Any) -> tuple[Caller, Caller, str, str]:
    async with world.orch.store.transaction() as work:
        await action_settings.put(
            work, "payments", "charge", requires_approval=True, approval_policy=None
        )
    alice = await add_user(world.orch, "alice")
    approver = await add_user(world.orch, "approver", permissions=("approve", "read"))
    info = await world.orch.commands.create(alice, order_command(**changes))
    with pytest.raises(errors.ApprovalRequired) as caught:
        await world.orch.commands.execute(alice, info["command_id"], ORDER)
    return alice, approver, info["command_id"], str(caught.value.details["staged_change_id"])


async def test_an_approved_plan_pruned_before_its_read_back_is_execution_not_found(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    _alice, approver, _command_id, change = await _staged_change(world)
    _prune_after(monkeypatch, world.orch, "execute_staged")
    with pytest.raises(errors.ExecutionNotFound) as caught:
        await world.orch.commands.approve(approver, change)
    # Not business_key_conflict (409, retryable): the plan did run, and a retry cannot help.
    assert caught.value.http_status == 404 and not caught.value.retryable
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_a_rejection_pruned_at_once_still_answers_what_it_committed(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, approver, command_id, change = await _staged_change(world)
    _prune_after(monkeypatch, world.orch, "release_staged")
    view = await world.orch.commands.reject(approver, change, reason="no")
    assert view["status"] == "failed" and view["error_code"] == "approval_rejected"
    assert await world.orch.commands.executions(alice, command_id) == []  # really gone
    assert (await world.shop.counts())["inventory.reserve"] == 0


async def test_staged_callbacks_commit_with_the_staged_record(world: World) -> None:
    hooks = [{"url": "https://hooks.example.com/a", "events": ["staged"]}]
    _alice, _approver, _command_id, change = await _staged_change(world, callbacks=hooks)
    async with world.orch.store.read() as conn:
        row = await staged.get_change(conn, change)
    assert row is not None
    queued = await world.orch.commands.pending_callbacks(row.execution_id)
    assert [(r.event, r.state) for r in queued] == [("staged", "pending")]


async def _agent_setup(world: World) -> tuple[Caller, str]:
    alice = await add_user(world.orch, "alice")
    info = await world.orch.commands.create(alice, order_command())
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    return alice, str(token)


async def test_an_agent_execution_pruned_before_its_status_is_read_is_a_tool_result(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, token = await _agent_setup(world)
    _prune_after(monkeypatch, world.orch, "execute_staged")
    result = await world.orch.agent.execute_staged_action(alice, token)
    assert result["status"] == "failed" and result["error"] == "confirmation_invalid"
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_agent_status_of_a_record_pruned_after_the_token_was_read_is_a_tool_result(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, token = await _agent_setup(world)
    agent = world.orch.agent
    assert (await agent.execute_staged_action(alice, token))["status"] == "succeeded"
    original = agent._confirmation

    async def read_then_prune(*args: Any) -> Any:
        found = await original(*args)
        await _prune_everything_finished(world.orch)
        return found

    monkeypatch.setattr(agent, "_confirmation", read_then_prune)
    result = await agent.execution_status(alice, token)
    assert result["status"] == "failed" and result["error"] == "confirmation_invalid"
    assert result["action"] == "order"
