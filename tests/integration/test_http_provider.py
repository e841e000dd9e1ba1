"""The HTTP provider adapter against the fake shop served over a real socket, on both backends.

The engine talks only HTTP here: faults are armed in the *server's* shop, so a lost response
is a socket closed after the effect committed, a timeout is the server holding its answer past
the client's deadline, and "connection refused" is a port nobody listens on. Every count is read
from the shop's own database. The seed scenarios of ``test_seed_scenarios`` run unchanged over
HTTP (the world is the same, its providers are not), then the HTTP-specific faults, then the
status-code classification against a mock transport, then the CLI in a subprocess.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger.states import EffectState, TxState
from orchestrator.engine import Orchestrator
from providers.contract import (
    ActionContract,
    ApplyOutcome,
    Confirmed,
    FencedOut,
    Found,
    LookupOutcome,
    NotFound,
    Provider,
    Rejected,
    Unavailable,
    Unknown,
)
from providers.fake.faults import FaultKind, FaultRule
from providers.fake.http_server import FakeShopServer, fake_shop_http_providers, serve
from providers.fake.shop import FakeShop
from providers.http import HttpAction, HttpProvider, short_code
from tests.conftest import DbUrls
from tests.integration import test_fencing, test_seed_scenarios
from tests.support.sagas import order, order_saga
from tests.support.world import World, fast_settings

REPO = Path(__file__).resolve().parents[2]
#: The client's deadline; the engine's own call timeout (fast_settings: 2 s) is longer, so the
#: adapter is what names a timeout ("read_timeout").
CLIENT_TIMEOUT = 1.0
CHARGE = {"amount": 1200, "currency": "EUR"}


@dataclass
class HttpWorld(World):
    """A :class:`World` whose engines reach the shop only through its HTTP server."""

    server: FakeShopServer | None = None
    opened: list[HttpProvider] = field(default_factory=list)

    def http_providers(self, base_url: str | None = None) -> list[HttpProvider]:
        """Fresh HTTP providers (their own clients), closed with the world."""
        assert self.server is not None
        providers = fake_shop_http_providers(base_url or self.server.url, timeout=CLIENT_TIMEOUT)
        self.opened.extend(providers)
        return providers

    async def engine(self, **settings: object) -> Orchestrator:
        """Another engine ("process") with HTTP providers of its own."""
        orch = await Orchestrator.open(
            self.urls.store, providers=self.http_providers(), settings=fast_settings(**settings)
        )
        self.extra.append(orch)
        return orch


@pytest.fixture
async def http_world(db_urls: DbUrls) -> AsyncIterator[HttpWorld]:
    """Shop (sku-1 = 100) behind an HTTP server on an ephemeral port; the engine uses HTTP."""
    shop = await FakeShop.open(db_urls.provider)
    await shop.seed_stock({"sku-1": 100})
    server = await serve(shop, "127.0.0.1", 0)
    # Every provider the world opens lands in this list, and is closed with it.
    opened = fake_shop_http_providers(server.url, timeout=CLIENT_TIMEOUT)
    extra: list[Orchestrator] = []  # the world's other engines, shared with it
    engines: list[Orchestrator] = []
    try:
        orch = await Orchestrator.open(db_urls.store, providers=opened, settings=fast_settings())
        engines.append(orch)
        yield HttpWorld(db_urls, shop, orch, extra, server, opened)
    finally:
        for engine in [*engines, *extra]:
            await engine.close()
        for provider in opened:
            await provider.aclose()
        await server.stop()  # before the shop: requests in progress still use its database
        await shop.close()


def _closed_port() -> int:
    """A port nobody listens on (bound, read, released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _ledger_reasons(world: World, tx_id: str, subject: str) -> list[str]:
    reasons = []
    for entry in await world.orch.ledger(tx_id):
        if entry.subject != subject:
            continue
        error = entry.detail.get("error") if isinstance(entry.detail, dict) else None
        if isinstance(error, dict) and isinstance(error.get("reason"), str):
            reasons.append(error["reason"])
        elif isinstance(entry.detail.get("reason"), str):
            reasons.append(entry.detail["reason"])
    return reasons


def _ledger_text(entries: list[Any]) -> str:
    return json.dumps([e.detail for e in entries], default=str)


# -- the seed scenarios, unchanged, over HTTP ----------------------------------------------------

SEED_SCENARIOS: dict[str, Callable[[World], Awaitable[None]]] = {
    name: fn
    for name, fn in vars(test_seed_scenarios).items()
    if name.startswith("test_") and inspect.iscoroutinefunction(fn)
}


@pytest.mark.parametrize("scenario", sorted(SEED_SCENARIOS))
async def test_seed_scenario_over_http(http_world: HttpWorld, scenario: str) -> None:
    fn = SEED_SCENARIOS[scenario]
    # They take the in-process ``world`` fixture; ours has the same shape.
    assert list(inspect.signature(fn).parameters) == ["world"], scenario
    await fn(http_world)


def test_every_seed_scenario_is_covered() -> None:
    assert len(SEED_SCENARIOS) >= 7


# -- faults across the socket ------------------------------------------------------------------


async def test_lost_response_is_a_closed_socket_after_the_effect(http_world: HttpWorld) -> None:
    w = http_world
    payments = w.http_providers()[1]
    w.shop.faults.add(FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge"))

    outcome = await payments.apply("charge", key="k-lost", payload=CHARGE, fence=1)

    assert outcome == Unknown("connection_closed")  # no status line ever arrived
    effect = (await w.shop.effects("payments.charge"))[0]
    assert (await w.shop.counts())["payments.charge"] == 1
    assert [c.outcome for c in await w.shop.calls(key="k-lost")] == ["lost_response"]
    found = await payments.lookup("charge", key="k-lost", payload=CHARGE)
    assert isinstance(found, Found) and found.remote_id == effect.remote_id
    assert found.result["amount"] == 1200


async def test_fail_before_is_a_503_and_the_charge_is_resent_once(http_world: HttpWorld) -> None:
    w = http_world
    w.shop.faults.add(FaultRule(FaultKind.FAIL_BEFORE, provider="payments", action="charge"))

    result = await w.orch.execute(order_saga(), order("42"))
    await w.orch.drain(timeout_seconds=10)

    assert (await w.orch.result(result.tx_id)).status is TxState.COMMITTED
    counts = await w.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (1, 1)
    charge = (await w.shop.effects("payments.charge"))[0]
    calls = [(c.call, c.outcome) for c in await w.shop.calls(key=charge.key)]
    assert calls[0] == ("apply", "unavailable")
    assert [c for c, _ in calls] == ["apply", "lookup", "apply"]  # lookup before the resend
    assert "http_503" in await _ledger_reasons(w, result.tx_id, charge.key)


async def test_timeout_past_the_client_deadline_is_resolved_by_lookup(
    http_world: HttpWorld,
) -> None:
    w = http_world
    w.shop.faults.add(
        FaultRule(
            FaultKind.TIMEOUT, provider="payments", action="charge", delay_s=CLIENT_TIMEOUT + 0.5
        )
    )

    result = await w.orch.execute(order_saga(), order("42"))
    await w.orch.drain(timeout_seconds=10)

    assert (await w.orch.result(result.tx_id)).status is TxState.COMMITTED
    counts = await w.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (1, 1)
    view = await w.orch.get(result.tx_id)
    op = next(o for o in view.operations if o.name == "charge")
    assert op.state is EffectState.CONFIRMED and op.lookups == 1
    assert "read_timeout" in await _ledger_reasons(w, result.tx_id, op.key)


async def test_late_original_after_a_timeout_is_fenced_out(http_world: HttpWorld) -> None:
    # The request is held *before* the effect: the client gives up, the lookup finds nothing,
    # the resend (fence 2) charges; the original then lands with fence 1 and gets a 412.
    w = http_world
    # The original must land after the lookup and the resend. They follow the client's timeout
    # at once, but on a loaded machine (the suite runs in several processes) "at once" has taken
    # over half a second, so the original is held well past that.
    delay = CLIENT_TIMEOUT + 3.0
    w.shop.faults.add(
        FaultRule(
            FaultKind.TIMEOUT,
            provider="payments",
            action="charge",
            delay_s=delay,
            effect_first=False,
        )
    )

    result = await w.orch.execute(order_saga(), order("42"))
    await w.orch.drain(timeout_seconds=10)
    assert (await w.orch.result(result.tx_id)).status is TxState.COMMITTED
    op = next(o for o in (await w.orch.get(result.tx_id)).operations if o.name == "charge")

    deadline = time.monotonic() + delay + 5
    while time.monotonic() < deadline:
        calls = await w.shop.calls(key=op.key)
        if len([c for c in calls if c.call == "apply"]) >= 2:
            break
        await asyncio.sleep(0.05)
    assert [(c.call, c.outcome) for c in calls] == [
        ("lookup", "not_found"),
        ("apply", "confirmed"),
        ("apply", "fenced_out"),
    ]
    assert (await w.shop.counts())["payments.charge"] == 1


async def test_indeterminate_503_after_the_effect_is_found_by_lookup(
    http_world: HttpWorld,
) -> None:
    w = http_world
    w.shop.faults.add(
        FaultRule(FaultKind.INDETERMINATE_5XX, provider="payments", action="charge", applied=True)
    )
    result = await w.orch.execute(order_saga(), order("42"))
    await w.orch.drain(timeout_seconds=10)

    assert (await w.orch.result(result.tx_id)).status is TxState.COMMITTED
    assert (await w.shop.counts())["payments.charge"] == 1


async def test_rejection_is_a_422_and_earlier_steps_are_compensated(
    http_world: HttpWorld,
) -> None:
    w = http_world
    w.shop.faults.add(FaultRule(FaultKind.REJECT, provider="payments", action="charge"))

    result = await w.orch.execute(order_saga(), order("42"))
    await w.orch.drain(timeout_seconds=10)

    final = await w.orch.result(result.tx_id)
    assert final.status is TxState.COMPENSATED
    counts = await w.shop.counts()
    assert (counts["inventory.reserve"], counts["inventory.release"]) == (1, 1)
    assert (counts["payments.charge"], counts["email.send"]) == (0, 0)
    assert await w.shop.stock("sku-1") == 100
    op = next(o for o in (await w.orch.get(result.tx_id)).operations if o.name == "charge")
    assert op.state is EffectState.FAILED
    assert "injected_rejection" in await _ledger_reasons(w, result.tx_id, op.key)


async def test_lookup_unavailable_keeps_the_charge_in_doubt_until_answered(
    http_world: HttpWorld,
) -> None:
    w = http_world
    w.shop.faults.add(FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge"))
    w.shop.faults.add(
        FaultRule(FaultKind.LOOKUP_UNAVAILABLE, provider="payments", action="charge", times=2)
    )

    result = await w.orch.execute(order_saga(), order("42"))
    await w.orch.drain(timeout_seconds=10)

    assert (await w.orch.result(result.tx_id)).status is TxState.COMMITTED
    counts = await w.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (1, 1)
    op = next(o for o in (await w.orch.get(result.tx_id)).operations if o.name == "charge")
    calls = [(c.call, c.outcome) for c in await w.shop.calls(key=op.key)]
    # The charge is never re-sent: after the lost response only lookups reach the shop, the
    # first two refused. On a loaded machine a "found" answer can miss the 1 s client deadline
    # and be asked again, so the shop's log (not a fixed count) says how many lookups there were.
    assert calls[:3] == [
        ("apply", "lost_response"),
        ("lookup", "unavailable"),
        ("lookup", "unavailable"),
    ]
    assert calls[3:] and set(calls[3:]) == {("lookup", "found")}
    assert op.lookups == len(calls) - 1


async def test_stale_worker_is_fenced_by_the_provider_with_412(http_world: HttpWorld) -> None:
    # test_fencing's scenario, its provider an HttpProvider: the stale apply is answered 412.
    w = http_world
    paused = test_fencing.PausingProvider(w.http_providers()[1], "charge")
    stale = await w.engine(call_timeout_seconds=30)
    stale.register_provider(paused)
    task = asyncio.create_task(stale.execute(order_saga(), order("42"), budget_seconds=0))
    await asyncio.wait_for(paused.reached.wait(), 10)

    healthy = await w.engine()
    healthy.store.advance_clock(stale.settings.lease_seconds + 1)
    await healthy.drain(timeout_seconds=10)
    paused.gate.set()
    stale_result = await asyncio.wait_for(task, 10)

    assert stale_result.status is TxState.COMMITTED
    counts = await w.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (1, 1)
    charge = (await w.shop.effects("payments.charge"))[0]
    assert [c.outcome for c in await w.shop.calls(key=charge.key)][-1] == "fenced_out"


async def test_fence_and_payload_mismatch_over_http(http_world: HttpWorld) -> None:
    payments = http_world.http_providers()[1]
    first = await payments.apply("charge", key="k-f", payload=CHARGE, fence=3)
    assert isinstance(first, Confirmed)
    assert await payments.apply("charge", key="k-f", payload=CHARGE, fence=2) == FencedOut(3)
    replay = await payments.apply("charge", key="k-f", payload=CHARGE, fence=3)
    assert replay == first
    mismatch = await payments.apply("charge", key="k-f", payload={**CHARGE, "amount": 1}, fence=4)
    assert mismatch == Rejected("idempotency_payload_mismatch")  # the 409
    invalid = await payments.apply("charge", key="k-i", payload={"currency": "EUR"}, fence=1)
    assert invalid == Rejected("invalid_payload")  # the code only, not the shop's message
    assert (await http_world.shop.counts())["payments.charge"] == 1


async def test_lookup_voids_a_key_it_never_saw(http_world: HttpWorld) -> None:
    payments = http_world.http_providers()[1]
    key = "order:42/charge?x=1"  # quoted into one path segment
    assert await payments.lookup("charge", key=key, payload=CHARGE) == NotFound(voided=False)
    voided = await payments.lookup("charge", key=key, payload=CHARGE, void_if_missing=True)
    assert voided == NotFound(voided=True)
    assert await payments.apply("charge", key=key, payload=CHARGE, fence=1) == Rejected("voided")
    assert (await http_world.shop.counts())["payments.charge"] == 0


async def test_connection_refused_fails_the_step_and_compensates(http_world: HttpWorld) -> None:
    w = http_world
    dead = f"http://127.0.0.1:{_closed_port()}"
    # Inventory and email live; payments points at a port nobody listens on.
    providers = w.http_providers()
    payments = w.http_providers(dead)[1]
    orch = await Orchestrator.open(
        w.urls.store, providers=[providers[0], payments, providers[2]], settings=fast_settings()
    )
    w.extra.append(orch)

    result = await orch.execute(order_saga(), order("42"))
    await orch.drain(timeout_seconds=10)

    final = await orch.result(result.tx_id)
    assert final.status is TxState.COMPENSATED
    view = await orch.get(result.tx_id)
    op = next(o for o in view.operations if o.name == "charge")
    assert op.state is EffectState.FAILED and op.lookups == 0
    counts = await w.shop.counts()
    assert (counts["inventory.reserve"], counts["inventory.release"]) == (1, 1)
    assert (counts["payments.charge"], counts["email.send"]) == (0, 0)
    assert await w.shop.calls(key=op.key) == []  # the shop never heard of it
    entries = await orch.ledger(result.tx_id)
    assert "not_sent:connection_refused" in _ledger_text(entries)


class Router:
    """One provider name, its actions served by different providers (to cut one action off)."""

    def __init__(self, name: str, routes: dict[str, Provider]) -> None:
        self._name = name
        self.routes = routes

    @property
    def name(self) -> str:
        return self._name

    def contract(self, action: str) -> ActionContract:
        return self.routes[action].contract(action)

    def actions(self) -> Mapping[str, ActionContract]:
        return {a: p.contract(a) for a, p in self.routes.items()}

    async def apply(
        self, action: str, *, key: str, payload: Mapping[str, Any], fence: int
    ) -> ApplyOutcome:
        return await self.routes[action].apply(action, key=key, payload=payload, fence=fence)

    async def lookup(
        self, action: str, *, key: str, payload: Mapping[str, Any], void_if_missing: bool = False
    ) -> LookupOutcome:
        return await self.routes[action].lookup(
            action, key=key, payload=payload, void_if_missing=void_if_missing
        )


async def test_unreachable_reversal_is_retried_not_parked(http_world: HttpWorld) -> None:
    # A refund or release that never left is in doubt (retried), not rejected: a rejected
    # reversal would park the saga for a person over a provider that was merely down.
    w = http_world
    live_inventory, payments, email = w.http_providers()
    dead_inventory = w.http_providers(f"http://127.0.0.1:{_closed_port()}")[0]
    inventory = Router("inventory", {"reserve": live_inventory, "release": dead_inventory})
    orch = await Orchestrator.open(
        w.urls.store, providers=[inventory, payments, email], settings=fast_settings()
    )
    w.extra.append(orch)
    w.shop.faults.add(FaultRule(FaultKind.REJECT, provider="payments", action="charge"))

    result = await orch.execute(order_saga(), order("42"), budget_seconds=0)

    view = await orch.get(result.tx_id)
    assert view.tx.status is TxState.COMPENSATING
    (release,) = view.compensations
    assert release.state is EffectState.UNKNOWN
    assert "not_sent:connection_refused" in _ledger_text(await orch.ledger(result.tx_id))
    assert (await w.shop.counts())["inventory.release"] == 0

    inventory.routes["release"] = live_inventory  # the provider is back
    await orch.drain(timeout_seconds=10)

    assert (await orch.result(result.tx_id)).status is TxState.COMPENSATED
    counts = await w.shop.counts()
    assert (counts["inventory.reserve"], counts["inventory.release"]) == (1, 1)
    assert await w.shop.stock("sku-1") == 100


# -- status-code classification (mock transport, no server) ------------------------------------


def _mock_provider(
    handler: Callable[[httpx.Request], httpx.Response], contract: ActionContract | None = None
) -> tuple[HttpProvider, httpx.AsyncClient]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    contract = contract or ActionContract("charge", compensation="refund", supports_void=True)
    action = HttpAction(contract, path="/v1/charges", lookup_path="/v1/charges/{key}")
    return HttpProvider("pay", "http://pay.test/", {"charge": action}, client=client), client


def _answer(status: int, body: Any = None, raw: bytes | None = None) -> httpx.Response:
    if raw is not None:
        return httpx.Response(status, content=raw)
    return httpx.Response(status, json=body) if body is not None else httpx.Response(status)


SECRET = "card 4242 4242 4242 4242 of Jane Doe was declined by issuer XYZ"


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, {"id": "ch_1", "amount": 5}, Confirmed("ch_1", {"id": "ch_1", "amount": 5})),
        (201, {"id": 17}, Confirmed("17", {"id": 17})),
        (200, {"amount": 5}, Unknown("malformed_response")),
        (200, None, Unknown("malformed_response")),
        (202, {"id": "ch_1"}, Unknown("http_202")),
        (302, None, Unknown("http_302")),
        (400, {"error": "invalid_payload: amount must be positive"}, Rejected("invalid_payload")),
        (402, {"error": {"code": "card_declined", "message": SECRET}}, Rejected("card_declined")),
        (403, {"code": "forbidden"}, Rejected("forbidden")),
        (404, None, Rejected("http_404")),
        (409, {"error": "idempotency_payload_mismatch"}, Rejected("idempotency_payload_mismatch")),
        (422, {"error": SECRET}, Rejected("card")),
        (422, {"message": SECRET}, Rejected("http_422")),
        (412, {"highest_fence": 9}, FencedOut(9)),
        (412, {"highest_fence": "9"}, FencedOut(5)),
        (408, None, Unknown("http_408")),
        (425, None, Unknown("http_425")),
        (429, {"error": "rate_limited"}, Unknown("http_429")),
        (500, {"error": SECRET}, Unknown("http_500")),
        (502, None, Unknown("http_502")),
        (503, None, Unknown("http_503")),
        (504, None, Unknown("http_504")),
        (418, {"error": "teapot"}, Unknown("http_418")),
    ],
)
async def test_apply_status_classification(status: int, body: Any, expected: object) -> None:
    provider, client = _mock_provider(lambda request: _answer(status, body))
    async with client:
        outcome = await provider.apply("charge", key="k", payload=CHARGE, fence=5)
    assert outcome == expected
    assert "4242" not in repr(outcome)


