"""The benchmark behind ``agent-txn bench``: the order saga end to end, and the driver's own limit.

One run, on one pair of databases (ours and, for ``--provider fake``, the shop's):

1. warm-up: ``warmup`` sagas executed and drained (imports, statement caches, pool, definition
   row), then the counters are snapshotted;
2. the measured phase: ``sagas`` executions of :func:`~fault_injection.sagas.order_saga`
   (reserve + charge; the receipt email goes through the outbox), ``concurrency`` in flight as
   asyncio tasks (one at a time when it is 1), then :meth:`Orchestrator.drain` until the outbox is
   empty. Throughput covers the whole phase, drain included, because the email is part of the
   saga's work; latency is per ``execute`` call;
3. the driver's small-commit rate on the *same* database with the *same* engine settings
   (:func:`ledger.dialects.create_engine`): tiny ``INSERT`` + commit transactions on a scratch
   table for ``driver_seconds``, then the bare driver's for as long
   (:mod:`fault_injection.bench_driver`). Measuring them in the same run is what makes
   ``efficiency`` meaningful: disks, servers and machines differ by multiples, the ratio much
   less;
4. the bench's own checker: the provider holds exactly one reserve, one charge and one email per
   saga (warm-up included), no reversal, and nothing is left in flight.

Commits and statements are counted by the store's SQLAlchemy event listeners
(``orch.store.stats``), never estimated.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fault_injection.bench_driver import measure_driver
from fault_injection.harness import DatabasePair, fresh_databases, scratch_folder
from fault_injection.sagas import STOCK, order, order_saga
from fault_injection.server_cpu import per_saga_ms, read_server, server_cpu_seconds
from ledger import dialects
from ledger.states import TxState
from ledger.store import SqliteWriter
from orchestrator.config import EngineSettings
from orchestrator.engine import Orchestrator
from providers.contract import (
    ActionContract,
    ApplyOutcome,
    JsonObject,
    LookupOutcome,
    Provider,
)
from providers.fake.shop import FakeShop
from providers.memory import MemoryShop

if TYPE_CHECKING:
    from providers.http import HttpProvider

ProviderKind = Literal["memory", "fake", "http"]
PROVIDERS: tuple[ProviderKind, ...] = ("memory", "fake", "http")

#: Effects every happy-path order saga leaves at the provider, exactly once each.
ONCE_PER_SAGA = ("inventory.reserve", "payments.charge", "email.send")
#: Effects a happy path must never produce.
NEVER = ("inventory.release", "payments.refund")
#: The HTTP client's deadline per call (``--provider http``); the loopback server answers in ms.
HTTP_TIMEOUT_SECONDS = 5.0
#: How long the fake shop's server process may take to say it listens (or to stop). As long as
#: a bench worker's start (``bench_workers.READY_TIMEOUT_SECONDS``): 30 s was passed on a busy
#: machine, and the run ended as "database unreachable".
SERVER_START_SECONDS = 120.0
#: How much of a child process's stderr a start failure quotes: its last lines (a
#: traceback's last say the cause), at most this many characters.
STDERR_TAIL_LINES = 3
STDERR_TAIL_CHARS = 600


@dataclass(frozen=True)
class BenchConfig:
    """What one run does."""

    sagas: int = 1000
    concurrency: int = 1
    provider: ProviderKind = "memory"
    latency_ms: float = 0.0
    warmup: int = 20
    #: How long the driver's small-commit loop runs.
    driver_seconds: float = 1.5
    #: The engine's SQLite ``synchronous`` (FULL is its durable default); the driver loop uses
    #: the same, so the efficiency ratio compares like with like.
    sqlite_synchronous: str = "FULL"
    #: Where the engine's SQLite store commits its groups (``None``: the engine's default;
    #: :attr:`orchestrator.config.EngineSettings.sqlite_writer`).
    sqlite_writer: SqliteWriter | None = None
    #: Longest wait for the outbox drain before the run is declared failed.
    drain_timeout_seconds: float = 120.0
    #: ``--workers W``: W worker processes drain sagas the bench prepared (0: in-process
    #: ``execute``); ``concurrency`` is then each worker's sagas in hand.
    workers: int = 0
    #: Recovery mode: ``sagas`` left in doubt by a crash, then ``workers`` fresh worker
    #: processes timed until all are terminal (:func:`fault_injection.fleet.run_fleet`).
    recovery: bool = False

    def __post_init__(self) -> None:
        if self.sagas < 1 or self.concurrency < 1 or self.warmup < 0 or self.workers < 0:
            raise ValueError("sagas and concurrency must be >= 1, warmup and workers >= 0")
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {', '.join(PROVIDERS)}")
        # Written as ranges that must hold: NaN fails every comparison, so it is refused too.
        if not (0 <= self.latency_ms < math.inf and 0 < self.driver_seconds < math.inf):
            raise ValueError("latency_ms must be finite and >= 0, driver_seconds finite and > 0")
        if self.recovery and (self.workers < 1 or self.provider != "fake"):
            raise ValueError("recovery mode needs workers >= 1 and the fake provider")


@dataclass
class CheckOutcome:
    """The bench's own checker: one effect per intent at the provider."""

    ok: bool
    counts: dict[str, int]
    expected: int
    problems: list[str] = field(default_factory=list)


