"""``agent-txn bench --compare dbos``: the same order saga on DBOS, pair by pair with ours.

The DBOS side (optional extra ``bench``: ``pip install 'agent-txn[bench]'``) is the order saga
written with DBOS's documented API — one ``@DBOS.workflow`` calling three ``@DBOS.step``
functions, ``reserve``, ``charge``, then ``send_receipt`` — against an in-process dict
provider (:class:`DictShop`) and DBOS's system database on the same kind of database as ours:
a fresh SQLite file (``sqlite:///…``) or a fresh PostgreSQL database on the same server. Each
workflow runs under ``SetWorkflowID(order id)``, DBOS's idempotency mechanism (our saga has
its business key).

Settings: DBOS's documented configuration (``name`` and ``system_database_url``, its default
engine: pool of 20, ``pool_pre_ping``; PostgreSQL through psycopg), with ``log_level`` WARNING
as ours. On SQLite DBOS sets neither ``journal_mode`` nor ``synchronous``; by default
(``sqlite_tuning="fast"``) the bench gives it WAL + ``synchronous=NORMAL``, its fastest SQLite
setting measured, through a ``system_database_engine`` built like DBOS's own (same pool, and
its own connect hook: ``IMMEDIATE`` transactions, ``busy_timeout=30000``, foreign keys) plus
those two pragmas. ``sqlite_tuning="default"`` leaves DBOS's engine as it makes it.

DBOS runs **in the bench's process**, on the main thread (sequential) or on ``concurrency``
threads, never inside an asyncio loop (its sync API warns there): each pair runs ours with
``asyncio.run`` and then DBOS, alternately. DBOS is launched on a fresh database before its
half of each pair and destroyed after it (launch and destroy are not timed); its background
threads (queue poller, notification listener) run only during its half.

What the DBOS side guarantees: each step's output is checkpointed before the next step runs,
and a workflow interrupted by a crash is resumed from its last completed step on the next
launch — a step that was running is run again. What it does not do (the comparison is not
like for like, and docs/benchmarks.md says so): no lookup of an unknown outcome at the provider
before a retry (unknown → lookup), no compensation of completed steps when a later one fails,
no fencing of a stale executor's calls, no outbox (the receipt is an ordinary third step), no
payload fingerprint per idempotency key, no hash-chained ledger.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from fault_injection.median_interval import median_interval
from fault_injection.server_cpu import per_saga_ms, read_server, server_cpu_seconds
from fault_injection.sweep import SWEEP_ROUNDS, Sweep, run_sweep
from ledger.dialects import dialect_of, normalize_url

SqliteTuning = Literal["fast", "default"]


def dbos_available() -> bool:
    """True when the ``dbos`` package (extra ``bench``) is importable."""
    return importlib.util.find_spec("dbos") is not None


class DictShop:
    """The DBOS side's provider: inventory, payments and email over dicts, thread-safe, with
    key dedup (a replayed key answers its first result and is not counted again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, str] = {}
        self.applied: Counter[str] = Counter()
        self.per_key: Counter[str] = Counter()
        self.stock = 1_000_000

    def apply(self, action: str, key: str, prefix: str) -> str:
        """Do ``action`` once for ``key``; the remote id."""
        with self._lock:
            known = self._done.get(key)
            if known is not None:
                return known
            if action == "inventory.reserve":
                self.stock -= 1
            remote_id = f"{prefix}_{uuid.uuid4().hex[:20]}"
            self._done[key] = remote_id
            self.applied[action] += 1
            self.per_key[key] += 1
            return remote_id


_shop = DictShop()
_workflow: Callable[[str, str, int], dict[str, str]] | None = None


