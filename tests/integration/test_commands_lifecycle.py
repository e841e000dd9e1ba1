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


