"""``agent-txn mcp``: the agent toolbox (:mod:`orchestrator.agent`) as an MCP server over stdio.

::

    AGENT_TXN_TOKEN=eyJ… AGENT_TXN_JWT_SECRET=… \\
        agent-txn mcp --db sqlite+aiosqlite:///agent.db --fake-shop sqlite+aiosqlite:///shop.db \\
        --room room-1

An MCP host (a desktop assistant, an agent runtime) spawns this process and talks JSON-RPC on
its stdin/stdout, with the official ``mcp`` SDK's low-level server. One process serves one
person: the JWT (``--token`` or ``AGENT_TXN_TOKEN``) is verified once at start and is the
invoking principal of every tool call, marked as an agent (``ai``). Every call still re-checks
that principal (alive, verified, member of the room, its grants) exactly as the Python API and
REST do, so revoking a grant takes effect on the next call without restarting the server.

Tools (listed fresh on every ``tools/list``, so commands authored later appear):

* ``prepare_<command name>`` — one per visible execute-mode command, its input schema generated
  from the command's typed inputs (types, required, bounds, lengths, pattern, enum; no other
  properties). It stages the plan and changes nothing the person has not confirmed, hence
  ``readOnlyHint: false`` (a staged record is written) but ``destructiveHint: false``.
  A command whose name is not a valid MCP tool name, is shared by two visible commands, or
  would shadow ``prepare_action`` gets no tool of its own; ``prepare_action`` reaches it.
* ``prepare_action`` — the same for any command, by name or id: ``{command, inputs}``.
* ``execute_staged_action`` — ``{confirmation_token}``, ``destructiveHint: true``. Its description
  tells the model to call it only after the person explicitly confirmed, in a later turn. The
  schema holds nothing but the token: the server forwards the pinned contract itself, so a
  model can neither see nor supply it.
* ``execution_status`` — ``{confirmation_token}``, ``readOnlyHint: true``.

There is deliberately no ``mark_delivered`` tool. The delivery marker is released when the reply
*crossed the room's visibility boundary* — a fact only the runtime that posts the reply knows.
A model calling it would do so before its answer is shown, so a lost reply followed by "yes, do
it" again would write twice: exactly what the marker prevents. Runtimes that know when a reply
was delivered call :meth:`orchestrator.agent.AgentToolbox.mark_delivered` through the Python
API; otherwise markers expire after the command's ``delivery_reconciliation_ttl_seconds``.

Every tool answers a JSON object, as text content (JSON-encoded) and as structured content:
the closed results of :mod:`orchestrator.agent`. Refusals (:class:`AgentTxnError`) are tool
results built by :func:`orchestrator.agent.tool_error`, with ``isError`` set; anything
unexpected is logged (its type only) and answered as ``command_execution_failed``. No provider
or database text and no traceback ever reaches the model.

The ``mcp`` SDK is imported when the server starts, not when the CLI loads, so other
``agent-txn`` commands do not pay for it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import re
import signal
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Final

import structlog
import typer

from ledger import principals
from orchestrator import authz, serve
from orchestrator.agent import tool_error, tool_result
from orchestrator.authz import AuthSettings, Caller
from orchestrator.errors import (
    AgentTxnError,
    CommandNotFound,
    PrincipalNotAuthorized,
    RequestInvalid,
)
from orchestrator.guidance import LANGUAGES

if TYPE_CHECKING:
    from mcp import types as mt
    from mcp.server.lowlevel import Server

    from ledger.store import SqliteWriter
    from orchestrator.engine import Orchestrator

log = structlog.get_logger(__name__)

DEFAULT_DB: Final = "sqlite+aiosqlite:///agent.db"
DB_ENV: Final = "AGENT_TXN_DB"
TOKEN_ENV: Final = "AGENT_TXN_TOKEN"
SECRET_ENV: Final = "AGENT_TXN_JWT_SECRET"
TENANT_ENV: Final = "AGENT_TXN_TENANT"

SERVER_NAME: Final = "agent-txn"
PREPARE_PREFIX: Final = "prepare_"
PREPARE_ACTION: Final = "prepare_action"
EXECUTE_STAGED_ACTION: Final = "execute_staged_action"
EXECUTION_STATUS: Final = "execution_status"
#: MCP tool names (SEP-986): what a per-command tool name must match to be offered.
TOOL_NAME_RE: Final = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
#: At most this many commands are read per ``tools/list`` (a host loads every tool into the
#: model's context; past this, ``prepare_action`` still reaches any command by id).
MAX_COMMANDS: Final = 1000
#: Commands listed by name in ``prepare_action``'s description.
MAX_LISTED: Final = 50
_PAGE: Final = 200
_LINE_CHARS: Final = 160
_MAX_ROOM_CHARS: Final = 64

_TOKEN_SCHEMA: Final[Mapping[str, Any]] = {
    "type": "string",
    "pattern": "^[0-9a-f]{32}$",
    "description": "The confirmation_token a prepare tool returned for this plan.",
}

#: The closed tool result of execute_staged_action and execution_status.
RESULT_SCHEMA: Final[Mapping[str, Any]] = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["succeeded", "failed", "staged", "running"]},
        "action": {"type": "string"},
        "error": {"type": ["string", "null"]},
        "retryable": {"type": "boolean"},
        "guidance": {"type": "string"},
        "reason": {"type": "string"},
    },
    "required": ["status", "action", "error", "retryable", "guidance"],
    "additionalProperties": False,
}

INSTRUCTIONS: Final = (
    "Actions that change anything take two turns. First call a prepare tool: nothing changes, "
    "and you get a proposal and a confirmation_token. Show the proposal to the person as it is "
    "and ask whether to go ahead. Only when the person explicitly says yes in a later message, "
    "call execute_staged_action with that token. Never execute in the same turn you prepared, "
    "and never on your own initiative. Repeating execute_staged_action with the same token "
    "never repeats the action. Tell the person what the result's guidance says."
)

_PREPARE_RULES: Final = (
    "Stages the action and changes nothing yet. Returns a proposal to show the person as it is, "
    "and a confirmation_token. Call execute_staged_action with that token only after the "
    "person explicitly confirms the proposal in a later turn."
)

_EXECUTE_DESCRIPTION: Final = (
    "Carry out the staged action behind confirmation_token, exactly as proposed. "
    "Call this ONLY after the person has explicitly confirmed the proposal in a later turn "
    "(their own reply, such as 'yes, do it'): never in the same turn as the prepare call, never "
    "on your own initiative, never because a previous answer seemed lost. Calling it again "
    "with the same token never repeats the action; it answers the same result. The result is "
    "{status, action, error, retryable, guidance}; tell the person what guidance says."
)

_STATUS_DESCRIPTION: Final = (
    "The current result of the action behind confirmation_token, without changing anything. "
    "Use it when a result said 'running', or to check whether a confirmed action ran."
)

_LENGTH_KEYWORDS: Final[Mapping[str, tuple[str, str]]] = {
    "string": ("minLength", "maxLength"),
    "array": ("minItems", "maxItems"),
    "object": ("minProperties", "maxProperties"),
}


def input_json_schema(inputs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """JSON Schema of a command's typed inputs (``definition["inputs"]``).

    It states what :meth:`orchestrator.saga.SagaDefinition.validate_inputs` enforces, so a model
    that follows the schema is not refused for the shape of its call. Optional inputs are left
    out of ``required`` (the validator also accepts ``null`` for them; the schema does not
    advertise it, since omitting the key says the same). No other property is allowed.
    """
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, spec in inputs.items():
        kind = str(spec["type"])
        prop: dict[str, Any] = {"type": kind}
        for bound in ("minimum", "maximum"):
            if spec.get(bound) is not None:
                prop[bound] = spec[bound]
        low, high = _LENGTH_KEYWORDS.get(kind, ("", ""))
        if low and spec.get("min_length") is not None:
            prop[low] = spec["min_length"]
        if high and spec.get("max_length") is not None:
            prop[high] = spec["max_length"]
        if spec.get("pattern") is not None:
            prop["pattern"] = spec["pattern"]
        if spec.get("enum") is not None:
            prop["enum"] = list(spec["enum"])
        properties[name] = prop
        if spec.get("required", True):
            required.append(name)
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


@dataclasses.dataclass(frozen=True, slots=True)
class VisibleCommand:
    """A command the session's principal can act in, as the tool list shows it."""

    command_id: str
    name: str
    mode: str
    description: str
    inputs: Mapping[str, Mapping[str, Any]]
    #: ``prepare_<name>``, or ``None`` when the command is reached through ``prepare_action``.
    tool_name: str | None = None