def _order_workflow() -> Callable[[str, str, int], dict[str, str]]:
    """Register (once) and return the DBOS order workflow."""
    global _workflow
    if _workflow is not None:
        return _workflow
    from dbos import DBOS  # type: ignore[import-not-found, unused-ignore]

    # Decorators applied as calls: without the optional extra, mypy sees ``DBOS`` as Any and
    # would call the decorator syntax untyped; the functions are what DBOS's docs show.
    def reserve(order_id: str, sku: str, quantity: int) -> str:
        return _shop.apply("inventory.reserve", f"{DBOS.workflow_id}:reserve", "res")

    def charge(order_id: str, amount: int, currency: str) -> str:
        return _shop.apply("payments.charge", f"{DBOS.workflow_id}:charge", "ch")

    def send_receipt(order_id: str, charge_id: str) -> str:
        return _shop.apply("email.send", f"{DBOS.workflow_id}:receipt", "em")

    reserve_step = DBOS.step()(reserve)
    charge_step = DBOS.step()(charge)
    receipt_step = DBOS.step()(send_receipt)

    def order(order_id: str, sku: str, amount: int) -> dict[str, str]:
        reservation = reserve_step(order_id, sku, 1)
        charge_id = charge_step(order_id, amount, "EUR")
        email = receipt_step(order_id, charge_id)
        return {"reservation": reservation, "charge": charge_id, "email": email}

    workflow: Callable[[str, str, int], dict[str, str]] = DBOS.workflow(name="bench_order")(order)
    _workflow = workflow
    return workflow


@dataclass
class DbosResult:
    """One DBOS run, with the keys of ours (``dbos_`` is added in the JSON)."""

    backend: str
    sagas: int
    concurrency: int
    settings: str
    sagas_per_s: float
    p50_ms: float
    p99_ms: float
    commits_per_saga: float
    statements_per_saga: float
    cpu_ms_per_saga: float
    elapsed_s: float
    check_ok: bool
    problems: list[str] = field(default_factory=list)
    #: The local PostgreSQL server's CPU a workflow (:mod:`fault_injection.server_cpu`).
    server_cpu_ms_per_saga: float | None = None


def _percentile(sorted_ms: list[float], q: float) -> float:
    if not sorted_ms:
        return 0.0
    rank = max(1, min(len(sorted_ms), round(q * len(sorted_ms) + 0.5)))
    return sorted_ms[rank - 1]


def _fast_sqlite_engine(url: str) -> sa.Engine:
    """DBOS's SQLite engine (its pool, its connect hook) plus WAL and synchronous=NORMAL."""
    engine = sa.create_engine(
        url, pool_size=20, max_overflow=0, pool_timeout=30, pool_pre_ping=True
    )

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = "IMMEDIATE"  # DBOS's own hook, as it installs it
        dbapi_conn.execute("PRAGMA busy_timeout=30000")
        dbapi_conn.execute("PRAGMA foreign_keys=ON")
        dbapi_conn.execute("PRAGMA journal_mode=WAL")  # the tuning
        dbapi_conn.execute("PRAGMA synchronous=NORMAL")

    return engine


#: asyncpg's client-side options, which libpq (psycopg) has no key for: DBOS's half runs
#: without them (it has its own pool and timeouts).
_ASYNCPG_ONLY_OPTIONS = frozenset(
    {
        "command_timeout", "prepared_statement_cache_size", "statement_cache_size",
        "max_cached_statement_lifetime", "max_cacheable_statement_size",
    }
)  # fmt: skip


def _psycopg_url(db: str) -> URL:
    """The ``--db`` server as psycopg (libpq) takes it. ``normalize_url`` writes the query for
    asyncpg, and libpq refuses a key it does not know (``invalid connection option "ssl"``):
    asyncpg's ``ssl`` goes back to libpq's ``sslmode`` (they take the same modes), ``timeout``
    becomes ``connect_timeout`` (whole seconds), and asyncpg's own options are left out."""
    url = make_url(normalize_url(db))
    query = {k: v for k, v in url.query.items() if k not in _ASYNCPG_ONLY_OPTIONS}
    if "ssl" in query:
        query["sslmode"] = query.pop("ssl")
    if "timeout" in query:
        query["connect_timeout"] = str(math.ceil(float(str(query.pop("timeout")))))
    return url.set(drivername="postgresql+psycopg", query=query)


