"""``agent-txn bench --workers W``: worker processes draining sagas the bench prepared.

The bench process (:func:`run_workers_bench`):

1. enqueues N order sagas (:meth:`Orchestrator.enqueue`: one commit each, the plan persisted
   with every step pending and no lease, so every saga is due at once and its first step is
   known never to have been sent — the worker that claims it applies without a lookup);
2. starts W worker processes (``python -m fault_injection.bench_workers worker``): each opens
   its providers and the store, runs ``warmup`` sagas of its own through ``execute``, prints
   ``ready`` and waits for ``go`` on stdin; then it runs the same :class:`orchestrator.worker.
   Worker` loop as ``agent-txn worker`` (claim due transactions in one statement with ``SKIP
   LOCKED``, drive them, dispatch due outbox events) until SIGTERM, and writes what it counted
   since ``go`` (commits, statements, CPU, provider calls, the memory shop's effects) to a JSON
   file;
3. says ``go`` to all workers at once and times until every saga is committed and every
   receipt sent (polling the store every 20 ms), stops the workers, adds their counts up and
   runs the bench's checker: exactly one reserve, charge and email per intent.

Providers: ``fake`` (each worker opens the shop's database) and ``http`` (one shop server
process, every worker a client of it) are one provider shared by all workers. ``memory`` gives
each worker its own in-process shop (a dict provider per process, no database): a saga's steps
all run in the worker that claimed it, and the checker still proves one effect per intent by
adding the shops' counts up (every saga committed, so every intent took effect at least once;
a total of exactly N per action leaves no room for a second one).

Also here: ``python -m fault_injection.bench_workers shop`` serves the fake shop over HTTP for
``--provider http`` (its own process, so the shop's CPU is not the client's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import signal
import sys
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fault_injection.bench import (
    HTTP_TIMEOUT_SECONDS,
    NEVER,
    ONCE_PER_SAGA,
    BenchConfig,
    BenchResult,
    CheckOutcome,
    InstrumentedProvider,
    ProviderKind,
    first_line,
    open_shop,
)
from fault_injection.bench_driver import measure_driver
from fault_injection.harness import DatabasePair
from fault_injection.sagas import STOCK, order, order_saga
from fault_injection.server_cpu import per_saga_ms, read_server, server_cpu_seconds
from ledger import dialects
from ledger.effects import EffectKind, count_unsettled
from ledger.states import TxState
from ledger.transactions import count_by_status
from orchestrator.config import EngineSettings
from orchestrator.engine import Orchestrator
from orchestrator.worker import Worker
from orchestrator.workerproc import worker_settings
from providers.contract import Provider

#: How often the bench asks the store whether the workers are done (at least; 1 % of the time
#: so far on long runs).
POLL_DONE_SECONDS = 0.02
#: Workers and recovery: the run fails past ``max(drain_timeout_seconds, N * this)``.
SECONDS_PER_SAGA_LIMIT = 0.5
#: How long a worker process may take to import and open, before its warm-up
#: (:func:`ready_timeout` adds the warm-up's own time).
READY_TIMEOUT_SECONDS = 120.0
#: Provider calls allowed for a warm-up saga in :func:`ready_timeout`: twice its three calls
#: (reserve, charge, the receipt), for a lookup after each.
WARMUP_CALLS_PER_SAGA = 2 * len(ONCE_PER_SAGA)
#: The worker's drain after its warm-up (``orch.drain(timeout_seconds=...)``).
WARMUP_DRAIN_SECONDS = 30.0
#: Each worker's idle poll (``agent-txn worker --poll-seconds``).
WORKER_POLL_SECONDS = 0.05


@dataclass
class WorkerCounts:
    """What one worker process counted between ``go`` and SIGTERM (its JSON file)."""

    worker_id: str
    commits: int = 0
    statements: int = 0
    rollbacks: int = 0
    cpu_s: float = 0.0
    provider_calls: int = 0
    claimed: int = 0
    passes: int = 0
    finished: int = 0
    events: int = 0
    errors: int = 0
    lease_lost: int = 0
    #: Memory provider only: effects applied by this process's shop (warm-up included).
    memory_counts: dict[str, int] = field(default_factory=dict)
    memory_duplicates: list[list[str]] = field(default_factory=list)


# -- the worker process ---------------------------------------------------------------------------


async def _worker_main(args: argparse.Namespace) -> WorkerCounts | None:
    calls = [0]
    async with AsyncExitStack() as stack:
        memory = None
        providers: list[Provider]
        if args.provider == "memory":
            from providers.memory import MemoryShop

            memory = MemoryShop()
            memory.seed_stock(STOCK)
            providers = memory.providers()
        elif args.provider == "fake":
            from providers.fake.shop import FakeShop

            shop = await FakeShop.open(args.provider_url)
            stack.push_async_callback(shop.close)
            providers = shop.providers()
        else:
            from providers.fake.http_server import fake_shop_http_providers

            clients = fake_shop_http_providers(args.base_url, timeout=HTTP_TIMEOUT_SECONDS)
            for client in clients:
                stack.push_async_callback(client.aclose)
            providers = list(clients)
        wrapped = [InstrumentedProvider(p, args.latency_ms / 1000, calls) for p in providers]
        settings = EngineSettings(
            worker_id=args.worker_id, sqlite_synchronous=args.sqlite_synchronous
        )
        orch = await Orchestrator.open(
            args.db, providers=wrapped, settings=worker_settings(settings, args.concurrency)
        )
        stack.push_async_callback(orch.close)
        saga = order_saga()
        await orch.register(saga)
        for i in range(args.warmup):
            await orch.execute(saga, order(f"warm-{args.worker_id}-{i}"))
        await orch.drain(timeout_seconds=WARMUP_DRAIN_SECONDS)

        worker = Worker(orch, concurrency=args.concurrency, poll_seconds=args.poll_seconds)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        print("ready", flush=True)
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if line.strip() != "go":
            return None
        stats0 = orch.store.stats.snapshot()
        cpu0 = time.process_time()
        calls0 = calls[0]
        run = await worker.run()
        stats1 = orch.store.stats.snapshot()
        counts = WorkerCounts(
            worker_id=args.worker_id,
            commits=stats1.commits - stats0.commits,
            statements=stats1.statements - stats0.statements,
            rollbacks=stats1.rollbacks - stats0.rollbacks,
            cpu_s=time.process_time() - cpu0,
            provider_calls=calls[0] - calls0,
            claimed=run.claimed,
            passes=run.passes,
            finished=run.finished,
            events=run.events,
            errors=run.errors,
            lease_lost=run.lease_lost,
        )
        if memory is not None:
            counts.memory_counts = memory.counts()
            counts.memory_duplicates = [list(pair) for pair in memory.duplicate_keys()]
    return counts


async def _shop_main(args: argparse.Namespace) -> int:
    from providers.fake.http_server import serve
    from providers.fake.shop import FakeShop

    shop = await FakeShop.open(args.provider_url)
    try:
        await shop.seed_stock(STOCK)
        server = await serve(shop, "127.0.0.1", 0)
        try:
            stopped = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stopped.set)
            print(f"listening on {server.url}", flush=True)
            await stopped.wait()
        finally:
            await server.stop()
    finally:
        await shop.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m fault_injection.bench_workers worker|shop ...`` (spawned by the bench)."""
    parser = argparse.ArgumentParser(prog="fault_injection.bench_workers")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="one bench worker process")
    w.add_argument("--db", required=True)
    w.add_argument("--provider", choices=["memory", "fake", "http"], required=True)
    w.add_argument("--provider-url", default="")
    w.add_argument("--base-url", default="")
    w.add_argument("--worker-id", required=True)
    w.add_argument("--concurrency", type=int, default=8)
    w.add_argument("--poll-seconds", type=float, default=WORKER_POLL_SECONDS)
    w.add_argument("--warmup", type=int, default=0)
    w.add_argument("--latency-ms", type=float, default=0.0)
    w.add_argument("--sqlite-synchronous", default="FULL")
    w.add_argument("--stats", required=True)
    s = sub.add_parser("shop", help="serve the fake shop over HTTP")
    s.add_argument("--provider-url", required=True)
    args = parser.parse_args(argv)
    if args.command == "shop":
        return asyncio.run(_shop_main(args))
    counts = asyncio.run(_worker_main(args))
    if counts is None:
        return 2
    Path(args.stats).write_text(json.dumps(counts.__dict__), encoding="utf-8")
    return 0


