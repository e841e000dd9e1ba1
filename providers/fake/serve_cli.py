"""``agent-txn fake-provider serve``: the fake shop over HTTP, for demos and HTTP-adapter tests.

::

    agent-txn fake-provider serve --port 8787 --db sqlite+aiosqlite:///provider.db \\
        [--host 127.0.0.1] [--seed-stock sku-1=100 ...]

``--db`` is the *provider's* database (never agent-txn's own). The command prints the base URL
on one line once it is listening (``--port 0`` picks a free port), and runs until SIGINT or
SIGTERM, when it stops accepting, cancels requests in progress and closes the database.
Registered as a plugin of the ``agent-txn`` CLI through the ``agent_txn.cli`` entry-point group.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from typing import Annotated
from urllib.parse import quote, quote_plus

import typer
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from providers.fake.schema import MAX_SKU_LENGTH, MAX_STOCK
from providers.fake.shop import FakeShop
from providers.fake.store import ShopDatabaseError

app = typer.Typer(
    help="The fake shop provider (inventory, payments, email) served over HTTP.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

#: The longest reason shown for a database that cannot be opened: one line, not a dump.
_MAX_REASON = 200


@app.callback()
def main() -> None:
    """The fake shop provider (inventory, payments, email) served over HTTP."""
    # A callback keeps ``serve`` a named sub-command: a Typer app with one command and no
    # callback would collapse into that command (``agent-txn fake-provider --port ...``).


def parse_stock(items: list[str]) -> dict[str, int]:
    """``["sku-1=100", ...]`` as ``{"sku-1": 100}``; raises :class:`typer.BadParameter`."""
    levels: dict[str, int] = {}
    for item in items:
        sku, sep, count = item.partition("=")
        try:
            units = int(count)
        except ValueError:
            units = -1
        # The stock table's bounds, checked here: past them the database refused the row after
        # the shop had opened (on PostgreSQL from 2**31 on, a driver error that printed the SQL
        # and its parameters; on SQLite past 64 bits, an OverflowError).
        if not sep or not sku or not 0 <= units <= MAX_STOCK:
            raise typer.BadParameter(
                f"expected SKU=UNITS with UNITS from 0 to {MAX_STOCK}, got {item!r}",
                param_hint="--seed-stock",
            )
        if len(sku) > MAX_SKU_LENGTH:
            raise typer.BadParameter(
                f"a SKU is at most {MAX_SKU_LENGTH} characters, got {len(sku)}",
                param_hint="--seed-stock",
            )
        levels[sku] = units
    return levels


class ServeError(Exception):
    """A start-up failure reported as one line (exit code 2), never a traceback."""


def _reason(exc: BaseException, db: str) -> str:
    """Why the provider database could not be opened, in one line without the password."""
    if isinstance(exc, ShopDatabaseError):
        return str(exc)  # ours, written to be shown
    if isinstance(exc, ArgumentError):
        # SQLAlchemy's text may repeat the URL, password included.
        return "--db is not a database URL (dialect+driver://user:password@host/database)"
    # The driver's own words, not SQLAlchemy's wrapping (the SQL and a link to its docs).
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    text = (str(cause).strip().splitlines() or [""])[0]
    try:
        password = make_url(db).password
    except Exception:
        password = None
    if password:
        for shown in {str(password), quote(str(password), safe=""), quote_plus(str(password))}:
            text = text.replace(shown, "***")
    if len(text) > _MAX_REASON:
        text = text[: _MAX_REASON - 1] + "…"
    name = type(cause).__name__
    return f"{text} ({name})" if text else name


def _checked_host(host: str, port: int) -> None:
    """Refuse, before the database is opened (nothing is written then), a ``--host`` that
    names no interface, and a ``--port`` in use there."""
    if not host:
        # asyncio takes "" as "every interface" (0.0.0.0 and ::): a typo that exposed the shop.
        raise ServeError(
            f"cannot serve on :{port}: --host is empty (0.0.0.0 or :: is every interface)"
        )
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        if port:
            for family, kind, proto, _, address in addresses:
                _probe_bind(family, kind, proto, address)
    except UnicodeError:
        # The idna codec refuses a label over 63 characters (a ValueError, not an OSError).
        raise ServeError(f"cannot serve on {host}:{port}: not a valid host name") from None
    except OSError as exc:
        raise ServeError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None


def _probe_bind(family: int, kind: int, proto: int, address: tuple[object, ...]) -> None:
    """Bind ``address`` and let it go: a port in use is refused before the shop's tables are
    made in ``--db``. The server binds again a moment later; should another process take the
    port in between, the server's own bind still fails cleanly, only after the tables."""
    with socket.socket(family, kind, proto) as probe:
        # As asyncio.start_server does on POSIX: a port left in TIME_WAIT is not "in use".
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        probe.bind(address)


async def _run(db: str, host: str, port: int, stock: dict[str, int]) -> None:
    # Local: the CLI imports this module to register the command, and only serving needs httpx.
    from providers.fake.http_server import serve as serve_shop

    try:
        shop = await FakeShop.open(db)
    except Exception as exc:
        raise ServeError(f"cannot open the provider database: {_reason(exc, db)}") from None
    try:
        if stock:
            await shop.seed_stock(stock)
        try:
            server = await serve_shop(shop, host, port)
        except OSError as exc:  # port in use, no such interface
            raise ServeError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
        try:
            stopped = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stopped.set)
            # One line, flushed: scripts and tests wait for it to know the port.
            print(f"fake-provider listening on {server.url}", flush=True)
            await stopped.wait()
        finally:
            await server.stop()
    finally:
        await shop.close()


@app.command()
def serve(
    port: Annotated[
        int, typer.Option("--port", help="TCP port; 0 picks a free one.", min=0, max=65535)
    ],
    db: Annotated[
        str,
        typer.Option("--db", help="The provider's database URL (SQLite or PostgreSQL)."),
    ],
    host: Annotated[str, typer.Option("--host", help="Interface to bind.")] = "127.0.0.1",
    seed_stock: Annotated[
        list[str] | None,
        typer.Option(
            "--seed-stock",
            help=f"Set a SKU's stock, SKU=UNITS, UNITS from 0 to {MAX_STOCK} (repeatable).",
        ),
    ] = None,
) -> None:
    """Serve the fake shop over HTTP until SIGINT or SIGTERM."""
    stock = parse_stock(seed_stock or [])
    try:
        _checked_host(host, port)
        asyncio.run(_run(db, host, port, stock))
    except ServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None


__all__ = ["ServeError", "app", "parse_stock", "serve"]