@contextlib.contextmanager
def _database(db: str | None, workdir: Path) -> Iterator[tuple[str, str]]:
    """A fresh system database for DBOS: (URL, backend); dropped after (PostgreSQL)."""
    if db is None or dialect_of(normalize_url(db)) == "sqlite":
        path = workdir / f"dbos-{uuid.uuid4().hex[:8]}.sqlite"
        yield f"sqlite:///{path}", "sqlite"
        return
    server = _psycopg_url(db)
    name = f"agt_dbos_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield server.set(database=name).render_as_string(hide_password=False), "postgres"
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def run_dbos(
    db: str | None,
    workdir: Path,
    *,
    sagas: int,
    concurrency: int = 1,
    warmup: int = 20,
    sqlite_tuning: SqliteTuning = "fast",
) -> DbosResult:
    """Launch DBOS on a fresh system database, run ``warmup`` then ``sagas`` order workflows
    (``concurrency`` threads), count its commits and statements, destroy it."""
    from dbos import (  # type: ignore[import-not-found, unused-ignore]
        DBOS,
        DBOSConfig,
        SetWorkflowID,
    )

    workflow = _order_workflow()
    with _database(db, workdir) as (url, backend):
        config: DBOSConfig = {
            "name": "agent-txn-bench",
            "system_database_url": url,
            "log_level": "WARNING",
        }
        settings = "documented defaults"
        if backend == "sqlite" and sqlite_tuning == "fast":
            config["system_database_engine"] = _fast_sqlite_engine(url)
            settings = "WAL + synchronous=NORMAL"
        instance = DBOS(config=config)
        DBOS.launch()
        try:
            engine = instance._sys_db.engine
            counted = Counter[str]()

            def on_commit(_conn: Any) -> None:
                counted["commits"] += 1

            def on_execute(_c: Any, _cur: Any, statement: str, *_a: Any) -> None:
                if not statement.startswith(("BEGIN", "PRAGMA")):
                    counted["statements"] += 1

            sa.event.listen(engine, "commit", on_commit)
            sa.event.listen(engine, "before_cursor_execute", on_execute)
            run_id = uuid.uuid4().hex[:6]
            before = _shop.applied.copy()
            problems: list[str] = []
            latencies: list[float] = []

            def one(i: int, prefix: str, record: bool) -> None:
                order_id = f"{prefix}-{run_id}-{i}"
                started = time.perf_counter()
                try:
                    with SetWorkflowID(order_id):
                        workflow(order_id, "sku-1", 1200)
                except Exception as exc:  # reported by the checker, never raised mid-run
                    problems.append(f"{order_id}: {type(exc).__name__}: {exc}")
                if record:
                    latencies.append((time.perf_counter() - started) * 1000)

            def run(count: int, prefix: str, record: bool) -> None:
                if concurrency == 1:
                    for i in range(count):
                        one(i, prefix, record)
                    return
                lock = threading.Lock()
                next_index = [0]

                def lane() -> None:
                    while True:
                        with lock:
                            i = next_index[0]
                            next_index[0] += 1
                        if i >= count:
                            return
                        one(i, prefix, record)

                with ThreadPoolExecutor(max_workers=concurrency) as pool:
                    for f in [pool.submit(lane) for _ in range(min(concurrency, count))]:
                        f.result()

            run(warmup, "warm", False)
            counted.clear()
            server_before = read_server(url)
            cpu0 = time.process_time()
            started = time.perf_counter()
            run(sagas, "bench", True)
            elapsed = time.perf_counter() - started
            cpu = time.process_time() - cpu0
            server_cpu = server_cpu_seconds(server_before, read_server(url))
            commits, statements = counted["commits"], counted["statements"]
            sa.event.remove(engine, "commit", on_commit)
            sa.event.remove(engine, "before_cursor_execute", on_execute)
        finally:
            DBOS.destroy()
            own_engine = config.get("system_database_engine")
            if own_engine is not None:
                own_engine.dispose()
    expected = sagas + warmup
    for name in ("inventory.reserve", "payments.charge", "email.send"):
        got = _shop.applied[name] - before[name]
        if got != expected:
            problems.append(f"{name}: {got} effects for {expected} workflows")
    problems += [f"key {k} took effect {n} times" for k, n in _shop.per_key.items() if n > 1]
    ordered = sorted(latencies)
    return DbosResult(
        backend=backend,
        sagas=sagas,
        concurrency=concurrency,
        settings=settings,
        sagas_per_s=sagas / elapsed,
        p50_ms=statistics.median(ordered) if ordered else 0.0,
        p99_ms=_percentile(ordered, 0.99),
        commits_per_saga=commits / sagas,
        statements_per_saga=statements / sagas,
        cpu_ms_per_saga=cpu * 1000 / sagas,
        elapsed_s=elapsed,
        check_ok=not problems,
        problems=problems,
        server_cpu_ms_per_saga=per_saga_ms(server_cpu, sagas),
    )