#: The local commits an order saga makes with no other saga to share them: one per durable
#: step (the first intent; the first outcome with the second intent; the second outcome with
#: the receipt), the receipt's own record riding on the next saga's first
#: (``tests/integration/test_engine.py`` counts exactly these). The issue's bound "sagas/s ≥
#: driver commit rate ÷ commits per saga (higher with group commit)" read with this count is
#: ``efficiency_ungrouped``: group commit is what can take it past 1.
UNGROUPED_COMMITS_PER_SAGA = 3


@dataclass
class BenchResult:
    """Everything a run measured. :meth:`as_json` gives the stable keys."""

    backend: str
    provider: str
    sagas: int
    concurrency: int
    warmup: int
    latency_ms: float
    sagas_per_s: float
    #: Per ``execute`` call; ``None`` where no caller waits on one saga (workers, recovery).
    p50_ms: float | None
    p99_ms: float | None
    #: ``None`` where the work runs in processes that report no counts (recovery).
    commits_per_saga: float | None
    statements_per_saga: float | None
    rollbacks_per_saga: float | None
    cpu_ms_per_saga: float
    provider_calls_per_saga: float | None
    driver_commits_per_s: float
    driver_connections: int
    efficiency: float | None
    elapsed_s: float
    check: CheckOutcome
    #: ``sequential`` / ``concurrent`` (in-process), ``workers`` or ``recovery``.
    mode: str = "sequential"
    workers: int = 0
    #: ``workers`` mode: the time the bench took to persist the N plans (not in ``elapsed_s``).
    prepare_s: float | None = None
    #: Mode-specific figures (``per_worker``, ``statuses``, ...), under their own keys.
    extra: dict[str, Any] = field(default_factory=dict)
    #: SQLite's ``synchronous`` for the engine and the driver loop (``None`` on PostgreSQL).
    sqlite_synchronous: str | None = None
    #: Where the SQLite store committed its groups: ``inline`` or ``process`` (``None`` on
    #: PostgreSQL and where the engine ran in other processes).
    sqlite_writer: str | None = None
    #: The bare driver's small commits per second (:func:`fault_injection.bench_driver.
    #: raw_commit_rate`), on as many connections; ``None`` where it could not be measured.
    raw_driver_commits_per_s: float | None = None
    #: The local PostgreSQL server's CPU a saga over the timed phase
    #: (:mod:`fault_injection.server_cpu`); ``None`` on SQLite and where it cannot be read.
    server_cpu_ms_per_saga: float | None = None
    #: The efficiency read with the commits a saga makes when it shares none
    #: (:data:`UNGROUPED_COMMITS_PER_SAGA`) instead of those counted: how far the engine goes
    #: past "driver commit rate ÷ commits per saga" by sharing commits. Equal to ``efficiency``
    #: sequentially; in-process modes only (``None`` with workers and in recovery, whose sagas
    #: also make the enqueue's and the claims' commits).
    efficiency_ungrouped: float | None = None

    def as_json(self) -> dict[str, Any]:
        """The report under stable keys (``--json``)."""
        data = asdict(self)
        data["check_ok"] = self.check.ok
        return data


