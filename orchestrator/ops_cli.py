"""``agent-txn ops …``: the operator jobs of :mod:`orchestrator.ops`, run by hand.

* ``ops prune`` deletes succeeded and failed execution records older than 180 days (staged never,
  the ledger never);
* ``ops requeue-callbacks`` recovers lost callback deliveries.

Both act on every tenant sharing the database unless given ``--tenant`` (the HTTP routes always
act on the server's own tenant). ``ops deliveries`` and ``ops acknowledge`` address a room, and
a room is one tenant's: they take that tenant (``--tenant``, default ``default``, as
``agent-txn serve --tenant``).

Operator-triggered only: nothing here schedules itself. Whoever can open the database is trusted
as an operator (the HTTP routes check :func:`orchestrator.ops.is_operator` instead). Every
subcommand takes ``--db`` like the rest of the CLI, opens the store with ``auto_upgrade="never"``
and fails the same way: one ``error:`` line on stderr, exit code 2. ``--json`` prints exactly the
dictionary the Python API returns.

The shared CLI plumbing is imported from :mod:`orchestrator.cli` inside the functions: ``cli``
imports this module to register it, so a module-level import back would be circular.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Final

import typer

from ledger.store import Store
from orchestrator import ops
from orchestrator.principals_cli import checked_text

DEFAULT_DB: Final = "sqlite+aiosqlite:///agent.db"
DB_ENV: Final = "AGENT_TXN_DB"

ops_app = typer.Typer(
    help="Operator jobs: retention pruning, callback requeue.", no_args_is_help=True
)

DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        envvar=DB_ENV,
        help="agent-txn database URL (sqlite+aiosqlite:///path.db or postgresql+asyncpg://…).",
        show_envvar=True,
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
TenantOption = Annotated[
    str | None,
    typer.Option(
        "--tenant", help="Only this tenant's execution records (default: every tenant's)."
    ),
]


def _tenant(tenant: str | None) -> str | None:
    # Refused as ``principals list --tenant`` refuses it: '' would select nothing, silently.
    return None if tenant is None else checked_text(tenant, "--tenant", 100)


#: Delivery markers are a tenant's: rooms of two tenants sharing a database may share an id.
MarkerTenantOption = Annotated[
    str,
    typer.Option(
        "--tenant",
        envvar="AGENT_TXN_TENANT",
        show_envvar=True,
        help="Tenant whose markers (as `agent-txn serve --tenant`).",
    ),
]


def _run(db: str, job: Callable[[Store], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Open the store and run ``job``; expected failures end as one line on stderr (exit 2)."""
    from orchestrator import cli

    async def main() -> dict[str, Any]:
        url = cli._checked_url(db)
        cli._require_existing(url)
        store = await Store.open(url, auto_upgrade="never")
        try:
            return await job(store)
        finally:
            await store.close()

    return cli._run(main())


def _print(result: dict[str, Any], as_json: bool, text: str) -> None:
    if as_json:
        typer.echo(json.dumps(result, sort_keys=True))  # exact: no markup, no wrapping
    else:
        typer.echo(text)


@ops_app.command("prune")
def prune(
    db: DbOption = DEFAULT_DB, tenant: TenantOption = None, as_json: JsonOption = False
) -> None:
    """Delete succeeded and failed execution records older than 180 days (staged never)."""
    scope = _tenant(tenant)
    result = _run(db, lambda store: ops.prune(store, tenant=scope))
    _print(
        result,
        as_json,
        f"pruned {result['pruned']} execution record(s) created before {result['cutoff']} "
        f"(retention {result['retention_days']} days)",
    )


@ops_app.command("requeue-callbacks")
def requeue_callbacks(
    db: DbOption = DEFAULT_DB,
    older_than_seconds: Annotated[
        float,
        typer.Option(help="How long a pending or running run must sit untouched to be stale."),
    ] = ops.REQUEUE_DEFAULT_OLDER_THAN_SECONDS,
    limit: Annotated[
        int, typer.Option(help=f"Most runs to change, 1..{ops.REQUEUE_MAX_LIMIT}.")
    ] = ops.REQUEUE_DEFAULT_LIMIT,
    tenant: TenantOption = None,
    as_json: JsonOption = False,
) -> None:
    """Republish stale pending, retry eligible failed, reclaim stale running callback runs."""
    # Range checks live in ops.requeue_callbacks (one rule for CLI and HTTP), so a bad value
    # ends as the same one-line request_invalid error here.
    scope = _tenant(tenant)
    result = _run(
        db,
        lambda store: ops.requeue_callbacks(
            store, older_than_seconds=older_than_seconds, limit=limit, tenant=scope
        ),
    )
    _print(
        result,
        as_json,
        f"republished {result['republished']}, retried {result['retried']}, "
        f"reclaimed {result['reclaimed']}",
    )


@ops_app.command("deliveries")
def deliveries(
    room: Annotated[str, typer.Argument(help="The room whose delivery markers to list.")],
    db: DbOption = DEFAULT_DB,
    tenant: MarkerTenantOption = "default",
    as_json: JsonOption = False,
) -> None:
    """List a room's agent delivery markers: state, expires_at, in_window (expired ones are
    flipped first, as every lookup does)."""
    from orchestrator import agent

    checked_text(room, "ROOM", 64)
    checked_text(tenant, "--tenant", 100)
    rows = _run(db, lambda store: _wrap(agent.deliveries(store, room, tenant=tenant)))["markers"]
    text = "\n".join(
        f"{m['execution_id']}  {m['state']:<12} expires {m['expires_at']}  "
        f"{'in window' if m['in_window'] else 'outside window'}"
        for m in rows
    )
    _print({"markers": rows}, as_json, text or "no delivery markers in this room")


@ops_app.command("acknowledge")
def acknowledge(
    room: Annotated[str, typer.Argument(help="The room of the markers.")],
    execution: Annotated[
        list[str], typer.Option("--execution", "-e", help="Execution id (repeatable).")
    ],
    execute: Annotated[
        bool, typer.Option("--execute", help="Release them (default: preview, no write).")
    ] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Also release in-window markers (re-opens duplicates)."),
    ] = False,
    db: DbOption = DEFAULT_DB,
    tenant: MarkerTenantOption = "default",
    as_json: JsonOption = False,
) -> None:
    """Release selected delivery markers; never rolls back a committed write."""
    from orchestrator import agent

    checked_text(room, "ROOM", 64)
    checked_text(tenant, "--tenant", 100)
    rows = _run(
        db,
        lambda store: _wrap(
            agent.acknowledge(store, room, execution, tenant=tenant, execute=execute, force=force)
        ),
    )["markers"]
    text = "\n".join(f"{m['execution_id']}  {m['result']}" for m in rows)
    _print({"markers": rows}, as_json, text)
    if any(m["result"] == "not_found" for m in rows):
        # The output says which; the exit code lets a script see that not every named
        # marker was there (a typo, another tenant's) without parsing it.
        from orchestrator import cli

        raise typer.Exit(cli.EXIT_PROBLEM)


async def _wrap(job: Awaitable[list[dict[str, Any]]]) -> dict[str, Any]:
    return {"markers": await job}


__all__ = ["ops_app"]
