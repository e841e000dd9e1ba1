"""The commands REST API end to end through HTTP, on SQLite and PostgreSQL.

The service's own semantics are pinned in ``tests/integration/test_commands.py``; what is pinned
here is what HTTP adds or could lose on the way: status codes and headers
(``Idempotent-Replayed``, ``X-Execution-Id``), the exact seed-000 bodies (the bare
``command_contract_mismatch``, the uniform 403s), credentials (JWT vs API key, ``alg: none``,
expired tokens), request validation that never echoes a value, and closed bodies for routes that
do not exist or fail unexpectedly.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any

import jwt
import pytest
from sqlalchemy import select

from ledger import action_settings
from ledger.errors import StoreUnavailable, ValueNotStorable
from ledger.schema import NAME_LENGTH, operations, outbox
from orchestrator.commands import MAX_SKIP
from orchestrator.errors import REGISTRY, envelope
from providers.fake.faults import FaultKind, FaultRule
from tests.api.conftest import SECRET, Api, bearer, order_inputs, token
from tests.support.commands import order_command

DENIED = {"detail": envelope("principal_not_authorized", phase="execute")}
DENIED_AUTHOR = {"detail": envelope("principal_not_authorized", phase="author")}
MISMATCH = {"detail": {"error": "command_contract_mismatch"}}


def _error(body: Any) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) == {"detail"}, body
    detail: dict[str, Any] = body["detail"]
    return detail


# -- authoring ----------------------------------------------------------------------------------


async def test_authoring_create_get_list_update_delete(api: Api) -> None:
    await api.add_user("alice")
    created = await api.create("alice")
    command_id = created["command_id"]
    assert created["scope"] == {"kind": "company", "id": "default"}
    assert len(created["digest"]) == 64 and created["digest"] == created["digest"].lower()
    assert created["definition"]["dependency_contract"]  # the server-built part is stored

    got = await api.client.get(f"/v1/commands/{command_id}", headers=bearer("alice"))
    assert got.status_code == 200 and got.json() == created
    listed = await api.client.get("/v1/commands", headers=bearer("alice"))
    assert listed.status_code == 200
    assert [c["command_id"] for c in listed.json()] == [command_id]

    changed = order_command(name="order_v2")
    updated = await api.client.put(
        f"/v1/commands/{command_id}",
        json={"definition": changed, "expected_digest": created["digest"]},
        headers=bearer("alice"),
    )
    assert updated.status_code == 200, updated.text
    assert updated.json()["name"] == "order_v2"
    assert updated.json()["digest"] != created["digest"]

    stale = await api.client.put(
        f"/v1/commands/{command_id}",
        json={"definition": order_command(name="order_v3"), "expected_digest": created["digest"]},
        headers=bearer("alice"),
    )
    assert stale.status_code == 409
    assert _error(stale.json())["error"] == "source_authority_changed"
    assert _error(stale.json())["phase"] == "author"

    deleted = await api.client.delete(f"/v1/commands/{command_id}", headers=bearer("alice"))
    assert deleted.status_code == 204 and deleted.content == b""
    gone = await api.client.get(f"/v1/commands/{command_id}", headers=bearer("alice"))
    assert gone.status_code == 404
    assert gone.json() == {"detail": envelope("command_not_found", phase="author")}
    listed = await api.client.get("/v1/commands", headers=bearer("alice"))
    assert listed.json() == []


async def test_put_keeps_an_absent_tag_and_clears_a_null_one(api: Api) -> None:
    await api.add_user("alice")
    command_id = (await api.create("alice", tag_id="t-1"))["command_id"]
    url = f"/v1/commands/{command_id}"

    async def put(**body: Any) -> dict[str, Any]:
        response = await api.client.put(
            url, json={"definition": order_command(), **body}, headers=bearer("alice")
        )
        assert response.status_code == 200, response.text
        view: dict[str, Any] = response.json()
        return view

    assert (await put())["tag_id"] == "t-1"  # absent: kept
    assert (await put(tag_id="t-2"))["tag_id"] == "t-2"
    cleared = await put(tag_id=None)  # explicit null: cleared (null keys are left out)
    assert "tag_id" not in cleared
    got = await api.client.get(url, headers=bearer("alice"))
    assert got.json() == cleared
    assert "tag_id" not in await put()  # absent again: stays cleared


async def test_authoring_needs_manage_on_every_action(api: Api) -> None:
    await api.add_user("runner", permissions=("execute",))
    response = await api.client.post(
        "/v1/commands", json={"definition": order_command()}, headers=bearer("runner")
    )
    assert response.status_code == 403
    assert response.json() == DENIED_AUTHOR


async def test_an_invalid_definition_is_a_400_envelope_in_the_author_phase(api: Api) -> None:
    await api.add_user("alice")
    response = await api.client.post(
        "/v1/commands",
        json={"definition": {"name": "x", "steps": "not a list"}},
        headers=bearer("alice"),
    )
    assert response.status_code == 400, response.text
    detail = _error(response.json())
    assert detail["phase"] == "author"
    assert REGISTRY[detail["error"]].http_status == 400


def _with_names(*, step: str = "charge", event: str = "receipt") -> dict[str, Any]:
    """The order command with its charge step and its outbox event renamed."""
    command = order_command()
    command["steps"][1]["name"] = step
    command["outbox"][0]["name"] = event
    command["outbox"][0]["payload"]["charge"] = {"$ref": f"steps.{step}.remote_id"}
    command["result"] = {"charge": {"$ref": f"steps.{step}.remote_id"}}
    return command


@pytest.mark.parametrize(
    ("names", "pointer"),
    [
        ({"event": "o" * (NAME_LENGTH + 1)}, "/outbox/0/name"),
        ({"step": "c" * (NAME_LENGTH + 1)}, "/steps/1/name"),
    ],
)
async def test_a_name_wider_than_its_column_is_refused_at_authoring(
    api: Api, names: dict[str, str], pointer: str
) -> None:
    """A step or outbox name is first written when an execution starts; PostgreSQL refused one
    wider than its column then (a 500 after the charge was sent, retried for ever), so authoring
    refuses it, on both backends alike."""
    await api.add_user("alice")
    before = await api.counts()
    response = await api.client.post(
        "/v1/commands", json={"definition": _with_names(**names)}, headers=bearer("alice")
    )
    assert response.status_code == 400, response.text
    detail = _error(response.json())
    assert detail["error"] == "saga_definition_invalid"
    assert detail["path"] == pointer
    assert f"at most {NAME_LENGTH} characters" in detail["details"]["reason"]
    assert await api.counts() == before


async def test_names_as_wide_as_their_columns_execute_on_both_backends(api: Api) -> None:
    await api.add_user("alice")
    names = {"step": "c" * NAME_LENGTH, "event": "o" * NAME_LENGTH}
    command = await api.create("alice", _with_names(**names))
    response = await api.execute("alice", command["command_id"])
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "succeeded"
    assert (await api.shop.counts())["payments.charge"] == 1
    async with api.orch.store.read() as conn:
        steps = (await conn.execute(select(operations.c.step))).scalars().all()
        kinds = (await conn.execute(select(outbox.c.kind))).scalars().all()
    assert sorted(steps) == sorted(["reserve", names["step"]]) and kinds == [names["event"]]


def _weighed_order() -> dict[str, Any]:
    """The order command with a number input and a cap whose bound JSONB would rewrite."""
    command = order_command(name="weighed")
    command["inputs"]["weight"] = {"type": "number"}
    command["caps"] = [{"name": "big", "value": {"$ref": "inputs.amount"}, "max": 1e20}]
    return command


async def test_a_big_float_in_a_definition_keeps_the_digest_recipe_on_both_backends(
    api: Api,
) -> None:
    """PostgreSQL's JSONB gives ``1e20`` back as ``100000000000000000000``: the definition is
    stored in that form on both backends, so sha256 of the GET definition is its digest, and
    that digest is accepted as ``expected_contract_digest``."""
    await api.add_user("alice")
    created = await api.create("alice", _weighed_order())
    got = await api.client.get(f"/v1/commands/{created['command_id']}", headers=bearer("alice"))
    definition = got.json()["definition"]
    assert definition["caps"][0]["max"] == 10**20 and type(definition["caps"][0]["max"]) is int
    recipe = json.dumps(definition, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    digest = hashlib.sha256(recipe.encode()).hexdigest()
    assert digest == got.json()["digest"] == created["digest"]
    response = await api.execute(
        "alice",
        created["command_id"],
        {**order_inputs(), "weight": 1},
        expected_contract_digest=digest,
    )
    assert response.status_code == 200, response.text


async def test_a_replay_with_a_big_float_input_is_the_same_request_on_both_backends(
    api: Api,
) -> None:
    """The stored input snapshot comes back from JSONB with ``1e16`` as an integer; the replay
    of the identical request still matches it, and nothing is sent twice."""
    await api.add_user("alice")
    command_id = (await api.create("alice", _weighed_order()))["command_id"]
    inputs = {**order_inputs(), "weight": 1e16}
    first = await api.execute("alice", command_id, inputs, idempotency_key="k-1e16")
    assert first.status_code == 200, first.text
    replay = await api.execute("alice", command_id, inputs, idempotency_key="k-1e16")
    assert replay.status_code == 200, replay.text
    assert replay.headers.get("idempotent-replayed") == "true"
    assert replay.json() == first.json()
    assert (await api.shop.counts())["payments.charge"] == 1
    other = await api.execute(
        "alice", command_id, {**inputs, "weight": 2e16}, idempotency_key="k-1e16"
    )
    assert other.status_code == 409
    assert _error(other.json())["error"] == "idempotency_payload_mismatch"


# -- execute ------------------------------------------------------------------------------------


async def test_execute_succeeds_with_the_execution_id_header(api: Api) -> None:
    await api.add_user("alice")
    command = await api.create("alice")
    response = await api.execute("alice", command["command_id"], idempotency_key="k-1")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "succeeded" and body["invoker_id"] == "alice"
    assert body["idempotency_key"] == "k-1"
    assert response.headers["X-Execution-Id"] == body["execution_id"]
    assert "Idempotent-Replayed" not in response.headers
    assert (await api.shop.counts())["payments.charge"] == 1


async def test_digest_mismatch_is_exactly_the_seed_body_and_writes_nothing(api: Api) -> None:
    await api.add_user("alice")
    command = await api.create("alice")
    before = await api.counts()
    stale = "0" * 64 if command["digest"] != "0" * 64 else "1" * 64
    response = await api.execute(
        "alice",
        command["command_id"],
        # Inputs that would not even validate: the digest is compared first.
        {"order_id": 7},
        idempotency_key="pinned",
        expected_contract_digest=stale,
    )
    assert response.status_code == 409
    assert response.json() == MISMATCH
    assert "X-Execution-Id" not in response.headers
    assert await api.counts() == before

    pinned = await api.execute(
        "alice",
        command["command_id"],
        idempotency_key="pinned",
        expected_contract_digest=command["digest"],
    )
    assert pinned.status_code == 200, pinned.text


@pytest.mark.parametrize(
    "digest", ["A" * 64, "a" * 63, "a" * 65, "g" * 64, "", " " + "a" * 63], ids=repr
)
async def test_a_malformed_digest_is_400_and_writes_nothing(api: Api, digest: str) -> None:
    await api.add_user("alice")
    command = await api.create("alice")
    before = await api.counts()
    response = await api.execute("alice", command["command_id"], expected_contract_digest=digest)
    assert response.status_code == 400
    assert _error(response.json())["error"] == "contract_digest_invalid"
    assert await api.counts() == before


async def test_same_key_from_two_users_gives_two_executions(api: Api) -> None:
    await api.add_user("alice")
    # bob may run the command but manages nothing, so alice's records stay hidden from him.
    await api.add_user("bob", permissions=("execute",))
    command_id = (await api.create("alice"))["command_id"]
    first = await api.execute("alice", command_id, order_inputs("a"), idempotency_key="same")
    second = await api.execute("bob", command_id, order_inputs("b"), idempotency_key="same")
    assert first.status_code == second.status_code == 200
    a, b = first.json(), second.json()
    assert a["execution_id"] != b["execution_id"]
    assert (a["invoker_id"], b["invoker_id"]) == ("alice", "bob")
    assert (await api.shop.counts())["payments.charge"] == 2

    # Each replays its own response, never the other's.
    again_a = await api.execute("alice", command_id, order_inputs("a"), idempotency_key="same")
    again_b = await api.execute("bob", command_id, order_inputs("b"), idempotency_key="same")
    assert again_a.json() == a and again_b.json() == b
    hidden = await api.client.get(
        f"/v1/commands/{command_id}/executions/{a['execution_id']}", headers=bearer("bob")
    )
    assert hidden.status_code == 404
    assert hidden.json() == {"detail": envelope("command_execution_not_found")}
    assert hidden.json()["detail"]["message"] == "Command execution not found."
    mine = await api.client.get(
        f"/v1/commands/{command_id}/executions/{b['execution_id']}", headers=bearer("bob")
    )
    assert mine.status_code == 200 and mine.json()["execution_id"] == b["execution_id"]


async def test_a_replay_answers_the_same_body_with_the_replay_header(api: Api) -> None:
    await api.add_user("alice")
    command_id = (await api.create("alice"))["command_id"]
    first = await api.execute("alice", command_id, idempotency_key="r")
    replay = await api.execute("alice", command_id, idempotency_key="r")
    assert first.status_code == replay.status_code == 200
    assert replay.json() == first.json()
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.headers["X-Execution-Id"] == first.json()["execution_id"]
    assert (await api.shop.counts())["payments.charge"] == 1

    other = await api.execute("alice", command_id, order_inputs("other"), idempotency_key="r")
    assert other.status_code == 409
    assert _error(other.json())["error"] == "idempotency_payload_mismatch"


async def test_a_rejected_effect_fails_and_the_same_key_then_succeeds(api: Api) -> None:
    await api.add_user("alice")
    command_id = (await api.create("alice"))["command_id"]
    api.shop.faults.add(FaultRule(FaultKind.REJECT, provider="payments", action="charge"))
    failed = await api.execute("alice", command_id, idempotency_key="retry-me")
    detail = _error(failed.json())
    assert detail["error"] == "provider_rejected"
    assert failed.status_code == REGISTRY["provider_rejected"].http_status
    assert detail["phase"] == "execute" and detail["retryable"] is False
    assert "injected" not in failed.text  # the provider's reason never reaches the caller
    execution_id = failed.headers["X-Execution-Id"]
    record = await api.client.get(
        f"/v1/commands/{command_id}/executions/{execution_id}", headers=bearer("alice")
    )
    assert record.status_code == 200
    assert record.json()["status"] == "failed"
    assert record.json()["error_code"] == "provider_rejected"
    assert (await api.shop.counts())["inventory.release"] == 1  # the reserve was reversed

    retry = await api.execute("alice", command_id, idempotency_key="retry-me")
    assert retry.status_code == 200, retry.text
    assert "Idempotent-Replayed" not in retry.headers
    assert retry.json()["execution_id"] != execution_id


async def test_a_failed_rule_names_its_audit_record_in_the_header(api: Api) -> None:
    await api.add_user("alice")
    rule = {"name": "min", "when": {"$gte": [{"$ref": "inputs.amount"}, 100]}, "message": "Min."}
    command_id = (await api.create("alice", order_command(rules=[rule])))["command_id"]
    refused = await api.execute("alice", command_id, order_inputs(amount=5))
    assert refused.status_code == 400
    assert _error(refused.json())["error"] == "command_rule_failed"
    record = await api.client.get(
        f"/v1/commands/{command_id}/executions/{refused.headers['X-Execution-Id']}",
        headers=bearer("alice"),
    )
    assert record.json()["status"] == "failed"
    assert (await api.shop.counts())["inventory.reserve"] == 0


# -- credentials --------------------------------------------------------------------------------


async def test_api_keys_are_refused_on_command_routes(api: Api) -> None:
    await api.add_user("alice")
    await api.add_user("svc", api_key="atk_test-key")
    command_id = (await api.create("alice"))["command_id"]
    key = {"X-API-Key": "atk_test-key"}
    calls = [
        api.client.get("/v1/commands", headers=key),
        api.client.get(f"/v1/commands/{command_id}", headers=key),
        api.client.post(
            f"/v1/commands/{command_id}/execute", json={"inputs": order_inputs()}, headers=key
        ),
        api.client.get(f"/v1/commands/{command_id}/executions", headers=key),
    ]
    for call in calls:
        response = await call
        assert response.status_code == 403
        detail = _error(response.json())
        assert detail["error"] == "jwt_required"
        assert detail["message"] == "Command routes require JWT authentication"
    # An unknown key is the uniform refusal, not "jwt_required": no key probing.
    unknown = await api.client.get("/v1/commands", headers={"X-API-Key": "atk_nope"})
    assert unknown.status_code == 403 and unknown.json() == DENIED_AUTHOR


async def test_every_principal_failure_is_the_same_403(api: Api) -> None:
    await api.add_user("alice", rooms=["room-1"])
    await api.add_user("disabled", disabled=True)
    await api.add_user("unverified", verified=False)
    await api.add_user("outsider")  # every grant, but not a member of room-1
    command_id = (await api.create("alice", scope={"kind": "room", "id": "room-1"}))["command_id"]
    ok = await api.execute("alice", command_id)
    assert ok.status_code == 200, ok.text
    bodies = []
    for who in ("nobody", "disabled", "unverified", "outsider"):
        response = await api.execute(who, command_id)
        assert response.status_code == 403, (who, response.text)
        bodies.append(response.json())
    assert bodies == [DENIED] * 4
    assert DENIED["detail"]["message"] == "Command principal is not authorized"


def _unsigned(principal_id: str) -> str:
    return jwt.encode({"sub": principal_id, "exp": int(time.time()) + 300}, "", algorithm="none")


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(lambda: f"Bearer {_unsigned('alice')}", id="alg-none"),
        pytest.param(lambda: f"Bearer {token('alice', exp=int(time.time()) - 60)}", id="expired"),
        pytest.param(lambda: f"Bearer {token('alice', secret='x' * 40)}", id="other-secret"),
        pytest.param(lambda: f"Bearer {token('alice', tenant='other')}", id="other-tenant"),
        pytest.param(lambda: "Bearer not-a-jwt", id="garbage"),
        pytest.param(lambda: "Basic YWxpY2U6eA==", id="basic"),
        pytest.param(lambda: None, id="none"),
    ],
)
async def test_bad_credentials_are_the_uniform_403(api: Api, header: Any) -> None:
    await api.add_user("alice")
    command_id = (await api.create("alice"))["command_id"]
    value = header()
    headers = {"Authorization": value} if value is not None else {}
    before = await api.counts()
    response = await api.client.post(
        f"/v1/commands/{command_id}/execute", json={"inputs": order_inputs()}, headers=headers
    )
    assert response.status_code == 403
    assert response.json() == DENIED
    assert await api.counts() == before


# -- audit reads --------------------------------------------------------------------------------


async def test_executions_are_listed_newest_first_and_paged(api: Api) -> None:
    await api.add_user("alice")
    command_id = (await api.create("alice"))["command_id"]
    ids = []
    for n in range(3):
        response = await api.execute("alice", command_id, order_inputs(f"o-{n}"))
        assert response.status_code == 200, response.text
        ids.append(response.json()["execution_id"])
    url = f"/v1/commands/{command_id}/executions"
    everything = await api.client.get(url, headers=bearer("alice"))
    assert [e["execution_id"] for e in everything.json()] == ids[::-1]
    page = await api.client.get(url, params={"skip": 1, "limit": 1}, headers=bearer("alice"))
    assert [e["execution_id"] for e in page.json()] == [ids[1]]
    edge = await api.client.get(url, params={"skip": 0, "limit": 200}, headers=bearer("alice"))
    assert edge.status_code == 200 and len(edge.json()) == 3
    last = await api.client.get(url, params={"skip": MAX_SKIP}, headers=bearer("alice"))
    assert last.status_code == 200 and last.json() == []
    for params, field in (
        ({"limit": 0}, "query.limit"),
        ({"limit": 201}, "query.limit"),
        ({"skip": -1}, "query.skip"),
        ({"skip": MAX_SKIP + 1}, "query.skip"),
        ({"skip": 2**63}, "query.skip"),  # past int64: was a 500 from the database driver
        ({"limit": "ten"}, "query.limit"),
    ):
        refused = await api.client.get(url, params=params, headers=bearer("alice"))
        assert refused.status_code == 422, params
        detail = _error(refused.json())
        assert detail["error"] == "request_invalid"
        assert [e["field"] for e in detail["details"]["errors"]] == [field]


async def test_commands_are_listed_newest_first_and_paged(api: Api) -> None:
    await api.add_user("alice")
    ids = [
        (await api.create("alice", order_command(name=f"o_{n}")))["command_id"] for n in range(3)
    ]
    everything = await api.client.get("/v1/commands", headers=bearer("alice"))
    newest_first = [c["command_id"] for c in everything.json()]
    assert sorted(newest_first) == sorted(ids) and len(newest_first) == 3
    for skip, limit in ((0, 1), (1, 1), (2, 1), (2, 5), (3, 1), (0, 200), (201, 200)):
        page = await api.client.get(
            "/v1/commands", params={"skip": skip, "limit": limit}, headers=bearer("alice")
        )
        assert page.status_code == 200
        assert page.json() == everything.json()[skip : skip + limit], (skip, limit)
    last = await api.client.get("/v1/commands", params={"skip": MAX_SKIP}, headers=bearer("alice"))
    assert last.status_code == 200 and last.json() == []
    for params in ({"limit": 0}, {"limit": 201}, {"skip": -1}, {"skip": 2**63}):
        refused = await api.client.get("/v1/commands", params=params, headers=bearer("alice"))
        assert refused.status_code == 422, params
        assert _error(refused.json())["error"] == "request_invalid"


async def test_an_unknown_execution_is_404(api: Api) -> None:
    await api.add_user("alice")
    command_id = (await api.create("alice"))["command_id"]
    response = await api.client.get(
        f"/v1/commands/{command_id}/executions/{'f' * 32}", headers=bearer("alice")
    )
    assert response.status_code == 404
    assert response.json() == {"detail": envelope("command_execution_not_found")}


# -- query --------------------------------------------------------------------------------------

STOCK_QUERY = {
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
}


async def test_the_query_route_reads_and_writes_no_execution(api: Api) -> None:
    await api.add_user("alice", actions=[("inventory", "stock")], permissions=("manage", "read"))
    command_id = (await api.create("alice", STOCK_QUERY))["command_id"]
    before = await api.counts()
    url = f"/v1/commands/{command_id}/query"
    response = await api.client.post(
        url, json={"inputs": {"sku": "sku-1"}}, headers=bearer("alice")
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"command_id": command_id, "result": {"available": 100}}
    assert await api.counts() == before

    pinned = await api.client.post(
        url,
        json={"inputs": {"sku": "sku-1"}, "expected_contract_digest": "a" * 64},
        headers=bearer("alice"),
    )
    assert pinned.status_code == 422
    errors = _error(pinned.json())["details"]["errors"]
    assert errors == [{"field": "body.expected_contract_digest", "problem": "extra_forbidden"}]


# -- request validation and closed bodies -------------------------------------------------------


async def test_validation_errors_name_the_field_never_the_value(api: Api) -> None:
    await api.add_user("alice")
    command_id = (await api.create("alice"))["command_id"]
    response = await api.client.post(
        f"/v1/commands/{command_id}/execute",
        json={"inputs": "SECRET-VALUE-1", "surprise": "SECRET-VALUE-2"},
        headers=bearer("alice"),
    )
    assert response.status_code == 422
    assert "SECRET-VALUE" not in response.text
    detail = _error(response.json())
    assert detail == envelope(
        "request_invalid",
        details={
            "errors": [
                {"field": "body.inputs", "problem": "dict_type"},
                {"field": "body.surprise", "problem": "extra_forbidden"},
            ]
        },
    )


async def test_a_body_that_is_not_json_is_422(api: Api) -> None:
    await api.add_user("alice")
    response = await api.client.post(
        "/v1/commands",
        content=b'{"definition": SECRET',
        headers={**bearer("alice"), "Content-Type": "application/json"},
    )
    assert response.status_code == 422
    assert "SECRET" not in response.text
    assert _error(response.json())["details"]["errors"][0]["problem"] == "json_invalid"


@pytest.mark.parametrize(
    "escaped", [r"nul\u0000byte", r"lone\ud800surrogate"], ids=["nul", "surrogate"]
)
async def test_strings_no_database_can_store_are_refused_before_the_service(
    api: Api, escaped: str
) -> None:
    await api.add_user("alice")
    command_id = (await api.create("alice"))["command_id"]
    before = await api.counts()
    raw = '{"inputs": {"order_id": "ESC", "sku": "sku-1", "amount": 5}}'.replace("ESC", escaped)
    response = await api.client.post(
        f"/v1/commands/{command_id}/execute",
        content=raw.encode(),
        headers={**bearer("alice"), "Content-Type": "application/json"},
    )
    assert response.status_code == 422, response.text
    assert _error(response.json())["details"]["errors"] == [
        {"field": "body", "problem": "value_error"}
    ]
    assert await api.counts() == before


@pytest.mark.parametrize("command_id", ["x" * 65, "a b", "a%00b"])
async def test_malformed_ids_in_paths_are_422(api: Api, command_id: str) -> None:
    await api.add_user("alice")
    response = await api.client.get(f"/v1/commands/{command_id}", headers=bearer("alice"))
    assert response.status_code == 422
    assert _error(response.json())["details"]["errors"][0]["field"] == "path.command_id"


async def test_an_oversized_body_is_refused_before_it_is_read(api: Api) -> None:
    await api.add_user("alice")
    response = await api.client.post(
        "/v1/commands",
        content=b" " * (4 * 1_048_576 + 1),
        headers={**bearer("alice"), "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    detail = _error(response.json())
    assert detail["error"] == "input_limit_exceeded"
    assert detail["details"]["resource"] == "request_body"


async def test_unknown_routes_and_methods_have_closed_bodies(api: Api) -> None:
    missing = await api.client.get("/v1/nothing-here")
    assert missing.status_code == 404
    assert _error(missing.json()) == {
        "error": "not_found",
        "phase": "execute",
        "message": "Not found.",
        "retryable": False,
        "details": {},
    }
    wrong = await api.client.patch("/v1/commands")
    assert wrong.status_code == 405
    assert _error(wrong.json())["error"] == "method_not_allowed"
    assert wrong.headers["Allow"] == "GET, POST"


async def test_an_unexpected_error_is_a_closed_500(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    await api.add_user("alice")

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("password=hunter2 at db.internal")

    monkeypatch.setattr(api.orch.commands, "list", broken)
    response = await api.client.get("/v1/commands", headers=bearer("alice"))
    assert response.status_code == 500
    assert response.json() == {"detail": envelope("command_execution_failed", phase="author")}
    assert "hunter2" not in response.text


async def test_a_lost_database_is_a_retryable_503_without_its_text(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    await api.add_user("alice")

    async def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("could not connect to db.internal:5432 as admin")

    monkeypatch.setattr(api.orch.commands, "get", unreachable)
    response = await api.client.get(f"/v1/commands/{'c' * 32}", headers=bearer("alice"))
    assert response.status_code == 503
    assert response.json() == {"detail": envelope("store_unavailable", phase="author")}
    assert response.json()["detail"]["retryable"] is True
    assert "db.internal" not in response.text


async def test_a_value_the_database_refuses_is_a_closed_400(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    await api.add_user("alice")

    async def refused(*args: Any, **kwargs: Any) -> Any:
        raise ValueNotStorable("database refused a value (22001: string too long for its column)")

    monkeypatch.setattr(api.orch.commands, "list", refused)
    response = await api.client.get("/v1/commands", headers=bearer("alice"))
    assert response.status_code == 400
    assert response.json() == {"detail": envelope("value_not_storable", phase="author")}
    assert response.json()["detail"]["retryable"] is False
    assert "22001" not in response.text


async def test_healthz_needs_no_credentials_and_openapi_is_published(api: Api) -> None:
    health = await api.client.get("/healthz")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    spec = (await api.client.get("/openapi.json")).json()
    paths = spec["paths"]
    assert set(paths) >= {
        "/v1/commands",
        "/v1/commands/{command_id}",
        "/v1/commands/{command_id}/execute",
        "/v1/commands/{command_id}/query",
        "/v1/commands/{command_id}/executions",
        "/v1/commands/{command_id}/executions/{execution_id}",
    }
    schemes = spec["components"]["securitySchemes"]
    assert {s["type"] for s in schemes.values()} == {"http", "apiKey"}
    execute = paths["/v1/commands/{command_id}/execute"]["post"]
    assert {"200", "400", "403", "404", "409", "422"} <= set(execute["responses"])
    assert SECRET not in str(spec)


# -- keys held by someone else, replacing and deleting (audit findings) --------------------------

BY_ORDER = {"$concat": ["order:", {"$ref": "inputs.order_id"}]}


async def _order_42_committed(api: Api) -> tuple[str, str]:
    """alice's order command with a business key, order o-1 already charged once."""
    await api.add_user("alice", permissions=("manage", "execute", "read"), rooms=["r1"])
    command_id = (await api.create("alice", order_command(business_key=BY_ORDER)))["command_id"]
    first = await api.execute("alice", command_id, idempotency_key="first")
    assert first.status_code == 200, first.text
    return str(command_id), first.headers["X-Execution-Id"]