class InstrumentedProvider:
    """Wraps a provider: counts every call and, with ``latency_s``, sleeps before each one
    (a remote service's round trip, without the noise of a real network)."""

    def __init__(self, inner: Provider, latency_s: float, counter: list[int]) -> None:
        self._inner = inner
        self._latency_s = latency_s
        self._counter = counter

    @property
    def name(self) -> str:
        """The wrapped provider's name."""
        return self._inner.name

    def contract(self, action: str) -> ActionContract:
        """The wrapped provider's contract of ``action``."""
        return self._inner.contract(action)

    def actions(self) -> Mapping[str, ActionContract]:
        """The wrapped provider's actions."""
        return self._inner.actions()

    async def apply(
        self, action: str, *, key: str, payload: JsonObject, fence: int
    ) -> ApplyOutcome:
        """Count, wait ``latency_s``, then apply."""
        self._counter[0] += 1
        if self._latency_s:
            await asyncio.sleep(self._latency_s)
        return await self._inner.apply(action, key=key, payload=payload, fence=fence)

    async def lookup(
        self, action: str, *, key: str, payload: JsonObject, void_if_missing: bool = False
    ) -> LookupOutcome:
        """Count, wait ``latency_s``, then look up."""
        self._counter[0] += 1
        if self._latency_s:
            await asyncio.sleep(self._latency_s)
        return await self._inner.lookup(
            action, key=key, payload=payload, void_if_missing=void_if_missing
        )


class Shop:
    """The provider side of a run: memory, fake or the fake over HTTP, with one way to count
    effects (``http``: the served shop's own database)."""

    def __init__(
        self,
        memory: MemoryShop | None,
        fake: FakeShop | None,
        http: list[HttpProvider] | None = None,
        base_url: str | None = None,
    ) -> None:
        self.memory = memory
        self.fake = fake
        self.http = http
        #: ``http``: where the shop is served (worker processes reach it there too).
        self.base_url = base_url

    def providers(self) -> list[Provider]:
        if self.memory is not None:
            return self.memory.providers()
        if self.http is not None:
            return list(self.http)
        assert self.fake is not None
        return self.fake.providers()

    async def counts(self) -> dict[str, int]:
        if self.memory is not None:
            return self.memory.counts()
        assert self.fake is not None
        return await self.fake.counts()

    def duplicates(self) -> list[tuple[str, str]]:
        # The fake shop's effects table has one row per key by constraint; only memory can tell.
        return self.memory.duplicate_keys() if self.memory is not None else []


@asynccontextmanager
async def serve_shop_process(provider_url: str) -> AsyncIterator[str]:
    """The fake shop served over HTTP by its own process (``python -m
    fault_injection.bench_workers shop``: :class:`~providers.fake.http_server.FakeShopServer`,
    stocked, on a free loopback port); yields its base URL and stops it (SIGTERM) after."""
    with tempfile.TemporaryDirectory(prefix="bench-shop-") as folder:
        stderr_path = Path(folder) / "shop.err"
        with stderr_path.open("wb") as stderr:  # the child keeps its own descriptor
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "fault_injection.bench_workers",
                "shop",
                "--provider-url",
                provider_url,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
            )
        try:
            text = await first_line(
                proc,
                stderr_path,
                who="the fake shop's server process",
                expect="listening on http",
                within_seconds=SERVER_START_SECONDS,
            )
            yield text.rsplit(" ", 1)[1]
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), SERVER_START_SECONDS)


async def first_line(
    proc: asyncio.subprocess.Process,
    stderr_path: Path,
    *,
    who: str,
    expect: str,
    within_seconds: float,
) -> str:
    """The first line a child process (a bench worker, the shop's server) says on stdout,
    which must start with ``expect``; else a :class:`~orchestrator.cli.CliFailure` naming
    ``who`` and quoting the end of its stderr (the file ``stderr_path``). Why: a child that
    died at start was a ``RuntimeError`` traceback that said ``b''`` (its stderr went
    nowhere), and one slower than ``within_seconds`` a ``TimeoutError``, an ``OSError`` the
    CLI took for "database unreachable"."""
    from orchestrator.cli import CliFailure

    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), within_seconds)
    except TimeoutError:
        said = f"it said nothing within {within_seconds:.0f} s"
    else:
        text = line.decode(errors="replace").strip()
        if text.startswith(expect):
            return text
        if not text:
            # Its stdout closed: it is exiting. Wait (briefly) for its code and last words.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)
            said = "it exited" + ("" if proc.returncode is None else f" {proc.returncode}")
        else:
            said = f"it said {text[:200]!r}"
    raise CliFailure(f"{who} did not start: {said}{_stderr_tail(stderr_path)}")


