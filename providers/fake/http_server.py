"""The fake shop served over HTTP/1.1, so its faults cross a real socket.

::

    POST /{provider}/{action}            apply; JSON body = payload,
                                         headers Idempotency-Key and X-Fence-Token
    GET  /{provider}/{action}/{key}      lookup (?void=1 asks for a tombstone)
    GET  /_health                        200 {"status": "ok", ...}

===============================================  ==============================================
shop answer                                      HTTP answer
===============================================  ==============================================
Confirmed(remote_id, result)                     200 ``{...result, "id": remote_id}``
Rejected("idempotency_payload_mismatch")         409 ``{"error": ...}``
Rejected(reason)                                 422 ``{"error": code, "message"?: detail}``
FencedOut(n)                                     412 ``{"error": "fenced_out", "highest_fence": n}``
Unknown (INDETERMINATE_5XX)                      503 ``{"error": "indeterminate"}``
ProviderUnavailable (FAIL_BEFORE)                503 ``{"error": "unavailable"}``
ResponseLost (LOSE_RESPONSE)                     the socket is closed, no byte of an answer
TIMEOUT                                          the shop's own sleep holds the answer back
Found / NotFound(voided) / Unavailable           200 ``{..., "id"}`` / 404 ``{"voided": b}`` / 503
===============================================  ==============================================

A bad request (no idempotency key, no fence where the contract honours fencing, a body that is
not a JSON object) is a 400 and reaches no provider. An unknown provider or action is a 404 on
apply (nothing was done) but a **400 on lookup**: a 404 there would read as an authoritative
"never happened".

The server is a small ``asyncio.start_server`` loop rather than uvicorn: it adds no dependency
and lets a fault close the socket at exactly the moment the fake provider says the response was
lost (after the effect committed, before any byte of the answer). Every response carries
``Connection: close``; one request per connection keeps the parser small.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from types import TracebackType
from typing import Any, Final
from urllib.parse import parse_qs, unquote

import httpx

from providers.contract import (
    Confirmed,
    FencedOut,
    Found,
    NotFound,
    Provider,
    Rejected,
    Unavailable,
    Unknown,
)
from providers.fake.actions import build_specs
from providers.fake.faults import ProviderUnavailable, ResponseLost
from providers.fake.shop import FakeShop
from providers.http import HttpAction, HttpProvider

log = logging.getLogger(__name__)

#: Largest request head (request line + headers) and body the server accepts.
MAX_HEAD_BYTES: Final = 64 * 1024
MAX_BODY_BYTES: Final = 1 << 20
#: How long a client may take to send its request before the connection is dropped.
READ_TIMEOUT_SECONDS: Final = 30.0
HEALTH_PATH: Final = "/_health"


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    segments: list[str]  # percent-decoded path segments
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names
    body: bytes


class _BadRequest(Exception):
    """The request cannot be parsed; answered with ``status`` and closed."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(code)
        self.status = status
        self.code = code


class _DropConnection(Exception):
    """Close the socket without writing an answer (an injected lost response)."""


