"""The HTTP face of the commands layer: seed 000's routes over :class:`CommandService`.

::

    app = create_app(orch, AuthSettings(jwt_secret=...))   # any ASGI server; ``agent-txn serve``

    POST   /v1/commands                                         author a command       201
    GET    /v1/commands?skip&limit                              list (newest first)
    GET    /v1/commands/{command_id}
    PUT    /v1/commands/{command_id}                            replace (CAS on its digest)
    DELETE /v1/commands/{command_id}                            soft delete            204
    POST   /v1/commands/{command_id}/execute                    run once, as the caller
    POST   /v1/commands/{command_id}/query                      query-mode commands
    GET    /v1/commands/{command_id}/executions?skip&limit      audit records, newest first
    GET    /v1/commands/{command_id}/executions/{execution_id}
    POST   /v1/commands/{command_id}/prepare                    stage a plan for the person
    POST   /v1/agent/execute                                    run the confirmed plan once
    POST   /v1/agent/status                                     the plan's tool result now
    POST   /v1/agent/delivered                                  the reply reached the room
    POST   /v1/staged-changes/{staged_change_id}/approve        run a plan waiting for approval
    POST   /v1/staged-changes/{staged_change_id}/reject         release it without running
    GET    /v1/ops/deliveries?room_id                           operators: a room's markers
    POST   /v1/ops/deliveries/acknowledge                       operators: release markers
    POST   /v1/ops/executions/prune                             operators: retention prune
    POST   /v1/ops/callbacks/requeue                            operators: lost callbacks
    GET    /healthz                                             liveness, no credentials

This module only translates: HTTP in, :class:`~orchestrator.commands.CommandService` (or
:class:`~orchestrator.agent.AgentToolbox`, :mod:`orchestrator.ops`) call, HTTP out. Every decision
(which check comes first, what is written, who may see what) is the service's, so the Python API
and the REST API cannot drift apart. The checks made here are who counts as an operator for the
``/v1/ops`` routes (:func:`current_operator`), which the ops module leaves to its callers, and
that a JWT's ``sub`` names a principal of this tenant at all (:func:`current_caller`).

Credentials: ``Authorization: Bearer <JWT>`` (:func:`~orchestrator.authz.authenticate_jwt`) or
``X-API-Key`` (:func:`~orchestrator.authz.authenticate_api_key`, which command routes then refuse
with 403 ``jwt_required``); neither is the uniform 403 ``principal_not_authorized``. A caller
built here is always ``jwt`` or ``api_key``, never ``trusted``.

The agent routes (prepare, ``/v1/agent/*``), the approval routes and the operator routes take a
JWT only (an API key is 403 ``jwt_required``); ``room`` and ``ai`` claims bind the caller to a room
and mark it as an agent. ``/v1/agent/execute`` and ``/status`` always answer 200 with exactly the
closed tool result ``{status, action, error, retryable, guidance[, reason]}`` — the outcome is in
the result — unless no tool ran at all (credentials, malformed body) or the store failed under it.

Every error leaves as ``{"detail": <closed envelope>}`` (phase ``author`` on authoring routes,
``stage`` on the agent and approval routes, ``execute`` elsewhere) — except
``command_contract_mismatch``, whose body seed 000 fixes to exactly
``{"detail": {"error": "command_contract_mismatch"}}``. Validation problems name the
field and the kind of problem, never the value sent; anything unexpected is logged and answered
with the generic 500 envelope, so neither provider nor database text can leak.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import structlog
from fastapi import Depends, FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ledger.errors import StoreBusy, StoreUnavailable, ValueNotStorable
from orchestrator import authz, ops
from orchestrator.authz import AuthSettings, Caller
from orchestrator.commands import MAX_LIMIT, MAX_SKIP, UNCHANGED, Outcome
from orchestrator.engine import Orchestrator
from orchestrator.errors import (
    AgentTxnError,
    InputLimitExceeded,
    LockConflict,
    PrincipalNotAuthorized,
    StoreUnavailableError,
    ValueNotStorableError,
    envelope,
)

log = structlog.get_logger(__name__)

#: Largest request body read at all. The budgets that matter (definition 1 MiB, inputs 1 MiB,
#: both as canonical JSON) are the service's; this only stops a client from making the server
#: buffer an unbounded body before those can run. Pretty-printed JSON is larger than canonical.
MAX_BODY_BYTES: Final = 4 * 1_048_576
#: Longest id a path or body carries (ids are 32 hex digits, uuid4 or time-ordered UUIDv7;
#: principals' ids are at most 64).
MAX_ID_LENGTH: Final = 64
#: Ids in paths: no NUL, no spaces, no slashes — nothing a database or a log line chokes on.
ID_PATTERN: Final = r"^[A-Za-z0-9._:-]{1,64}$"
#: Markers one acknowledge request may name.
MAX_ACKNOWLEDGE: Final = 200
#: A requeue age past this (~31 700 years) already means "older than every run" (the cutoff is
#: clamped to the epoch); finite ages above it are clamped to it, so converting seconds to
#: milliseconds can never overflow to infinity. Non-finite and negative ages pass through and
#: are refused by :func:`orchestrator.ops.requeue_callbacks`.
MAX_REQUEUE_AGE_SECONDS: Final = 1e12
#: Validation errors reported per response (a fuzzer's body can have thousands).
MAX_REPORTED_ERRORS: Final = 20
#: Longest field name echoed in a validation error (extra keys are the client's text).
MAX_FIELD_CHARS: Final = 128
#: Seed 000 fixes this body exactly: no message, no envelope, nothing to learn from.
CONTRACT_MISMATCH: Final = "command_contract_mismatch"
REPLAYED_HEADER: Final = "Idempotent-Replayed"
EXECUTION_HEADER: Final = "X-Execution-Id"

AUTHORING: Final = "authoring"
EXECUTION: Final = "execution"
AGENT: Final = "agent"
APPROVALS: Final = "approvals"
OPERATIONS: Final = "operations"
#: The envelope phase of each route tag (a route's first mapped tag decides; else ``execute``).
TAG_PHASES: Final = {AUTHORING: "author", AGENT: "stage", APPROVALS: "stage"}


# -- response models (documentation of the bodies the service builds) ---------------------------


class ErrorEnvelope(BaseModel):
    """The closed error envelope: one registered code, a fixed message, allowed details only."""

    error: str
    phase: Literal["author", "execute", "stage", "release", "callback"]
    message: str
    retryable: bool
    details: dict[str, Any]
    step: str | None = None
    path: str | None = None


class ContractMismatchDetail(BaseModel):
    """Seed 000's exact 409 body for a stale ``expected_contract_digest``."""

    model_config = ConfigDict(extra="forbid")

    error: Literal["command_contract_mismatch"]