def _first_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _LINE_CHARS else line[: _LINE_CHARS - 1] + "…"


def _signature(inputs: Mapping[str, Mapping[str, Any]]) -> str:
    parts = []
    for name, spec in inputs.items():
        optional = "" if spec.get("required", True) else ", optional"
        parts.append(f"{name} ({spec['type']}{optional})")
    return ", ".join(parts) or "no inputs"


class McpTools:
    """The MCP tool surface over one engine, for one authenticated caller.

    Kept free of the SDK (plain dicts in, plain dicts out) so the tool logic can be tested and
    reused without a transport; :func:`build_server` adapts it to the SDK's types.
    """

    def __init__(self, orch: Orchestrator, caller: Caller, *, language: str | None = None) -> None:
        self.orch = orch
        self.caller = caller
        self.language = language

    # -- the catalogue -------------------------------------------------------------------------

    async def commands(self) -> list[VisibleCommand]:
        """Every command the caller can act in (both modes), with per-command tool names."""
        found: list[VisibleCommand] = []
        skip = 0
        while len(found) < MAX_COMMANDS:
            try:
                page = await self.orch.commands.list(self.caller, skip=skip, limit=_PAGE)
            except PrincipalNotAuthorized:
                # A session whose principal may not act here lists no tools (``tools/list`` has
                # no closed-result form to carry a refusal); each call is refused on its own.
                return []
            for view in page:
                definition = view.get("definition") or {}
                found.append(
                    VisibleCommand(
                        command_id=str(view["command_id"]),
                        name=str(view["name"]),
                        mode=str(view.get("mode") or definition.get("mode") or "execute"),
                        description=str(definition.get("description") or ""),
                        inputs=dict(definition.get("inputs") or {}),
                    )
                )
            if len(page) < _PAGE:
                break
            skip += _PAGE
        found = found[:MAX_COMMANDS]
        runnable = Counter(c.name for c in found if c.mode == "execute")
        out = []
        for c in found:
            tool = PREPARE_PREFIX + c.name
            own = (
                c.mode == "execute"
                and runnable[c.name] == 1
                and tool != PREPARE_ACTION
                and TOOL_NAME_RE.fullmatch(tool) is not None
            )
            out.append(dataclasses.replace(c, tool_name=tool if own else None))
        return out

    async def tools(self) -> list[dict[str, Any]]:
        """The tool list as plain MCP wire dicts (``name``, ``description``, ``inputSchema``,
        ``annotations``, ``outputSchema``)."""
        commands = await self.commands()
        tools: list[dict[str, Any]] = []
        for c in commands:
            if c.tool_name is None:
                continue
            tools.append(
                {
                    "name": c.tool_name,
                    "title": f"Prepare {c.name}",
                    "description": (
                        f"{c.description.strip() or f'Prepare the {c.name} action.'}"
                        f"\n\n{_PREPARE_RULES}"
                    ),
                    "inputSchema": input_json_schema(c.inputs),
                    "annotations": _prepare_annotations(f"Prepare {c.name}"),
                }
            )
        tools.append(
            {
                "name": PREPARE_ACTION,
                "title": "Prepare an action",
                "description": _generic_description(commands),
                "inputSchema": {
                    "type": "object",
                    "properties": {
                        "command": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 200,
                            "description": "The action's name from the list, or its id.",
                        },
                        "inputs": {
                            "type": "object",
                            "description": "The action's inputs, as its prepare_<name> tool "
                            "would take them.",
                        },
                    },
                    "required": ["command", "inputs"],
                    "additionalProperties": False,
                },
                "annotations": _prepare_annotations("Prepare an action"),
            }
        )
        token_only = {
            "type": "object",
            "properties": {"confirmation_token": dict(_TOKEN_SCHEMA)},
            "required": ["confirmation_token"],
            "additionalProperties": False,
        }
        tools.append(
            {
                "name": EXECUTE_STAGED_ACTION,
                "title": "Carry out a confirmed action",
                "description": _EXECUTE_DESCRIPTION,
                "inputSchema": token_only,
                "outputSchema": dict(RESULT_SCHEMA),
                "annotations": {
                    "title": "Carry out a confirmed action",
                    "readOnlyHint": False,
                    "destructiveHint": True,
                    # The same token answers the same result; it never writes twice.
                    "idempotentHint": True,
                    "openWorldHint": True,
                },
            }
        )
        tools.append(
            {
                "name": EXECUTION_STATUS,
                "title": "Status of an action",
                "description": _STATUS_DESCRIPTION,
                "inputSchema": copy.deepcopy(token_only),
                "outputSchema": dict(RESULT_SCHEMA),
                "annotations": {
                    "title": "Status of an action",
                    "readOnlyHint": True,
                    "idempotentHint": True,
                    "openWorldHint": False,
                },
            }
        )
        return tools

    # -- calls ---------------------------------------------------------------------------------

    async def call(self, name: str, arguments: Mapping[str, Any] | None) -> dict[str, Any]:
        """Run one tool; always a JSON object, never a raise for a refusal or a failure."""
        args = dict(arguments or {})
        action = ""
        try:
            if name == EXECUTE_STAGED_ACTION:
                token = _token_argument(args)
                return await self.orch.agent.execute_staged_action(self.caller, token)
            if name == EXECUTION_STATUS:
                token = _token_argument(args)
                return await self.orch.agent.execution_status(self.caller, token)
            if name == PREPARE_ACTION:
                _only(args, ("command", "inputs"), required=("command",))
                command = args["command"]
                if not isinstance(command, str) or not command:
                    raise _invalid("command", "must be a non-empty string")
                command_id, action = await self._resolve(command)
                return await self._prepare(command_id, args.get("inputs", {}))
            if name.startswith(PREPARE_PREFIX):
                for c in await self.commands():
                    if c.tool_name == name:
                        action = c.name
                        return await self._prepare(c.command_id, args)
                raise CommandNotFound()  # deleted, or no longer visible, since it was listed
            raise _invalid("name", "no such tool")
        except AgentTxnError as exc:
            return tool_error(exc, action, await self._error_language())
        except Exception as exc:  # never a traceback or a driver's text to the model
            log.error("mcp tool failed", tool=name, error=type(exc).__name__)
            return tool_result("failed", action, "command_execution_failed", "en")

    async def _prepare(self, command_id: str, inputs: Any) -> dict[str, Any]:
        return await self.orch.agent.prepare(
            self.caller,
            command_id,
            inputs,
            room_id=self.caller.room_id,
            language=self.language,
        )

    async def _resolve(self, command: str) -> tuple[str, str]:
        """``command`` (a name or an id) to ``(command_id, name)``. An unknown value is tried as
        an id: prepare itself decides whether the caller may see it."""
        visible = await self.commands()
        for c in visible:
            if c.command_id == command:
                return c.command_id, c.name
        named = [c for c in visible if c.name == command]
        if len(named) > 1:
            raise _invalid("command", "several actions have this name: pass its id")
        if named:
            return named[0].command_id, named[0].name
        return command, ""

    async def _error_language(self) -> str:
        """The language refusals are worded in: the session's, else the room's, else English."""
        if self.language in LANGUAGES:
            return str(self.language)
        if self.caller.room_id is None:
            return "en"
        try:
            async with self.orch.store.read() as conn:
                member = await principals.membership(
                    conn, self.caller.room_id, self.caller.principal_id
                )
        except Exception:  # the refusal still goes out, in English
            return "en"
        language = getattr(member, "language", None)
        return language if language in LANGUAGES else "en"

    async def check_caller(self) -> None:
        """Refuse at start, not on the first call, when the principal cannot act at all."""
        tenant = self.orch.settings.tenant
        async with self.orch.store.read() as conn:
            await authz.load_principal(
                conn, self.caller, tenant=tenant, scope_kind="company", scope_id=tenant
            )