class FakeShopServer:
    """Serves one :class:`FakeShop` on ``host:port`` (``port=0`` picks a free one).

    Start with :meth:`start` (or :func:`serve`), stop with :meth:`stop` (or ``async with``).
    Stopping cancels requests still in progress, such as one held back by a TIMEOUT fault.
    """

    def __init__(self, shop: FakeShop, host: str = "127.0.0.1", port: int = 0) -> None:
        self.shop = shop
        self.host = host
        self._requested_port = port
        self._providers: dict[str, Provider] = {p.name: p for p in shop.providers()}
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False

    @property
    def port(self) -> int:
        """The port bound (useful with ``port=0``); kept after :meth:`stop`."""
        if self._port is None:
            raise RuntimeError("the server was never started")
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port``, the base URL for :func:`fake_shop_http_providers`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and start accepting connections."""
        if self._server is not None:
            raise RuntimeError("the server is already started")
        self._stopping = False
        self._server = await asyncio.start_server(
            self._handle, self.host, self._requested_port, limit=MAX_HEAD_BYTES
        )
        self._port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting, cancel requests in progress and wait for them to end."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping = True
        server.close()
        # A connection accepted just before close() has a task that has not run yet: let it
        # start (and see _stopping) before taking the list of tasks to cancel.
        await asyncio.sleep(0)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()

    async def __aenter__(self) -> FakeShopServer:
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def __repr__(self) -> str:
        where = self.url if self._server is not None else "not serving"
        return f"FakeShopServer({where})"

    # -- one connection -----------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            if self._stopping:
                return  # accepted in the last moment before stop(): answer nothing
            try:
                async with asyncio.timeout(READ_TIMEOUT_SECONDS):
                    request = await _read_request(reader)
            except _BadRequest as bad:
                await _respond(writer, bad.status, {"error": bad.code})
                return
            if request is None:  # the client went away before sending a request
                return
            status, body = await self._dispatch(request)
            await _respond(writer, status, body)
        except _DropConnection:
            # No byte of an answer: the client sees the connection closed after its request.
            pass
        except (ConnectionError, TimeoutError):
            pass  # the client gave up (its timeout) or never finished its request
        except asyncio.CancelledError:
            # Only stop() cancels a handler, and nothing awaits it but stop()'s gather; ending
            # quietly spares asyncio's "unhandled exception in client_connected_cb" report.
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            if task is not None:
                self._tasks.discard(task)

    async def _dispatch(self, request: _Request) -> tuple[int, Mapping[str, Any]]:
        segments = request.segments
        if request.method == "GET" and segments == [HEALTH_PATH.lstrip("/")]:
            return 200, {"status": "ok", "providers": sorted(self._providers)}
        if len(segments) == 2:
            if request.method != "POST":
                return 405, {"error": "method_not_allowed"}
            return await self._apply(request, segments[0], segments[1])
        if len(segments) == 3:
            if request.method != "GET":
                return 405, {"error": "method_not_allowed"}
            return await self._lookup(request, segments[0], segments[1], segments[2])
        return 404, {"error": "no_route"}

    def _provider(self, provider: str, action: str) -> Provider | None:
        found = self._providers.get(provider)
        if found is None or action not in found.actions():
            return None
        return found

    async def _apply(
        self, request: _Request, provider_name: str, action: str
    ) -> tuple[int, Mapping[str, Any]]:
        provider = self._provider(provider_name, action)
        if provider is None:
            return 404, {"error": "unknown_action"}
        key = request.headers.get("idempotency-key", "")
        if not key:
            return 400, {"error": "missing_idempotency_key"}
        fence_text = request.headers.get("x-fence-token")
        if fence_text is None:
            if provider.contract(action).supports_fencing:
                return 400, {"error": "missing_fence_token"}
            fence = 0
        else:
            try:
                fence = int(fence_text)
            except ValueError:
                return 400, {"error": "invalid_fence_token"}
        try:
            payload = json.loads(request.body)
        except ValueError:
            return 400, {"error": "invalid_json"}
        if not isinstance(payload, dict):
            return 400, {"error": "invalid_payload"}

        try:
            outcome = await provider.apply(action, key=key, payload=payload, fence=fence)
        except ResponseLost:
            raise _DropConnection from None
        except ProviderUnavailable:
            return 503, {"error": "unavailable"}
        except Exception:
            # The effect may or may not have committed: say so with a 500, never the text.
            log.exception("apply %s.%s failed", provider_name, action)
            return 500, {"error": "internal"}
        if isinstance(outcome, Confirmed):
            return 200, {**outcome.result, "id": outcome.remote_id}
        if isinstance(outcome, Rejected):
            code, _, message = outcome.reason.partition(": ")
            status = 409 if code == "idempotency_payload_mismatch" else 422
            return status, {"error": code, **({"message": message} if message else {})}
        if isinstance(outcome, FencedOut):
            return 412, {"error": "fenced_out", "highest_fence": outcome.highest_fence}
        assert isinstance(outcome, Unknown)
        return 503, {"error": "indeterminate"}

    async def _lookup(
        self, request: _Request, provider_name: str, action: str, key: str
    ) -> tuple[int, Mapping[str, Any]]:
        provider = self._provider(provider_name, action)
        if provider is None:
            return 400, {"error": "unknown_action"}
        void = request.query.get("void", ["0"])[-1] in ("1", "true")
        try:
            # The payload only labels a tombstone in the shop's table; a GET carries none.
            outcome = await provider.lookup(action, key=key, payload={}, void_if_missing=void)
        except Exception:
            log.exception("lookup %s.%s failed", provider_name, action)
            return 503, {"error": "unavailable"}
        if isinstance(outcome, Found):
            return 200, {**outcome.result, "id": outcome.remote_id}
        if isinstance(outcome, NotFound):
            return 404, {"error": "not_found", "voided": outcome.voided}
        assert isinstance(outcome, Unavailable)
        return 503, {"error": "unavailable"}


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    """One request off the stream; ``None`` on a clean EOF before it; raises _BadRequest."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    except asyncio.LimitOverrunError:
        raise _BadRequest(431, "headers_too_large") from None
    try:
        lines = head[:-4].decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise _BadRequest(400, "bad_request_line") from None
    if not version.startswith("HTTP/1."):
        raise _BadRequest(505, "http_version_not_supported")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _BadRequest(400, "bad_header")
        headers[name.lower()] = value.strip()
    if "transfer-encoding" in headers:
        # Our clients always send Content-Length; chunked uploads are not needed here.
        raise _BadRequest(501, "transfer_encoding_not_supported")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise _BadRequest(400, "bad_content_length") from None
    if length < 0:
        raise _BadRequest(400, "bad_content_length")
    if length > MAX_BODY_BYTES:
        raise _BadRequest(413, "body_too_large")
    try:
        body = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError:
        return None
    path, _, query = target.partition("?")
    if not path.startswith("/"):
        raise _BadRequest(400, "bad_target")
    # Split before decoding, so a key with an encoded "/" stays one segment.
    segments = [unquote(part) for part in path[1:].split("/")]
    return _Request(method.upper(), segments, parse_qs(query), headers, body)


