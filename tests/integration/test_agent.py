"""The person-confirmation protocol through the Python API, on both backends.

Every "no second charge" claim is checked in the fake shop's own database.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from ledger import executions, principals
from orchestrator import errors
from orchestrator.agent import MARKER, MAX_LIVE_MARKERS, OPS_RESOURCE, agent_key
from orchestrator.authz import Caller
from tests.support.commands import add_user, order_command
from tests.support.world import World

ORDER_ID = "11111111-1111-4111-8111-111111111111"  # business data that looks like a UUID
ORDER = {"order_id": ORDER_ID, "sku": "sku-1", "amount": 1200}
TOOL_KEYS = {"status", "action", "error", "retryable", "guidance"}


async def _setup(
    world: World, *, language: str = "en", **changes: Any
) -> tuple[Caller, dict[str, Any]]:
    alice = await add_user(world.orch, "alice")
    async with world.orch.store.transaction() as work:
        await principals.join_room(work, "room-1", "alice", language=language)
    info = await world.orch.commands.create(alice, order_command(**changes))
    return Caller(principal_id="alice", kind="user", auth="jwt", room_id="room-1", ai=True), info


async def _charges(world: World) -> int:
    return (await world.shop.counts())["payments.charge"]


async def test_prepare_stages_and_the_proposal_shows_business_data_only(world: World) -> None:
    alice, info = await _setup(world, description="Ship order")
    staged = await world.orch.agent.prepare(alice, info["command_id"], ORDER)
    token, text = staged["confirmation_token"], staged["proposal"]
    assert re.fullmatch(r"[0-9a-f]{32}", token)
    assert "Ship order" in text and "1200" in text and "sku-1" in text
    assert ORDER_ID in text  # looks like a UUID, but it is the caller's business data
    record = (await world.orch.commands.executions(alice, info["command_id"]))[0]
    for secret in (token, info["digest"], record["execution_id"], info["command_id"]):
        assert secret not in text
    assert len(text) <= 1200
    assert record["status"] == "staged"
    assert (await world.shop.counts())["inventory.reserve"] == 0


async def test_confirm_runs_once_and_a_repeated_yes_replays(world: World) -> None:
    alice, info = await _setup(world)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    first = await agent.execute_staged_action(alice, token)
    assert set(first) == TOOL_KEYS
    assert first["status"] == "succeeded" and first["error"] is None
    assert first["action"] == "order"
    again = await agent.execute_staged_action(alice, token)  # the same token twice
    assert again == first
    # The person repeats "yes, do it" because the receipt did not arrive: a new prepare, a new
    # token, the same request in the same room — replayed, not written again.
    token2 = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    replay = await agent.execute_staged_action(alice, token2)
    assert replay["status"] == "succeeded"
    assert await _charges(world) == 1


async def test_after_delivery_the_same_request_is_a_new_write(world: World) -> None:
    alice, info = await _setup(world)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    assert (await agent.execute_staged_action(alice, token))["status"] == "succeeded"
    record = (await world.orch.commands.executions(alice, info["command_id"]))[0]
    assert record["idempotency_key"] == agent_key(info["command_id"], "room-1", ORDER)
    assert await agent.mark_delivered_by_token(alice, token)
    assert not await agent.mark_delivered(alice, record["execution_id"])  # only once
    token2 = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    assert (await agent.execute_staged_action(alice, token2))["status"] == "succeeded"
    assert await _charges(world) == 2


async def test_the_window_expires_lazily_at_the_ttl_resolved_at_execute(world: World) -> None:
    alice, info = await _setup(world, delivery_reconciliation_ttl_seconds=60)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    await agent.execute_staged_action(alice, token)
    world.orch.store.advance_clock(61)
    markers = await agent.window("room-1")
    assert [m.state for m in markers] == ["expired"]
    token2 = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    assert (await agent.execute_staged_action(alice, token2))["status"] == "succeeded"
    assert await _charges(world) == 2


async def test_legacy_markers_expire_at_900s_and_in_flight_ones_not_before_3600s(
    world: World,
) -> None:
    alice, info = await _setup(world)
    agent = world.orch.agent
    ids = []
    for n in range(2):
        token = (await agent.prepare(alice, info["command_id"], {**ORDER, "amount": 10 + n}))[
            "confirmation_token"
        ]
        await agent.execute_staged_action(alice, token)
        ids.append((await world.orch.commands.executions(alice, info["command_id"]))[0])
    async with world.orch.store.transaction() as work:
        # One marker written before TTLs existed; one execution still in flight.
        await executions.finish(
            work, ids[0]["execution_id"], status="succeeded", lifecycle_snapshot={MARKER: {}}
        )
        await executions.finish(
            work,
            ids[1]["execution_id"],
            status="running",
            lifecycle_snapshot={MARKER: {"state": "pending", "expires_at": 0}},
        )
    world.orch.store.advance_clock(901)
    states = {m.execution.execution_id: m.state for m in await agent.window("room-1")}
    assert states == {ids[0]["execution_id"]: "expired", ids[1]["execution_id"]: "pending"}
    world.orch.store.advance_clock(3600)
    states = {m.execution.execution_id: m.state for m in await agent.window("room-1")}
    assert states[ids[1]["execution_id"]] == "expired"


async def test_an_edited_command_is_refused_with_the_pinned_digest(world: World) -> None:
    alice, info = await _setup(world)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    await world.orch.commands.update(alice, info["command_id"], order_command(description="v2"))
    result = await agent.execute_staged_action(alice, token)
    assert result["status"] == "failed" and result["error"] == "command_contract_mismatch"
    assert set(result) == TOOL_KEYS
    assert (await world.shop.counts())["inventory.reserve"] == 0


async def test_assertion_reason_and_guidance_in_the_rooms_language(world: World) -> None:
    guard = {
        "kind": "assert",
        "name": "big",
        "expr": {"$gt": [{"$ref": "inputs.amount"}, 5000]},
        "message": "  Orders under\n50 EUR   ship free; " + "x" * 300,
    }
    alice, info = await _setup(world, language="zh-TW", steps=[guard, *order_command()["steps"]])
    agent = world.orch.agent
    with pytest.raises(errors.AssertionFailed):
        await agent.prepare(alice, info["command_id"], ORDER)  # refused before staging
    # Through the tool path the refusal is a closed tool result with the author's reason.
    result = agent_tool_error(
        errors.AssertionFailed("  Orders under\n50 EUR   ship free; " + "x" * 300)
    )
    assert result["reason"].startswith("Orders under 50 EUR ship free;")
    assert len(result["reason"]) == 200 and "\n" not in result["reason"]
    assert set(result) == TOOL_KEYS | {"reason"}


def agent_tool_error(exc: errors.AgentTxnError) -> dict[str, Any]:
    from orchestrator.agent import tool_error

    return tool_error(exc, "order", "zh-TW")


async def test_guidance_follows_the_room_language(world: World) -> None:
    alice, info = await _setup(world, language="zh-TW")
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    result = await agent.execute_staged_action(alice, token)
    assert result["guidance"] == "已完成。請告訴對方完成了哪些事項。"
    bad = await agent.execute_staged_action(alice, "0" * 32)
    assert bad["error"] == "confirmation_invalid" and bad["status"] == "failed"


async def test_another_persons_token_is_invalid(world: World) -> None:
    alice, info = await _setup(world)
    token = (await world.orch.agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    await add_user(world.orch, "mallory")
    mallory = Caller(principal_id="mallory", kind="user", auth="jwt")
    result = await world.orch.agent.execute_staged_action(mallory, token)
    assert result["error"] == "confirmation_invalid"
    assert await _charges(world) == 0


async def test_query_mode_commands_have_no_staged_path(world: World) -> None:
    alice = await add_user(
        world.orch, "alice", actions=(("inventory", "stock"),), permissions=("manage", "read")
    )
    info = await world.orch.commands.create(
        alice,
        {
            "name": "stock_level",
            "mode": "query",
            "inputs": {"sku": {"type": "string"}},
            "steps": [
                {
                    "kind": "query",
                    "name": "stock",
                    "provider": "inventory",
                    "action": "stock",
                    "payload": {"sku": {"$ref": "inputs.sku"}},
                }
            ],
        },
    )
    with pytest.raises(errors.CommandModeMismatch):
        await world.orch.agent.prepare(alice, info["command_id"], {"sku": "sku-1"})


async def test_more_than_16_live_markers_fail_the_room_closed(world: World) -> None:
    alice, info = await _setup(world)
    agent = world.orch.agent
    for n in range(MAX_LIVE_MARKERS + 1):
        token = (await agent.prepare(alice, info["command_id"], {**ORDER, "amount": 100 + n}))[
            "confirmation_token"
        ]
        assert (await agent.execute_staged_action(alice, token))["status"] == "succeeded"
    with pytest.raises(errors.RoomWriteProtected):
        await agent.prepare(alice, info["command_id"], {**ORDER, "amount": 99})
    # Delivering one frees capacity.
    first = (await world.orch.commands.executions(alice, info["command_id"], limit=200))[-1]
    await agent.mark_delivered(alice, first["execution_id"])
    assert (await agent.prepare(alice, info["command_id"], {**ORDER, "amount": 99}))["proposal"]


async def test_operators_list_preview_and_acknowledge_markers(world: World) -> None:
    alice, info = await _setup(world)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    await agent.execute_staged_action(alice, token)
    ops = await add_user(
        world.orch, "ops", actions=(tuple(OPS_RESOURCE.split(".")),), permissions=("manage",)
    )
    with pytest.raises(errors.PrincipalNotAuthorized):
        await agent.deliveries(alice, "room-1")
    listed = await agent.deliveries(ops, "room-1")
    assert [(m["state"], m["in_window"]) for m in listed] == [("pending", True)]
    execution_id = listed[0]["execution_id"]
    preview = await agent.acknowledge(ops, "room-1", [execution_id], execute=False, force=True)
    assert preview[0]["result"] == "would_acknowledge"
    assert (await agent.deliveries(ops, "room-1"))[0]["state"] == "pending"  # no write
    refused = await agent.acknowledge(ops, "room-1", [execution_id], execute=True)
    assert refused[0]["result"] == "needs_force"
    done = await agent.acknowledge(ops, "room-1", [execution_id], execute=True, force=True)
    assert done[0]["result"] == "acknowledged"
    # Acknowledging never rolls back the committed write; it re-opens the key.
    assert await _charges(world) == 1
    token2 = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    await agent.execute_staged_action(alice, token2)
    assert await _charges(world) == 2


async def test_five_redeliveries_while_pending_are_one_effect_and_five_equal_results(
    world: World,
) -> None:
    alice, info = await _setup(world, delivery_reconciliation_ttl_seconds=60)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    results = [await agent.execute_staged_action(alice, token) for _ in range(5)]
    assert all(r == results[0] for r in results) and results[0]["status"] == "succeeded"
    assert await _charges(world) == 1
    world.orch.store.advance_clock(61)
    # After expiry the token is used up, and a new confirmed call may write again.
    used = await agent.execute_staged_action(alice, token)
    assert used["error"] == "confirmation_invalid"
    token2 = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    assert (await agent.execute_staged_action(alice, token2))["status"] == "succeeded"
    assert await _charges(world) == 2


async def test_forged_tokens_are_refused_before_any_read_of_state(world: World) -> None:
    alice, _info = await _setup(world)
    for forged in ("", "zz" * 16, "0" * 31, "A" * 32, "0" * 33):
        result = await world.orch.agent.execute_staged_action(alice, forged)
        assert result["error"] == "confirmation_invalid" and set(result) == TOOL_KEYS
    assert await _charges(world) == 0


async def test_a_full_65_row_window_with_a_pending_oldest_row_fails_closed(world: World) -> None:
    alice, info = await _setup(world)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], {**ORDER, "amount": 1}))[
        "confirmation_token"
    ]
    await agent.execute_staged_action(alice, token)
    oldest = (await world.orch.commands.executions(alice, info["command_id"]))[0]
    for n in range(64):  # 64 newer ones, each delivered: only the oldest is still pending
        token = (await agent.prepare(alice, info["command_id"], {**ORDER, "amount": 2 + n}))[
            "confirmation_token"
        ]
        await agent.execute_staged_action(alice, token)
        newest = (await world.orch.commands.executions(alice, info["command_id"], limit=1))[0]
        await agent.mark_delivered(alice, newest["execution_id"])
    with pytest.raises(errors.RoomWriteProtected):
        await agent.prepare(alice, info["command_id"], {**ORDER, "amount": 999})
    await agent.mark_delivered(alice, oldest["execution_id"])  # capacity frees
    assert (await agent.prepare(alice, info["command_id"], {**ORDER, "amount": 999}))["proposal"]


async def test_ops_cli_lists_previews_and_acknowledges_markers(world: World) -> None:
    import json

    from typer.testing import CliRunner

    from orchestrator import cli

    alice, info = await _setup(world)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    await agent.execute_staged_action(alice, token)
    runner = CliRunner()

    def run(*args: str) -> Any:
        result = await_cli(runner, cli.app, [*args, "--db", world.urls.store, "--json"])
        return json.loads(result)["markers"]

    listed = run("ops", "deliveries", "room-1")
    assert [(m["state"], m["in_window"]) for m in listed] == [("pending", True)]
    assert run("ops", "deliveries", "room-1", "--tenant", "other") == []  # not its markers
    execution_id = listed[0]["execution_id"]
    assert run("ops", "acknowledge", "room-1", "-e", execution_id, "--force")[0]["result"] == (
        "would_acknowledge"
    )
    assert run("ops", "acknowledge", "room-1", "-e", execution_id, "--execute")[0]["result"] == (
        "needs_force"
    )
    done = run("ops", "acknowledge", "room-1", "-e", execution_id, "--execute", "--force")
    assert done[0]["result"] == "acknowledged"
    assert (await agent.window("room-1"))[0].state == "acknowledged"


def await_cli(runner: Any, app: Any, args: list[str]) -> str:
    """Run the CLI in a worker thread: it starts its own event loop."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(runner.invoke, app, args).result()
    assert result.exit_code == 0, result.output
    return str(result.stdout)