def _prepare_annotations(title: str) -> dict[str, Any]:
    # Staging writes a staged record (not read-only) but changes nothing the person has not
    # confirmed (not destructive); each call stages a new plan with a new token. openWorldHint
    # stays unset (default true): a command's query steps read the providers while preparing.
    return {
        "title": title,
        "readOnlyHint": False,
        "destructiveHint": False,
        "idempotentHint": False,
    }


def _generic_description(commands: Sequence[VisibleCommand]) -> str:
    runnable = [c for c in commands if c.mode == "execute"]
    names = Counter(c.name for c in runnable)
    lines = [
        "Prepare any action by name (or id): {command, inputs}. " + _PREPARE_RULES,
        "",
        "Actions:" if runnable else "No actions are available.",
    ]
    for c in runnable[:MAX_LISTED]:
        label = c.name if names[c.name] == 1 else f"{c.name} (id {c.command_id})"
        about = f": {_first_line(c.description)}" if c.description.strip() else ""
        lines.append(f"- {label}{about} — inputs: {_signature(c.inputs)}")
    if len(runnable) > MAX_LISTED:
        lines.append(f"… and {len(runnable) - MAX_LISTED} more (see the prepare_<name> tools).")
    return "\n".join(lines)


def _invalid(field: str, problem: str) -> RequestInvalid:
    return RequestInvalid(details={"errors": [{"field": field, "problem": problem}]})


