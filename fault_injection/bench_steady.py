"""A fixed workload for counting instructions: ``python -m fault_injection.bench_steady N C``.

Why: on this kind of machine the wall clock of the same run moves by a third between runs
(the virtual machine's neighbours), so a change worth 5 % needs many alternating pairs of
``agent-txn bench`` to show. ``valgrind --tool=callgrind`` counts the instructions the process
executes instead: two runs of the same code agree to about 1 % per saga (run a changed tree once
first: compiling its modules is counted too). This module runs
exactly the work the bench measures in-process — a warm-up of 30 order sagas, then N sagas
with C in flight on the memory provider, then the drain — and nothing time-based (no driver
loop, no DBOS), so that::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python -m fault_injection.bench_steady 200 16 [sqlite|postgres URL]

minus the same with ``N = 0``, divided by N, is the engine's instructions per saga (kernel
time, such as the WAL's writes, is not counted: read it with the bench). ``docs/benchmarks-log.md``
("Counting instructions") has the figures and the commands. ``--no-drain`` leaves the drain out.

On SQLite with C > 1 the store's default ships commit groups to a writer process, whose
instructions callgrind does not count unless told to follow children
(``--trace-children=yes``, which counts them in a file of their own): pass ``--sqlite-writer
inline`` to count the whole engine in this one process, as the log's instruction counts
did.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from pathlib import Path

from fault_injection.bench import _run_sagas, open_shop
from fault_injection.harness import DatabasePair, fresh_databases, scratch_folder
from fault_injection.sagas import order_saga
from ledger.store import SQLITE_WRITERS, SqliteWriter
from orchestrator.config import EngineSettings
from orchestrator.engine import Orchestrator

WARMUP = 30


async def run(
    sagas: int,
    concurrency: int,
    urls: DatabasePair,
    *,
    drain: bool,
    sqlite_writer: SqliteWriter | None = None,
) -> dict[str, int]:
    """Warm up, then run ``sagas`` order sagas ``concurrency`` at a time (then drain); the
    shop's effect counts."""
    settings = EngineSettings(
        worker_id=f"steady-{uuid.uuid4().hex[:8]}",
        sqlite_synchronous="NORMAL",
        sqlite_writer=sqlite_writer,
        pg_pool_size=max(20, concurrency),
    )
    async with open_shop("memory", urls.provider) as shop:
        orch = await Orchestrator.open(urls.store, providers=shop.providers(), settings=settings)
        async with orch:
            await orch.register(order_saga())
            for count, tag in ((WARMUP, "warm"), (sagas, "steady")):
                if count:
                    problems = await _run_sagas(orch, count, concurrency, tag, [])
                    if problems:
                        raise SystemExit(f"{tag}: {problems[:3]}")
                    if drain:
                        await orch.drain()
            return await shop.counts()


async def _main(args: argparse.Namespace) -> None:
    with scratch_folder(args.db, "steady-") as workdir:
        async with fresh_databases(args.db, Path(workdir)) as urls:
            await run(
                args.sagas,
                args.concurrency,
                urls,
                drain=not args.no_drain,
                sqlite_writer=args.sqlite_writer,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("sagas", type=int)
    parser.add_argument("concurrency", type=int)
    parser.add_argument("db", nargs="?", default=None, help="omitted: SQLite files")
    parser.add_argument("--no-drain", action="store_true")
    parser.add_argument("--sqlite-writer", choices=SQLITE_WRITERS, default=None)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
