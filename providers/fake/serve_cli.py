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
import sys
from typing import Annotated

import typer

from providers.fake.shop import FakeShop

app = typer.Typer(
    help="The fake shop provider (inventory, payments, email) served over HTTP.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


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
        if not sep or not sku or units < 0:
            raise typer.BadParameter(
                f"expected SKU=UNITS with UNITS >= 0, got {item!r}", param_hint="--seed-stock"
            )
        levels[sku] = units
    return levels


class ServeError(Exception):
    """A start-up failure reported as one line (exit code 2), never a traceback."""


async def _run(db: str, host: str, port: int, stock: dict[str, int]) -> None:
    # Local: the CLI imports this module to register the command, and only serving needs httpx.
    from providers.fake.http_server import serve as serve_shop

    try:
        shop = await FakeShop.open(db)
    except Exception as exc:
        # Only the error's type: the message may repeat the URL, password included.
        raise ServeError(f"cannot open the provider database ({type(exc).__name__})") from None
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
        typer.Option("--seed-stock", help="Set a SKU's stock, SKU=UNITS (repeatable)."),
    ] = None,
) -> None:
    """Serve the fake shop over HTTP until SIGINT or SIGTERM."""
    stock = parse_stock(seed_stock or [])
    try:
        asyncio.run(_run(db, host, port, stock))
    except ServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None


__all__ = ["ServeError", "app", "parse_stock", "serve"]