async def _respond(writer: asyncio.StreamWriter, status: int, body: Mapping[str, Any]) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    reason = HTTPStatus(status).phrase
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    )
    writer.write(head.encode("latin-1") + data)
    await writer.drain()


async def serve(shop: FakeShop, host: str = "127.0.0.1", port: int = 0) -> FakeShopServer:
    """Start serving ``shop``; the caller stops the returned server."""
    server = FakeShopServer(shop, host, port)
    await server.start()
    return server


def fake_shop_http_actions(
    dedup_window_seconds: float = 86400.0,
) -> dict[str, dict[str, HttpAction]]:
    """The HTTP mapping of every shop action, with the in-process fake's own contracts.

    ``email.send`` is the shop's outbox notification: a request that never left is retried
    (unknown), never given up on after the commit. Reversals are retried by default.
    """
    return {
        provider: {
            action: HttpAction(
                spec.contract,
                path=f"/{provider}/{action}",
                lookup_path=f"/{provider}/{action}/{{key}}",
                not_sent="unknown" if (provider, action) == ("email", "send") else None,
            )
            for action, spec in actions.items()
        }
        for provider, actions in build_specs(dedup_window_seconds).items()
    }


def fake_shop_http_providers(
    base_url: str,
    *,
    timeout: float = 5.0,
    client: httpx.AsyncClient | None = None,
    dedup_window_seconds: float = 86400.0,
) -> list[HttpProvider]:
    """HTTP providers (inventory, payments, email) for a shop served at ``base_url``.

    The contracts are the in-process fake's (pass the shop's ``dedup_window_seconds`` if it is
    not the default). Without ``client`` each provider opens its own; close them with
    :meth:`HttpProvider.aclose`.
    """
    return [
        HttpProvider(name, base_url, actions, client=client, timeout=timeout)
        for name, actions in fake_shop_http_actions(dedup_window_seconds).items()
    ]


__all__ = [
    "HEALTH_PATH",
    "FakeShopServer",
    "fake_shop_http_actions",
    "fake_shop_http_providers",
    "serve",
]