class ErrorResponse(BaseModel):
    """Every error response: ``{"detail": envelope}``."""

    detail: ErrorEnvelope


class ExecuteErrorResponse(BaseModel):
    """Errors of ``/execute``: the envelope, or the bare contract-mismatch body."""

    detail: ErrorEnvelope | ContractMismatchDetail


class ScopeView(BaseModel):
    """Where a command is mounted."""

    kind: Literal["company", "room"]
    id: str


class CommandView(BaseModel):
    """A stored command as the authoring routes show it (null-valued keys are left out)."""

    model_config = ConfigDict(extra="allow")

    command_id: str
    name: str
    scope: ScopeView
    tag_id: str | None = None
    version: int
    mode: str
    #: SHA-256 of the stored definition: what ``expected_contract_digest`` pins.
    digest: str
    definition: dict[str, Any]
    created_by: str | None = None
    created_at: str | None = None
    updated_at: str | None = None
    deleted: bool | None = None


class ExecutionView(BaseModel):
    """One execution record (null-valued keys are left out: absent means null)."""

    model_config = ConfigDict(extra="allow")

    execution_id: str
    command_id: str
    status: str
    invoker_id: str | None = None
    invoker_client_id: str | None = None
    idempotency_key: str | None = None
    origin: str | None = None
    duration_ms: int | None = None
    input_snapshot: dict[str, Any] | None = None
    authorization_snapshot: dict[str, Any] | None = None
    steps: list[dict[str, Any]] | None = None
    result_refs: list[dict[str, Any]] | None = None
    error: str | None = None
    error_code: str | None = None
    staged_change_id: str | None = None
    created_at: str | None = None
    result: Any = None


class QueryResult(BaseModel):
    """What a query-mode command answers."""

    model_config = ConfigDict(extra="allow")

    command_id: str
    result: Any = None


class Health(BaseModel):
    """Liveness."""

    status: Literal["ok"]


class PreparedAction(BaseModel):
    """What ``…/prepare`` answers: the proposal for the person, the token for the agent."""

    model_config = ConfigDict(extra="forbid")

    #: What will happen, in the room's language; never ids, digests, keys or the token.
    proposal: str
    #: Opaque, 32 hex characters, valid for an hour; the agent sends it back once confirmed.
    confirmation_token: str
    #: The command's name.
    action: str
    #: When the confirmation expires (ISO-8601 UTC).
    expires_at: str