def _only(args: Mapping[str, Any], allowed: Sequence[str], *, required: Sequence[str]) -> None:
    """The arguments are exactly the schema's: an extra key (say, a contract the model made
    up) is refused rather than ignored."""
    for key in args:
        if key not in allowed:
            raise _invalid(key, "not an argument of this tool")
    for key in required:
        if key not in args:
            raise _invalid(key, "required")


def _token_argument(args: Mapping[str, Any]) -> str:
    _only(args, ("confirmation_token",), required=("confirmation_token",))
    token = args["confirmation_token"]
    # The toolbox checks the format itself (a malformed token is confirmation_invalid).
    return token if isinstance(token, str) else ""


# -- the SDK side -------------------------------------------------------------------------------


def build_server(tools: McpTools) -> Server[Any]:
    """The SDK's low-level server with ``tools/list`` and ``tools/call`` over ``tools``.

    The low-level server (not ``MCPServer``) because the tool list is data: one tool per stored
    command, re-read on every listing, with schemas generated from the stored inputs.
    """
    from importlib.metadata import PackageNotFoundError, version

    from mcp import types as mt
    from mcp.server.lowlevel import Server

    try:
        ours = version("agent-txn")
    except PackageNotFoundError:
        ours = "0"

    async def list_tools(ctx: Any, params: mt.PaginatedRequestParams | None) -> mt.ListToolsResult:
        listed = [mt.Tool.model_validate(t) for t in await tools.tools()]
        return mt.ListToolsResult(tools=listed)

    async def call_tool(ctx: Any, params: mt.CallToolRequestParams) -> mt.CallToolResult:
        result = await tools.call(params.name, params.arguments)
        return mt.CallToolResult(
            content=[
                mt.TextContent(
                    type="text", text=json.dumps(result, ensure_ascii=False, sort_keys=True)
                )
            ],
            structured_content=result,
            is_error=result.get("status") == "failed",
        )

    return Server(
        SERVER_NAME,
        version=ours,
        title="agent-txn",
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


def session_caller(caller: Caller, room: str | None) -> Caller:
    """The principal every call acts as: the token's, as an agent, in ``room`` (a token bound
    to another room is refused, as :func:`orchestrator.agent.prepare` would)."""
    if room is not None and caller.room_id is not None and caller.room_id != room:
        raise PrincipalNotAuthorized()
    return dataclasses.replace(caller, room_id=room or caller.room_id, ai=True)


async def run_mcp(
    url: str,
    *,
    token: str,
    auth: AuthSettings,
    tenant: str,
    room: str | None = None,
    language: str | None = None,
    fake_shop: str | None = None,
    app_ref: str | None = None,
    sqlite_writer: SqliteWriter | None = None,
) -> None:
    """Authenticate, open the engine and providers, serve MCP on stdio until stdin closes (or
    SIGTERM/SIGINT), then close everything."""
    import anyio
    from mcp.server.stdio import stdio_server

    from orchestrator import cli
    from orchestrator.engine import Orchestrator
    from orchestrator.workerproc import close_all, open_providers

    caller = session_caller(authz.authenticate_jwt(token, auth), room)
    # Before anything opens: a refused --tenant is one line (cli.engine_settings), and nothing
    # is left to close.
    settings = cli.engine_settings(tenant=tenant, sqlite_writer=sqlite_writer)
    closers: list[Any] = []
    try:
        providers = await open_providers(fake_shop, app_ref, closers)
        orch = await Orchestrator.open(url, providers=providers, settings=settings)
        closers.append(orch)
        tools = McpTools(orch, caller, language=language)
        await tools.check_caller()
        server = build_server(tools)
        loop = asyncio.get_running_loop()
        with anyio.CancelScope() as scope:
            # A host that signals instead of closing stdin still gets the engine closed.
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, scope.cancel)
            try:
                async with stdio_server() as (read_stream, write_stream):
                    await server.run(
                        read_stream, write_stream, server.create_initialization_options()
                    )
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
    finally:
        await close_all(closers)