#: What ``--dbos-concurrency auto`` tries. DBOS was fastest at 1 in flight (SQLite) or 4
#: (PostgreSQL) on every machine measured, and only slower past 16 (``docs/benchmarks.md``,
#: "Each engine at its fastest setting"); 32 is there to show that on a machine of its own.
SWEEP_CONCURRENCY: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
#: Workflows each sweep run measures, at most (after its warm-up): enough to rank the settings,
#: few enough that the sweep takes about a minute at DBOS's rates.
SWEEP_SAGAS = 300


def sweep_dbos(
    db: str | None,
    workdir: Path,
    *,
    sagas: int,
    warmup: int,
    sqlite_tuning: SqliteTuning,
    concurrencies: tuple[int, ...] = SWEEP_CONCURRENCY,
    rounds: int = SWEEP_ROUNDS,
    on_run: Callable[[int, int, DbosResult, float | None], None] | None = None,
    on_rerun: Callable[[int, int, float], None] | None = None,
) -> Sweep:
    """Run DBOS alone at each of ``concurrencies``, ``rounds`` times over, on the database
    ``run_dbos`` gives each run; ``on_run(round, concurrency, result, steal)`` after each, and
    ``on_rerun(round, concurrency, steal)`` before a disturbed run's rerun
    (:func:`fault_injection.sweep.run_sweep`).

    Why: the issue's target is against "DBOS in its fastest settings", and which setting is
    fastest depends on the backend and the machine (sequential on SQLite, 4 in flight on
    PostgreSQL where we measured). ``bench --dbos-concurrency auto`` then runs DBOS's half of
    every pair at :attr:`~fault_injection.sweep.Sweep.fastest` instead of a number the caller
    had to know."""

    def run_one(concurrency: int) -> DbosResult:
        return run_dbos(
            db,
            workdir,
            sagas=sagas,
            concurrency=concurrency,
            warmup=warmup,
            sqlite_tuning=sqlite_tuning,
        )

    return run_sweep(
        run_one,
        rate=lambda result: result.sagas_per_s,
        problems=lambda result: result.problems,
        who="DBOS",
        sagas=sagas,
        concurrencies=concurrencies,
        rounds=rounds,
        on_run=on_run,
        on_rerun=on_rerun,
    )


#: ``--match-time``: our half never runs more than this many times ``--sagas``.
MATCH_CAP = 20


def matched_sagas(sagas: int, dbos_seconds: float, ours_per_s: float) -> int:
    """How many sagas our next half runs so that it lasts about as long as DBOS's last half
    did at our last rate: at least ``sagas``, at most :data:`MATCH_CAP` times it.

    Why: with the same N, our half lasts a tenth of DBOS's, so the two halves of a pair sample
    a virtual machine's stolen time (``fault_injection.steal``) very unevenly; halves of about
    equal length see about the same. More sagas only makes our tables larger, never easier."""
    wanted = round(dbos_seconds * ours_per_s)
    return max(sagas, min(MATCH_CAP * sagas, wanted))


