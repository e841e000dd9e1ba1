"""The agent toolbox, approvals and operator jobs through HTTP, on SQLite and PostgreSQL.

The toolbox's own semantics are pinned in ``tests/integration/test_agent.py`` and
``test_approvals.py``; what is pinned here is the REST face of the person-confirmation protocol:
prepare → the proposal (no token, no digest, no ids) → execute → the closed tool result (always
200, exactly its keys), the replay guard and its release, forged and foreign tokens, an edited
command; approvals (409 with ``staged_change_id``, approve, reject); and the operator routes
(who is an operator, preview / execute / force, prune's exact shape, requeue's bounds). Every
"no second charge" is counted in the fake shop's own database.
"""

from __future__ import annotations

from typing import Any, Final

import httpx
import pytest

from ledger import action_settings
from orchestrator.errors import envelope
from tests.api.conftest import Api, bearer, order_inputs
from tests.support.commands import order_command

ROOM: Final = "room-1"
TOOL_KEYS: Final = {"status", "action", "error", "retryable", "guidance"}
PREPARED_KEYS: Final = {"proposal", "confirmation_token", "action", "expires_at"}
OPERATOR: Final = (("agent-txn", "ops"),)
DENIED_OPS: Final = {"detail": envelope("principal_not_authorized", phase="execute")}


def _agent(principal_id: str) -> dict[str, str]:
    """An agent's credential: bound to the room, marked as AI."""
    return bearer(principal_id, room=ROOM, ai=True)


def _detail(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"detail"}, body
    detail: dict[str, Any] = body["detail"]
    return detail


async def _charges(api: Api) -> int:
    return (await api.shop.counts())["payments.charge"]


async def _setup(api: Api, **changes: Any) -> str:
    """alice (member of the room, every order grant) and her order command."""
    await api.add_user("alice", rooms=[ROOM])
    return str((await api.create("alice", order_command(**changes)))["command_id"])