class ToolResult(BaseModel):
    """The closed tool result of ``/v1/agent/execute`` and ``/status``: these keys only."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["succeeded", "running", "staged", "failed"]
    action: str
    #: A registered code, or null.
    error: str | None
    retryable: bool
    #: A fixed string per code, in the room's language; no provider or database text.
    guidance: str
    #: For ``assertion_failed`` only: the author's message, one line, at most 200 characters.
    reason: str | None = None


class Released(BaseModel):
    """What ``/v1/agent/delivered`` answers: whether a pending marker was released."""

    model_config = ConfigDict(extra="forbid")

    released: bool


class DeliveryMarker(BaseModel):
    """One agent-confirmed execution's delivery marker."""

    model_config = ConfigDict(extra="forbid")

    execution_id: str
    command_id: str
    state: str
    expires_at: str
    #: Pending and not expired: it still guards the room against a duplicate write.
    in_window: bool
    created_at: str


class Deliveries(BaseModel):
    """A room's markers, newest first (the same object ``agent-txn ops deliveries --json``
    prints)."""

    model_config = ConfigDict(extra="forbid")

    markers: list[DeliveryMarker]


class AcknowledgedMarker(BaseModel):
    """What acknowledging one marker did (``would_acknowledge`` is a preview: nothing written)."""

    model_config = ConfigDict(extra="forbid")

    execution_id: str
    result: Literal["not_found", "not_pending", "needs_force", "would_acknowledge", "acknowledged"]
    state: str | None = None
    in_window: bool | None = None


class Acknowledged(BaseModel):
    """Per requested marker, in request order."""

    model_config = ConfigDict(extra="forbid")

    markers: list[AcknowledgedMarker]


class Pruned(BaseModel):
    """What a retention prune did: exactly these keys."""

    model_config = ConfigDict(extra="forbid")

    pruned: int
    retention_days: int
    #: Records created before this instant (ISO-8601 UTC) were eligible.
    cutoff: str


class Requeued(BaseModel):
    """Callback runs changed by a requeue, per kind."""

    model_config = ConfigDict(extra="forbid")

    republished: int
    retried: int
    reclaimed: int


# -- request models -----------------------------------------------------------------------------


def _bad_strings(value: Any) -> str | None:
    """Why a JSON value cannot be stored, or ``None``: NUL characters (PostgreSQL text and jsonb
    refuse them) and lone surrogates (no UTF-8 form). Iterative: depth is the client's choice."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return "strings must not contain NUL characters"
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "strings must be valid Unicode (no lone surrogates)"
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return None


class _Body(BaseModel):
    """Request bodies: unknown fields are refused, and every string must be storable."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        problem = _bad_strings(data)
        if problem is not None:
            raise ValueError(problem)
        return data


IdField = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)]


class ScopeIn(_Body):
    """Where to mount a command: the company (tenant) or one room."""

    kind: Literal["company", "room"]
    #: The room id (required for ``room``); for ``company`` it defaults to the tenant.
    id: IdField | None = None

    @model_validator(mode="after")
    def _room_needs_id(self) -> ScopeIn:
        if self.kind == "room" and self.id is None:
            raise ValueError("a room scope needs its id")
        return self


class CreateCommand(_Body):
    """``POST /v1/commands``."""

    definition: dict[str, Any]
    scope: ScopeIn | None = None
    tag_id: IdField | None = None


class UpdateCommand(_Body):
    """``PUT /v1/commands/{command_id}``: compare-and-set on ``expected_digest`` when given.

    ``tag_id`` absent keeps the stored tag; ``"tag_id": null`` clears it."""

    definition: dict[str, Any]
    expected_digest: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    tag_id: IdField | None = Field(
        default=None, description="Absent: the tag is kept. null: the tag is cleared."
    )


class ExecuteCommand(_Body):
    """``POST …/execute``.

    ``idempotency_key`` (1-128 characters) and ``expected_contract_digest`` (64 lowercase hex)
    are checked by the service, not here, so a malformed one gets its registered 400 code
    rather than a generic validation error."""

    inputs: dict[str, Any]
    idempotency_key: str | None = Field(
        default=None, description="1-128 characters; bucketed per caller."
    )
    expected_contract_digest: str | None = Field(
        default=None,
        description="SHA-256 (64 lowercase hex) of the stored definition, for trusted callers.",
    )


class QueryCommand(_Body):
    """``POST …/query``: inputs only (seed 000: query mode has no digest pin)."""

    inputs: dict[str, Any]


