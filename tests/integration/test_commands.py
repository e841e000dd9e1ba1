"""The commands layer through the Python API, on both backends (seed 000, rule by rule).

Effects are counted in the fake shop's own database; "nothing written" is checked by counting
our own rows before and after.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from sqlalchemy import func, select

from ledger import action_settings, commands, principals
from ledger.canonical import canonical_json
from ledger.schema import (
    callback_runs,
    executions,
    idempotency_reservations,
    transactions,
)
from ledger.schema import ledger as ledger_table
from orchestrator import errors
from orchestrator.authz import Caller
from orchestrator.commands import CommandLimits, CommandService
from providers.fake.faults import FaultKind, FaultRule
from tests.support.commands import ORDER_ACTIONS, add_user, order_command
from tests.support.world import World

ORDER = {"order_id": "42", "sku": "sku-1", "amount": 1200}


async def _counts(world: World) -> dict[str, int]:
    out: dict[str, int] = {}
    async with world.orch.store.read() as conn:
        for table in (executions, idempotency_reservations, transactions, ledger_table):
            out[table.name] = (
                await conn.execute(select(func.count()).select_from(table))
            ).scalar_one()
    return out


async def _setup(
    world: World, *, actions: tuple[tuple[str, str], ...] = ORDER_ACTIONS, **changes: Any
) -> tuple[CommandService, Caller, dict[str, Any]]:
    svc = world.orch.commands
    alice = await add_user(world.orch, "alice", actions=actions)
    info = await svc.create(alice, order_command(**changes))
    return svc, alice, info


# -- execute, digest --------------------------------------------------------------------------


async def test_execute_commits_and_records_the_execution(world: World) -> None:
    svc, alice, info = await _setup(world)
    outcome = await svc.execute(alice, info["command_id"], ORDER, idempotency_key="k-1")
    assert outcome.status_code == 200
    body = outcome.body
    assert body["status"] == "succeeded" and body["invoker_id"] == "alice"
    assert body["result"]["charge"] == body["result_refs"][1]["remote_id"]
    assert body["authorization_snapshot"]["resource_ids"] == sorted(
        [
            "email.send",
            "inventory.release",
            "inventory.reserve",
            "payments.charge",
            "payments.refund",
        ]
    )
    assert "error" not in body  # null-valued keys are dropped
    counts = await world.shop.counts()
    assert counts["payments.charge"] == 1
    listed = await svc.executions(alice, info["command_id"])
    assert [e["execution_id"] for e in listed] == [outcome.execution_id]


async def test_an_execution_and_its_transaction_get_time_ordered_ids(world: World) -> None:
    svc, alice, info = await _setup(world)
    first = await svc.execute(alice, info["command_id"], ORDER, idempotency_key="k-1")
    await asyncio.sleep(0.002)  # the second is minted in a later millisecond
    second = await svc.execute(
        alice, info["command_id"], {**ORDER, "order_id": "43"}, idempotency_key="k-2"
    )
    ids = [first.execution_id, second.execution_id]
    assert ids == sorted(ids)
    async with world.orch.store.read() as conn:
        tx_ids = [
            (
                await conn.execute(select(executions.c.tx_id).where(executions.c.execution_id == e))
            ).scalar_one()
            for e in ids
        ]
    assert tx_ids == sorted(tx_ids)
    assert {uuid.UUID(hex=i).version for i in ids + tx_ids} == {7}


async def test_digest_mismatch_writes_nothing_and_is_checked_before_inputs(world: World) -> None:
    svc, alice, info = await _setup(world)
    before = await _counts(world)
    with pytest.raises(errors.ContractMismatch) as caught:
        # Invalid inputs too: the digest is compared first.
        await svc.execute(
            alice,
            info["command_id"],
            {"bad": 1},
            idempotency_key="k",
            expected_contract_digest="0" * 64,
        )
    assert caught.value.http_status == 409
    assert await _counts(world) == before
    assert (await world.shop.counts())["payments.charge"] == 0


async def test_the_stored_digest_is_the_canonical_sha256_of_the_stored_definition(
    world: World,
) -> None:
    import hashlib
    import json

    svc, alice, info = await _setup(world)
    stored = info["definition"]
    text = json.dumps(stored, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert info["digest"] == hashlib.sha256(text.encode()).hexdigest()
    assert "dependency_contract" in stored
    outcome = await svc.execute(
        alice, info["command_id"], ORDER, expected_contract_digest=info["digest"]
    )
    assert outcome.status_code == 200


@pytest.mark.parametrize("digest", ["A" * 64, "0" * 63, "g" * 64, ""])
async def test_malformed_digest_is_refused(world: World, digest: str) -> None:
    svc, alice, info = await _setup(world)
    with pytest.raises(errors.ContractDigestInvalid):
        await svc.execute(alice, info["command_id"], ORDER, expected_contract_digest=digest)


# -- idempotency --------------------------------------------------------------------------------


async def test_same_key_from_two_actors_never_shares_a_response(world: World) -> None:
    svc, alice, info = await _setup(world)
    bob = await add_user(world.orch, "bob", permissions=("execute", "read"))
    a = await svc.execute(alice, info["command_id"], ORDER, idempotency_key="same")
    b = await svc.execute(
        bob, info["command_id"], {**ORDER, "order_id": "43"}, idempotency_key="same"
    )
    assert a.execution_id != b.execution_id and not a.replayed and not b.replayed
    again = await svc.execute(
        bob, info["command_id"], {**ORDER, "order_id": "43"}, idempotency_key="same"
    )
    assert again.replayed and again.body == b.body
    assert (await world.shop.counts())["payments.charge"] == 2
    with pytest.raises(errors.ExecutionNotFound):
        await svc.execution(bob, info["command_id"], str(a.execution_id))


async def test_replay_returns_the_stored_response_and_does_not_act_again(world: World) -> None:
    svc, alice, info = await _setup(world)
    first = await svc.execute(alice, info["command_id"], ORDER, idempotency_key="r")
    second = await svc.execute(alice, info["command_id"], ORDER, idempotency_key="r")
    assert second.replayed and second.body == first.body
    assert (await world.shop.counts())["payments.charge"] == 1
    with pytest.raises(errors.IdempotencyPayloadMismatch):
        await svc.execute(alice, info["command_id"], {**ORDER, "amount": 5}, idempotency_key="r")


@pytest.mark.parametrize("key", ["", "x" * 129])
async def test_key_length_is_1_to_128(world: World, key: str) -> None:
    svc, alice, info = await _setup(world)
    with pytest.raises(errors.IdempotencyKeyInvalid):
        await svc.execute(alice, info["command_id"], ORDER, idempotency_key=key)
    ok = await svc.execute(alice, info["command_id"], ORDER, idempotency_key="x" * 128)
    assert ok.status_code == 200


async def test_failed_execution_releases_its_key_and_the_retry_succeeds(world: World) -> None:
    svc, alice, info = await _setup(world)
    world.shop.faults.add(FaultRule(FaultKind.REJECT, provider="payments", action="charge"))
    with pytest.raises(errors.OutcomeError) as caught:
        await svc.execute(alice, info["command_id"], ORDER, idempotency_key="f")
    assert caught.value.code == "provider_rejected"
    failed = await svc.execution(alice, info["command_id"], str(caught.value.execution_id))
    assert failed["status"] == "failed" and failed["error_code"] == "provider_rejected"
    counts = await world.shop.counts()
    assert counts["inventory.release"] == 1  # the reserve was reversed
    retry = await svc.execute(alice, info["command_id"], ORDER, idempotency_key="f")
    assert retry.status_code == 200 and not retry.replayed
    assert (await world.shop.counts())["payments.charge"] == 1
    async with world.orch.store.read() as conn:
        queued = (await conn.execute(select(func.count()).select_from(callback_runs))).scalar_one()
    assert queued == 0  # the order command has no callbacks


async def test_in_doubt_execution_blocks_its_key_even_after_the_ttl(world: World) -> None:
    svc, alice, info = await _setup(world)
    world.shop.faults.add(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge", times=1)
    )
    world.shop.faults.add(
        FaultRule(FaultKind.LOOKUP_UNAVAILABLE, provider="payments", action="charge", times=None)
    )
    outcome = await svc.execute(
        alice, info["command_id"], ORDER, idempotency_key="d", budget_seconds=0
    )
    assert outcome.status_code == 202 and outcome.body["status"] == "running"
    world.orch.store.advance_clock(25 * 3600)
    with pytest.raises(errors.IdempotencyInProgress) as caught:
        await svc.execute(alice, info["command_id"], ORDER, idempotency_key="d")
    assert caught.value.retryable
    # Once workers settle it, the key replays the outcome instead.
    world.shop.faults.clear()
    await world.orch.drain(timeout_seconds=10)
    done = await svc.execution(alice, info["command_id"], str(outcome.execution_id))
    assert done["status"] == "succeeded"
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_a_large_response_replays_as_a_truncated_stand_in(world: World) -> None:
    big = {"note": {"type": "string", "max_length": 300_000}}
    svc, alice, info = await _setup(
        world,
        inputs={**order_command()["inputs"], **big},
        result={"note": {"$ref": "inputs.note"}},
    )
    inputs = {**ORDER, "note": "x" * 200_000}
    first = await svc.execute(alice, info["command_id"], inputs, idempotency_key="big")
    assert first.body["result"]["note"] == inputs["note"]
    replay = await svc.execute(alice, info["command_id"], inputs, idempotency_key="big")
    assert replay.replayed and replay.body["truncated"] is True
    assert replay.body["execution_id"] == first.execution_id
    assert "result" not in replay.body


# -- concurrency --------------------------------------------------------------------------------


async def test_lock_conflict_is_409_retryable_and_the_retry_succeeds(world: World) -> None:
    if world.urls.backend != "postgres":
        pytest.skip("row-lock timeouts are PostgreSQL's; SQLite serialises writers in-process")
    svc, alice, info = await _setup(world)
    svc.limits = CommandLimits(lock_retries=1, lock_timeout_ms=50)
    holder = await world.engine()
    before = await _counts(world)
    async with holder.store.transaction() as work:
        await commands.lock_for_apply(work, info["command_id"])  # a concurrent apply holds it
        with pytest.raises(errors.LockConflict) as caught:
            await svc.execute(alice, info["command_id"], ORDER, idempotency_key="lk")
    assert caught.value.retryable and caught.value.envelope()["phase"] == "execute"
    assert await _counts(world) == before  # nothing partial landed, not even the reservation
    retry = await svc.execute(alice, info["command_id"], ORDER, idempotency_key="lk")
    assert retry.status_code == 200


async def test_two_concurrent_executes_of_one_command_both_land_once(world: World) -> None:
    svc, alice, info = await _setup(world)
    results = await asyncio.gather(
        svc.execute(alice, info["command_id"], {**ORDER, "order_id": "a"}, idempotency_key="a"),
        svc.execute(alice, info["command_id"], {**ORDER, "order_id": "b"}, idempotency_key="b"),
    )
    assert {r.status_code for r in results} == {200}
    assert (await world.shop.counts())["payments.charge"] == 2


# -- authorization ------------------------------------------------------------------------------


async def test_api_key_callers_are_refused_on_command_routes(world: World) -> None:
    svc, _alice, info = await _setup(world)
    await add_user(world.orch, "svc-client", kind="client")
    client = Caller(principal_id="svc-client", kind="client", auth="api_key")
    with pytest.raises(errors.JwtRequired) as caught:
        await svc.execute(client, info["command_id"], ORDER)
    assert caught.value.message == "Command routes require JWT authentication"


async def test_every_principal_failure_is_the_same_403(world: World) -> None:
    svc, _alice, info = await _setup(world)
    await add_user(world.orch, "eve", tenant="other-tenant")
    await add_user(world.orch, "dave", verified=False)
    await add_user(world.orch, "carol")
    async with world.orch.store.transaction() as work:
        await principals.set_flags(work, "carol", disabled=True)
    envelopes = []
    for pid in ("nobody", "eve", "dave", "carol"):
        with pytest.raises(errors.PrincipalNotAuthorized) as caught:
            await svc.execute(
                Caller(principal_id=pid, kind="user", auth="jwt"), info["command_id"], ORDER
            )
        envelopes.append(caught.value.envelope())
    assert all(e == envelopes[0] for e in envelopes)
    assert envelopes[0]["message"] == "Command principal is not authorized"


async def test_room_scoped_commands_need_a_current_member(world: World) -> None:
    svc = world.orch.commands
    alice = await add_user(world.orch, "alice")
    async with world.orch.store.transaction() as work:
        await principals.join_room(work, "room-1", "alice")
    info = await svc.create(alice, order_command(), scope_kind="room", scope_id="room-1")
    assert (await svc.execute(alice, info["command_id"], ORDER)).status_code == 200
    async with world.orch.store.transaction() as work:
        await principals.leave_room(work, "room-1", "alice")
    with pytest.raises(errors.PrincipalNotAuthorized):
        await svc.execute(alice, info["command_id"], {**ORDER, "order_id": "43"})


async def test_no_definer_rights_the_invoker_needs_every_grant(world: World) -> None:
    svc, _alice, info = await _setup(world)
    # Bob may reserve but not charge: the author's rights do not lend him the charge.
    bob = await add_user(
        world.orch,
        "bob",
        permissions=("execute",),
        actions=(("inventory", "reserve"), ("email", "send")),
    )
    before = await _counts(world)
    with pytest.raises(errors.PrincipalNotAuthorized):
        await svc.execute(bob, info["command_id"], ORDER)
    assert await _counts(world) == before
    assert (await world.shop.counts())["inventory.reserve"] == 0


async def test_amount_caps_of_a_grant_are_enforced(world: World) -> None:
    svc, _alice, info = await _setup(world)
    capped = await add_user(world.orch, "capped", permissions=("execute", "read"), max_amount=1000)
    with pytest.raises(errors.PrincipalNotAuthorized):
        await svc.execute(capped, info["command_id"], ORDER)  # 1200 > 1000
    ok = await svc.execute(capped, info["command_id"], {**ORDER, "amount": 1000})
    assert ok.status_code == 200


async def test_a_grant_revoked_mid_saga_stops_the_next_effect(world: World) -> None:
    # The charge payload depends on the reserve's result: checked again before the effect.
    command = order_command()
    command["steps"][1]["payload"]["order"] = {"$ref": "steps.reserve.remote_id"}
    svc, alice, info = await _setup(world, steps=command["steps"])
    original = world.orch.registry.get("inventory")

    class Revoking:
        name = "inventory"

        def __getattr__(self, item: str) -> Any:
            return getattr(original, item)

        async def apply(self, action: str, **kw: Any) -> Any:
            answer = await original.apply(action, **kw)
            if action == "reserve":
                async with world.orch.store.transaction() as work:
                    await principals.revoke(work, "alice", "payments", "charge", "execute")
            return answer

    world.orch.register_provider(Revoking())  # type: ignore[arg-type]
    with pytest.raises(errors.OutcomeError) as caught:
        await svc.execute(alice, info["command_id"], ORDER)
    assert caught.value.code == "principal_not_authorized"
    counts = await world.shop.counts()
    assert counts["payments.charge"] == 0 and counts["inventory.release"] == 1


async def test_a_result_field_the_caller_cannot_read_is_403(world: World) -> None:
    svc, _alice, info = await _setup(
        world, result={"amount": {"$ref": "steps.charge.result.amount"}}
    )
    reader = await add_user(world.orch, "reader", permissions=("execute",))
    async with world.orch.store.transaction() as work:
        await principals.grant(
            work,
            principal_id="reader",
            provider="payments",
            action="charge",
            permission="execute",
            readable_fields=["charge_id"],
        )
    with pytest.raises(errors.FieldNotReadable):
        await svc.execute(reader, info["command_id"], ORDER)
    assert (await world.shop.counts())["payments.charge"] == 0


# -- drift and authority ------------------------------------------------------------------------


async def test_v1_and_v2_differ_on_the_same_unrelated_edit(world: World) -> None:
    svc = world.orch.commands
    alice = await add_user(world.orch, "alice")
    v1 = await svc.create(alice, order_command(version=1))
    v2 = await svc.create(alice, order_command(version=2, name="order2"))
    async with world.orch.store.transaction() as work:
        # An approval-settings edit on a referenced action: part of the v2 contract only.
        await action_settings.put(
            work, "payments", "charge", requires_approval=False, approval_policy={"note": "x"}
        )
    assert (await svc.execute(alice, v1["command_id"], ORDER)).status_code == 200
    with pytest.raises(errors.SchemaDependencyChanged) as caught:
        await svc.execute(alice, v2["command_id"], {**ORDER, "order_id": "43"})
    assert caught.value.http_status == 409 and not caught.value.retryable


async def test_a_locked_action_is_refused_before_any_write(world: World) -> None:
    svc, alice, info = await _setup(world)
    async with world.orch.store.transaction() as work:
        await action_settings.lock(work, "payments", "charge", "reindex")
    before = await _counts(world)
    with pytest.raises(errors.ActionLocked) as caught:
        await svc.execute(alice, info["command_id"], ORDER)
    assert caught.value.http_status == 400
    assert caught.value.message == "Action is currently locked for operation: reindex"
    assert await _counts(world) == before


async def test_a_command_edited_between_validation_and_apply_aborts(world: World) -> None:
    svc, alice, info = await _setup(world)

    async def edit() -> None:
        await svc.update(alice, info["command_id"], order_command(description="edited"))

    svc.between_validation_and_apply = edit
    before = await _counts(world)
    with pytest.raises(errors.SourceAuthorityChanged):
        await svc.execute(alice, info["command_id"], ORDER, idempotency_key="sa")
    svc.between_validation_and_apply = None
    after = await _counts(world)
    assert after["executions"] == before["executions"]
    assert after["transactions"] == before["transactions"]
    assert (await world.shop.counts())["inventory.reserve"] == 0


async def test_a_deleted_command_is_not_found(world: World) -> None:
    svc, alice, info = await _setup(world)
    await svc.delete(alice, info["command_id"])
    with pytest.raises(errors.CommandNotFound):
        await svc.execute(alice, info["command_id"], ORDER)


# -- rules, caps, asserts, cardinality, budgets ------------------------------------------------


async def test_a_failed_rule_leaves_a_failed_record_and_nothing_else(world: World) -> None:
    rule = {
        "name": "big_enough",
        "when": {"$gte": [{"$ref": "inputs.amount"}, 100]},
        "message": "Orders start at 1 EUR.",
    }
    svc, alice, info = await _setup(world, rules=[rule])
    with pytest.raises(errors.RuleFailed) as caught:
        await svc.execute(alice, info["command_id"], {**ORDER, "amount": 5})
    assert caught.value.http_status == 400
    listed = await svc.executions(alice, info["command_id"])
    assert listed[0]["status"] == "failed" and listed[0]["error_code"] == "command_rule_failed"
    assert "tx_id" not in listed[0]
    assert (await world.shop.counts())["inventory.reserve"] == 0


async def test_a_cap_is_enforced_before_any_effect(world: World) -> None:
    cap = {"name": "amount_cap", "value": {"$ref": "inputs.amount"}, "max": 1000}
    svc, alice, info = await _setup(world, caps=[cap])
    with pytest.raises(errors.CapExceeded) as caught:
        await svc.execute(alice, info["command_id"], ORDER)
    assert caught.value.details == {"cap": "amount_cap", "limit": 1000, "actual": 1200}
    assert (await world.shop.counts())["inventory.reserve"] == 0
    assert (
        await svc.execute(alice, info["command_id"], {**ORDER, "amount": 1000})
    ).status_code == 200


async def test_an_assert_before_the_first_effect_records_the_authors_message(
    world: World,
) -> None:
    command = order_command()
    guard = {
        "kind": "assert",
        "name": "has_lines",
        "expr": {"$gt": [{"$ref": "inputs.amount"}, 5000]},
        "message": "That order   has no\nlines to ship.",
    }
    svc, alice, info = await _setup(world, steps=[guard, *command["steps"]])
    with pytest.raises(errors.AssertionFailed) as caught:
        await svc.execute(alice, info["command_id"], ORDER)
    assert caught.value.message == "That order has no lines to ship."
    record = (await svc.executions(alice, info["command_id"]))[0]
    assert record["error"] == "That order has no lines to ship."
    assert (await world.shop.counts())["inventory.reserve"] == 0


async def test_query_steps_feed_cardinality_and_templates(world: World) -> None:
    command = order_command()
    stock = {
        "kind": "query",
        "name": "stock",
        "provider": "inventory",
        "action": "stock",
        "payload": {"sku": {"$ref": "inputs.sku"}},
        "cardinality": {"min": 1, "max": 1},
    }
    svc, alice, info = await _setup(
        world,
        actions=(*ORDER_ACTIONS, ("inventory", "stock")),
        steps=[stock, *command["steps"]],
        result={"available": {"$ref": "queries.stock.result.available"}},
    )
    ok = await svc.execute(alice, info["command_id"], ORDER)
    assert ok.status_code == 200 and isinstance(ok.body["result"]["available"], int)
    with pytest.raises(errors.CardinalityFailed) as caught:
        await svc.execute(
            alice, info["command_id"], {**ORDER, "sku": "no-such-sku", "order_id": "9"}
        )
    assert caught.value.details["actual"] == 0


@pytest.mark.parametrize(
    ("limit_field", "code"),
    [("max_mutations", "mutation"), ("max_relations", "relation")],
)
async def test_runtime_budgets_at_limit_and_limit_plus_one(
    world: World, limit_field: str, code: str
) -> None:
    svc, alice, info = await _setup(world)
    # The order command: 2 effects + 1 outbox event = 3 mutations; 3 providers touched.
    svc.limits = CommandLimits(**{limit_field: 3})
    assert (await svc.execute(alice, info["command_id"], ORDER)).status_code == 200
    svc.limits = CommandLimits(**{limit_field: 2})
    with pytest.raises(errors.LimitExceeded) as caught:
        await svc.execute(alice, info["command_id"], {**ORDER, "order_id": "43"})
    assert caught.value.code == f"{code}_limit_exceeded"
    assert caught.value.details == {"resource": code, "limit": 2, "actual": 3}


# -- query mode and audit visibility ------------------------------------------------------------


async def test_query_mode_reads_and_writes_no_audit_row(world: World) -> None:
    svc = world.orch.commands
    alice = await add_user(
        world.orch, "alice", actions=(("inventory", "stock"),), permissions=("manage", "read")
    )
    info = await svc.create(
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
            "result": {"available": {"$ref": "queries.stock.result.available"}},
        },
    )
    before = await _counts(world)
    answer = await svc.query(alice, info["command_id"], {"sku": "sku-1"})
    assert isinstance(answer["result"]["available"], int)
    assert await _counts(world) == before
    with pytest.raises(errors.CommandModeMismatch):
        await svc.execute(alice, info["command_id"], {"sku": "sku-1"})


async def test_a_manager_in_scope_sees_others_executions_and_a_bystander_does_not(
    world: World,
) -> None:
    svc, alice, info = await _setup(world)
    outcome = await svc.execute(alice, info["command_id"], ORDER)
    manager = await add_user(world.orch, "manager", permissions=("manage",))
    bystander = await add_user(world.orch, "bystander", permissions=("execute",))
    seen = await svc.execution(manager, info["command_id"], str(outcome.execution_id))
    assert seen["execution_id"] == outcome.execution_id
    with pytest.raises(errors.ExecutionNotFound):
        await svc.execution(bystander, info["command_id"], str(outcome.execution_id))
    assert await svc.executions(bystander, info["command_id"]) == []


async def test_executions_page_newest_first_within_bounds(world: World) -> None:
    svc, alice, info = await _setup(world)
    ids = [
        (await svc.execute(alice, info["command_id"], {**ORDER, "order_id": str(i)})).execution_id
        for i in range(3)
    ]
    page = await svc.executions(alice, info["command_id"], skip=1, limit=1)
    assert [e["execution_id"] for e in page] == [ids[1]]
    for skip, limit in ((-1, 50), (0, 0), (0, 201)):
        with pytest.raises(errors.RequestInvalid):
            await svc.executions(alice, info["command_id"], skip=skip, limit=limit)


async def test_lifecycle_callbacks_are_queued_with_the_outcome(world: World) -> None:
    hooks = [{"url": "https://hooks.example.com/a", "events": ["succeeded", "failed"]}]
    svc, alice, info = await _setup(world, callbacks=hooks)
    ok = await svc.execute(alice, info["command_id"], ORDER)
    world.shop.faults.add(FaultRule(FaultKind.REJECT, provider="payments", action="charge"))
    with pytest.raises(errors.OutcomeError) as caught:
        await svc.execute(alice, info["command_id"], {**ORDER, "order_id": "43"})
    succeeded = await svc.pending_callbacks(str(ok.execution_id))
    failed = await svc.pending_callbacks(str(caught.value.execution_id))
    assert [(r.event, r.target, r.state) for r in succeeded] == [
        ("succeeded", "https://hooks.example.com/a", "pending")
    ]
    assert [(r.event, r.state) for r in failed] == [("failed", "pending")]
    assert failed[0].payload["execution_id"] == caught.value.execution_id


async def test_unstorable_text_is_refused_as_invalid_input_on_both_backends(world: World) -> None:
    svc, alice, info = await _setup(world)
    for bad in ("a\x00b", "\ud800"):
        with pytest.raises(errors.InputInvalid):
            await svc.execute(alice, info["command_id"], {**ORDER, "order_id": bad})
    assert (await world.shop.counts())["inventory.reserve"] == 0


async def test_company_scope_is_this_tenant(world: World) -> None:
    svc = world.orch.commands
    alice = await add_user(world.orch, "alice")
    with pytest.raises(errors.RequestInvalid):
        await svc.create(alice, order_command(), scope_kind="company", scope_id="another-tenant")


async def test_storage_failures_on_reads_are_registered_errors(world: World) -> None:
    svc, alice, info = await _setup(world)
    await world.orch.store.close()  # its connections closed, then a broken engine in place
    url = world.urls.store
    broken = url.replace("agent.db", "missing/dir/agent.db") if "sqlite" in url else url + "_nope"
    from sqlalchemy.ext.asyncio import create_async_engine

    world.orch.store.engine = create_async_engine(broken)
    with pytest.raises(errors.StoreUnavailableError):
        await svc.get(alice, info["command_id"])


STOCK_QUERY = {
    "kind": "query",
    "name": "stock",
    "provider": "inventory",
    "action": "stock",
    "payload": {"sku": {"$ref": "inputs.sku"}},
}


async def _query_command(world: World) -> tuple[CommandService, Caller, dict[str, Any]]:
    return await _setup(
        world,
        actions=(*ORDER_ACTIONS, ("inventory", "stock")),
        steps=[STOCK_QUERY, *order_command()["steps"]],
        result={"available": {"$ref": "queries.stock.result.available"}},
    )


async def test_query_budget_at_limit_and_limit_plus_one(world: World) -> None:
    svc, alice, info = await _query_command(world)
    svc.limits = CommandLimits(max_queries=1)
    assert (await svc.execute(alice, info["command_id"], ORDER)).status_code == 200
    svc.limits = CommandLimits(max_queries=0)
    with pytest.raises(errors.LimitExceeded) as caught:
        await svc.execute(alice, info["command_id"], {**ORDER, "order_id": "43"})
    assert caught.value.code == "query_limit_exceeded"
    assert caught.value.details == {"resource": "query", "limit": 0, "actual": 1}


async def test_output_budget_at_limit_and_limit_plus_one(world: World) -> None:
    svc, alice, info = await _setup(world)  # result: the charge's id (always the same size)
    first = await svc.execute(alice, info["command_id"], ORDER)
    size = len(canonical_json(first.body["result"]))
    tight = await world.engine(max_output_bytes=size)
    tight_svc = tight.commands
    assert (
        await tight_svc.execute(alice, info["command_id"], {**ORDER, "order_id": "a"})
    ).status_code == 200
    tighter = await world.engine(max_output_bytes=size - 1)
    with pytest.raises(errors.OutcomeError) as caught:
        await tighter.commands.execute(alice, info["command_id"], {**ORDER, "order_id": "b"})
    assert caught.value.code == "output_limit_exceeded"
    counts = await world.shop.counts()
    assert counts["payments.refund"] == 1  # turned back before commit, every effect reversed


async def test_a_slow_read_phase_is_504_command_timeout_and_writes_nothing(world: World) -> None:
    svc, alice, info = await _query_command(world)
    world.shop.faults.add(
        FaultRule(FaultKind.TIMEOUT, provider="inventory", action="stock", delay_s=5.0)
    )
    svc.limits = CommandLimits(timeout_seconds=0.2)
    before = await _counts(world)
    with pytest.raises(errors.CommandTimeout) as caught:
        await svc.execute(alice, info["command_id"], ORDER)
    assert caught.value.http_status == 504 and caught.value.details == {"limit": 0.2}
    assert await _counts(world) == before


@pytest.mark.parametrize(
    "point", ["prepare.after_commit", "record.before_commit", "commit.before_commit"]
)
async def test_a_crash_mid_execution_is_finished_by_a_worker_with_its_record(
    world: World, point: str
) -> None:
    from orchestrator.crashpoints import SimulatedCrash

    svc, alice, info = await _setup(world)
    world.orch.crashpoints.arm(point)
    with pytest.raises(SimulatedCrash):
        await svc.execute(alice, info["command_id"], ORDER, idempotency_key="crash")
    await world.orch.abandon()  # the process died: its connections go, its leases expire
    survivor = await world.engine()
    survivor.store.advance_clock(3600)
    await survivor.drain(timeout_seconds=20)
    record = (await survivor.commands.executions(alice, info["command_id"]))[0]
    assert record["status"] == "succeeded", record
    # Exactly one effect per intent, in the provider's own database.
    counts = await world.shop.counts()
    assert counts["payments.charge"] == 1 and counts["inventory.reserve"] == 1
    replay = await survivor.commands.execute(
        alice, info["command_id"], ORDER, idempotency_key="crash"
    )
    assert replay.replayed and replay.body["status"] == "succeeded"