@dataclass
class ComparePair:
    """One pair: our run, then DBOS's, and ours ÷ theirs."""

    ours: Any  # fault_injection.bench.BenchResult (not imported: no cycle, no dbos import there)
    dbos: DbosResult
    #: The machine's stolen share of CPU time during each half (``fault_injection.steal``);
    #: ``None`` where it cannot be read.
    steal: float | None = None
    dbos_steal: float | None = None

    @property
    def ratio(self) -> float:
        """Our sagas/s over DBOS's workflows/s."""
        return self.ours.sagas_per_s / self.dbos.sagas_per_s if self.dbos.sagas_per_s else 0.0


def compare_json(pairs: list[ComparePair]) -> dict[str, Any]:
    """Our report (the run of median throughput) plus the DBOS keys: medians over the pairs."""
    by_ours = sorted(pairs, key=lambda p: p.ours.sagas_per_s)
    median_pair = by_ours[len(by_ours) // 2]
    data: dict[str, Any] = median_pair.ours.as_json()
    data["steal_share"] = median_pair.steal  # as a run alone reports it, for that half
    dbos_median = sorted(pairs, key=lambda p: p.dbos.sagas_per_s)[len(pairs) // 2].dbos
    data["dbos_sagas_per_s"] = statistics.median(p.dbos.sagas_per_s for p in pairs)
    data["ratio_vs_dbos"] = statistics.median(p.ratio for p in pairs)
    # How sure the median is (fault_injection.median_interval): None below six pairs.
    interval = median_interval([p.ratio for p in pairs])
    data["ratio_vs_dbos_ci95_low"] = None if interval is None else interval.low
    data["ratio_vs_dbos_ci95_high"] = None if interval is None else interval.high
    data["ratio_vs_dbos_ci95_coverage"] = None if interval is None else interval.coverage
    data["dbos_p50_ms"] = dbos_median.p50_ms
    data["dbos_p99_ms"] = dbos_median.p99_ms
    data["dbos_commits_per_saga"] = dbos_median.commits_per_saga
    data["dbos_statements_per_saga"] = dbos_median.statements_per_saga
    data["dbos_cpu_ms_per_saga"] = dbos_median.cpu_ms_per_saga
    data["dbos_server_cpu_ms_per_saga"] = dbos_median.server_cpu_ms_per_saga
    data["dbos_settings"] = dbos_median.settings
    # Each engine may run at its own fastest setting (bench --dbos-concurrency): say DBOS's.
    data["dbos_concurrency"] = dbos_median.concurrency
    data["dbos_check_ok"] = all(p.dbos.check_ok for p in pairs)
    data["check_ok"] = data["dbos_check_ok"] and all(p.ours.check.ok for p in pairs)
    data["pairs"] = [
        {
            "sagas": p.ours.sagas,
            "dbos_sagas": p.dbos.sagas,
            "concurrency": p.ours.concurrency,
            "dbos_concurrency": p.dbos.concurrency,
            "sagas_per_s": p.ours.sagas_per_s,
            "dbos_sagas_per_s": p.dbos.sagas_per_s,
            "ratio_vs_dbos": p.ratio,
            "cpu_ms_per_saga": p.ours.cpu_ms_per_saga,
            "dbos_cpu_ms_per_saga": p.dbos.cpu_ms_per_saga,
            "server_cpu_ms_per_saga": p.ours.server_cpu_ms_per_saga,
            "dbos_server_cpu_ms_per_saga": p.dbos.server_cpu_ms_per_saga,
            "steal_share": p.steal,
            "dbos_steal_share": p.dbos_steal,
        }
        for p in pairs
    ]
    return data


__all__ = [
    "MATCH_CAP",
    "SWEEP_CONCURRENCY",
    "SWEEP_SAGAS",
    "ComparePair",
    "DbosResult",
    "DictShop",
    "SqliteTuning",
    "compare_json",
    "dbos_available",
    "run_dbos",
    "sweep_dbos",
]
