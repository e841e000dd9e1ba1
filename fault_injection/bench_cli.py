"""``agent-txn bench``: throughput, latency and commit economy of the order saga.

::

    agent-txn bench [--db URL] [--sagas N] [--concurrency C] [--provider memory|fake]
        [--latency-ms L] [--warmup W] [--json PATH] [--sqlite-synchronous FULL|NORMAL]

``--db`` omitted runs on fresh SQLite files in a temporary folder; a PostgreSQL URL names the
*server*: fresh databases are created there and dropped after. Exit status: 0 when the bench's
checker found exactly one effect per intent, 1 otherwise, 2 on bad usage.

Lives in ``fault_injection`` (not ``orchestrator``) because it needs the shops and the suite's
order saga, which the orchestrator layer must not import; it is plugged in through the
``agent_txn.cli`` entry-point group.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fault_injection.bench import PROVIDERS, BenchConfig, BenchResult, run_bench

app = typer.Typer(
    help="Benchmark the order saga end to end.",
    invoke_without_command=True,
    pretty_exceptions_show_locals=False,
)


def render(result: BenchResult, out: Console) -> None:
    """The human report: one table, then the checker's verdict."""
    table = Table(
        title=f"order saga · {result.backend} · {result.provider} provider · "
        f"{result.sagas} sagas · concurrency {result.concurrency}"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("sagas/s", f"{result.sagas_per_s:,.1f}"),
        ("p50 latency (ms)", f"{result.p50_ms:.2f}"),
        ("p99 latency (ms)", f"{result.p99_ms:.2f}"),
        ("commits / saga", f"{result.commits_per_saga:.2f}"),
        ("statements / saga", f"{result.statements_per_saga:.2f}"),
        ("client CPU ms / saga", f"{result.cpu_ms_per_saga:.2f}"),
        ("provider calls / saga", f"{result.provider_calls_per_saga:.2f}"),
        (
            f"driver commits/s ({result.driver_connections} conn)",
            f"{result.driver_commits_per_s:,.0f}",
        ),
        ("efficiency", f"{result.efficiency:.2f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    out.print(table)
    check = result.check
    if check.ok:
        out.print(
            f"[green]check OK[/]: exactly one reserve, charge and email per intent "
            f"({check.expected} each, warm-up included), nothing in flight"
        )
    else:
        out.print("[red]check FAILED[/]:")
        for problem in check.problems:
            out.print(f"  - {problem}")


@app.callback()
def bench(
    db: Annotated[str | None, typer.Option(help="SQLite URL, or a PostgreSQL server URL.")] = None,
    sagas: Annotated[int, typer.Option(min=1, help="Measured sagas.")] = 1000,
    concurrency: Annotated[int, typer.Option(min=1, max=1024, help="Sagas in flight.")] = 1,
    provider: Annotated[str, typer.Option(help="memory | fake")] = "memory",
    latency_ms: Annotated[
        float, typer.Option(min=0, help="Added to every provider call (asyncio.sleep).")
    ] = 0.0,
    warmup: Annotated[int, typer.Option(min=0, help="Sagas run before measuring.")] = 20,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the results as JSON to PATH.")
    ] = None,
    sqlite_synchronous: Annotated[
        str, typer.Option(help="SQLite synchronous pragma (engine and driver loop).")
    ] = "FULL",
    driver_seconds: Annotated[
        float, typer.Option(min=0.1, help="Length of the driver's small-commit loop.")
    ] = 1.5,
) -> None:
    """Run the order saga (reserve + charge, receipt via the outbox) and report its costs."""
    from fault_injection.cli import checked_db

    checked_db(db)
    out = Console(highlight=False, soft_wrap=True)
    if provider not in PROVIDERS:
        out.print(f"[red]error:[/] --provider must be one of {', '.join(PROVIDERS)}")
        raise typer.Exit(2)
    if sqlite_synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
        out.print("[red]error:[/] --sqlite-synchronous must be OFF, NORMAL, FULL or EXTRA")
        raise typer.Exit(2)
    config = BenchConfig(
        sagas=sagas,
        concurrency=concurrency,
        provider="memory" if provider == "memory" else "fake",
        latency_ms=latency_ms,
        warmup=warmup,
        driver_seconds=driver_seconds,
        sqlite_synchronous=sqlite_synchronous.upper(),
    )
    result = asyncio.run(run_bench(config, db=db))
    render(result, out)
    if json_path is not None:
        json_path.write_text(json.dumps(result.as_json(), indent=2) + "\n", encoding="utf-8")
    if not result.check.ok:
        raise typer.Exit(1)
