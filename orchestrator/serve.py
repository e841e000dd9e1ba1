"""``agent-txn serve``: the commands HTTP API (:mod:`orchestrator.http_api`) under uvicorn.

::

    agent-txn serve --db sqlite+aiosqlite:///agent.db --port 8000 \\
        --fake-shop sqlite+aiosqlite:///provider.db --jwt-secret "$SECRET"

Providers come as for ``agent-txn worker``: ``--fake-shop URL`` and/or ``--app module:attribute``.
JWTs are verified with exactly one key: ``--jwt-secret`` (HS256; ``AGENT_TXN_JWT_SECRET`` when
the option is absent, so the secret need not appear in ``ps``) or ``--jwt-public-key-file``
(RS256). ``--tenant`` is the tenant the engine serves and the one tokens must belong to.

The socket is bound before uvicorn starts, so a busy port is one ``error:`` line (exit 2) like
every other CLI failure, and ``--port 0`` works: the bound URL is printed on one flushed line
(``agent-txn serving on http://…``) once requests are accepted — scripts and tests wait for it.
SIGTERM or SIGINT stops accepting, lets requests in progress finish (uvicorn's graceful
shutdown), then closes the engine and the providers, and the process exits 0.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final

import typer
from pydantic import ValidationError

from orchestrator.authz import AuthSettings

if TYPE_CHECKING:
    from ledger.store import SqliteWriter

DEFAULT_DB: Final = "sqlite+aiosqlite:///agent.db"
DB_ENV: Final = "AGENT_TXN_DB"
SECRET_ENV: Final = "AGENT_TXN_JWT_SECRET"
TENANT_ENV: Final = "AGENT_TXN_TENANT"
SQLITE_WRITER_ENV: Final = "AGENT_TXN_SQLITE_WRITER"


# Options shared by every command that authenticates JWTs (``serve``, ``mcp``).
JwtSecretOption = Annotated[
    str | None,
    typer.Option(
        "--jwt-secret",
        envvar=SECRET_ENV,
        show_envvar=True,
        help="HS256 secret JWTs are verified with (at least 32 bytes).",
    ),
]
JwtPublicKeyOption = Annotated[
    Path | None,
    typer.Option(
        "--jwt-public-key-file", dir_okay=False, help="PEM RSA public key (RS256 instead)."
    ),
]
JwtAudienceOption = Annotated[
    str | None, typer.Option("--jwt-audience", help="Required aud claim.")
]
JwtIssuerOption = Annotated[str | None, typer.Option("--jwt-issuer", help="Required iss claim.")]
TenantOption = Annotated[
    str,
    typer.Option("--tenant", envvar=TENANT_ENV, show_envvar=True, help="Tenant served."),
]
# Shared by every command that runs sagas on a store (``serve``, ``mcp``, ``worker``): the one
# engine setting an operator may need to turn off on SQLite, since it starts a process.
SqliteWriterOption = Annotated[
    str | None,
    typer.Option(
        "--sqlite-writer",
        envvar=SQLITE_WRITER_ENV,
        show_envvar=True,
        help="SQLite: where groups of concurrent transactions commit: process (a writer process "
        "of the store's own, the default) or inline (on the event loop, no second process).",
    ),
]
#: How long requests in progress may take to finish after SIGTERM.
GRACEFUL_SECONDS: Final = 10


def _bind(host: str, port: int) -> socket.socket:
    """A bound socket for ``host:port`` (``OSError`` when the port is taken or the host unknown)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _auth_settings(
    secret: str | None,
    public_key_file: Path | None,
    tenant: str,
    audience: str | None,
    issuer: str | None,
) -> AuthSettings:
    """The JWT settings, or a one-line failure naming what is wrong (never the secret)."""
    from orchestrator import cli

    if secret is not None and public_key_file is not None:
        raise cli.CliFailure("give --jwt-secret or --jwt-public-key-file, not both")
    values: dict[str, Any] = {"tenant": tenant, "audience": audience, "issuer": issuer}
    if public_key_file is not None:
        try:
            values["jwt_public_key"] = public_key_file.read_text()
        except OSError as exc:
            raise cli.CliFailure(f"--jwt-public-key-file: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            # A DER key or some other binary file: the key must be PEM text.
            raise cli.CliFailure(
                "--jwt-public-key-file: not a PEM text file (a binary file, such as a DER key)"
            ) from None
        values["jwt_algorithm"] = "RS256"
    elif secret is not None:
        values["jwt_secret"] = secret
    else:
        raise cli.CliFailure(
            f"a JWT key is needed: --jwt-secret (or {SECRET_ENV}) or --jwt-public-key-file"
        )
    try:
        return AuthSettings(**values)
    except ValidationError as exc:
        # Only the validators' messages: pydantic would otherwise echo the input (the secret).
        reasons = "; ".join(str(e.get("msg", "invalid")) for e in exc.errors())
        raise cli.CliFailure(f"JWT settings: {reasons}") from None


async def run_server(
    url: str,
    *,
    host: str,
    port: int,
    auth: AuthSettings,
    tenant: str,
    fake_shop: str | None = None,
    app_ref: str | None = None,
    sqlite_writer: SqliteWriter | None = None,
) -> None:
    """Open the engine and providers, serve the API until SIGTERM/SIGINT, close everything."""
    # uvicorn is imported here, not with the module: the CLI imports this module to register
    # ``serve``, and no other command needs it.
    import uvicorn

    from orchestrator import cli
    from orchestrator.engine import Orchestrator
    from orchestrator.http_api import create_app
    from orchestrator.uvicorn_server import SignalledServer
    from orchestrator.workerproc import close_all, open_providers

    # Before the port is bound: a refused --tenant is one line (cli.engine_settings).
    settings = cli.engine_settings(tenant=tenant, sqlite_writer=sqlite_writer)
    try:
        sock = _bind(host, port)
    except OSError as exc:
        raise cli.CliFailure(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    except UnicodeError:
        # getaddrinfo encodes a name with IDNA first, which refuses a label over 63 characters.
        raise cli.CliFailure(f"cannot serve on {host}:{port}: not a valid host name") from None
    closers: list[Any] = []
    try:
        providers = await open_providers(fake_shop, app_ref, closers)
        orch = await Orchestrator.open(url, providers=providers, settings=settings)
        closers.append(orch)
        config = uvicorn.Config(
            create_app(orch, auth),
            lifespan="off",
            # Our logs are structlog JSON on stderr; uvicorn's own loggers propagate to the
            # root logger (warnings and errors only), and stdout keeps the one "serving" line.
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SECONDS,
            server_header=False,
        )
        server = SignalledServer(
            config, lambda: print(f"agent-txn serving on {_url(sock)}", flush=True)
        )
        await server.serve(sockets=[sock])
    finally:
        sock.close()
        await close_all(closers)


def serve(
    db: Annotated[
        str,
        typer.Option(
            "--db",
            envvar=DB_ENV,
            show_envvar=True,
            help="agent-txn database URL (sqlite+aiosqlite:///path.db or postgresql+asyncpg://…).",
        ),
    ] = DEFAULT_DB,
    host: Annotated[str, typer.Option("--host", help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="TCP port; 0 picks a free one.")
    ] = 8000,
    fake_shop: Annotated[
        str | None,
        typer.Option("--fake-shop", help="Serve the fake shop's providers from this database."),
    ] = None,
    app_ref: Annotated[
        str | None, typer.Option("--app", help="module:attribute giving your providers.")
    ] = None,
    jwt_secret: JwtSecretOption = None,
    jwt_public_key_file: JwtPublicKeyOption = None,
    jwt_audience: JwtAudienceOption = None,
    jwt_issuer: JwtIssuerOption = None,
    tenant: TenantOption = "default",
    sqlite_writer: SqliteWriterOption = None,
) -> None:
    """Serve the commands HTTP API (OpenAPI at /openapi.json) until SIGTERM or SIGINT."""
    from orchestrator import cli

    async def job() -> None:
        # Checked inside cli._run, so every refusal is the CLI's one clean error line.
        auth = _auth_settings(jwt_secret, jwt_public_key_file, tenant, jwt_audience, jwt_issuer)
        url = cli._checked_url(db)
        shop = cli._checked_url(fake_shop, "--fake-shop") if fake_shop is not None else None
        writer = cli._checked_sqlite_writer(sqlite_writer)
        await run_server(
            url,
            host=host,
            port=port,
            auth=auth,
            tenant=tenant,
            fake_shop=shop,
            app_ref=app_ref,
            sqlite_writer=writer,
        )

    cli._run(job())
    print("agent-txn stopped", flush=True)


__all__ = ["run_server", "serve"]