def _names_the_first(response: Any, first_execution: str, phase: str) -> None:
    assert response.status_code == 409, response.text
    detail = _error(response.json())
    assert detail["error"] == "business_key_committed" and detail["phase"] == phase
    assert detail["retryable"] is False
    assert detail["details"]["business_key"] == "order:o-1"
    assert detail["details"]["execution_id"] == first_execution
    assert "X-Execution-Id" not in response.headers  # nothing of this call was written


async def test_a_committed_business_key_is_a_final_409_naming_the_first(api: Api) -> None:
    command_id, first = await _order_42_committed(api)
    before = await api.counts()
    again = await api.execute("alice", command_id, idempotency_key="second")
    _names_the_first(again, first, "execute")
    assert await api.counts() == before
    named = await api.client.get(
        f"/v1/commands/{command_id}/executions/{first}", headers=bearer("alice")
    )
    assert named.status_code == 200 and named.json()["status"] == "succeeded"


async def test_prepare_and_gated_execute_never_answer_a_plan_that_did_not_land(api: Api) -> None:
    command_id, first = await _order_42_committed(api)
    before = await api.counts()
    # Before: 200 with a proposal and a confirmation token nothing stood behind.
    prepared = await api.client.post(
        f"/v1/commands/{command_id}/prepare",
        json={"inputs": order_inputs()},
        headers=bearer("alice", room="r1", ai=True),
    )
    _names_the_first(prepared, first, "stage")
    async with api.orch.store.transaction() as work:
        await action_settings.put(
            work, "payments", "charge", requires_approval=True, approval_policy=None
        )
    # Before: 409 approval_required with a staged change and an X-Execution-Id that 404.
    gated = await api.execute("alice", command_id, idempotency_key="gated")
    _names_the_first(gated, first, "execute")
    assert await api.counts() == before