def mcp(
    db: Annotated[
        str,
        typer.Option(
            "--db",
            envvar=DB_ENV,
            show_envvar=True,
            help="agent-txn database URL (sqlite+aiosqlite:///path.db or postgresql+asyncpg://…).",
        ),
    ] = DEFAULT_DB,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar=TOKEN_ENV,
            show_envvar=True,
            help="The person's JWT; every tool call acts as its principal. Prefer the "
            "environment variable (options show in ps).",
        ),
    ] = None,
    jwt_secret: serve.JwtSecretOption = None,
    jwt_public_key_file: serve.JwtPublicKeyOption = None,
    jwt_audience: serve.JwtAudienceOption = None,
    jwt_issuer: serve.JwtIssuerOption = None,
    tenant: serve.TenantOption = "default",
    room: Annotated[
        str | None,
        typer.Option("--room", help="The room the agent acts in (its language, its window)."),
    ] = None,
    language: Annotated[
        str | None,
        typer.Option(
            "--language", help="Proposal and guidance language: en or zh-TW (default: the room's)."
        ),
    ] = None,
    fake_shop: Annotated[
        str | None,
        typer.Option("--fake-shop", help="Serve the fake shop's providers from this database."),
    ] = None,
    app_ref: Annotated[
        str | None, typer.Option("--app", help="module:attribute giving your providers.")
    ] = None,
    sqlite_writer: serve.SqliteWriterOption = None,
) -> None:
    """Serve the agent toolbox over MCP on stdin/stdout (prepare, execute, status)."""
    from orchestrator import cli
    from orchestrator.serve import _auth_settings

    async def job() -> None:
        # Checked inside cli._run, so every refusal is the CLI's one clean error line on stderr
        # (stdout is the MCP wire).
        if not token:
            raise cli.CliFailure(f"a JWT is needed: --token (or {TOKEN_ENV})")
        if language is not None and language not in LANGUAGES:
            raise cli.CliFailure(f"--language must be one of {', '.join(LANGUAGES)}")
        if room is not None and not (0 < len(room) <= _MAX_ROOM_CHARS and room.strip() == room):
            raise cli.CliFailure(f"--room must be a room id of 1 to {_MAX_ROOM_CHARS} characters")
        auth = _auth_settings(jwt_secret, jwt_public_key_file, tenant, jwt_audience, jwt_issuer)
        url = cli._checked_url(db)
        shop = cli._checked_url(fake_shop, "--fake-shop") if fake_shop is not None else None
        writer = cli._checked_sqlite_writer(sqlite_writer)
        await run_mcp(
            url,
            token=token,
            auth=auth,
            tenant=tenant,
            room=room,
            language=language,
            fake_shop=shop,
            app_ref=app_ref,
            sqlite_writer=writer,
        )

    cli._run(job())


__all__ = [
    "EXECUTE_STAGED_ACTION",
    "EXECUTION_STATUS",
    "PREPARE_ACTION",
    "McpTools",
    "build_server",
    "input_json_schema",
    "mcp",
    "run_mcp",
    "session_caller",
]