# -- the bench side -------------------------------------------------------------------------------


async def _count_done(reader: Orchestrator) -> tuple[int, int]:
    """(committed transactions, outbox events not yet settled)."""
    async with reader.store.read() as conn:
        statuses = await count_by_status(conn)
        unsent = await count_unsettled(conn, EffectKind.OUTBOX)
    return statuses.get(TxState.COMMITTED.value, 0), unsent


def ready_timeout(config: BenchConfig) -> float:
    """How long a worker may take to say ``ready``: its start, then its warm-up, one saga after
    another, each with its provider calls' ``--latency-ms``. Why scaled: a fixed 120 s fired
    on a legitimate warm-up (``--warmup 9 --latency-ms 5000`` takes over two minutes)."""
    per_saga = SECONDS_PER_SAGA_LIMIT + WARMUP_CALLS_PER_SAGA * config.latency_ms / 1000
    return READY_TIMEOUT_SECONDS + WARMUP_DRAIN_SECONDS + config.warmup * per_saga


async def _start_worker(
    args: list[str], stats_path: Path, stderr_path: Path
) -> asyncio.subprocess.Process:
    """One worker process; its stderr goes to the file ``stderr_path`` (quoted if it fails to
    start, :func:`~fault_injection.bench.first_line`)."""
    with stderr_path.open("wb") as stderr:  # the child keeps its own descriptor
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "fault_injection.bench_workers",
            "worker",
            *args,
            "--stats",
            str(stats_path),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )


