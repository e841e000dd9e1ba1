"""``agent-txn mcp`` in a subprocess, driven by the official MCP SDK's client over stdio.

The person, their grants, their room and the order command are created with the Python API on
the same databases the server then opens (SQLite files, or PostgreSQL databases). The client
lists the tools and walks the person-confirmation protocol: prepare → a proposal that shows
business data but never the token or any structural id → execute with the token → the same
result when repeated → exactly one charge in the fake shop's own database. Refusals come back as
closed tool results, never as a traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import jwt
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp import types as mt

from ledger import principals
from orchestrator.authz import Caller
from orchestrator.engine import Orchestrator
from orchestrator.mcp_server import (
    EXECUTE_STAGED_ACTION,
    EXECUTION_STATUS,
    PREPARE_ACTION,
    McpTools,
    session_caller,
)
from providers.fake.shop import FakeShop
from tests.conftest import DbUrls
from tests.support.commands import ORDER_ACTIONS, add_user, order_command
from tests.support.world import World, fast_settings

REPO = Path(__file__).resolve().parents[2]
SECRET = "mcp-acceptance-secret-0123456789abcdef"
ROOM = "room-1"
ORDER_ID = "11111111-1111-4111-8111-111111111111"  # business data that looks like a UUID
ORDER = {"order_id": ORDER_ID, "sku": "sku-1", "amount": 1200}
TOOL_KEYS = {"status", "action", "error", "retryable", "guidance"}
PREPARE_KEYS = {"proposal", "confirmation_token", "action", "expires_at"}
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "maxLength": 64},
        "sku": {"type": "string"},
        "amount": {"type": "integer", "minimum": 1},
    },
    "required": ["order_id", "sku", "amount"],
    "additionalProperties": False,
}
#: Every constraint an input can carry, to check the JSON Schema mapping end to end.
RICH_INPUTS = {
    "code": {"type": "string", "min_length": 2, "max_length": 8, "pattern": "^[A-Z]+$"},
    "tier": {"type": "string", "enum": ["gold", "silver"], "required": False},
    "ratio": {"type": "number", "minimum": 0, "maximum": 1, "required": False},
    "tags": {"type": "array", "min_length": 1, "max_length": 3, "required": False},
    "meta": {"type": "object", "max_length": 4, "required": False},
    "gift": {"type": "boolean", "required": False},
}
RICH_SCHEMA = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "minLength": 2, "maxLength": 8, "pattern": "^[A-Z]+$"},
        "tier": {"type": "string", "enum": ["gold", "silver"]},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "minItems": 1, "maxItems": 3},
        "meta": {"type": "object", "maxProperties": 4},
        "gift": {"type": "boolean"},
    },
    "required": ["code"],
    "additionalProperties": False,
}


def _agent_txn() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("agent-txn")
    return [str(script)] if script.exists() else [sys.executable, "-m", "orchestrator.cli"]


def _token(**claims: Any) -> str:
    now = int(time.time())
    body = {"sub": "alice", "kind": "user", "iat": now, "exp": now + 3600, "room": ROOM}
    body.update(claims)
    return jwt.encode(body, SECRET, algorithm="HS256")


async def _setup(urls: DbUrls) -> dict[str, Any]:
    """The person, their room and two commands, written through the Python API."""
    shop = await FakeShop.open(urls.provider)
    await shop.seed_stock({"sku-1": 100})
    orch = await Orchestrator.open(urls.store, providers=shop.providers(), settings=fast_settings())
    try:
        alice = await add_user(orch, "alice")
        async with orch.store.transaction() as work:
            await principals.join_room(work, ROOM, "alice", language="en")
        info = await orch.commands.create(
            alice, order_command(description="Ship the order and charge the buyer")
        )
        rich = order_command(name="rich_order", inputs=RICH_INPUTS)
        rich["steps"][1]["payload"]["amount"] = 5
        rich["steps"][1]["payload"]["order"] = {"$ref": "inputs.code"}
        rich["steps"][0]["payload"]["sku"] = "sku-1"
        await orch.commands.create(alice, rich)
        return info
    finally:
        await orch.close()
        await shop.close()


@asynccontextmanager
async def _session(urls: DbUrls, errlog: Any, *extra: str) -> AsyncIterator[ClientSession]:
    """An initialized client session with ``agent-txn mcp`` (the secrets in its environment)."""
    params = StdioServerParameters(
        command=_agent_txn()[0],
        args=[
            *_agent_txn()[1:],
            "mcp",
            "--db",
            urls.store,
            "--fake-shop",
            urls.provider,
            "--room",
            ROOM,
            *extra,
        ],
        env={
            "AGENT_TXN_TOKEN": _token(),
            "AGENT_TXN_JWT_SECRET": SECRET,
            "PYTHONPATH": str(REPO),
        },
        cwd=str(REPO),
    )
    async with (
        stdio_client(params, errlog=errlog) as (read, write),
        ClientSession(read, write, read_timeout_seconds=60) as session,
    ):
        await session.initialize()
        yield session


def _unordered(schema: dict[str, Any]) -> dict[str, Any]:
    """``required`` is a set in JSON Schema: compare it sorted."""
    return {**schema, "required": sorted(schema["required"])}


def _payload(result: mt.CallToolResult) -> dict[str, Any]:
    """The tool result's JSON, checked to be the same as text and as structured content."""
    assert len(result.content) == 1
    block = result.content[0]
    assert isinstance(block, mt.TextContent)
    payload: dict[str, Any] = json.loads(block.text)
    assert result.structured_content == payload
    return payload


