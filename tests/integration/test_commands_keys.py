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


async def _setup(world: World) -> tuple[CommandService, Caller, str]:
    svc = world.orch.commands
    alice = await add_user(world.orch, "alice")
    info = await svc.create(alice, order_command(business_key=BY_ORDER))
    return svc, alice, str(info["command_id"])


# -- a committed holder (findings: "still in flight", retryable forever) ------------------------


# -- staging a plan that did not land ------------------------------------------------------------


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