async def test_put_needs_manage_on_the_stored_actions_too(api: Api) -> None:
    await api.add_user("alice")
    await api.add_user("dave", actions=(("inventory", "reserve"), ("inventory", "release")))
    created = await api.create("alice")
    url = f"/v1/commands/{created['command_id']}"
    inventory_only = order_command(outbox=[], result=None)
    inventory_only["steps"] = inventory_only["steps"][:1]
    assert (await api.client.delete(url, headers=bearer("dave"))).status_code == 403
    replaced = await api.client.put(
        url, json={"definition": inventory_only}, headers=bearer("dave")
    )
    assert replaced.status_code == 403  # before: 200, and alice's charge step was gone
    assert replaced.json() == DENIED_AUTHOR
    got = await api.client.get(url, headers=bearer("alice"))
    assert got.json()["digest"] == created["digest"]


async def test_delete_releases_the_commands_staged_changes(api: Api) -> None:
    async with api.orch.store.transaction() as work:
        await action_settings.put(
            work, "payments", "charge", requires_approval=True, approval_policy=None
        )
    await api.add_user("alice", permissions=("manage", "execute", "read"))
    await api.add_user("approver", permissions=("approve", "read"))
    command_id = (await api.create("alice", order_command(business_key=BY_ORDER)))["command_id"]
    staged = await api.execute("alice", command_id, idempotency_key="k")
    assert staged.status_code == 409
    change = _error(staged.json())["details"]["staged_change_id"]
    execution_id = staged.headers["X-Execution-Id"]
    deleted = await api.client.delete(f"/v1/commands/{command_id}", headers=bearer("alice"))
    assert deleted.status_code == 204
    for decision in ("approve", "reject"):  # before: 404 staged_change_not_found
        late = await api.client.post(
            f"/v1/staged-changes/{change}/{decision}", headers=bearer("approver")
        )
        assert late.status_code == 409
        assert late.json() == {"detail": envelope("staged_change_decided", phase="stage")}
    record = await api.client.get(
        f"/v1/commands/{command_id}/executions/{execution_id}", headers=bearer("alice")
    )
    assert record.status_code == 200
    assert (record.json()["status"], record.json()["error_code"]) == ("failed", "staged_released")
    assert (await api.shop.counts())["inventory.reserve"] == 0


async def test_a_key_lost_in_a_race_names_an_execution_that_exists(api: Api) -> None:
    await api.add_user("alice", permissions=("manage", "execute", "read"))
    command_id = (await api.create("alice"))["command_id"]
    both_checked = asyncio.Barrier(2)

    async def after_validation() -> None:
        await both_checked.wait()

    api.orch.commands.between_validation_and_apply = after_validation
    responses = await asyncio.gather(
        *(api.execute("alice", command_id, idempotency_key="same") for _ in range(2))
    )
    api.orch.commands.between_validation_and_apply = None
    assert sorted(r.status_code for r in responses) == [200, 409], [r.text for r in responses]
    won = next(r for r in responses if r.status_code == 200)
    lost = next(r for r in responses if r.status_code == 409)
    detail = _error(lost.json())
    assert detail["error"] == "idempotency_in_progress" and detail["retryable"] is True
    named = detail["details"]["execution_id"]
    assert named == won.json()["execution_id"]  # before: the loser's own, never-written id
    got = await api.client.get(
        f"/v1/commands/{command_id}/executions/{named}", headers=bearer("alice")
    )
    assert got.status_code == 200
    assert (await api.shop.counts())["payments.charge"] == 1