async def run_workers_bench(
    config: BenchConfig, urls: DatabasePair, workdir: Path | None = None
) -> BenchResult:
    """The ``--workers`` mode on one pair of empty databases (see module doc)."""
    if config.workers < 1:
        raise ValueError("workers must be >= 1")
    async with AsyncExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-w-")))
        return await _run_workers(config, urls, workdir)
    raise AssertionError("unreachable")  # pragma: no cover


async def _run_workers(config: BenchConfig, urls: DatabasePair, workdir: Path) -> BenchResult:
    n, w = config.sagas, config.workers
    async with open_shop(config.provider, urls.provider) as shop:
        common = ["--db", urls.store, "--provider", config.provider]
        common += ["--provider-url", urls.provider, "--base-url", shop.base_url or ""]
        common += ["--concurrency", str(config.concurrency), "--warmup", str(config.warmup)]
        common += ["--latency-ms", str(config.latency_ms)]
        common += ["--sqlite-synchronous", config.sqlite_synchronous]
        stats_paths = [workdir / f"worker-{i}.json" for i in range(w)]
        stderrs = [workdir / f"worker-{i}.err" for i in range(w)]
        procs = [
            await _start_worker([*common, "--worker-id", f"bench-w{i}"], stats_paths[i], stderrs[i])
            for i in range(w)
        ]
        reader = await Orchestrator.open(urls.store)
        try:
            for i, proc in enumerate(procs):
                await first_line(
                    proc,
                    stderrs[i],
                    who=f"bench worker bench-w{i} (pid {proc.pid})",
                    expect="ready",
                    within_seconds=ready_timeout(config),
                )
            # Only now, with every worker warmed up and waiting for "go" (its warm-up drain
            # must not take them): the bench's own engine persists the plans, calling no
            # provider.
            cpu0 = time.process_time()
            prep_started = time.perf_counter()
            prep_stats = await prepare_sagas(urls.store, shop.providers(), n, config.concurrency)
            prepare_s = time.perf_counter() - prep_started
            prepare_cpu = time.process_time() - cpu0
            expected = n + w * config.warmup
            server_before = read_server(urls.store)
            started = time.perf_counter()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
            deadline = started + max(config.drain_timeout_seconds, n * SECONDS_PER_SAGA_LIMIT)
            problems: list[str] = []
            while True:
                committed, unsent = await _count_done(reader)
                if committed >= expected and unsent == 0:
                    break
                if time.perf_counter() > deadline:
                    problems.append(
                        f"timed out: {committed} of {expected} committed, {unsent} receipts unsent"
                    )
                    break
                # Finer than 1 % of the time so far, and no scan storm on a long run.
                waited = time.perf_counter() - started
                await asyncio.sleep(max(POLL_DONE_SECONDS, waited / 100))
            elapsed = time.perf_counter() - started
            # Read before the workers end: a backend that has ended takes its time with it.
            server_cpu = server_cpu_seconds(server_before, read_server(urls.store))
        except BaseException:
            # A worker that did not start (or any failure) ends the run: the reader's
            # connections with it, which were left open (the happy path closes it below).
            await reader.close()
            raise
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                await asyncio.wait_for(proc.wait(), 60)
        counts = _read_counts(stats_paths)
        if len(counts) < w:
            problems.append(f"{w - len(counts)} workers wrote no counts (they died)")
        problems += [
            f"worker {p.pid} exited {p.returncode}" for p in procs if p.returncode not in (0,)
        ]
        check = await _check_workers(shop, reader, counts, expected, config.provider)
        await reader.close()
        check.problems[:0] = problems
        check.ok = check.ok and not problems

        connections = (
            1 if urls.backend == "sqlite" else min(w * config.concurrency, dialects.PG_POOL_SIZE)
        )
        driver = await measure_driver(
            urls.store,
            seconds=config.driver_seconds,
            connections=connections,
            sqlite_synchronous=config.sqlite_synchronous,
        )

    commits = prep_stats[0] + sum(c.commits for c in counts)
    statements = prep_stats[1] + sum(c.statements for c in counts)
    rollbacks = prep_stats[2] + sum(c.rollbacks for c in counts)
    cpu = prepare_cpu + sum(c.cpu_s for c in counts)
    sagas_per_s = n / elapsed
    commits_per_saga = commits / n
    return BenchResult(
        backend=urls.backend,
        provider=config.provider,
        sagas=n,
        concurrency=config.concurrency,
        warmup=config.warmup,
        latency_ms=config.latency_ms,
        sagas_per_s=sagas_per_s,
        p50_ms=None,
        p99_ms=None,
        commits_per_saga=commits_per_saga,
        statements_per_saga=statements / n,
        rollbacks_per_saga=rollbacks / n,
        cpu_ms_per_saga=cpu * 1000 / n,
        provider_calls_per_saga=sum(c.provider_calls for c in counts) / n,
        driver_commits_per_s=driver.engine,
        raw_driver_commits_per_s=driver.raw,
        driver_connections=connections,
        efficiency=sagas_per_s * commits_per_saga / driver.engine if driver.engine else 0.0,
        elapsed_s=elapsed,
        check=check,
        mode="workers",
        workers=w,
        sqlite_synchronous=config.sqlite_synchronous if urls.backend == "sqlite" else None,
        prepare_s=prepare_s,
        server_cpu_ms_per_saga=per_saga_ms(server_cpu, n),
        extra={
            "prepare_sagas_per_s": n / prepare_s if prepare_s else 0.0,
            "end_to_end_sagas_per_s": n / (prepare_s + elapsed),
            "prepare_commits_per_saga": prep_stats[0] / n,
            "prepare_cpu_ms_per_saga": prepare_cpu * 1000 / n,
            "worker_cpu_ms_per_saga": sum(c.cpu_s for c in counts) * 1000 / n,
            "per_worker": [
                {
                    "worker_id": c.worker_id,
                    "finished": c.finished,
                    "events": c.events,
                    "claimed": c.claimed,
                    "passes": c.passes,
                    "commits": c.commits,
                    "cpu_s": round(c.cpu_s, 3),
                    "errors": c.errors,
                    "lease_lost": c.lease_lost,
                }
                for c in counts
            ],
        },
    )


