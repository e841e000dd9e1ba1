"""Property-based fuzzing of the published OpenAPI document: no request may produce a 5xx.

Besides "no 5xx", every answer must be one the document declares (status code, content type,
body schema), so the OpenAPI a client generates its code from tells the truth about errors too.

schemathesis reads ``/openapi.json`` from the ASGI app and generates requests for every
operation (valid and invalid ones), sent with a valid JWT of a principal who may author, run and
approve the order command, acts in a room and is an operator, so generated bodies reach the
service (the agent toolbox, approvals and the ``/v1/ops`` jobs included) and not only the
credential check. A second pass pins ``command_id`` to a real command, ``staged_change_id`` to a
real change waiting for approval and the operator's ``room_id`` to a room holding a delivery
marker, so execute, prepare, query, the audit reads, approve / reject and the marker routes are
fuzzed against things that exist rather than answering 404 (or an empty list) every time.

SQLite only: this fuzzes the HTTP layer (request models, path constraints, credentials, error
mapping), which is the same code on both backends; the storage semantics behind it are pinned
on SQLite and PostgreSQL by ``test_commands_api.py`` and the integration suite. (Strings no
database can store — NUL, lone surrogates — are refused in the HTTP layer, and that refusal is
tested on both backends there.)

The app runs in schemathesis' own event-loop thread, so the engine must be opened there too:
:class:`FuzzedApp` opens it in the ASGI lifespan startup and closes it at shutdown. schemathesis'
pytest plugin ends every ASGI lifespan after each test, so each test starts on fresh databases.

(The plugin's ``schemathesis.pytest.from_fixture`` / ``@schema.parametrize()`` would be the usual
spelling, but schemathesis 4.32 reads ``Function._nodeid``, which pytest 9.2 no longer has; the
per-operation ``APIOperation.as_strategy`` with Hypothesis' ``@given`` is the documented
alternative and keeps one failing route from hiding the others.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.python.asgi import shutdown_lifespans
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.types import Receive, Scope, Send

from ledger import action_settings, principals
from orchestrator.authz import AuthSettings, Caller
from orchestrator.engine import Orchestrator
from orchestrator.errors import ApprovalRequired
from orchestrator.http_api import create_app
from providers.fake.shop import FakeShop
from tests.api.conftest import SECRET, TENANT, token
from tests.support.commands import ORDER_ACTIONS, order_command
from tests.support.world import fast_settings

AUTHOR = "fuzzer"
ROOM = "room-1"
#: A command whose one effect needs an approval (the fuzzer may approve its own: the policy
#: allows it), so approve and reject are fuzzed against a change that exists. Only effect steps
#: need approvals: the order command's receipt (an outbox event on the same action) does not.
NOTICE = {
    "name": "notice",
    "inputs": {"to": {"type": "string", "max_length": 64}},
    "steps": [
        {
            "kind": "effect",
            "name": "mail",
            "provider": "email",
            "action": "send",
            "payload": {"to": {"$ref": "inputs.to"}, "template": "notice"},
        }
    ],
}


class FuzzedApp:
    """An ASGI app that opens the engine, the shop and a command in its lifespan startup."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.starts = 0
        self.app: Any = None
        self.command_id = ""
        self.staged_change_id = ""
        self._closers: list[Any] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self.app(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self._open()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for closer in reversed(self._closers):
                    await closer.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _open(self) -> None:
        self.starts += 1
        here = self.directory / f"start-{self.starts}"
        here.mkdir()
        self._closers = []
        shop = await FakeShop.open(f"sqlite+aiosqlite:///{here / 'provider.db'}")
        self._closers.append(shop)
        await shop.seed_stock({"sku-1": 1_000_000})
        orch = await Orchestrator.open(
            f"sqlite+aiosqlite:///{here / 'agent.db'}",
            providers=shop.providers(),
            settings=fast_settings(),
        )
        self._closers.append(orch)
        async with orch.store.transaction() as work:
            await action_settings.put(
                work,
                "email",
                "send",
                requires_approval=True,
                approval_policy={"separate_approver": False},
            )
            await principals.add_principal(
                work, principal_id=AUTHOR, tenant=TENANT, kind="user", name=AUTHOR
            )
            for provider, action in ORDER_ACTIONS:
                for permission in ("manage", "execute", "read", "approve"):
                    await principals.grant(
                        work,
                        principal_id=AUTHOR,
                        provider=provider,
                        action=action,
                        permission=permission,
                    )
            await principals.grant(
                work, principal_id=AUTHOR, provider="agent-txn", action="ops", permission="manage"
            )
            await principals.join_room(work, ROOM, AUTHOR)
        author = Caller(AUTHOR, "user", "jwt")
        command = await orch.commands.create(author, order_command())
        self.command_id = command["command_id"]
        # A delivery marker in the room (what the operator routes list and acknowledge) ...
        agent = Caller(AUTHOR, "user", "jwt", room_id=ROOM, ai=True)
        inputs = {"order_id": "o-1", "sku": "sku-1", "amount": 5}
        prepared = await orch.agent.prepare(agent, self.command_id, inputs)
        await orch.agent.execute_staged_action(agent, prepared["confirmation_token"])
        # ... and a change waiting for approval.
        notice = await orch.commands.create(author, NOTICE)
        try:
            await orch.commands.execute(author, notice["command_id"], {"to": "a@example.com"})
        except ApprovalRequired as staged:
            self.staged_change_id = str(staged.details["staged_change_id"])
        assert self.staged_change_id
        self.app = create_app(orch, AuthSettings(jwt_secret=SECRET, tenant=TENANT))


@pytest.fixture
def fuzzed(tmp_path: Path) -> Iterator[FuzzedApp]:
    """The app under fuzzing; its lifespan is ended (engine closed) after the test."""
    app = FuzzedApp(tmp_path)
    yield app
    shutdown_lifespans()


@pytest.fixture
def api_schema(fuzzed: FuzzedApp) -> Any:
    """The OpenAPI document as the running app publishes it (this starts its lifespan)."""
    return schemathesis.openapi.from_asgi("/openapi.json", fuzzed)


FUZZ = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def _fuzz(
    operation: Any, mode: GenerationMode, pins: dict[str, str], query: dict[str, str]
) -> None:
    """Send ``max_examples`` generated requests to one operation; raise on a 5xx or on an
    answer the document does not declare."""

    @FUZZ
    @given(case=operation.as_strategy(mode, path_parameters=pins or None, query=query or None))
    def run(case: Any) -> None:
        case.call_and_validate(headers={"Authorization": f"Bearer {token(AUTHOR)}"}, checks=CHECKS)

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("real_command", [False, True], ids=["any-id", "real-command"])
def test_no_request_is_a_server_error(
    api_schema: Any, fuzzed: FuzzedApp, mode: GenerationMode, real_command: bool
) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 20  # every route of the API is in the document
    failures: list[str] = []
    for operation in operations:
        pins: dict[str, str] = {}
        query: dict[str, str] = {}
        if real_command and "{command_id}" in operation.path:
            if operation.method.upper() == "DELETE":
                continue  # deleting the one real command would make the rest of the pass 404s
            pins["command_id"] = fuzzed.command_id
        if real_command and "{staged_change_id}" in operation.path:
            pins["staged_change_id"] = fuzzed.staged_change_id
        if real_command and operation.path == "/v1/ops/deliveries":
            query["room_id"] = ROOM
        if mode.is_negative and operation.path in ("/healthz", "/v1/ops/executions/prune"):
            continue  # no parameters, nothing to make invalid: Hypothesis would be Unsatisfiable
        try:
            _fuzz(operation, mode, pins, query)
        except Exception as exc:  # collected, so one failing route does not hide the others
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
    assert not failures, "\n\n".join(failures)