async def _call(session: ClientSession, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await session.call_tool(name, arguments)
    assert isinstance(result, mt.CallToolResult)
    payload = _payload(result)
    assert result.is_error == (payload.get("status") == "failed")
    return payload


async def test_the_confirmation_protocol_over_mcp(db_urls: DbUrls, tmp_path: Path) -> None:
    info = await _setup(db_urls)
    errors = tmp_path / "mcp-stderr.log"
    with errors.open("w") as errlog:
        async with _session(db_urls, errlog) as session:
            tools = {t.name: t for t in (await session.list_tools()).tools}

            # -- the tool list -----------------------------------------------------------
            assert {"prepare_order", "prepare_rich_order", PREPARE_ACTION} <= set(tools)
            assert {EXECUTE_STAGED_ACTION, EXECUTION_STATUS} <= set(tools)
            prepare = tools["prepare_order"]
            assert _unordered(prepare.input_schema) == _unordered(ORDER_SCHEMA)
            assert _unordered(tools["prepare_rich_order"].input_schema) == RICH_SCHEMA
            assert prepare.description is not None
            assert prepare.description.startswith("Ship the order and charge the buyer")
            assert "later turn" in prepare.description
            assert prepare.annotations is not None
            assert prepare.annotations.destructive_hint is False
            assert prepare.annotations.read_only_hint is False
            execute = tools[EXECUTE_STAGED_ACTION]
            assert execute.annotations is not None
            assert execute.annotations.destructive_hint is True
            assert execute.annotations.read_only_hint is False
            assert execute.description is not None
            assert "explicitly confirmed" in execute.description
            assert "later turn" in execute.description
            assert execute.input_schema == {
                "type": "object",
                "properties": {
                    "confirmation_token": {
                        "type": "string",
                        "pattern": "^[0-9a-f]{32}$",
                        "description": "The confirmation_token a prepare tool returned for "
                        "this plan.",
                    }
                },
                "required": ["confirmation_token"],
                "additionalProperties": False,
            }
            status_tool = tools[EXECUTION_STATUS]
            assert status_tool.annotations is not None
            assert status_tool.annotations.read_only_hint is True
            listing = json.dumps([t.model_dump(by_alias=True, mode="json") for t in tools.values()])
            assert "digest" not in listing.lower()
            assert info["digest"] not in listing

            # -- prepare: a proposal for the person, a token for the agent -------------------
            staged = await _call(session, "prepare_order", ORDER)
            assert set(staged) == PREPARE_KEYS
            token, text = staged["confirmation_token"], staged["proposal"]
            assert re.fullmatch(r"[0-9a-f]{32}", token)
            assert staged["action"] == "order"
            assert "1200" in text and "sku-1" in text and ORDER_ID in text
            for secret in (token, info["digest"], info["command_id"]):
                assert secret not in text

            # -- the person said yes (a later turn): execute, then the same call again -------
            first = await _call(session, EXECUTE_STAGED_ACTION, {"confirmation_token": token})
            assert set(first) == TOOL_KEYS
            assert first["status"] == "succeeded" and first["error"] is None
            assert first["action"] == "order"
            again = await _call(session, EXECUTE_STAGED_ACTION, {"confirmation_token": token})
            assert again == first
            status = await _call(session, EXECUTION_STATUS, {"confirmation_token": token})
            assert status == first

            # "Yes, do it" once more through the generic tool: a new token for the same request
            # in the same room replays the original while its reply may not have arrived.
            restaged = await _call(session, PREPARE_ACTION, {"command": "order", "inputs": ORDER})
            assert set(restaged) == PREPARE_KEYS
            replay = await _call(
                session,
                EXECUTE_STAGED_ACTION,
                {"confirmation_token": restaged["confirmation_token"]},
            )
            assert replay == first

            # -- refusals are closed tool results ----------------------------------------
            forged = await _call(session, EXECUTE_STAGED_ACTION, {"confirmation_token": "0" * 32})
            assert set(forged) == TOOL_KEYS
            assert forged["status"] == "failed" and forged["error"] == "confirmation_invalid"
            smuggled = await _call(
                session,
                EXECUTE_STAGED_ACTION,
                {"confirmation_token": token, "expected_contract_digest": info["digest"]},
            )
            assert smuggled["error"] == "request_invalid"
            bad = await _call(session, "prepare_order", {"order_id": "42"})
            assert set(bad) == TOOL_KEYS and bad["error"] == "command_input_invalid"
            unknown = await _call(session, PREPARE_ACTION, {"command": "nope", "inputs": {}})
            assert unknown["error"] == "command_not_found"
            for result in (forged, smuggled, bad, unknown):
                assert result["guidance"] and "Traceback" not in json.dumps(result)

    log = errors.read_text()
    assert "Traceback" not in log, log
    shop = await FakeShop.open(db_urls.provider)
    try:
        counts = await shop.counts()
    finally:
        await shop.close()
    assert counts["payments.charge"] == 1
    assert counts["inventory.reserve"] == 1


async def test_the_language_option_words_the_proposal(db_urls: DbUrls, tmp_path: Path) -> None:
    await _setup(db_urls)
    with (tmp_path / "mcp-stderr.log").open("w") as errlog:
        async with _session(db_urls, errlog, "--language", "zh-TW") as session:
            staged = await _call(session, "prepare_order", ORDER)
            result = await _call(
                session,
                EXECUTE_STAGED_ACTION,
                {"confirmation_token": staged["confirmation_token"]},
            )
    assert result["status"] == "succeeded"
    assert result["guidance"] == "已完成。請告訴對方完成了哪些事項。"


@pytest.mark.parametrize(
    ("token", "extra", "expected"),
    [
        ("not-a-jwt", [], "principal_not_authorized"),
        (_token(room="room-2"), [], "principal_not_authorized"),  # bound to another room
        (None, [], "a JWT is needed"),
        (_token(), ["--language", "fr"], "--language must be one of"),
    ],
)
def test_start_up_refusals_are_one_error_line(
    tmp_path: Path, token: str | None, extra: list[str], expected: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_TXN_")}
    env["PYTHONPATH"] = str(REPO)
    env["AGENT_TXN_JWT_SECRET"] = SECRET
    if token is not None:
        env["AGENT_TXN_TOKEN"] = token
    db = f"sqlite+aiosqlite:///{tmp_path / 'agent.db'}"
    done = subprocess.run(
        [*_agent_txn(), "mcp", "--db", db, "--room", ROOM, *extra],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""  # stdout is the MCP wire
    assert expected in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert SECRET not in done.stderr


# -- the tool surface in process (no transport): naming rules and failure containment -----------


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
}


async def _tools(world: World) -> McpTools:
    author = await add_user(world.orch, "alice", actions=(*ORDER_ACTIONS, ("inventory", "stock")))
    async with world.orch.store.transaction() as work:
        await principals.join_room(work, ROOM, "alice", language="en")
    await world.orch.commands.create(author, STOCK_QUERY)
    caller = session_caller(Caller("alice", "user", "jwt"), ROOM)
    assert caller.ai and caller.room_id == ROOM
    return McpTools(world.orch, caller)


async def test_only_unambiguous_execute_commands_get_a_tool_of_their_own(world: World) -> None:
    tools = await _tools(world)
    author = Caller("alice", "user", "jwt")
    first = await world.orch.commands.create(author, order_command())
    await world.orch.commands.create(author, order_command())  # the same name twice
    await world.orch.commands.create(author, order_command(name="action"))
    await world.orch.commands.create(author, order_command(name="ship:fast"))
    names = [t["name"] for t in await tools.tools()]
    # No prepare_order (ambiguous), no second prepare_action, nothing for the query command or
    # for a name MCP does not allow: all of them stay reachable through prepare_action.
    assert names == [PREPARE_ACTION, EXECUTE_STAGED_ACTION, EXECUTION_STATUS]
    generic = (await tools.tools())[0]["description"]
    assert f"order (id {first['command_id']})" in generic and "ship:fast" in generic
    assert "stock_level" not in generic  # no staged path for query commands

    ambiguous = await tools.call(PREPARE_ACTION, {"command": "order", "inputs": ORDER})
    assert ambiguous["error"] == "request_invalid"
    by_id = await tools.call(PREPARE_ACTION, {"command": first["command_id"], "inputs": ORDER})
    assert set(by_id) == PREPARE_KEYS and by_id["action"] == "order"
    fast = await tools.call(PREPARE_ACTION, {"command": "ship:fast", "inputs": ORDER})
    assert fast["action"] == "ship:fast"
    query = await tools.call(PREPARE_ACTION, {"command": "stock_level", "inputs": {"sku": "x"}})
    assert query["error"] == "command_mode_mismatch" and query["action"] == "stock_level"
    assert (await tools.call("prepare_order", ORDER))["error"] == "command_not_found"
    assert (await tools.call("mark_delivered", {}))["error"] == "request_invalid"
    assert (await world.shop.counts())["payments.charge"] == 0


async def test_a_session_of_nobody_lists_no_command_and_every_call_is_refused(
    world: World,
) -> None:
    tools = await _tools(world)  # alice's command exists; the session's principal does not
    await world.orch.commands.create(Caller("alice", "user", "jwt"), order_command())
    generic = [PREPARE_ACTION, EXECUTE_STAGED_ACTION, EXECUTION_STATUS]
    assert [t["name"] for t in await tools.tools()] == ["prepare_order", *generic]

    nobody = McpTools(world.orch, session_caller(Caller("nobody", "user", "jwt"), ROOM))
    assert [t["name"] for t in await nobody.tools()] == generic  # the listing was refused
    refused = await nobody.call(PREPARE_ACTION, {"command": "order", "inputs": ORDER})
    assert refused["status"] == "failed"
    assert (await world.shop.counts())["payments.charge"] == 0


async def test_an_unexpected_failure_is_a_closed_result_without_its_text(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = await _tools(world)
    await world.orch.commands.create(Caller("alice", "user", "jwt"), order_command())

    async def broken(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("password=hunter2 at db.internal:5432")

    monkeypatch.setattr(world.orch.agent, "prepare", broken)
    result = await tools.call("prepare_order", ORDER)
    assert set(result) == TOOL_KEYS
    assert result["error"] == "command_execution_failed" and result["action"] == "order"
    assert "hunter2" not in json.dumps(result)