class PrepareCommand(_Body):
    """``POST …/prepare``: stage the plan for the person to confirm (an agent's first turn)."""

    inputs: dict[str, Any]
    room_id: IdField | None = Field(
        default=None, description="The room the agent acts in (a token's `room` claim must match)."
    )
    language: Literal["en", "zh-TW"] | None = Field(
        default=None, description="The proposal's language; default: the member's room language."
    )


class ConfirmedAction(_Body):
    """``/v1/agent/execute`` and ``/status``.

    The token is checked by the toolbox, not here, so a malformed one is the same
    ``confirmation_invalid`` tool result as an unknown one (no shape probing)."""

    confirmation_token: str = Field(description="The token `prepare` returned.")


class Delivered(_Body):
    """``/v1/agent/delivered``: name the execution or the token that confirmed it (one of them)."""

    execution_id: IdField | None = None
    confirmation_token: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Delivered:
        if (self.execution_id is None) == (self.confirmation_token is None):
            raise ValueError("give exactly one of execution_id and confirmation_token")
        return self


class DecideChange(_Body):
    """``…/approve`` and ``…/reject`` (the body may be left out)."""

    reason: str | None = Field(
        default=None, description="Kept whitespace-collapsed, at most 500 characters."
    )


class Acknowledge(_Body):
    """``POST /v1/ops/deliveries/acknowledge``: preview by default; ``execute`` releases."""

    room_id: IdField
    execution_ids: list[IdField] = Field(min_length=1, max_length=MAX_ACKNOWLEDGE)
    #: Strict booleans: ``"false"`` must not release anything by being truthy or coerced.
    execute: bool = Field(default=False, strict=True, description="Release (else a preview).")
    force: bool = Field(default=False, strict=True, description="Also release in-window markers.")


class Requeue(_Body):
    """``POST /v1/ops/callbacks/requeue``.

    The ranges are checked by :func:`orchestrator.ops.requeue_callbacks` (one rule for the CLI
    and HTTP); they are only declared here, so clients and fuzzers know them."""

    older_than_seconds: float = Field(
        default=ops.REQUEUE_DEFAULT_OLDER_THAN_SECONDS,
        strict=True,
        description="How long a pending or running run must sit untouched to be stale (>= 0).",
        json_schema_extra={"minimum": 0},
    )
    limit: int = Field(
        default=ops.REQUEUE_DEFAULT_LIMIT,
        strict=True,
        description=f"Most runs to change, 1..{ops.REQUEUE_MAX_LIMIT}.",
        json_schema_extra={"minimum": 1, "maximum": ops.REQUEUE_MAX_LIMIT},
    )


CommandId = Annotated[
    str, Path(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN, description="Command id.")
]
ExecutionId = Annotated[
    str,
    Path(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN, description="Execution id."),
]
StagedChangeId = Annotated[
    str,
    Path(
        min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN, description="Staged change id."
    ),
]
RoomId = Annotated[
    str,
    Query(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN, description="Room id."),
]
Skip = Annotated[
    int, Query(ge=0, le=MAX_SKIP, description=f"Records to skip, newest first (0-{MAX_SKIP}).")
]
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description=f"Records to return (1-{MAX_LIMIT}).")]


# -- errors -------------------------------------------------------------------------------------