def _stderr_tail(path: Path) -> str:
    """``: `` and the last lines a child wrote to the file ``path``, on one line."""
    try:
        text = path.read_bytes()[-64 * STDERR_TAIL_CHARS :].decode(errors="replace")
    except OSError:
        text = ""
    # A traceback's markers (the ^^^^ under a call) say nothing on one line.
    lines = [line.strip() for line in text.splitlines() if line.strip(" ^~\t")]
    tail = " | ".join(lines[-STDERR_TAIL_LINES:])
    if not tail:
        return " (nothing on its stderr)"
    return ": " + (tail if len(tail) <= STDERR_TAIL_CHARS else "…" + tail[-STDERR_TAIL_CHARS:])


@asynccontextmanager
async def open_shop(kind: ProviderKind, provider_url: str) -> AsyncIterator[Shop]:
    """The provider side of a run, stocked. ``http``: the shop is served by its own process
    (a remote service: its CPU is not the client's) and reached through :class:`HttpProvider`;
    this process opens the shop's database only to count effects."""
    if kind == "memory":
        memory = MemoryShop()
        memory.seed_stock(STOCK)
        yield Shop(memory, None)
        return
    async with AsyncExitStack() as stack:
        base_url = None
        if kind == "http":
            base_url = await stack.enter_async_context(serve_shop_process(provider_url))
        fake = await FakeShop.open(provider_url)
        stack.push_async_callback(fake.close)
        if kind == "fake":
            await fake.seed_stock(STOCK)
            yield Shop(None, fake)
            return
        # Local: httpx is for the http provider only, and every agent-txn command imports this
        # module (the bench's options are registered at start-up).
        from providers.fake.http_server import fake_shop_http_providers

        assert base_url is not None
        clients = fake_shop_http_providers(base_url, timeout=HTTP_TIMEOUT_SECONDS)
        for client in clients:
            stack.push_async_callback(client.aclose)
        yield Shop(None, fake, clients, base_url)