def _read_counts(paths: list[Path]) -> list[WorkerCounts]:
    """The counts the workers wrote when they stopped (a missing file: that worker died)."""
    return [WorkerCounts(**json.loads(p.read_text(encoding="utf-8"))) for p in paths if p.exists()]


async def prepare_sagas(
    url: str, providers: list[Provider], count: int, concurrency: int
) -> tuple[int, int, int]:
    """``count`` order sagas enqueued for the workers (see the module doc), ``concurrency`` at
    a time. Returns the enqueuing engine's (commits, statements, rollbacks)."""
    settings = EngineSettings(worker_id=f"bench-prep-{uuid.uuid4().hex[:6]}")
    orch = await Orchestrator.open(url, providers=providers, settings=settings)
    saga = order_saga()
    await orch.register(saga)
    before = orch.store.stats.snapshot()
    next_index = 0

    async def one_lane() -> None:
        nonlocal next_index
        while next_index < count:
            i = next_index
            next_index += 1
            await orch.enqueue(saga, order(f"bench-{i}"))

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(max(1, min(concurrency, count))):
                group.create_task(one_lane())
        after = orch.store.stats.snapshot()
    finally:
        await orch.close()
    return (
        after.commits - before.commits,
        after.statements - before.statements,
        after.rollbacks - before.rollbacks,
    )