def _responses(*statuses: int, execute: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI declarations of a route's error responses (so fuzzers know they are expected)."""
    model = ExecuteErrorResponse if execute else ErrorResponse
    return {status: {"model": model, "description": "Error envelope."} for status in statuses}


def _phase_of(route: Any) -> str:
    for tag in getattr(route, "tags", None) or ():
        if tag in TAG_PHASES:
            return TAG_PHASES[tag]
    return "execute"


def error_response(exc: AgentTxnError, phase: str) -> JSONResponse:
    """The HTTP answer for a registered error (headers: the execution it left, if any)."""
    headers: dict[str, str] = {}
    execution_id = getattr(exc, "execution_id", None)
    if isinstance(execution_id, str) and execution_id:
        headers[EXECUTION_HEADER] = execution_id
    if exc.code == CONTRACT_MISMATCH:
        body: dict[str, Any] = {"error": CONTRACT_MISMATCH}
    else:
        body = exc.envelope(phase)
    return JSONResponse({"detail": body}, status_code=exc.http_status, headers=headers)


def _internal_error(phase: str) -> JSONResponse:
    return JSONResponse(
        {"detail": envelope("command_execution_failed", phase=phase)}, status_code=500
    )


def _outcome_response(outcome: Outcome) -> JSONResponse:
    """An execute-like outcome: its status and body, the replay and execution headers."""
    headers: dict[str, str] = {}
    if outcome.replayed:
        headers[REPLAYED_HEADER] = "true"
    if outcome.execution_id:
        headers[EXECUTION_HEADER] = outcome.execution_id
    return JSONResponse(outcome.body, status_code=outcome.status_code, headers=headers)


class _GuardedRoute(APIRoute):
    """A route whose errors all leave as envelopes, in the route's phase.

    Handled here rather than with ``app.exception_handler(Exception)``: Starlette re-raises an
    exception after its catch-all handler answered, which would reach the server (and a test
    client) as a crash although the client got a clean 500."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        phase = _phase_of(self)

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (RequestValidationError, StarletteHTTPException):
                raise  # the app's handlers below give them the same shape
            except AgentTxnError as exc:
                return error_response(exc, phase)
            except StoreUnavailable:
                # A read that found the database gone: retryable, and nothing of the driver's
                # text (host names, credentials) reaches the client.
                log.warning("http.store_unavailable", method=request.method, route=self.path)
                return error_response(StoreUnavailableError(), phase)
            except StoreBusy:
                return error_response(LockConflict(), phase)
            except ValueNotStorable:
                log.warning("http.value_not_storable", method=request.method, route=self.path)
                return error_response(ValueNotStorableError(), phase)
            except Exception:
                log.exception("http.unexpected_error", method=request.method, route=self.path)
                return _internal_error(phase)

        return guarded


def _field(loc: Any) -> str:
    parts = loc if isinstance(loc, list | tuple) else (loc,)
    return ".".join(str(p) for p in parts)[:MAX_FIELD_CHARS]


def _validation_problems(exc: RequestValidationError) -> Iterator[dict[str, str]]:
    for error in exc.errors()[:MAX_REPORTED_ERRORS]:
        yield {"field": _field(error.get("loc", ())), "problem": str(error.get("type", "invalid"))}


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    body = envelope(
        "request_invalid",
        phase=_phase_of(request.scope.get("route")),
        details={"errors": list(_validation_problems(exc))},
    )
    return JSONResponse({"detail": body}, status_code=422)


#: Starlette's own refusals, in the envelope's shape (not registry codes: no program ran).
_HTTP_ERRORS: Final = {
    404: ("not_found", "Not found."),
    405: ("method_not_allowed", "Method not allowed."),
}
_UNREADABLE: Final = ("bad_request", "The request cannot be read.")


async def _on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own answers (unknown route, wrong method, unreadable body) in our shape."""
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    phase = _phase_of(request.scope.get("route"))
    if status >= 500:
        return _internal_error(phase)
    code, message = _HTTP_ERRORS.get(status, _UNREADABLE)
    body = {"error": code, "phase": phase, "message": message, "retryable": False, "details": {}}
    headers = {"Allow": _allowed_methods(request)} if status == 405 else {}
    return JSONResponse({"detail": body}, status_code=status, headers=headers)


def _allowed_methods(request: Request) -> str:
    """Every method the path answers to. Starlette names only the first route that matched
    the path, which is wrong when GET and POST of one path are two routes (``/v1/commands``)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "__none__"})
        if match is Match.PARTIAL:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


# -- body size ----------------------------------------------------------------------------------


class _BodyLimit:
    """Refuse request bodies over :data:`MAX_BODY_BYTES` before anything buffers them."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.limit:
            await self._refuse(scope, receive, send, declared)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # Raised into the body reader: FastAPI answers 400 "cannot be read".
                    raise InputLimitExceeded(
                        details={"resource": "request_body", "limit": self.limit, "actual": seen}
                    )
            return message

        await self.app(scope, counted, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        error = InputLimitExceeded(
            details={"resource": "request_body", "limit": self.limit, "actual": size}
        )
        await error_response(error, "execute")(scope, receive, send)


def _declared_length(scope: Scope) -> int | None:
    """The body size the client announced (an unreadable ``Content-Length`` counts as too big:
    the server would otherwise trust a length it cannot check)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return MAX_BODY_BYTES + 1
    return None


# -- credentials --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _State:
    """What the request dependencies need, kept on ``app.state`` (never in module globals)."""

    orch: Orchestrator
    auth: AuthSettings


_bearer = HTTPBearer(auto_error=False, description="A JWT naming the principal (`sub`).")
_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="A principal's API key.")


async def current_caller(
    request: Request,
    token: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    key: Annotated[str | None, Depends(_api_key)],
) -> Caller:
    """Who is calling: a verified JWT first, else an API key; neither is the uniform 403.

    A JWT only proves that someone signed a ``sub``; whether that names a principal who may act
    in this tenant at all is checked here, once for every route, so a token naming nobody (or
    someone of another tenant) is the uniform 403 everywhere rather than, on a listing, an
    empty answer that looks like success. An API key already names a live principal, and the
    command routes refuse it with ``jwt_required``."""
    state: _State = request.app.state.agent_txn
    if token is not None:
        caller = authz.authenticate_jwt(token.credentials, state.auth)
        async with state.orch.store.read() as conn:
            await authz.require_known_principal(conn, caller, tenant=state.orch.commands.tenant)
        return caller
    if key:
        async with state.orch.store.read() as conn:
            return await authz.authenticate_api_key(conn, key)
    raise PrincipalNotAuthorized()


Who = Annotated[Caller, Depends(current_caller)]


async def jwt_caller(who: Who) -> Caller:
    """A caller holding a JWT: the agent, approval and operator routes act for a person."""
    authz.require_jwt(who)
    return who


JwtWho = Annotated[Caller, Depends(jwt_caller)]


async def current_operator(request: Request, who: JwtWho) -> Caller:
    """A JWT caller who is an operator (``manage`` on ``agent-txn.ops``, company scope of the
    tenant); anyone else is the uniform 403."""
    state: _State = request.app.state.agent_txn
    tenant = state.orch.commands.tenant
    async with state.orch.store.read() as conn:
        principal = await authz.load_principal(
            conn, who, tenant=tenant, scope_kind="company", scope_id=tenant
        )
    if not ops.is_operator(principal):
        raise PrincipalNotAuthorized()
    return who


Operator = Annotated[Caller, Depends(current_operator)]


# -- the app ------------------------------------------------------------------------------------


def create_app(orch: Orchestrator, auth: AuthSettings) -> FastAPI:
    """The FastAPI application serving ``orch``'s commands, verifying credentials with ``auth``.

    ``orch`` stays the caller's: the app neither opens nor closes it (``agent-txn serve`` does),
    so tests and embedding applications control its lifetime and event loop.
    """
    app = FastAPI(
        title="agent-txn",
        version="0.1.0",
        summary="Stored saga commands, executed exactly once as the caller.",
        openapi_url="/openapi.json",
        docs_url="/docs",
        redoc_url=None,
    )
    app.router.route_class = _GuardedRoute
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_middleware(_BodyLimit)
    app.state.agent_txn = _State(orch, auth)
    service = orch.commands

    common = (403, 404, 422, 500, 503)

    @app.get("/healthz", tags=["health"], response_model=Health)
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves requests (no credentials needed)."""
        return {"status": "ok"}

    @app.post(
        "/v1/commands",
        tags=[AUTHORING],
        status_code=201,
        response_model=None,
        responses={201: {"model": CommandView}, **_responses(400, 409, *common)},
    )
    async def create_command(body: CreateCommand, who: Who) -> JSONResponse:
        """Store a command; the author must manage every action it uses."""
        scope = body.scope or ScopeIn(kind="company")
        view = await service.create(
            who, body.definition, scope_kind=scope.kind, scope_id=scope.id, tag_id=body.tag_id
        )
        return JSONResponse(view, status_code=201)

    @app.get(
        "/v1/commands",
        tags=[AUTHORING],
        response_model=None,
        responses={200: {"model": list[CommandView]}, **_responses(*common)},
    )
    async def list_commands(who: Who, skip: Skip = 0, limit: Limit = 50) -> JSONResponse:
        """Commands the caller may act in, newest first."""
        return JSONResponse(await service.list(who, skip=skip, limit=limit))

    @app.get(
        "/v1/commands/{command_id}",
        tags=[AUTHORING],
        response_model=None,
        responses={200: {"model": CommandView}, **_responses(*common)},
    )
    async def get_command(command_id: CommandId, who: Who) -> JSONResponse:
        """One command, with the digest that ``expected_contract_digest`` pins."""
        return JSONResponse(await service.get(who, command_id))

    @app.put(
        "/v1/commands/{command_id}",
        tags=[AUTHORING],
        response_model=None,
        responses={200: {"model": CommandView}, **_responses(400, 409, *common)},
    )
    async def update_command(command_id: CommandId, body: UpdateCommand, who: Who) -> JSONResponse:
        """Replace a command's definition; a moved digest is 409 ``source_authority_changed``.
        The caller must manage the actions of the stored definition and of the new one."""
        view = await service.update(
            who,
            command_id,
            body.definition,
            expected_digest=body.expected_digest,
            # Only a key the client sent is an edit: absent keeps the tag, null clears it.
            tag_id=body.tag_id if "tag_id" in body.model_fields_set else UNCHANGED,
        )
        return JSONResponse(view)

    @app.delete(
        "/v1/commands/{command_id}",
        tags=[AUTHORING],
        status_code=204,
        response_class=Response,
        responses=_responses(*common),
    )
    async def delete_command(command_id: CommandId, who: Who) -> Response:
        """Soft-delete a command; its executions stay readable, and the plans it staged that
        nobody decided are released in the same commit."""
        await service.delete(who, command_id)
        return Response(status_code=204)

    @app.post(
        "/v1/commands/{command_id}/execute",
        tags=[EXECUTION],
        response_model=None,
        responses={
            200: {"model": ExecutionView, "description": "Succeeded (or replayed)."},
            202: {"model": ExecutionView, "description": "Accepted; workers finish it."},
            **_responses(400, 409, *common, 504, execute=True),
        },
    )
    async def execute_command(
        command_id: CommandId, body: ExecuteCommand, who: Who
    ) -> JSONResponse:
        """Run the command's saga exactly once, with the caller's own grants."""
        outcome = await service.execute(
            who,
            command_id,
            body.inputs,
            idempotency_key=body.idempotency_key,
            expected_contract_digest=body.expected_contract_digest,
        )
        return _outcome_response(outcome)

    @app.post(
        "/v1/commands/{command_id}/query",
        tags=[EXECUTION],
        response_model=None,
        responses={200: {"model": QueryResult}, **_responses(400, *common, 504)},
    )
    async def query_command(command_id: CommandId, body: QueryCommand, who: Who) -> JSONResponse:
        """Run a query-mode command: reads only, no lock, no audit row."""
        return JSONResponse(await service.query(who, command_id, body.inputs))

    @app.get(
        "/v1/commands/{command_id}/executions",
        tags=[EXECUTION],
        response_model=None,
        responses={200: {"model": list[ExecutionView]}, **_responses(*common)},
    )
    async def list_executions(
        command_id: CommandId, who: Who, skip: Skip = 0, limit: Limit = 50
    ) -> JSONResponse:
        """Execution records the caller may see, newest first."""
        return JSONResponse(await service.executions(who, command_id, skip=skip, limit=limit))

    @app.get(
        "/v1/commands/{command_id}/executions/{execution_id}",
        tags=[EXECUTION],
        response_model=None,
        responses={200: {"model": ExecutionView}, **_responses(*common)},
    )
    async def get_execution(
        command_id: CommandId, execution_id: ExecutionId, who: Who
    ) -> JSONResponse:
        """One execution record; 404 unless the caller may see it (never 403: no probing)."""
        return JSONResponse(await service.execution(who, command_id, execution_id))

    # -- the agent toolbox (seed 000 "Agent 工具箱") ---------------------------------------------

    agent = orch.agent

    @app.post(
        "/v1/commands/{command_id}/prepare",
        tags=[AGENT],
        response_model=None,
        responses={200: {"model": PreparedAction}, **_responses(400, 409, *common, 504)},
    )
    async def prepare_command(
        command_id: CommandId, body: PrepareCommand, who: JwtWho
    ) -> JSONResponse:
        """Validate and stage the plan as the caller; nothing runs until it is confirmed."""
        prepared = await agent.prepare(
            who, command_id, body.inputs, room_id=body.room_id, language=body.language
        )
        return JSONResponse(prepared)

    tool_responses: dict[int | str, dict[str, Any]] = {
        200: {"model": ToolResult, "description": "The tool result (it carries the outcome)."},
        **_responses(400, 403, 409, 422, 500, 503),
    }

    @app.post("/v1/agent/execute", tags=[AGENT], response_model=None, responses=tool_responses)
    async def agent_execute(body: ConfirmedAction, who: JwtWho) -> JSONResponse:
        """Run the confirmed plan once (only after the person said yes, in a later turn). The
        same token again, or the same request prepared again, replays while its delivery is
        pending."""
        return JSONResponse(await agent.execute_staged_action(who, body.confirmation_token))

    @app.post("/v1/agent/status", tags=[AGENT], response_model=None, responses=tool_responses)
    async def agent_status(body: ConfirmedAction, who: JwtWho) -> JSONResponse:
        """The tool result of the plan behind the token as it stands now (no write)."""
        return JSONResponse(await agent.execution_status(who, body.confirmation_token))

    @app.post(
        "/v1/agent/delivered",
        tags=[AGENT],
        response_model=None,
        responses={200: {"model": Released}, **_responses(400, 403, 409, 422, 500, 503)},
    )
    async def agent_delivered(body: Delivered, who: JwtWho) -> JSONResponse:
        """The reply crossed the room's visibility boundary: release the delivery marker, so the
        same request later is a new write. ``released: false`` if nothing was pending."""
        if body.execution_id is not None:
            released = await agent.mark_delivered(who, body.execution_id)
        else:
            assert body.confirmation_token is not None  # the model allows exactly one
            released = await agent.mark_delivered_by_token(who, body.confirmation_token)
        return JSONResponse({"released": released})

    # -- approvals --------------------------------------------------------------------------------

    @app.post(
        "/v1/staged-changes/{staged_change_id}/approve",
        tags=[APPROVALS],
        response_model=None,
        responses={
            200: {"model": ExecutionView, "description": "Succeeded."},
            202: {"model": ExecutionView, "description": "Accepted; workers finish it."},
            **_responses(400, 409, *common, 504),
        },
    )
    async def approve_staged_change(
        staged_change_id: StagedChangeId, who: JwtWho, body: DecideChange | None = None
    ) -> JSONResponse:
        """Run the frozen plan exactly as staged (the command's digest is checked again)."""
        reason = body.reason if body is not None else None
        return _outcome_response(await service.approve(who, staged_change_id, reason=reason))

    @app.post(
        "/v1/staged-changes/{staged_change_id}/reject",
        tags=[APPROVALS],
        response_model=None,
        responses={200: {"model": ExecutionView}, **_responses(400, 409, *common)},
    )
    async def reject_staged_change(
        staged_change_id: StagedChangeId, who: JwtWho, body: DecideChange | None = None
    ) -> JSONResponse:
        """Release the plan without running it: the execution fails ``approval_rejected`` and its
        idempotency key is free again."""
        reason = body.reason if body is not None else None
        view = await service.reject(who, staged_change_id, reason=reason)
        return JSONResponse(view, headers={EXECUTION_HEADER: str(view["execution_id"])})

    # -- operators ----------------------------------------------------------------------------

    ops_common = (403, 422, 500, 503)

    @app.get(
        "/v1/ops/deliveries",
        tags=[OPERATIONS],
        response_model=None,
        responses={200: {"model": Deliveries}, **_responses(*ops_common)},
    )
    async def list_deliveries(room_id: RoomId, operator: Operator) -> JSONResponse:
        """A room's delivery markers with state, ``expires_at`` and ``in_window`` (expired ones
        are flipped first, as every lookup does)."""
        return JSONResponse({"markers": await agent.deliveries(operator, room_id)})

    @app.post(
        "/v1/ops/deliveries/acknowledge",
        tags=[OPERATIONS],
        response_model=None,
        responses={200: {"model": Acknowledged}, **_responses(400, 409, *ops_common)},
    )
    async def acknowledge_deliveries(body: Acknowledge, operator: Operator) -> JSONResponse:
        """Release selected markers: a preview unless ``execute``; in-window ones need ``force``
        (it cancels a live replay guard). Never rolls back a committed write."""
        markers = await agent.acknowledge(
            operator, body.room_id, body.execution_ids, execute=body.execute, force=body.force
        )
        return JSONResponse({"markers": markers})

    @app.post(
        "/v1/ops/executions/prune",
        tags=[OPERATIONS],
        response_model=None,
        responses={200: {"model": Pruned}, **_responses(409, *ops_common)},
    )
    async def prune_executions(operator: Operator) -> JSONResponse:
        """Delete succeeded and failed execution records older than 180 days (staged never, the
        ledger never)."""
        del operator  # checked by the dependency, in this server's tenant
        # The operator's own tenant only: tenants may share the database.
        return JSONResponse(await ops.prune(orch.store, tenant=orch.commands.tenant))

    @app.post(
        "/v1/ops/callbacks/requeue",
        tags=[OPERATIONS],
        response_model=None,
        responses={200: {"model": Requeued}, **_responses(400, 409, *ops_common)},
    )
    async def requeue_callbacks(operator: Operator, body: Requeue | None = None) -> JSONResponse:
        """Republish stale pending, retry eligible failed and reclaim stale running callback runs
        (``older_than_seconds`` >= 0, ``limit`` 1..2000, checked by the ops module)."""
        del operator
        body = body or Requeue()
        age = body.older_than_seconds
        if math.isfinite(age):
            age = min(age, MAX_REQUEUE_AGE_SECONDS)
        result = await ops.requeue_callbacks(
            orch.store, older_than_seconds=age, limit=body.limit, tenant=orch.commands.tenant
        )
        return JSONResponse(result)

    return app


__all__ = [
    "MAX_BODY_BYTES",
    "CommandView",
    "ErrorEnvelope",
    "ExecutionView",
    "PreparedAction",
    "ToolResult",
    "create_app",
    "error_response",
]