def _percentile(sorted_ms: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1) of an already sorted list."""
    if not sorted_ms:
        return 0.0
    rank = max(1, min(len(sorted_ms), round(q * len(sorted_ms) + 0.5)))
    return sorted_ms[rank - 1]


async def _run_sagas(
    orch: Orchestrator, count: int, concurrency: int, prefix: str, latencies: list[float]
) -> list[str]:
    """Execute ``count`` order sagas, ``concurrency`` in flight; the problems found."""
    saga = order_saga()
    problems: list[str] = []
    next_index = 0

    async def one_runner() -> None:
        nonlocal next_index
        while next_index < count:
            i = next_index
            next_index += 1  # no await between the read and the write: tasks never share an i
            started = time.perf_counter()
            result = await orch.execute(saga, order(f"{prefix}-{i}"))
            latencies.append((time.perf_counter() - started) * 1000)
            if result.status is not TxState.COMMITTED:
                problems.append(f"saga {prefix}-{i} ended {result.status.value}")

    if concurrency == 1:
        await one_runner()
    else:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, count)):
                group.create_task(one_runner())
    return problems


async def _check(shop: Shop, orch: Orchestrator, expected: int) -> CheckOutcome:
    counts = await shop.counts()
    problems = [
        f"{name}: {counts.get(name, 0)} effects for {expected} intents"
        for name in ONCE_PER_SAGA
        if counts.get(name, 0) != expected
    ]
    problems += [f"{name}: {counts[name]} on a happy path" for name in NEVER if counts.get(name)]
    problems += [f"{p}: key {k} took effect more than once" for p, k in shop.duplicates()]
    left = await orch.in_flight()
    if left:
        problems.append(f"{left} transactions or outbox events still in flight")
    return CheckOutcome(not problems, counts, expected, problems)


async def run_bench(
    config: BenchConfig,
    *,
    db: str | None = None,
    urls: DatabasePair | None = None,
    workdir: Path | None = None,
) -> BenchResult:
    """One benchmark run. ``urls`` reuses an existing pair of empty databases (tests);
    otherwise ``db`` gets fresh ones, dropped after: SQLite files in a temporary folder
    (omitted) or in the folder of the file a SQLite URL names, databases on the server a
    PostgreSQL URL names (:func:`~fault_injection.harness.scratch_folder`)."""
    async with AsyncExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(scratch_folder(db, "bench-")))
        if urls is None:
            urls = await stack.enter_async_context(fresh_databases(db, workdir))
        if config.recovery:
            from fault_injection.bench_workers import run_recovery_bench

            return await run_recovery_bench(config, urls)
        if config.workers:
            from fault_injection.bench_workers import run_workers_bench

            return await run_workers_bench(config, urls, workdir)
        return await _run_on(config, urls)
    raise AssertionError("unreachable")  # pragma: no cover  (mypy: AsyncExitStack may swallow)


async def _run_on(config: BenchConfig, urls: DatabasePair) -> BenchResult:
    calls = [0]
    async with open_shop(config.provider, urls.provider) as shop:
        wrapped = [
            InstrumentedProvider(p, config.latency_ms / 1000, calls) for p in shop.providers()
        ]
        settings = EngineSettings(
            worker_id=f"bench-{uuid.uuid4().hex[:8]}",
            sqlite_synchronous=config.sqlite_synchronous,
            sqlite_writer=config.sqlite_writer,
            # Every saga in flight holds a connection during each of its local transactions.
            pg_pool_size=max(dialects.PG_POOL_SIZE, config.concurrency),
        )
        orch = await Orchestrator.open(urls.store, providers=wrapped, settings=settings)
        async with orch:
            await orch.register(order_saga())
            problems: list[str] = []
            if config.warmup:
                problems += await _run_sagas(orch, config.warmup, config.concurrency, "warm", [])
                await orch.drain(timeout_seconds=config.drain_timeout_seconds)

            before = orch.store.stats.snapshot()
            calls_before = calls[0]
            latencies: list[float] = []
            server_before = read_server(urls.store)
            cpu_started = time.process_time()
            started = time.perf_counter()
            problems += await _run_sagas(orch, config.sagas, config.concurrency, "bench", latencies)
            await orch.drain(timeout_seconds=config.drain_timeout_seconds)
            elapsed = time.perf_counter() - started
            cpu = time.process_time() - cpu_started
            server_cpu = server_cpu_seconds(server_before, read_server(urls.store))
            after = orch.store.stats.snapshot()
            # The SQLite writer process's CPU is the engine's too (ledger/sqlite_writer.py).
            cpu += after.writer_cpu_s - before.writer_cpu_s
            provider_calls = calls[0] - calls_before

            check = await _check(shop, orch, config.sagas + config.warmup)
            check.problems[:0] = problems
            check.ok = check.ok and not problems

        # SQLite has one writer, so more connections only queue on its lock; on PostgreSQL the
        # loop runs as many connections as sagas were in flight.
        connections = 1 if urls.backend == "sqlite" else config.concurrency
        driver = await measure_driver(
            urls.store,
            seconds=config.driver_seconds,
            connections=connections,
            sqlite_synchronous=config.sqlite_synchronous,
        )

    n = config.sagas
    sagas_per_s = n / elapsed
    commits_per_saga = (after.commits - before.commits) / n
    ordered = sorted(latencies)
    return BenchResult(
        backend=urls.backend,
        provider=config.provider,
        sagas=n,
        concurrency=config.concurrency,
        warmup=config.warmup,
        latency_ms=config.latency_ms,
        sagas_per_s=sagas_per_s,
        p50_ms=statistics.median(ordered) if ordered else 0.0,
        p99_ms=_percentile(ordered, 0.99),
        commits_per_saga=commits_per_saga,
        statements_per_saga=(after.statements - before.statements) / n,
        rollbacks_per_saga=(after.rollbacks - before.rollbacks) / n,
        cpu_ms_per_saga=cpu * 1000 / n,
        provider_calls_per_saga=provider_calls / n,
        driver_commits_per_s=driver.engine,
        driver_connections=connections,
        efficiency=sagas_per_s * commits_per_saga / driver.engine if driver.engine else 0.0,
        efficiency_ungrouped=(
            sagas_per_s * UNGROUPED_COMMITS_PER_SAGA / driver.engine if driver.engine else 0.0
        ),
        elapsed_s=elapsed,
        check=check,
        mode="sequential" if config.concurrency == 1 else "concurrent",
        sqlite_synchronous=config.sqlite_synchronous if urls.backend == "sqlite" else None,
        sqlite_writer=orch.store.sqlite_writer if urls.backend == "sqlite" else None,
        raw_driver_commits_per_s=driver.raw,
        server_cpu_ms_per_saga=per_saga_ms(server_cpu, n),
    )


__all__ = [
    "PROVIDERS",
    "UNGROUPED_COMMITS_PER_SAGA",
    "BenchConfig",
    "BenchResult",
    "CheckOutcome",
    "InstrumentedProvider",
    "run_bench",
]
