"""Replacing and deleting a command, on both backends: only a manager of what is stored may
replace it, and a deleted command leaves no staged plan waiting forever."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from ledger import action_settings, commands, staged, transactions
from ledger.schema import executions, idempotency_reservations
from ledger.schema import ledger as ledger_table
from ledger.schema import transactions as transactions_table
from ledger.states import TxState
from orchestrator import errors
from orchestrator.authz import Caller
from orchestrator.commands import CommandService
from tests.support.commands import add_user, order_command
from tests.support.world import World

ORDER = {"order_id": "42", "sku": "sku-1", "amount": 1200}
BY_ORDER = {"$concat": ["order:", {"$ref": "inputs.order_id"}]}
INVENTORY = (("inventory", "reserve"), ("inventory", "release"))
HOOKS = [{"url": "https://hooks.example.com/a", "events": ["failed"]}]


def _inventory_only() -> dict[str, object]:
    command = order_command()
    command["steps"] = command["steps"][:1]  # reserve only: the charge is gone
    command["outbox"] = []
    command["result"] = None
    return command


# -- replace ------------------------------------------------------------------------------------


async def test_a_command_is_replaced_only_by_a_manager_of_what_it_stores(world: World) -> None:
    svc = world.orch.commands
    alice = await add_user(world.orch, "alice")
    dave = await add_user(world.orch, "dave", actions=INVENTORY)  # manages inventory only
    info = await svc.create(alice, order_command())
    command_id = info["command_id"]
    with pytest.raises(errors.PrincipalNotAuthorized):
        await svc.delete(dave, command_id)
    # Before: 200, and alice's charge step was gone.
    with pytest.raises(errors.PrincipalNotAuthorized):
        await svc.update(dave, command_id, _inventory_only())
    got = await svc.get(alice, command_id)
    assert got["digest"] == info["digest"]
    assert [s["name"] for s in got["definition"]["steps"]] == ["reserve", "charge"]
    # Alice manages both: she may narrow it.
    narrowed = await svc.update(alice, command_id, _inventory_only())
    assert [s["name"] for s in narrowed["definition"]["steps"]] == ["reserve"]


# -- delete -------------------------------------------------------------------------------------


async def _staged(world: World, key: str | None) -> tuple[CommandService, Caller, Caller, str, str]:
    async with world.orch.store.transaction() as work:
        await action_settings.put(
            work, "payments", "charge", requires_approval=True, approval_policy=None
        )
    svc = world.orch.commands
    alice = await add_user(world.orch, "alice")
    approver = await add_user(world.orch, "approver", permissions=("approve", "read"))
    info = await svc.create(alice, order_command(business_key=BY_ORDER, callbacks=HOOKS))
    with pytest.raises(errors.ApprovalRequired) as caught:
        await svc.execute(alice, info["command_id"], ORDER, idempotency_key=key)
    change = str(caught.value.details["staged_change_id"])
    return svc, alice, approver, str(info["command_id"]), change


async def test_deleting_a_command_releases_its_staged_changes(world: World) -> None:
    svc, alice, approver, command_id, change = await _staged(world, key="k")
    async with world.orch.store.read() as conn:
        row = await staged.get_change(conn, change)
        assert row is not None
        execution_id = row.execution_id
        tx_id = (
            await conn.execute(
                select(executions.c.tx_id).where(executions.c.execution_id == execution_id)
            )
        ).scalar_one()
    await svc.delete(alice, command_id)

    async with world.orch.store.read() as conn:
        row = await staged.get_change(conn, change)
        record = (
            await conn.execute(select(executions).where(executions.c.execution_id == execution_id))
        ).one()
        tx = await transactions.get(conn, tx_id)
        keys = (await conn.execute(select(idempotency_reservations))).all()
        holder = await transactions.live_by_business_key(conn, "order:42")
        released = (
            await conn.execute(
                select(ledger_table.c.action, ledger_table.c.to_state).where(
                    ledger_table.c.tx_id == tx_id
                )
            )
        ).all()
    # Before: the change stayed pending, the execution and its transaction `staged` forever.
    assert row is not None and row.state == "rejected" and row.decided_by == "alice"
    assert record.status == "failed" and record.error_code == "staged_released"
    assert tx is not None and tx.status is TxState.FAILED
    assert keys == [] and holder is None  # the idempotency key and the business key are free
    assert ("release", "failed") in [tuple(r) for r in released]  # recorded in the ledger
    # Deciding it afterwards says it was decided (not "not found"); nothing ran.
    with pytest.raises(errors.StagedChangeDecided):
        await svc.reject(approver, change)
    with pytest.raises(errors.StagedChangeDecided):
        await svc.approve(approver, change)
    assert (await world.shop.counts())["inventory.reserve"] == 0
    # Its record stays readable, as the rejection left it.
    view = await svc.execution(alice, command_id, execution_id)
    assert view["status"] == "failed" and view["error_code"] == "staged_released"
    # Its "failed" callback was queued with the release, as a rejection queues it.
    queued = await svc.pending_callbacks(execution_id)
    assert [(r.event, r.state) for r in queued] == [("failed", "pending")]


async def test_a_deleted_commands_pending_change_left_behind_can_still_be_rejected(
    world: World,
) -> None:
    """A change stranded by a delete before deletes released them (an older version): reject
    reaches it; approve refuses to run a deleted command's plan."""
    svc, _alice, approver, command_id, change = await _staged(world, key="k")
    async with world.orch.store.transaction() as work:
        assert await commands.soft_delete(work, command_id)  # what an older delete did
    with pytest.raises(errors.SourceAuthorityChanged):
        await svc.approve(approver, change)
    view = await svc.reject(approver, change, reason="stale")
    assert view["status"] == "failed" and view["error_code"] == "approval_rejected"
    async with world.orch.store.read() as conn:
        tx_status = (
            await conn.execute(
                select(transactions_table.c.status).where(
                    transactions_table.c.execution_id == view["execution_id"]
                )
            )
        ).scalar_one()
    assert tx_status == TxState.FAILED.value
    assert (await world.shop.counts())["inventory.reserve"] == 0


async def test_deleting_a_command_releases_its_unconfirmed_agent_plans(world: World) -> None:
    svc = world.orch.commands
    alice = await add_user(world.orch, "alice")
    info = await svc.create(alice, order_command(business_key=BY_ORDER))
    command_id = info["command_id"]
    token = (await world.orch.agent.prepare(alice, command_id, ORDER))["confirmation_token"]
    await svc.delete(alice, command_id)
    async with world.orch.store.read() as conn:
        holder = await transactions.live_by_business_key(conn, "order:42")
        statuses = (await conn.execute(select(executions.c.status, executions.c.error_code))).all()
    assert holder is None
    assert [tuple(s) for s in statuses] == [("failed", "staged_released")]
    result = await world.orch.agent.execute_staged_action(alice, str(token))
    assert result["status"] == "failed"
    assert (await world.shop.counts())["inventory.reserve"] == 0