async def run_recovery_bench(config: BenchConfig, urls: DatabasePair) -> BenchResult:
    """``--mode recovery``: :func:`fault_injection.fleet.run_fleet` without faults.

    ``config.sagas`` transactions are left in doubt (each dies right after its intent was
    durable; :func:`~fault_injection.fleet.make_in_doubt`, not timed), then ``config.workers``
    fresh ``agent-txn worker`` processes (fake shop, ``config.concurrency`` sagas in hand each)
    are timed from their start until every transaction is terminal and every receipt sent.
    Their CPU is the children's rusage (process start and imports included); commits and
    statements are not reported, as those processes report no counts. The checker reads the
    shop's database and every invariant (:func:`~fault_injection.invariants.check_invariants`).
    """
    from fault_injection.fleet import run_fleet
    from fault_injection.harness import Harness

    if config.provider != "fake":
        raise ValueError("recovery mode runs the fleet's fake shop: use --provider fake")
    n = config.sagas
    harness = await Harness.open(urls)
    try:
        children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        report = await run_fleet(
            harness,
            sagas=config.sagas,
            workers=config.workers,
            concurrency=config.concurrency,
            deadline_seconds=max(config.drain_timeout_seconds, n * SECONDS_PER_SAGA_LIMIT),
        )
        children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        effects = await harness.shop.counts()
        invariants = await harness.check()
    finally:
        await harness.close()
    problems = [
        f"{name}: {effects.get(name, 0)} effects for {n} intents"
        for name in ONCE_PER_SAGA
        if effects.get(name, 0) != n
    ]
    problems += [f"{name}: {effects[name]} on a happy path" for name in NEVER if effects.get(name)]
    committed = report.statuses.get(TxState.COMMITTED.value, 0)
    if committed != n:
        problems.append(f"{committed} of {n} sagas committed ({report.statuses})")
    problems += [f"invariant {v.invariant}: {v.message}" for v in invariants.violations[:10]]
    problems += [
        f"a worker exited {code}"
        for i, code in enumerate(report.exit_codes)
        if code not in (0,) and i not in report.stopped_while_starting
    ]
    check = CheckOutcome(not problems, effects, n, problems)
    cpu = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)

    connections = (
        1
        if urls.backend == "sqlite"
        else min(config.workers * config.concurrency, dialects.PG_POOL_SIZE)
    )
    driver = await measure_driver(
        urls.store,
        seconds=config.driver_seconds,
        connections=connections,
        sqlite_synchronous=config.sqlite_synchronous,
    )
    return BenchResult(
        backend=urls.backend,
        provider=config.provider,
        sagas=n,
        concurrency=config.concurrency,
        warmup=0,
        latency_ms=0.0,
        sagas_per_s=report.sagas_per_s,
        p50_ms=None,
        p99_ms=None,
        commits_per_saga=None,
        statements_per_saga=None,
        rollbacks_per_saga=None,
        cpu_ms_per_saga=cpu * 1000 / n,
        provider_calls_per_saga=None,
        driver_commits_per_s=driver.engine,
        raw_driver_commits_per_s=driver.raw,
        driver_connections=connections,
        efficiency=None,
        elapsed_s=report.seconds_to_settle,
        check=check,
        mode="recovery",
        workers=config.workers,
        sqlite_synchronous=config.sqlite_synchronous if urls.backend == "sqlite" else None,
        extra={
            "seconds_to_settle": report.seconds_to_settle,
            "statuses": report.statuses,
            "invariants_checked": {
                "transactions": invariants.transactions,
                "effects": invariants.effects,
                "ledger_rows": invariants.ledger_rows,
            },
        },
    )


async def _check_workers(
    shop: Any,
    reader: Orchestrator,
    counts: list[WorkerCounts],
    expected: int,
    provider: ProviderKind,
) -> CheckOutcome:
    """One effect per intent: the shared shop's database, or the memory shops added up."""
    if provider == "memory":
        effects: dict[str, int] = {}
        duplicates: list[str] = []
        for c in counts:
            for name, k in c.memory_counts.items():
                effects[name] = effects.get(name, 0) + k
            duplicates += [f"{p}: key {k} took effect twice" for p, k in c.memory_duplicates]
    else:
        effects = await shop.counts()
        duplicates = []
    problems = [
        f"{name}: {effects.get(name, 0)} effects for {expected} intents"
        for name in ONCE_PER_SAGA
        if effects.get(name, 0) != expected
    ]
    problems += [f"{name}: {effects[name]} on a happy path" for name in NEVER if effects.get(name)]
    problems += duplicates
    committed, _unsent = await _count_done(reader)
    if committed != expected:
        problems.append(f"{committed} of {expected} sagas committed")
    left = await reader.in_flight()
    if left:
        problems.append(f"{left} transactions or outbox events still in flight")
    return CheckOutcome(not problems, effects, expected, problems)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())


__all__ = [
    "WorkerCounts",
    "main",
    "prepare_sagas",
    "run_recovery_bench",
    "run_workers_bench",
]