async def _prepare(
    api: Api, command_id: str, inputs: dict[str, Any] | None = None, *, who: str = "alice"
) -> dict[str, Any]:
    response = await api.client.post(
        f"/v1/commands/{command_id}/prepare",
        json={"inputs": inputs or order_inputs()},
        headers=_agent(who),
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def _tool(api: Api, route: str, token: str, *, who: str = "alice") -> dict[str, Any]:
    """``/v1/agent/{route}``: always 200, exactly the closed tool result."""
    response = await api.client.post(
        f"/v1/agent/{route}", json={"confirmation_token": token}, headers=_agent(who)
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    assert set(result) == TOOL_KEYS, result
    return result


async def _delivered(api: Api, who: str = "alice", **body: str) -> httpx.Response:
    return await api.client.post("/v1/agent/delivered", json=body, headers=_agent(who))


# -- the person-confirmation protocol -----------------------------------------------------------


async def test_prepare_confirm_replay_and_deliver_over_rest(api: Api) -> None:
    command_id = await _setup(api, description="Ship order")
    command = (await api.client.get(f"/v1/commands/{command_id}", headers=bearer("alice"))).json()
    staged = await _prepare(api, command_id)
    assert set(staged) == PREPARED_KEYS and staged["action"] == "order"
    token, proposal = staged["confirmation_token"], staged["proposal"]
    assert len(token) == 32 and "Ship order" in proposal and "1200" in proposal
    records = (
        await api.client.get(f"/v1/commands/{command_id}/executions", headers=bearer("alice"))
    ).json()
    assert [r["status"] for r in records] == ["staged"]
    assert records[0]["origin"] == "agent" and records[0]["authorization_snapshot"]["ai"] is True
    for secret in (token, command["digest"], command_id, records[0]["execution_id"]):
        assert secret not in proposal
    assert await _charges(api) == 0  # staged, nothing ran
    assert (await _tool(api, "status", token))["status"] == "staged"

    first = await _tool(api, "execute", token)
    assert first["status"] == "succeeded" and first["error"] is None
    assert await _tool(api, "execute", token) == first  # the same token again
    assert (await _tool(api, "status", token))["status"] == "succeeded"
    # "Yes, do it" again because the receipt did not arrive: a new token, the same request.
    again = (await _prepare(api, command_id))["confirmation_token"]
    assert await _tool(api, "execute", again) == first
    assert await _charges(api) == 1

    # The reply reached the room: released once, and the same request is a new write.
    released = await _delivered(api, confirmation_token=token)
    assert released.status_code == 200 and released.json() == {"released": True}
    assert (await _delivered(api, confirmation_token=token)).json() == {"released": False}
    third = (await _prepare(api, command_id))["confirmation_token"]
    assert (await _tool(api, "execute", third))["status"] == "succeeded"
    assert await _charges(api) == 2
    newest = (
        await api.client.get(
            f"/v1/commands/{command_id}/executions", params={"limit": 1}, headers=bearer("alice")
        )
    ).json()[0]
    by_id = await _delivered(api, execution_id=newest["execution_id"])
    assert by_id.json() == {"released": True}


async def test_a_plan_with_a_big_float_input_runs_once_confirmed_on_both_backends(
    api: Api,
) -> None:
    """A staged plan is reloaded from the database when it is confirmed; PostgreSQL's JSONB
    gives ``1e16`` back as an integer, and the plan's fingerprints were taken in that form, so
    it runs instead of parking in manual review as a payload mismatch."""
    await api.add_user("alice", rooms=[ROOM])
    command = order_command()
    command["inputs"]["weight"] = {"type": "number"}
    command["steps"][0]["payload"]["for"] = {"$ref": "inputs.weight"}
    command_id = str((await api.create("alice", command))["command_id"])
    staged = await _prepare(api, command_id, {**order_inputs(), "weight": 1e16})
    token = staged["confirmation_token"]
    first = await _tool(api, "execute", token)
    assert first["status"] == "succeeded", first
    again = await _prepare(api, command_id, {**order_inputs(), "weight": 1e16})
    assert await _tool(api, "execute", again["confirmation_token"]) == first
    assert await _charges(api) == 1


async def test_forged_and_foreign_tokens_are_confirmation_invalid(api: Api) -> None:
    command_id = await _setup(api)
    await api.add_user("mallory", rooms=[ROOM])
    token = (await _prepare(api, command_id))["confirmation_token"]
    for forged in ("", "zz" * 16, "0" * 31, "A" * 32, "0" * 32, "x" * 500):
        result = await _tool(api, "execute", forged)
        assert (result["status"], result["error"]) == ("failed", "confirmation_invalid")
        assert (await _tool(api, "status", forged))["error"] == "confirmation_invalid"
    # Another principal holding alice's token: the same answer as a forged one.
    stolen = await _tool(api, "execute", token, who="mallory")
    assert stolen["error"] == "confirmation_invalid" and stolen["action"] == ""
    assert (await _tool(api, "status", token, who="mallory"))["error"] == "confirmation_invalid"
    assert (await _delivered(api, "mallory", confirmation_token=token)).json() == {
        "released": False
    }
    assert await _charges(api) == 0
    # The token still works for alice.
    assert (await _tool(api, "execute", token))["status"] == "succeeded"


async def test_an_edited_command_after_prepare_is_a_contract_mismatch(api: Api) -> None:
    command_id = await _setup(api)
    token = (await _prepare(api, command_id))["confirmation_token"]
    edited = await api.client.put(
        f"/v1/commands/{command_id}",
        json={"definition": order_command(description="edited")},
        headers=bearer("alice"),
    )
    assert edited.status_code == 200, edited.text
    result = await _tool(api, "execute", token)
    assert (result["status"], result["error"]) == ("failed", "command_contract_mismatch")
    assert (await api.shop.counts())["inventory.reserve"] == 0
    # Nothing ran, but the plan the person saw is retired (docs/agent.md), not left staged.
    records = (
        await api.client.get(f"/v1/commands/{command_id}/executions", headers=bearer("alice"))
    ).json()
    assert [(r["status"], r.get("error_code")) for r in records] == [
        ("failed", "command_contract_mismatch")
    ]


async def test_delivering_an_in_flight_reply_does_not_let_the_request_charge_again(
    api: Api,
) -> None:
    from providers.fake.faults import FaultKind, FaultRule

    command_id = await _setup(api)
    api.shop.faults.add(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge", times=1)
    )
    api.shop.faults.add(FaultRule(FaultKind.LOOKUP_UNAVAILABLE, provider="payments", times=None))
    token = (await _prepare(api, command_id))["confirmation_token"]
    first = await _tool(api, "execute", token)
    assert first["status"] == "running", first  # in doubt, or parked for an operator
    # The "still in progress" reply reached the room.
    assert (await _delivered(api, confirmation_token=token)).json() == {"released": True}
    again = (await _prepare(api, command_id))["confirmation_token"]
    assert (await _tool(api, "execute", again))["status"] == "running"
    counts = await api.shop.counts()
    assert (counts["payments.charge"], counts["inventory.reserve"]) == (1, 1)


async def test_agent_routes_take_a_jwt_and_closed_bodies(api: Api) -> None:
    command_id = await _setup(api)
    await api.add_user("svc", api_key="atk_agent-key")
    key = {"X-API-Key": "atk_agent-key"}
    for url, body in (
        (f"/v1/commands/{command_id}/prepare", {"inputs": order_inputs()}),
        ("/v1/agent/execute", {"confirmation_token": "0" * 32}),
        ("/v1/agent/status", {"confirmation_token": "0" * 32}),
        ("/v1/agent/delivered", {"execution_id": "e-1"}),
    ):
        response = await api.client.post(url, json=body, headers=key)
        assert response.status_code == 403, url
        assert response.json() == {"detail": envelope("jwt_required", phase="stage")}
        anonymous = await api.client.post(url, json=body)
        assert anonymous.json() == {"detail": envelope("principal_not_authorized", phase="stage")}
    malformed: list[dict[str, Any]] = [
        {},
        {"confirmation_token": "0" * 32, "surprise": 1},
        {"confirmation_token": 7},
    ]
    for sent in malformed:
        bad = await api.client.post("/v1/agent/execute", json=sent, headers=_agent("alice"))
        assert bad.status_code == 422 and _detail(bad)["error"] == "request_invalid"
    for sent in ({}, {"execution_id": "e-1", "confirmation_token": "0" * 32}):
        bad = await api.client.post("/v1/agent/delivered", json=sent, headers=_agent("alice"))
        assert bad.status_code == 422, sent
        assert _detail(bad)["details"]["errors"] == [{"field": "body", "problem": "value_error"}]


async def test_prepare_refusals_are_stage_envelopes_and_stage_nothing(api: Api) -> None:
    command_id = await _setup(api)
    before = await api.counts()
    url = f"/v1/commands/{command_id}/prepare"
    invalid = await api.client.post(url, json={"inputs": {"order_id": 7}}, headers=_agent("alice"))
    assert invalid.status_code == 400
    assert _detail(invalid)["error"] == "command_input_invalid"
    assert _detail(invalid)["phase"] == "stage"
    # A token bound to one room cannot prepare in another.
    elsewhere = await api.client.post(
        url, json={"inputs": order_inputs(), "room_id": "room-2"}, headers=_agent("alice")
    )
    assert elsewhere.status_code == 403
    assert elsewhere.json() == {"detail": envelope("principal_not_authorized", phase="stage")}
    language = await api.client.post(
        url, json={"inputs": order_inputs(), "language": "fr"}, headers=_agent("alice")
    )
    assert language.status_code == 422
    assert _detail(language)["details"]["errors"][0]["field"] == "body.language"
    missing = await api.client.post(
        f"/v1/commands/{'c' * 32}/prepare", json={"inputs": {}}, headers=_agent("alice")
    )
    assert missing.json() == {"detail": envelope("command_not_found", phase="stage")}
    assert await api.counts() == before
    # room_id in the body binds an unbound token; the language may be chosen.
    staged = await api.client.post(
        url,
        json={"inputs": order_inputs(), "room_id": ROOM, "language": "zh-TW"},
        headers=bearer("alice"),
    )
    assert staged.status_code == 200, staged.text
    result = await api.client.post(
        "/v1/agent/execute",
        json={"confirmation_token": staged.json()["confirmation_token"]},
        headers=bearer("alice"),
    )
    assert result.json()["guidance"] == "已完成。請告訴對方完成了哪些事項。"


# -- approvals ----------------------------------------------------------------------------------


async def _requires_approval(api: Api) -> None:
    async with api.orch.store.transaction() as work:
        await action_settings.put(
            work, "payments", "charge", requires_approval=True, approval_policy=None
        )


async def _stage(api: Api, command_id: str, key: str) -> tuple[str, str]:
    """Execute as alice: 409 ``approval_required`` naming the staged change."""
    response = await api.execute("alice", command_id, idempotency_key=key)
    assert response.status_code == 409, response.text
    detail = _detail(response)
    assert detail["error"] == "approval_required" and detail["phase"] == "execute"
    assert set(detail["details"]) == {"staged_change_id"}
    return str(detail["details"]["staged_change_id"]), response.headers["X-Execution-Id"]


async def test_approvals_over_rest(api: Api) -> None:
    await _requires_approval(api)  # before the command: it is part of its dependency contract
    command_id = await _setup(api)
    await api.add_user("approver", permissions=("approve", "read"))
    change, execution_id = await _stage(api, command_id, "k-1")
    assert await _stage(api, command_id, "k-1") == (change, execution_id)  # replays
    assert (await api.shop.counts())["inventory.reserve"] == 0

    url = f"/v1/staged-changes/{change}"
    own = await api.client.post(f"{url}/approve", json={}, headers=bearer("alice"))
    assert own.status_code == 403  # the invoker alone cannot approve by default
    assert own.json() == {"detail": envelope("principal_not_authorized", phase="stage")}
    approved = await api.client.post(
        f"{url}/approve", json={"reason": "fine"}, headers=bearer("approver")
    )
    assert approved.status_code == 200, approved.text
    assert approved.json()["status"] == "succeeded"
    assert approved.json()["execution_id"] == execution_id
    assert approved.headers["X-Execution-Id"] == execution_id
    again = await api.client.post(f"{url}/approve", headers=bearer("approver"))  # no body
    assert again.status_code == 409
    assert again.json() == {"detail": envelope("staged_change_decided", phase="stage")}
    assert await _charges(api) == 1

    second, second_execution = await _stage(api, command_id, "k-2")
    rejected = await api.client.post(
        f"/v1/staged-changes/{second}/reject",
        json={"reason": "not   today"},
        headers=bearer("approver"),
    )
    assert rejected.status_code == 200, rejected.text
    view = rejected.json()
    assert view["execution_id"] == second_execution
    assert (view["status"], view["error_code"]) == ("failed", "approval_rejected")
    assert await _charges(api) == 1
    # The key is free again: the same request stages a new change.
    assert (await _stage(api, command_id, "k-2"))[0] != second

    unknown = await api.client.post(
        f"/v1/staged-changes/{'f' * 32}/reject", headers=bearer("approver")
    )
    assert unknown.status_code == 404
    assert unknown.json() == {"detail": envelope("staged_change_not_found", phase="stage")}
    extra = await api.client.post(f"{url}/approve", json={"why": 1}, headers=bearer("approver"))
    assert extra.status_code == 422


async def test_an_agent_confirmed_plan_waits_for_an_approver(api: Api) -> None:
    await _requires_approval(api)  # before the command: it is part of its dependency contract
    command_id = await _setup(api)
    await api.add_user("approver", permissions=("approve", "read"))
    token = (await _prepare(api, command_id))["confirmation_token"]
    result = await _tool(api, "execute", token)
    assert (result["status"], result["error"]) == ("staged", "approval_required")
    record = (
        await api.client.get(f"/v1/commands/{command_id}/executions", headers=bearer("alice"))
    ).json()[0]
    approved = await api.client.post(
        f"/v1/staged-changes/{record['staged_change_id']}/approve", headers=bearer("approver")
    )
    assert approved.status_code == 200, approved.text
    assert (await _tool(api, "status", token))["status"] == "succeeded"
    assert await _charges(api) == 1


# -- operators ----------------------------------------------------------------------------------


async def _confirmed(api: Api, command_id: str) -> None:
    token = (await _prepare(api, command_id))["confirmation_token"]
    assert (await _tool(api, "execute", token))["status"] == "succeeded"


async def test_operator_routes_refuse_non_operators(api: Api) -> None:
    await api.add_user("alice")  # manages every order action, but not agent-txn.ops
    await api.add_user("ops-key", actions=OPERATOR, permissions=("manage",), api_key="atk_ops")
    calls: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", f"/v1/ops/deliveries?room_id={ROOM}", None),
        ("POST", "/v1/ops/deliveries/acknowledge", {"room_id": ROOM, "execution_ids": ["e"]}),
        ("POST", "/v1/ops/executions/prune", None),
        ("POST", "/v1/ops/callbacks/requeue", {}),
    ]
    for method, url, body in calls:
        for headers, expected in (
            (bearer("alice"), DENIED_OPS),
            (bearer("nobody"), DENIED_OPS),
            ({}, DENIED_OPS),
            ({"X-API-Key": "atk_ops"}, {"detail": envelope("jwt_required")}),
        ):
            response = await api.client.request(method, url, json=body, headers=headers)
            assert response.status_code == 403, (url, response.text)
            assert response.json() == expected


async def test_operators_list_preview_and_acknowledge_markers(api: Api) -> None:
    command_id = await _setup(api)
    await api.add_user("ops", actions=OPERATOR, permissions=("manage",))
    await _confirmed(api, command_id)
    listed = await api.client.get(
        "/v1/ops/deliveries", params={"room_id": ROOM}, headers=bearer("ops")
    )
    assert listed.status_code == 200, listed.text
    markers = listed.json()["markers"]
    assert [(m["state"], m["in_window"], m["command_id"]) for m in markers] == [
        ("pending", True, command_id)
    ]
    execution_id = markers[0]["execution_id"]

    async def acknowledge(**body: Any) -> list[dict[str, Any]]:
        response = await api.client.post(
            "/v1/ops/deliveries/acknowledge",
            json={"room_id": ROOM, "execution_ids": [execution_id], **body},
            headers=bearer("ops"),
        )
        assert response.status_code == 200, response.text
        out: list[dict[str, Any]] = response.json()["markers"]
        return out

    assert (await acknowledge(force=True))[0]["result"] == "would_acknowledge"  # a preview
    assert (await acknowledge())[0]["result"] == "needs_force"
    assert (await acknowledge(execute=True))[0]["result"] == "needs_force"
    still = await api.client.get(
        "/v1/ops/deliveries", params={"room_id": ROOM}, headers=bearer("ops")
    )
    assert still.json() == listed.json()  # the previews and refusals wrote nothing
    assert (await acknowledge(execute=True, force=True))[0] == {
        "execution_id": execution_id,
        "state": "pending",
        "in_window": True,
        "result": "acknowledged",
    }
    assert (await acknowledge(execute=True, force=True))[0]["result"] == "not_pending"
    unknown = await api.client.post(
        "/v1/ops/deliveries/acknowledge",
        json={"room_id": ROOM, "execution_ids": ["nope"], "execute": True},
        headers=bearer("ops"),
    )
    assert unknown.json() == {"markers": [{"execution_id": "nope", "result": "not_found"}]}
    # Acknowledging never rolls back the committed write; it re-opens the request.
    assert await _charges(api) == 1
    await _confirmed(api, command_id)
    assert await _charges(api) == 2


@pytest.mark.parametrize(
    ("body", "field", "problem"),
    [
        ({"room_id": ROOM, "execution_ids": []}, "body.execution_ids", "too_short"),
        ({"room_id": ROOM, "execution_ids": ["e"] * 201}, "body.execution_ids", "too_long"),
        ({"room_id": ROOM, "execution_ids": ["e"], "execute": "true"}, "body.execute", "bool_type"),
        ({"room_id": ROOM, "execution_ids": ["e"], "force": 1}, "body.force", "bool_type"),
        ({"room_id": "a b", "execution_ids": ["e"]}, "body.room_id", "string_pattern_mismatch"),
        ({"execution_ids": ["e"]}, "body.room_id", "missing"),
    ],
    ids=["none", "201", "string-flag", "int-flag", "bad-room", "no-room"],
)
async def test_acknowledge_bodies_are_validated(
    api: Api, body: dict[str, Any], field: str, problem: str
) -> None:
    await api.add_user("ops", actions=OPERATOR, permissions=("manage",))
    response = await api.client.post(
        "/v1/ops/deliveries/acknowledge", json=body, headers=bearer("ops")
    )
    assert response.status_code == 422
    assert _detail(response)["details"]["errors"] == [{"field": field, "problem": problem}]


async def test_prune_answers_exactly_its_shape(api: Api) -> None:
    await api.add_user("alice")
    await api.add_user("ops", actions=OPERATOR, permissions=("manage",))
    command_id = (await api.create("alice"))["command_id"]
    executed = await api.execute("alice", command_id)
    assert executed.status_code == 200
    young = await api.client.post("/v1/ops/executions/prune", headers=bearer("ops"))
    assert young.status_code == 200, young.text
    body = young.json()
    assert set(body) == {"pruned", "retention_days", "cutoff"}
    assert (body["pruned"], body["retention_days"]) == (0, 180)
    assert body["cutoff"].endswith("Z")
    api.orch.store.advance_clock(181 * 86_400)
    old = await api.client.post("/v1/ops/executions/prune", headers=bearer("ops"))
    assert old.json()["pruned"] == 1
    gone = await api.client.get(
        f"/v1/commands/{command_id}/executions/{executed.json()['execution_id']}",
        headers=bearer("alice"),
    )
    assert gone.status_code == 404


async def test_requeue_answers_its_counts_and_its_bounds_are_the_ops_modules(api: Api) -> None:
    await api.add_user("ops", actions=OPERATOR, permissions=("manage",))

    async def requeue(body: Any) -> httpx.Response:
        return await api.client.post("/v1/ops/callbacks/requeue", json=body, headers=bearer("ops"))

    for ok in (None, {}, {"older_than_seconds": 0, "limit": 1}, {"limit": 2000}):
        response = await requeue(ok)
        assert response.status_code == 200, (ok, response.text)
        assert response.json() == {"republished": 0, "retried": 0, "reclaimed": 0}
    # An absurd (finite) age means "older than everything", never an overflow.
    assert (await requeue({"older_than_seconds": 1e306})).status_code == 200
    out_of_range: list[tuple[dict[str, Any], str]] = [
        ({"limit": 0}, "limit"),
        ({"limit": 2001}, "limit"),
        ({"older_than_seconds": -1}, "older_than_seconds"),
        ({"older_than_seconds": -0.5, "limit": 10**6}, "older_than_seconds"),
    ]
    for bad, field in out_of_range:
        response = await requeue(bad)
        assert response.status_code == 422, bad
        detail = _detail(response)
        assert detail["error"] == "request_invalid"
        assert detail["details"]["errors"][0]["field"] == field  # the ops module's own names
    # Types are the HTTP layer's: a string or a boolean is not a number.
    mistyped: list[tuple[dict[str, Any], str, str]] = [
        ({"limit": "5"}, "body.limit", "int_type"),
        ({"limit": 5.0}, "body.limit", "int_type"),
        ({"older_than_seconds": True}, "body.older_than_seconds", "float_type"),
    ]
    for sent, name, problem in mistyped:
        response = await requeue(sent)
        assert response.status_code == 422, sent
        assert _detail(response)["details"]["errors"] == [{"field": name, "problem": problem}]
