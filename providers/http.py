"""A declarative adapter for REST providers: one :class:`HttpAction` per action, no code.

::

    payments = HttpProvider(
        "payments",
        "https://api.example.com",
        {
            "charge": HttpAction(
                ActionContract("charge", compensation="refund", echo_fields=("amount",)),
                path="/payments/charge",
                lookup_path="/payments/charge/{key}",
            ),
            "refund": HttpAction(ActionContract("refund", is_compensation=True), ...),
        },
        headers={"Authorization": "Bearer ..."},
    )
    async with payments:
        orch = await Orchestrator.open(url, providers=[payments])

``apply`` sends the payload as the JSON body with the idempotency key in ``Idempotency-Key``
and, when the contract honours fencing, the fence in ``X-Fence-Token``. ``lookup`` asks
``GET lookup_path`` with ``{key}`` substituted (URL-quoted; ``?void=1`` when the engine asks
for a tombstone). The answer is classified by status code:

=====================================  ===============================================
apply answer                           outcome
=====================================  ===============================================
200, 201 with a JSON object with id    ``Confirmed(body[id], body)``
200, 201 without one                   ``Unknown("malformed_response")``
``fenced_status`` (412)                ``FencedOut(body["highest_fence"])``
``definite_statuses`` (400 402 403     ``Rejected(code)``, ``code`` a short token from
404 409 422)                           ``body["error"]`` / ``body["code"]``
``indeterminate_statuses`` (408 425    ``Unknown("http_<status>")``
429 500 502 503 504)
any other status (202, 3xx, 418 ...)   ``Unknown("http_<status>")``
ConnectError, ConnectTimeout           ``Rejected("not_sent:connection_refused"|
                                       "not_sent:connect_timeout")``; ``Unknown`` with
                                       the same code for compensations (see below)
ReadTimeout, WriteTimeout, PoolTimeout ``Unknown("read_timeout"|...)``
RemoteProtocolError, ReadError, ...    ``Unknown("connection_closed"|"read_error"|...)``
=====================================  ===============================================

The id is taken as the provider gives it, whatever its length: the engine bounds what it
records (``providers.contract.bounded_remote_id``), so every provider is held to the same rule.

Lookup: 200 with an id is ``Found``, 404 is ``NotFound(voided=body["voided"])``, anything
else (another status, a malformed body, any transport error) is ``Unavailable``.

Why anything unclassified is *unknown*: it is the only answer that cannot lose money. The
engine looks an unknown effect up before it sends again, so a wrong "unknown" costs a lookup,
while a wrong "rejected" compensates a charge that went through.

Why a refused connection is a *rejection* (for forward steps): ``httpx.ConnectError`` and
``httpx.ConnectTimeout`` are raised only while the TCP (and TLS) connection is being set up,
before a single byte of the request is written, so the provider cannot hold an effect from
*this* request. Answering ``Unknown`` instead would make the engine poll a provider it cannot
reach until the retry budget parks the saga for a person; ``Rejected`` fails the step at once
and compensates the earlier steps, which is what "the provider never got it" calls for. The
reason says ``not_sent:`` so the ledger shows it was not a business refusal; a retry policy for
unreachable providers can be layered on later. One limit, which this answer shares with the
engine's resend after an authoritative ``NotFound``: it speaks for this request only. An
*earlier* attempt with the same key still in flight at the provider is not covered by it; the
lookup-first protocol (and a void tombstone where the contract supports it) guards against such
a late original.

Compensation actions (``contract.is_compensation``) answer ``Unknown("not_sent:...")`` instead:
a reversal must eventually happen, and the engine parks a saga whose reversal was *rejected* at
once, while an unknown one is looked up and retried within the compensation budget. Actions
used as outbox notifications (after the commit, where nothing is left to compensate) should say
``not_sent="unknown"`` for the same reason; :attr:`HttpAction.not_sent` overrides the default
either way.

Reasons are short codes only (a letter, then at most 63 of ``[A-Za-z0-9_.:-]``): no response body
and no exception text is ever copied into an outcome, so nothing a provider says can leak into
the ledger or an error envelope.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any, Final, Literal
from urllib.parse import quote

import httpx

from providers.contract import (
    ActionContract,
    ApplyOutcome,
    Confirmed,
    FencedOut,
    Found,
    JsonObject,
    LookupOutcome,
    NotFound,
    Rejected,
    Unavailable,
    Unknown,
    UnknownAction,
)

#: Statuses that prove the provider did not, and will not, act on the request.
DEFINITE_STATUSES: Final = frozenset({400, 402, 403, 404, 409, 422})
#: Statuses after which the effect may or may not exist.
INDETERMINATE_STATUSES: Final = frozenset({408, 425, 429, 500, 502, 503, 504})
#: 2xx answers that carry the effect (202 Accepted does not: the work is not done yet).
CONFIRMED_STATUSES: Final = frozenset({200, 201})
#: Bodies larger than this are not parsed (the outcome degrades to unknown / unavailable).
MAX_RESPONSE_BYTES: Final = 1 << 20

NotSent = Literal["rejected", "unknown"]

_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_.:\-]*")
_MAX_CODE = 64


@dataclass(frozen=True, slots=True)
class HttpAction:
    """How one provider action maps onto HTTP."""

    contract: ActionContract
    #: Path of the apply request, relative to the provider's base URL.
    path: str
    method: str = "POST"
    #: Path of the lookup; ``{key}`` is replaced by the URL-quoted idempotency key. Required
    #: when the contract says ``supports_lookup``.
    lookup_path: str | None = None
    lookup_method: str = "GET"
    idempotency_header: str = "Idempotency-Key"
    #: Sent only when the contract says ``supports_fencing``; ``None`` never sends it.
    fence_header: str | None = "X-Fence-Token"
    #: Field of the JSON answer that names the effect at the provider.
    remote_id_field: str = "id"
    #: Fields of an error answer tried, in order, for the short reason code.
    error_fields: tuple[str, ...] = ("error", "code")
    #: Field of the ``fenced_status`` answer carrying the provider's highest fence.
    fence_field: str = "highest_fence"
    #: Field of a lookup's 404 answer saying the key is void (a tombstone exists).
    voided_field: str = "voided"
    #: Query parameter that asks the lookup to void a key it never saw.
    void_param: str = "void"
    definite_statuses: frozenset[int] = DEFINITE_STATUSES
    indeterminate_statuses: frozenset[int] = INDETERMINATE_STATUSES
    #: Status meaning "a newer fence was seen"; ``None`` if the provider has none.
    fenced_status: int | None = 412
    #: The outcome of a request that provably never left (connection refused or connect
    #: timeout). ``None``: ``"rejected"``, or ``"unknown"`` for a compensation action.
    not_sent: NotSent | None = None

    def not_sent_outcome(self, code: str) -> Rejected | Unknown:
        """What a request that never reached the provider answers (see the module docstring)."""
        mode = self.not_sent or ("unknown" if self.contract.is_compensation else "rejected")
        return Unknown(code) if mode == "unknown" else Rejected(code)

    def __post_init__(self) -> None:
        if not self.path.startswith("/"):
            raise ValueError(f"path must start with '/', not {self.path!r}")
        if self.contract.supports_lookup:
            if self.lookup_path is None:
                raise ValueError(
                    f"action {self.contract.name!r} supports lookup but has no lookup_path"
                )
            if "{key}" not in self.lookup_path:
                raise ValueError("lookup_path must contain '{key}'")
        overlap = self.definite_statuses & self.indeterminate_statuses
        if overlap:
            raise ValueError(f"statuses both definite and indeterminate: {sorted(overlap)}")
        if self.fenced_status is not None and self.fenced_status in (
            self.definite_statuses | self.indeterminate_statuses
        ):
            raise ValueError("fenced_status must not also be definite or indeterminate")


def short_code(value: object, fallback: str) -> str:
    """The leading token of ``value`` as a reason code, or ``fallback``.

    ``"invalid_payload: amount must be ..."`` becomes ``"invalid_payload"``: only the machine
    part of a provider's message is kept, bounded, so no provider prose is ever recorded.
    """
    if isinstance(value, str):
        match = _CODE.match(value.strip())
        if match:
            code = match.group(0)[:_MAX_CODE].rstrip(":.-")
            return code or fallback
    return fallback


def _transport_code(exc: httpx.HTTPError) -> str:
    # Named explicitly so the ledger reads well; the order matters (subclasses first).
    if isinstance(exc, httpx.ReadTimeout):
        return "read_timeout"
    if isinstance(exc, httpx.WriteTimeout):
        return "write_timeout"
    if isinstance(exc, httpx.PoolTimeout):
        return "pool_timeout"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "connection_closed"
    if isinstance(exc, httpx.ReadError):
        return "read_error"
    if isinstance(exc, httpx.WriteError):
        return "write_error"
    if isinstance(exc, httpx.ProtocolError):
        return "protocol_error"
    return "transport_error"


class _BodyTooLarge(Exception):
    pass


class HttpProvider:
    """A :class:`~providers.contract.Provider` over a REST API, configured by :class:`HttpAction`.

    Owns its :class:`httpx.AsyncClient` unless one is passed in; close it with :meth:`aclose`
    (or ``async with``). ``timeout`` bounds every request (it overrides the client's own); keep
    it below the engine's ``call_timeout_seconds`` so the adapter, not the engine, names the
    timeout. ``headers`` (authentication, say) go with every request.
    """

    def __init__(
        self,
        name: str,
        base_url: str,
        actions: Mapping[str, HttpAction],
        *,
        client: httpx.AsyncClient | None = None,
        timeout: float = 10.0,
        headers: Mapping[str, str] | None = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        if not name:
            raise ValueError("name must not be empty")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        for key, spec in actions.items():
            if spec.contract.name != key:
                raise ValueError(f"action {key!r} carries the contract of {spec.contract.name!r}")
        self._name = name
        self._base_url = base_url.rstrip("/")
        self._actions = dict(actions)
        self._contracts = MappingProxyType({a: s.contract for a, s in self._actions.items()})
        self._timeout = httpx.Timeout(timeout)
        self._headers = dict(headers or {})
        self._max_bytes = max_response_bytes
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient()

    # -- Provider protocol --------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The provider's name as steps reference it."""
        return self._name

    @property
    def base_url(self) -> str:
        """The URL every action path is relative to."""
        return self._base_url

    def contract(self, action: str) -> ActionContract:
        """The contract of ``action``; raises :class:`UnknownAction` if there is none."""
        return self._action(action).contract

    def actions(self) -> Mapping[str, ActionContract]:
        """Every action this provider offers."""
        return self._contracts

    async def apply(
        self, action: str, *, key: str, payload: JsonObject, fence: int
    ) -> ApplyOutcome:
        """Send ``action`` once with ``key``; classify the answer (see the module table)."""
        spec = self._action(action)
        try:
            body = json.dumps(dict(payload), separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError):
            # Nothing was sent: the request could not even be written.
            return Rejected("not_sent:payload_not_json")
        headers = {**self._headers, "Content-Type": "application/json"}
        headers[spec.idempotency_header] = key
        if spec.fence_header is not None and spec.contract.supports_fencing:
            headers[spec.fence_header] = str(fence)
        request = self._client.build_request(
            spec.method,
            self._base_url + spec.path,
            content=body.encode(),
            headers=headers,
            timeout=self._timeout,
        )
        try:
            status, answer = await self._send(request)
        except httpx.ConnectTimeout:
            return spec.not_sent_outcome("not_sent:connect_timeout")
        except httpx.ConnectError:
            return spec.not_sent_outcome("not_sent:connection_refused")
        except httpx.HTTPError as exc:
            return Unknown(_transport_code(exc))
        except _BodyTooLarge:
            return Unknown("response_too_large")
        return self._classify_apply(spec, status, answer, fence)

    async def lookup(
        self, action: str, *, key: str, payload: JsonObject, void_if_missing: bool = False
    ) -> LookupOutcome:
        """Ask what became of ``key``: 200 found, 404 not found, anything else unavailable."""
        spec = self._action(action)
        if spec.lookup_path is None:
            return Unavailable("no_lookup")
        path = spec.lookup_path.replace("{key}", quote(key, safe=""))
        params = {spec.void_param: "1"} if void_if_missing and spec.contract.supports_void else None
        request = self._client.build_request(
            spec.lookup_method,
            self._base_url + path,
            params=params,
            headers=self._headers,
            timeout=self._timeout,
        )
        try:
            status, answer = await self._send(request)
        except httpx.ConnectTimeout:
            return Unavailable("connect_timeout")
        except httpx.ConnectError:
            return Unavailable("connection_refused")
        except httpx.HTTPError as exc:
            return Unavailable(_transport_code(exc))
        except _BodyTooLarge:
            return Unavailable("response_too_large")
        if status == 200:
            remote_id = _remote_id(answer, spec.remote_id_field)
            if remote_id is None or not isinstance(answer, dict):
                return Unavailable("malformed_response")
            return Found(remote_id, answer)
        if status == 404:
            voided = isinstance(answer, dict) and answer.get(spec.voided_field) is True
            return NotFound(voided=voided)
        return Unavailable(f"http_{status}")

    # -- lifecycle ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the HTTP client if this provider created it."""
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> HttpProvider:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"HttpProvider({self._name!r}, {self._base_url!r}, actions={sorted(self._actions)})"

    # -- internals ----------------------------------------------------------------------------

    def _action(self, action: str) -> HttpAction:
        try:
            return self._actions[action]
        except KeyError:
            offered = ", ".join(sorted(self._actions)) or "none"
            raise UnknownAction(
                f"provider {self._name!r} has no action {action!r} (it offers: {offered})"
            ) from None

    async def _send(self, request: httpx.Request) -> tuple[int, Any]:
        """Status and parsed JSON body (``None`` if absent or not JSON), reading at most the cap."""
        # No redirects: a 3xx is unclassified (unknown), never silently re-sent elsewhere.
        response = await self._client.send(request, stream=True, follow_redirects=False)
        try:
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > self._max_bytes:
                    raise _BodyTooLarge
                chunks.append(chunk)
        finally:
            await response.aclose()
        raw = b"".join(chunks)
        try:
            answer = json.loads(raw) if raw else None
        except ValueError:
            answer = None
        return response.status_code, answer

    @staticmethod
    def _classify_apply(spec: HttpAction, status: int, answer: Any, fence: int) -> ApplyOutcome:
        if status in CONFIRMED_STATUSES:
            remote_id = _remote_id(answer, spec.remote_id_field)
            if remote_id is None or not isinstance(answer, dict):
                # It said yes but not to what: the effect may exist, so find it by lookup.
                return Unknown("malformed_response")
            return Confirmed(remote_id, answer)
        if spec.fenced_status is not None and status == spec.fenced_status:
            highest = answer.get(spec.fence_field) if isinstance(answer, dict) else None
            if isinstance(highest, bool) or not isinstance(highest, int):
                # The provider refused our fence without naming its own: ours is a lower bound.
                highest = fence
            return FencedOut(highest)
        if status in spec.definite_statuses:
            return Rejected(_error_code(answer, spec.error_fields, f"http_{status}"))
        return Unknown(f"http_{status}")


def _remote_id(answer: Any, field_name: str) -> str | None:
    if not isinstance(answer, dict):
        return None
    value = answer.get(field_name)
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        return None
    return str(value)


def _error_code(answer: Any, fields: tuple[str, ...], fallback: str) -> str:
    if isinstance(answer, dict):
        for name in fields:
            value = answer.get(name)
            if isinstance(value, dict):
                # {"error": {"code": "card_declined", "message": "..."}} (Stripe's shape).
                value = value.get("code")
            code = short_code(value, "")
            if code:
                return code
    return fallback


__all__ = [
    "CONFIRMED_STATUSES",
    "DEFINITE_STATUSES",
    "INDETERMINATE_STATUSES",
    "MAX_RESPONSE_BYTES",
    "HttpAction",
    "HttpProvider",
    "NotSent",
    "short_code",
]