async def test_apply_sends_key_fence_and_json_body() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return _answer(200, {"id": "ch_1"})

    provider, client = _mock_provider(handler)
    async with client:
        await provider.apply("charge", key="op:1", payload={"b": 1, "a": "é"}, fence=7)
    (request,) = seen
    assert (request.method, str(request.url)) == ("POST", "http://pay.test/v1/charges")
    assert request.headers["Idempotency-Key"] == "op:1"
    assert request.headers["X-Fence-Token"] == "7"
    assert request.headers["Content-Type"] == "application/json"
    assert json.loads(request.content) == {"b": 1, "a": "é"}


async def test_no_fence_header_when_the_contract_does_not_fence() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return _answer(200, {"id": "m_1"})

    contract = ActionContract("charge", supports_fencing=False)
    provider, client = _mock_provider(handler, contract)
    async with client:
        await provider.apply("charge", key="k", payload={}, fence=7)
    assert "X-Fence-Token" not in seen[0].headers


@pytest.mark.parametrize(
    ("status", "body", "void", "expected", "query"),
    [
        (200, {"id": "ch_1", "amount": 5}, False, Found("ch_1", {"id": "ch_1", "amount": 5}), ""),
        (200, {"amount": 5}, False, Unavailable("malformed_response"), ""),
        (404, None, False, NotFound(voided=False), ""),
        (404, {"voided": True}, True, NotFound(voided=True), "void=1"),
        (404, {"voided": "yes"}, True, NotFound(voided=False), "void=1"),
        (410, None, False, Unavailable("http_410"), ""),
        (500, {"error": SECRET}, False, Unavailable("http_500"), ""),
        (503, None, True, Unavailable("http_503"), "void=1"),
    ],
)
async def test_lookup_status_classification(
    status: int, body: Any, void: bool, expected: object, query: str
) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return _answer(status, body)

    provider, client = _mock_provider(handler)
    async with client:
        outcome = await provider.lookup("charge", key="a/b c", payload=CHARGE, void_if_missing=void)
    assert outcome == expected
    assert seen[0].method == "GET"
    assert seen[0].url.raw_path.decode() == "/v1/charges/a%2Fb%20c" + (f"?{query}" if query else "")