async def test_a_repeated_yes_on_an_approval_gated_command_stages_once(world: World) -> None:
    from ledger import action_settings

    async with world.orch.store.transaction() as work:
        await action_settings.put(
            work, "payments", "charge", requires_approval=True, approval_policy=None
        )
    alice, info = await _setup(world)
    approver = await add_user(world.orch, "approver", permissions=("approve", "read"))
    agent = world.orch.agent
    results = []
    for _ in range(2):  # "yes", and "yes" again because nothing seemed to happen
        token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
        results.append(await agent.execute_staged_action(alice, token))
    assert [r["error"] for r in results] == ["approval_required", "approval_required"]
    staged_rows = [
        e
        for e in await world.orch.commands.executions(alice, info["command_id"])
        if e.get("staged_change_id")
    ]
    assert len(staged_rows) == 1
    outcome = await world.orch.commands.approve(approver, staged_rows[0]["staged_change_id"])
    assert outcome.status_code == 200
    assert await _charges(world) == 1


async def test_api_key_callers_cannot_confirm_or_release(world: World) -> None:
    alice, info = await _setup(world)
    token = (await world.orch.agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    keyed = Caller(principal_id="alice", kind="user", auth="api_key", room_id="room-1")
    result = await world.orch.agent.execute_staged_action(keyed, token)
    assert result["error"] == "jwt_required"
    with pytest.raises(errors.JwtRequired):
        await world.orch.agent.mark_delivered_by_token(keyed, token)
    assert await _charges(world) == 0


async def test_unconfirmed_plans_are_released_once_their_confirmation_expires(
    world: World,
) -> None:
    alice, info = await _setup(world)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    world.orch.store.advance_clock(3601)
    await agent.prepare(alice, info["command_id"], {**ORDER, "amount": 5})
    old = (await world.orch.commands.executions(alice, info["command_id"]))[-1]
    assert old["status"] == "failed" and old["error_code"] == "staged_released"
    assert (await agent.execute_staged_action(alice, token))["error"] == "confirmation_invalid"
    assert (await world.shop.counts())["inventory.reserve"] == 0


# -- audit findings: in-flight keys, concurrent confirmations, expired holders, tenants ---------


async def _in_doubt_confirm(
    world: World, *, parked: bool = False
) -> tuple[Any, Caller, dict[str, Any], str]:
    """A confirmed order whose charge response is lost while lookups are down: in doubt
    (``running``), or with ``parked`` out of lookups and waiting for an operator."""
    from providers.fake.faults import FaultKind, FaultRule

    world.shop.faults.add(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge", times=1)
    )
    world.shop.faults.add(FaultRule(FaultKind.LOOKUP_UNAVAILABLE, provider="payments", times=None))
    # Lookups that never run out within the call: it stays in doubt.
    orch = world.orch if parked else await world.engine(reconcile_attempts=1000)
    alice, info = await _setup(world)
    token = (await orch.agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    result = await orch.agent.execute_staged_action(alice, token, budget_seconds=0.2)
    expected = "manual_review" if parked else "in_doubt"
    assert (result["status"], result["error"]) == ("running", expected)
    record = (await world.orch.commands.executions(alice, info["command_id"]))[0]
    return orch.agent, alice, info, record["execution_id"]


@pytest.mark.parametrize("parked", [False, True], ids=["running", "manual_review"])
async def test_delivering_an_in_flight_reply_keeps_the_key_of_the_execution(
    world: World, parked: bool
) -> None:
    agent, alice, info, execution_id = await _in_doubt_confirm(world, parked=parked)
    # The "still in progress" reply reached the room: recorded, but the key stays held.
    assert await agent.mark_delivered(alice, execution_id)
    assert [m.state for m in await agent.window("room-1")] == ["delivered"]
    token2 = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    again = await agent.execute_staged_action(alice, token2, budget_seconds=0.2)
    assert again["status"] == "running"
    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["inventory.reserve"]) == (1, 1)


async def test_acknowledging_an_in_doubt_marker_keeps_the_key_too(world: World) -> None:
    agent, alice, info, execution_id = await _in_doubt_confirm(world)
    ops = await add_user(
        world.orch, "ops", actions=(tuple(OPS_RESOURCE.split(".")),), permissions=("manage",)
    )
    done = await agent.acknowledge(ops, "room-1", [execution_id], execute=True, force=True)
    assert done[0]["result"] == "acknowledged"
    token2 = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    again = await agent.execute_staged_action(alice, token2, budget_seconds=0.2)
    assert again["status"] == "running"
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_once_a_delivered_in_doubt_execution_settles_the_request_is_a_new_write(
    world: World,
) -> None:
    agent, alice, info, execution_id = await _in_doubt_confirm(world)
    assert await agent.mark_delivered(alice, execution_id)
    world.shop.faults.clear()
    async with world.orch.store.transaction() as work:  # as recovery finishes it
        fresh = await executions.get_for_update(work, execution_id)
        assert fresh is not None
        await executions.finish(work, execution_id, status="succeeded")
    token2 = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    assert (await agent.execute_staged_action(alice, token2))["status"] == "succeeded"
    assert (await world.shop.counts())["payments.charge"] == 2


async def test_one_token_confirmed_three_times_at_once_answers_the_winners_status(
    world: World,
) -> None:
    import asyncio

    alice, info = await _setup(world)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    results = await asyncio.gather(*(agent.execute_staged_action(alice, token) for _ in range(3)))
    for result in results:
        assert result["status"] in ("succeeded", "running"), result
        assert result["error"] in (None, "in_doubt"), result
    assert [r["status"] for r in results].count("succeeded") >= 1
    assert await _charges(world) == 1


async def test_two_tokens_for_one_request_confirmed_at_once_answer_the_winners_status(
    world: World,
) -> None:
    import asyncio

    alice, info = await _setup(world)
    agent = world.orch.agent
    tokens = [
        (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
        for _ in range(2)
    ]
    results = await asyncio.gather(*(agent.execute_staged_action(alice, t) for t in tokens))
    for result in results:
        assert result["status"] in ("succeeded", "running"), result
        assert result["error"] in (None, "in_doubt"), result
    assert await _charges(world) == 1
    statuses = sorted(
        e["status"] for e in await world.orch.commands.executions(alice, info["command_id"])
    )
    assert statuses == ["failed", "succeeded"]  # the loser's plan was retired, not left staged


BUSINESS_KEY = {"$concat": ["order:", {"$ref": "inputs.order_id"}]}


async def _bob_in_room(world: World) -> Caller:
    await add_user(world.orch, "bob")
    async with world.orch.store.transaction() as work:
        await principals.join_room(work, "room-1", "bob")
    return Caller(principal_id="bob", kind="user", auth="jwt", room_id="room-1", ai=True)


async def test_an_expired_unconfirmed_plan_of_another_person_does_not_hold_the_business_key(
    world: World,
) -> None:
    alice, info = await _setup(world, business_key=BUSINESS_KEY)
    bob = await _bob_in_room(world)
    agent = world.orch.agent
    bobs = (await agent.prepare(bob, info["command_id"], ORDER))["confirmation_token"]
    # While bob's confirmation is open, the order is his to confirm.
    with pytest.raises(errors.BusinessKeyConflict):
        await world.orch.commands.execute(alice, info["command_id"], ORDER)
    world.orch.store.advance_clock(3601)  # bob never confirms
    outcome = await world.orch.commands.execute(alice, info["command_id"], ORDER)
    assert outcome.status_code == 200
    assert (await agent.execute_staged_action(bob, bobs))["error"] == "confirmation_invalid"
    assert await _charges(world) == 1


async def test_racing_writers_past_an_expired_plan_write_once(world: World) -> None:
    import asyncio

    alice, info = await _setup(world, business_key=BUSINESS_KEY)
    bob = await _bob_in_room(world)
    await add_user(world.orch, "carol")
    carol = Caller(principal_id="carol", kind="user", auth="jwt")
    await world.orch.agent.prepare(bob, info["command_id"], ORDER)
    world.orch.store.advance_clock(3601)
    outcomes = await asyncio.gather(
        *(world.orch.commands.execute(c, info["command_id"], ORDER) for c in (alice, carol)),
        return_exceptions=True,
    )
    done = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert [o.status_code for o in done] == [200], outcomes
    assert all(isinstance(o, errors.BusinessKeyConflict) for o in refused), outcomes
    assert await _charges(world) == 1


async def test_an_expired_unconfirmed_plan_does_not_block_another_persons_prepare(
    world: World,
) -> None:
    alice, info = await _setup(world, business_key=BUSINESS_KEY)
    bob = await _bob_in_room(world)
    agent = world.orch.agent
    await agent.prepare(bob, info["command_id"], ORDER)
    world.orch.store.advance_clock(3601)
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    assert (await agent.execute_staged_action(alice, token))["status"] == "succeeded"
    assert await _charges(world) == 1


async def test_status_of_an_expired_unconfirmed_token_says_it_is_no_longer_valid(
    world: World,
) -> None:
    alice, info = await _setup(world)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    assert (await agent.execution_status(alice, token))["status"] == "staged"
    world.orch.store.advance_clock(3601)
    status = await agent.execution_status(alice, token)
    assert (status["status"], status["error"]) == ("failed", "confirmation_invalid")
    assert status == await agent.execute_staged_action(alice, token)


async def test_delivery_markers_are_per_tenant(world: World) -> None:
    alice, info = await _setup(world)
    agent = world.orch.agent
    token = (await agent.prepare(alice, info["command_id"], ORDER))["confirmation_token"]
    await agent.execute_staged_action(alice, token)
    mine = (await world.orch.commands.executions(alice, info["command_id"]))[0]["execution_id"]
    other = await world.engine(tenant="other")
    ops = await add_user(
        other,
        "ops-other",
        actions=(tuple(OPS_RESOURCE.split(".")),),
        permissions=("manage",),
        tenant="other",
    )
    # Another tenant's operator sees nothing of this room and cannot release its marker.
    assert await other.agent.deliveries(ops, "room-1") == []
    done = await other.agent.acknowledge(ops, "room-1", [mine], execute=True, force=True)
    assert done[0]["result"] == "not_found"
    assert [m.state for m in await agent.window("room-1")] == ["pending"]
    # Nor do this tenant's pending markers fill the other tenant's room of the same id.
    for n in range(MAX_LIVE_MARKERS):  # with the first one: one over the limit
        t = (await agent.prepare(alice, info["command_id"], {**ORDER, "amount": 100 + n}))[
            "confirmation_token"
        ]
        await agent.execute_staged_action(alice, t)
    with pytest.raises(errors.RoomWriteProtected):
        await agent.prepare(alice, info["command_id"], {**ORDER, "amount": 99})
    carol = await add_user(other, "carol", tenant="other")
    async with other.store.transaction() as work:
        await principals.join_room(work, "room-1", "carol")
    theirs = await other.commands.create(carol, order_command())
    carol = Caller(principal_id="carol", kind="user", auth="jwt", room_id="room-1", ai=True)
    assert (await other.agent.prepare(carol, theirs["command_id"], ORDER))["proposal"]