@pytest.mark.parametrize(
    ("error", "apply_expected", "lookup_expected"),
    [
        (
            httpx.ConnectError("[Errno 111] refused"),
            Rejected("not_sent:connection_refused"),
            Unavailable("connection_refused"),
        ),
        (
            httpx.ConnectTimeout("slow"),
            Rejected("not_sent:connect_timeout"),
            Unavailable("connect_timeout"),
        ),
        (httpx.ReadTimeout("slow"), Unknown("read_timeout"), Unavailable("read_timeout")),
        (httpx.WriteTimeout("slow"), Unknown("write_timeout"), Unavailable("write_timeout")),
        (httpx.PoolTimeout("busy"), Unknown("pool_timeout"), Unavailable("pool_timeout")),
        (
            httpx.RemoteProtocolError("Server disconnected"),
            Unknown("connection_closed"),
            Unavailable("connection_closed"),
        ),
        (httpx.ReadError("reset by peer"), Unknown("read_error"), Unavailable("read_error")),
        (httpx.WriteError("broken pipe"), Unknown("write_error"), Unavailable("write_error")),
    ],
)
async def test_transport_errors(
    error: httpx.HTTPError, apply_expected: object, lookup_expected: object
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise error

    provider, client = _mock_provider(handler)
    async with client:
        assert await provider.apply("charge", key="k", payload=CHARGE, fence=1) == apply_expected
        assert await provider.lookup("charge", key="k", payload=CHARGE) == lookup_expected


@pytest.mark.parametrize(
    ("contract", "not_sent", "expected"),
    [
        (ActionContract("charge", compensation="refund"), None, Rejected),
        (ActionContract("charge", is_compensation=True), None, Unknown),
        (ActionContract("charge"), "unknown", Unknown),
        (ActionContract("charge", is_compensation=True), "rejected", Rejected),
    ],
)
async def test_not_sent_outcome_by_kind_of_action(
    contract: ActionContract, not_sent: Any, expected: type
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    action = HttpAction(contract, path="/c", lookup_path="/c/{key}", not_sent=not_sent)
    provider = HttpProvider("p", "http://p.test", {"charge": action}, client=client)
    async with client:
        outcome = await provider.apply("charge", key="k", payload={}, fence=1)
    assert outcome == expected("not_sent:connection_refused")


async def test_oversized_and_unserializable() -> None:
    provider, client = _mock_provider(
        lambda r: _answer(200, raw=b'{"id":"x","pad":"' + b"a" * 2_000_000 + b'"}')
    )
    async with client:
        assert await provider.apply("charge", key="k", payload=CHARGE, fence=1) == Unknown(
            "response_too_large"
        )
        assert await provider.lookup("charge", key="k", payload=CHARGE) == Unavailable(
            "response_too_large"
        )
        bad = await provider.apply("charge", key="k", payload={"x": {1, 2}}, fence=1)
    assert bad == Rejected("not_sent:payload_not_json")


def test_http_action_validation_and_protocol() -> None:
    contract = ActionContract("charge")
    with pytest.raises(ValueError, match="lookup_path"):
        HttpAction(contract, path="/c")
    with pytest.raises(ValueError, match="start with"):
        HttpAction(contract, path="c", lookup_path="/c/{key}")
    with pytest.raises(ValueError, match="both definite and indeterminate"):
        HttpAction(contract, path="/c", lookup_path="/c/{key}", definite_statuses=frozenset({503}))
    assert HttpAction(ActionContract("send", supports_lookup=False), path="/s").lookup_path is None
    assert short_code("invalid_payload: details", "x") == "invalid_payload"
    assert short_code("  ", "fallback") == "fallback"
    assert short_code(17, "fallback") == "fallback"
    assert len(short_code("a" * 500, "x")) == 64


async def test_fake_shop_http_providers_share_the_in_process_contracts(db_urls: DbUrls) -> None:
    async with await FakeShop.open(db_urls.provider) as shop:
        providers = fake_shop_http_providers("http://127.0.0.1:1")
        try:
            for http, local in zip(providers, shop.providers(), strict=True):
                assert isinstance(http, Provider)
                assert http.name == local.name
                assert dict(http.actions()) == dict(local.actions())
        finally:
            for p in providers:
                await p.aclose()


async def test_server_routes(http_world: HttpWorld) -> None:
    assert http_world.server is not None
    async with httpx.AsyncClient(base_url=http_world.server.url) as client:
        health = await client.get("/_health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert health.headers["connection"] == "close"
        assert (await client.post("/payments/nope", json={})).status_code == 404
        # An unknown action on the lookup route must not read as "never happened".
        assert (await client.get("/payments/nope/k")).status_code == 400
        assert (await client.get("/a/b/c/d")).status_code == 404
        assert (await client.put("/payments/charge", json={})).status_code == 405
        no_key = await client.post("/payments/charge", json=CHARGE, headers={"X-Fence-Token": "1"})
        assert (no_key.status_code, no_key.json()) == (400, {"error": "missing_idempotency_key"})
        no_fence = await client.post(
            "/payments/charge", json=CHARGE, headers={"Idempotency-Key": "k"}
        )
        assert no_fence.status_code == 400
        not_json = await client.post(
            "/payments/charge",
            content=b"{nope",
            headers={"Idempotency-Key": "k", "X-Fence-Token": "1"},
        )
        assert not_json.status_code == 400
    assert (await http_world.shop.counts())["payments.charge"] == 0


# -- the CLI, in a subprocess ---------------------------------------------------------------------


async def test_cli_fake_provider_serve(db_urls: DbUrls) -> None:
    port = _closed_port()  # free now; the server binds it next
    argv = [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "fake-provider",
        "serve",
        "--port",
        str(port),
        "--db",
        db_urls.provider,
        "--seed-stock",
        "sku-1=7",
    ]
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        # The server prints its URL once it listens; /_health must answer right after.
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert f"listening on http://127.0.0.1:{port}" in line, line
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=5) as client:
            health = await client.get("/_health")
        assert health.status_code == 200
        assert health.json()["providers"] == ["email", "inventory", "payments"]
        inventory = fake_shop_http_providers(base)[0]
        async with inventory:
            reserved = await inventory.apply(
                "reserve", key="cli-1", payload={"sku": "sku-1", "quantity": 7}, fence=1
            )
            assert isinstance(reserved, Confirmed)
            again = await inventory.apply(
                "reserve", key="cli-2", payload={"sku": "sku-1", "quantity": 1}, fence=1
            )
            assert again == Rejected("out_of_stock")  # the seeded stock, all taken
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.communicate()
    assert proc.returncode == 0, err.decode()
    async with await FakeShop.open(db_urls.provider) as shop:
        assert (await shop.counts())["inventory.reserve"] == 1


def test_cli_rejects_a_bad_stock_spec() -> None:
    from typer.testing import CliRunner

    from providers.fake.serve_cli import app

    run = CliRunner().invoke(app, ["serve", "--port", "0", "--db", "x", "--seed-stock", "sku"])
    assert run.exit_code == 2
    assert "SKU=UNITS" in run.output


def _serve(*args: str) -> tuple[int, str]:
    from typer.testing import CliRunner

    from providers.fake.serve_cli import app

    run = CliRunner().invoke(app, ["serve", "--port", "0", *args])
    return run.exit_code, run.output


@pytest.mark.parametrize(
    ("host", "message"),
    [
        # asyncio took "" for every interface, 0.0.0.0 and ::, and served the shop there.
        ("", "cannot serve on :0: --host is empty (0.0.0.0 or :: is every interface)"),
        # The idna codec's UnicodeError (a label over 63 characters) was a traceback.
        ("a" * 64, f"cannot serve on {'a' * 64}:0: not a valid host name"),
    ],
)
def test_cli_refuses_a_host_that_names_no_interface(
    host: str, message: str, tmp_path: Path
) -> None:
    target = tmp_path / "provider.db"
    code, output = _serve("--db", f"sqlite+aiosqlite:///{target}", "--host", host)
    assert code == 2, output
    assert output.strip() == f"error: {message}"
    assert not target.exists()  # refused before the database was opened


def test_cli_refuses_a_port_in_use_before_making_the_shops_tables(tmp_path: Path) -> None:
    import socket

    target = tmp_path / "provider.db"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output = _serve("--db", f"sqlite+aiosqlite:///{target}", "--port", str(port))
    assert code == 2, output
    assert output.startswith(f"error: cannot serve on 127.0.0.1:{port}: "), output
    assert not target.exists()  # it made the shop's tables, then found the port taken


@pytest.mark.parametrize(
    "spec", ["sku-1=2147483648", "sku-1=99999999999999999999", "sku-1=-1", f"{'s' * 129}=1"]
)
def test_cli_refuses_stock_the_table_cannot_hold(spec: str, tmp_path: Path) -> None:
    """OverflowError on SQLite, and on PostgreSQL (its stock column is a 32-bit INTEGER) a
    driver error that printed the SQL and its parameters."""
    target = tmp_path / "provider.db"
    code, output = _serve("--db", f"sqlite+aiosqlite:///{target}", "--seed-stock", spec)
    assert code == 2, output
    assert "Invalid value for --seed-stock" in output and "Traceback" not in output
    assert not target.exists()


def test_cli_says_why_the_database_cannot_be_opened(backend: str, tmp_path: Path) -> None:
    """It said only the exception's class (``cannot open the provider database
    (OperationalError)``); now the driver's reason too, never the password."""
    secret = "hunter2secret"
    if backend == "sqlite":
        target = tmp_path / "provider.db"
        target.write_text("not a database, " * 100)
        url = f"sqlite+aiosqlite:///{target}"
        reason = "file is not a database (DatabaseError)"
    else:
        from sqlalchemy import make_url

        from tests.conftest import pg_admin_url

        # Named as its password: the server's "does not exist" repeats it, and it is hidden.
        url = make_url(pg_admin_url()).set(password=secret, database=secret)
        url = url.render_as_string(hide_password=False)
        reason = ""
    code, output = _serve("--db", url)
    assert code == 2, output
    assert output.startswith("error: cannot open the provider database: "), output
    assert reason in output and secret not in output and "Traceback" not in output


def test_cli_says_an_in_memory_database_is_not_the_shops() -> None:
    code, output = _serve("--db", "sqlite+aiosqlite://")
    assert code == 2, output
    assert output.strip() == (
        "error: cannot open the provider database: the fake shop needs a SQLite file, not an "
        "in-memory database"
    )
