"""Concurrency: K workers racing on the same in-doubt sagas, a paused worker fenced out, and (on
PostgreSQL) the database going away under the workers: connections killed, server restarted.

Workers are separate engines (one per simulated process) driven as asyncio tasks; their
database clocks run past the dead holders' leases, so every one of them may claim everything.
On PostgreSQL one scenario also races real ``agent-txn worker`` processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from fault_injection.harness import SUITE_SETTINGS, Harness, admin_engine
from fault_injection.results import ScenarioResult
from fault_injection.sagas import order_saga
from fault_injection.scenarios_seed import (
    HoldingProvider,
    Scenario,
    ScenarioRun,
    at,
    calls_of,
    counts_text,
    order_keys,
)
from ledger.states import TxState
from orchestrator.engine import Orchestrator, RecoveryReport

SUITE = "concurrency"

#: Where the crashed sagas of a drain scenario die, cycled over the sagas: before any call,
#: around the first and the pivot call, inside the commit, and after the receipt was sent.
CRASH_SPOTS: tuple[tuple[str, str | None, str], ...] = (
    ("prepare.after_commit", None, "operation"),
    ("effect.after_apply", "reserve", "operation"),
    ("effect.before_apply", "charge", "operation"),
    ("effect.after_apply", "charge", "operation"),
    ("commit.before_commit", None, "operation"),
    ("effect.after_apply", "receipt", "outbox"),
)

TERMINATE_SQL = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


async def _crash_many(run: ScenarioRun, prefix: str, n: int) -> None:
    """Start ``n`` orders, each in its own engine that dies at one of :data:`CRASH_SPOTS`."""
    for i in range(n):
        tx, inputs = run.new_tx(f"{prefix}-{i}")
        point, name, kind = CRASH_SPOTS[i % len(CRASH_SPOTS)]
        orch = await run.harness.engine()
        orch.crashpoints.arm(point, when=at(tx, name, kind))
        await run.run_until_crash(orch, orch.execute(order_saga(), inputs, tx_id=tx), point)


async def _workers(harness: Harness, k: int, advance_seconds: float) -> list[Orchestrator]:
    fresh = [await harness.engine() for _ in range(k)]
    for orch in fresh:
        orch.store.advance_clock(advance_seconds)
    return fresh


async def _settled(run: ScenarioRun, reader: Orchestrator, n: int) -> Counter[str]:
    """Expect every saga of the run committed and each intent applied exactly once."""
    statuses: Counter[str] = Counter()
    for tx in run.tx_ids:
        statuses[(await reader.result(tx)).status.value] += 1
    run.expect(statuses == Counter({TxState.COMMITTED.value: n}), f"final statuses {statuses}")
    counts = await run.delta()
    expected = {"reserve": n, "charge": n, "email": n, "release": 0, "refund": 0}
    run.expect(counts == expected, f"counts {counts}, expected {expected}")
    mine = {
        key
        for tx in run.tx_ids
        for key in (lambda k: (k.reserve, k.charge, k.receipt, k.release, k.refund))(order_keys(tx))
    }
    per_key = Counter(
        e.key for e in await run.harness.shop.effects() if e.status == "applied" and e.key in mine
    )
    doubled = sorted(key for key, times in per_key.items() if times > 1)
    run.expect(not doubled, f"keys applied more than once: {doubled[:5]}")
    return statuses


def _report_json(r: RecoveryReport | BaseException) -> dict[str, Any]:
    if isinstance(r, BaseException):
        # Where the worker died, in our code (the driver's frames say nothing useful).
        frames = [
            f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_tb(r.__traceback__)
            if "/site-packages/" not in f.filename
        ]
        return {"died": f"{type(r).__name__}: {r}"[:300], "where": frames[-4:]}
    return {
        "transactions": r.transactions,
        "events": r.events,
        "lease_lost": r.lease_lost,
        "errors": r.errors,
    }


async def k_workers_drain(harness: Harness, *, workers: int = 4, sagas: int = 20) -> ScenarioResult:
    """``sagas`` orders die in doubt at assorted points; ``workers`` engines drain them at once:
    every order commits once, no effect twice."""
    run = await ScenarioRun.start(harness, SUITE, "k_workers_drain")
    await _crash_many(run, "c-drain", sagas)
    lease = float(SUITE_SETTINGS["lease_seconds"])
    fresh = await _workers(harness, workers, lease + 1)
    # Small batches: a worker's pass claims at most ``batch`` sagas, so all K get some and
    # race on the rest (one pass with the default limit could take the whole backlog).
    batch = max(1, sagas // (workers * 2))
    reports = await asyncio.gather(*(w.drain(timeout_seconds=30, limit=batch) for w in fresh))
    await _settled(run, fresh[0], sagas)
    run.detail["workers"] = [_report_json(r) for r in reports]
    claimed = sum(r.transactions + r.events for r in reports)
    counts = await run.delta()
    return await run.finish(
        f"{workers} workers drain {sagas} in-doubt sagas",
        f"claims={claimed} " + counts_text(counts, "reserve", "charge", "email"),
        counts=counts,
    )


async def paused_worker_fenced(harness: Harness, *, workers: int = 4) -> ScenarioResult:
    """Two workers freeze mid-call (a GC pause) until their leases run out and ``workers``
    healthy ones race to finish their orders. One was frozen before the provider saw its
    charge: the provider refuses its lower fence (``fenced_out``). The other was frozen after
    the provider acted: our store refuses its record (``LeaseLost``, rolled back)."""
    run = await ScenarioRun.start(harness, SUITE, "paused_worker_fenced")
    tx_req, in_req = run.new_tx("c-pause-request")
    tx_ans, in_ans = run.new_tx("c-pause-answer")
    held = {
        tx_req: HoldingProvider(harness.shop.payments, "charge", hold="request"),
        tx_ans: HoldingProvider(harness.shop.payments, "charge", hold="answer"),
    }
    stale: dict[str, Orchestrator] = {}
    tasks: dict[str, asyncio.Task[Any]] = {}
    for tx, inputs in ((tx_req, in_req), (tx_ans, in_ans)):
        # A call budget far beyond the pause, so only the lease, not a timeout, runs out.
        stale[tx] = await harness.engine(call_timeout_seconds=60)
        stale[tx].register_provider(held[tx])
        tasks[tx] = asyncio.create_task(
            stale[tx].execute(order_saga(), inputs, tx_id=tx, budget_seconds=0)
        )
    rollbacks = stale[tx_ans].store.stats.rollbacks
    try:
        for h in held.values():
            await asyncio.wait_for(h.reached.wait(), 10)
        lease = stale[tx_req].settings.lease_seconds
        crew = await _workers(harness, workers, lease + 1)
        await asyncio.gather(*(w.drain(timeout_seconds=10) for w in crew))
        healthy = crew[0]
        meanwhile = {tx: (await healthy.result(tx)).status for tx in held}
    finally:
        for h in held.values():
            h.gate.set()  # the paused workers wake up and carry on with fence 1
        woke = await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 10)
    run.expect(
        all(s is TxState.COMMITTED for s in meanwhile.values()),
        f"the healthy workers ended {meanwhile}",
    )
    for tx, outcome in zip(tasks, woke, strict=True):
        status = getattr(outcome, "status", outcome)
        run.expect(status is TxState.COMMITTED, f"{tx}: the stale worker reported {status!r}")
    req_calls = await calls_of(harness, _charge_key(tx_req))
    run.expect(
        req_calls[-1:] == ["apply:fenced_out"],
        f"frozen request: charge calls {req_calls}, expected the late apply fenced out",
    )
    ans_key = _charge_key(tx_ans)
    ans_calls = await calls_of(harness, ans_key)
    run.expect(ans_calls == ["apply:confirmed", "lookup:found"], f"frozen answer: {ans_calls}")
    stale_rows = [
        e
        for e in await healthy.ledger(tx_ans)
        if e.subject == ans_key and e.action == "apply" and e.detail.get("fence") == 1
    ]
    run.expect(not stale_rows, "the stale holder's record of the charge landed in the ledger")
    refused = stale[tx_ans].store.stats.rollbacks - rollbacks
    run.expect(refused >= 1, "the stale holder's fenced write was never attempted and refused")
    run.detail["store_refusals"] = refused
    counts = await run.delta()
    run.expect((counts["charge"], counts["email"]) == (2, 2), "counts differ from charge=2 email=2")
    return await run.finish(
        "paused worker fenced",
        "provider refused the late apply (fenced_out), store refused the late record "
        f"(LeaseLost), {counts_text(counts, 'charge', 'email')} for 2 orders",
        counts=counts,
    )


def _charge_key(tx_id: str) -> str:
    return order_keys(tx_id).charge


def _skipped(run: ScenarioRun, label: str, reason: str) -> ScenarioResult:
    """A scenario that cannot run here, recorded as skipped (not as a silent pass)."""
    return ScenarioResult(
        suite=run.suite,
        name=run.name,
        passed=True,
        line=f"SKIP {label}: {reason}",
        seconds=time.monotonic() - run.started,
        detail={"skipped": reason},
    )


async def _disrupted_drain(
    run: ScenarioRun,
    *,
    workers: int,
    sagas: int,
    disrupt: Callable[[], Awaitable[object]],
    first_round_seconds: float,
) -> tuple[list[RecoveryReport | BaseException], object, Orchestrator]:
    """Crash ``sagas`` orders, start ``workers`` draining, and run ``disrupt`` (a coroutine
    function) once the workers' second provider answer is in hand; then a fresh round of
    workers (clocks past every lease of the first round) drains whatever is left."""
    harness = run.harness
    await _crash_many(run, f"c-{run.name}", sagas)
    lease = float(SUITE_SETTINGS["lease_seconds"])
    first = await _workers(harness, workers, lease + 1)
    hits = 0
    go = asyncio.Event()

    def trigger(_point: str, _ctx: Mapping[str, Any]) -> None:
        nonlocal hits
        hits += 1
        if hits == 2:
            go.set()  # the worker is between the provider's answer and its record

    for w in first:
        w.crashpoints.arm("effect.after_apply", times=None, action=trigger)

    async def disrupt_when_due() -> object:
        await go.wait()
        return await disrupt()

    disruptor = asyncio.create_task(disrupt_when_due())
    outcomes = await asyncio.gather(
        *(w.drain(timeout_seconds=first_round_seconds) for w in first), return_exceptions=True
    )
    if not disruptor.done() and not go.is_set():
        disruptor.cancel()
    disrupted: object = None
    with contextlib.suppress(asyncio.CancelledError):
        disrupted = await disruptor
    for w in first:
        w.crashpoints.disarm()
    # Leases written by the first round are judged on its shifted clock: go past them too.
    second = await harness.recover(
        workers=workers, advance_seconds=2 * lease + 5, timeout_seconds=30
    )
    return list(outcomes), disrupted, second[0]


def _survival(run: ScenarioRun, outcomes: list[RecoveryReport | BaseException]) -> None:
    run.detail["first_round"] = [_report_json(o) for o in outcomes]
    died = [o for o in outcomes if isinstance(o, BaseException)]
    run.expect(
        not died,
        f"{len(died)} of {len(outcomes)} workers died: "
        + "; ".join(f"{type(d).__name__}: {d}"[:160] for d in died[:2]),
    )


async def connection_loss_during_recovery(
    harness: Harness, *, workers: int = 4, sagas: int = 12
) -> ScenarioResult:
    """PostgreSQL: every backend of our database is terminated while K workers drain; they
    survive, and after a fresh drain nothing is stranded and nothing was applied twice."""
    run = await ScenarioRun.start(harness, SUITE, "connection_loss_during_recovery")
    label = "connection loss during recovery"
    if harness.dbs.backend != "postgres":
        return _skipped(run, label, "needs PostgreSQL (backends are terminated by pid)")
    # NullPool (admin_engine's): the admin's own connection must not be a pooled one the kill
    # could reach.
    admin: AsyncEngine = admin_engine(harness.dbs.store)

    async def terminate() -> int:
        async with admin.connect() as conn:
            return sum(1 for row in (await conn.execute(text(TERMINATE_SQL))).all() if row[0])

    try:
        outcomes, killed, reader = await _disrupted_drain(
            run, workers=workers, sagas=sagas, disrupt=terminate, first_round_seconds=4
        )
    finally:
        await admin.dispose()
    run.detail["backends_terminated"] = killed
    run.expect(bool(killed), "no backend was terminated: the fault never happened")
    _survival(run, outcomes)
    await _settled(run, reader, sagas)
    counts = await run.delta()
    return await run.finish(
        label,
        f"{killed} backends terminated, {workers} workers, "
        + counts_text(counts, "reserve", "charge", "email"),
        counts=counts,
    )


@dataclass(frozen=True)
class LocalCluster:
    """The local Debian PostgreSQL cluster serving a URL (what ``pg_ctlcluster`` restarts)."""

    version: str
    name: str
    host: str
    port: int

    def ctl(self, command: str) -> tuple[str, ...]:
        """``pg_ctlcluster`` argv for ``command`` (start / restart), bypassing systemd."""
        return ("pg_ctlcluster", "--skip-systemctl-redirect", self.version, self.name, command)


async def _run(*argv: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace")[-500:]


async def local_cluster(url: str) -> LocalCluster | None:
    """The cluster serving ``url`` if it is a local one this process may restart, else None.

    Chosen by port from ``pg_lsclusters`` (the server under test, never another one); the
    version from ``/etc/postgresql`` and the cluster ``main`` when the listing is unavailable.
    """
    parsed = make_url(url)
    host, port = parsed.host or "127.0.0.1", parsed.port or 5432
    if host not in ("127.0.0.1", "localhost", "::1") or os.geteuid() != 0:
        return None
    if shutil.which("pg_ctlcluster") is None:
        return None
    if shutil.which("pg_lsclusters") is not None:
        code, out = await _run("pg_lsclusters", "--no-header")
        for line in out.splitlines() if code == 0 else []:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == str(port):
                return LocalCluster(parts[0], parts[1], host, port)
        if code == 0:
            return None  # no local cluster listens on that port
    versions = _installed_versions()
    return LocalCluster(versions[-1], "main", host, port) if versions else None


def _installed_versions() -> list[str]:
    base = Path("/etc/postgresql")
    return sorted(p.name for p in base.iterdir()) if base.is_dir() else []


async def wait_for_postgres(
    host: str = "127.0.0.1", port: int = 5432, *, seconds: float = 60.0
) -> bool:
    """Wait until ``pg_isready`` answers for the server at ``host``:``port``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        code, _ = await _run("pg_isready", "-q", "-h", host, "-p", str(port))
        if code == 0:
            return True
        await asyncio.sleep(0.2)
    return False


async def server_restart_during_recovery(
    harness: Harness, *, workers: int = 4, sagas: int = 12
) -> ScenarioResult:
    """PostgreSQL: the server restarts while K workers drain; once it answers again a fresh
    drain leaves nothing stranded and nothing applied twice. Opt-in: it disturbs every client
    of the server. Always leaves the server running."""
    run = await ScenarioRun.start(harness, SUITE, "server_restart_during_recovery")
    label = "server restart during recovery"
    if harness.dbs.backend != "postgres":
        return _skipped(run, label, "needs PostgreSQL")
    cluster = await local_cluster(harness.dbs.store)
    if cluster is None:
        return _skipped(run, label, "needs the local Debian cluster of the server (as root)")

    async def restart_server() -> str:
        code, out = await _run(*cluster.ctl("restart"))
        ready = await wait_for_postgres(cluster.host, cluster.port)
        return f"exit={code} ready={ready} {out.strip()}"[:300]

    try:
        outcomes, restarted, reader = await _disrupted_drain(
            run, workers=workers, sagas=sagas, disrupt=restart_server, first_round_seconds=8
        )
    finally:
        # Whatever happened above, the server is left running for everyone else.
        if not await wait_for_postgres(cluster.host, cluster.port, seconds=5):
            await _run(*cluster.ctl("start"))
            await wait_for_postgres(cluster.host, cluster.port)
    run.detail["restart"] = restarted
    run.detail["cluster"] = f"{cluster.version}/{cluster.name}:{cluster.port}"
    run.expect(
        isinstance(restarted, str) and restarted.startswith("exit=0 ready=True"),
        f"the restart did not happen cleanly: {restarted}",
    )
    _survival(run, outcomes)
    await _settled(run, reader, sagas)
    counts = await run.delta()
    return await run.finish(
        label,
        f"server restarted, {workers} workers, "
        + counts_text(counts, "reserve", "charge", "email"),
        counts=counts,
    )


async def k_worker_processes_drain(
    harness: Harness, *, workers: int = 4, sagas: int = 24
) -> ScenarioResult:
    """PostgreSQL: ``sagas`` orders die in doubt; ``workers`` separate ``agent-txn worker``
    processes drain them at once (``SKIP LOCKED`` batches): each order commits exactly once."""
    run = await ScenarioRun.start(harness, SUITE, "k_worker_processes_drain")
    for i in range(sagas):
        tx, inputs = run.new_tx(f"c-proc-{i}")
        point, name, kind = CRASH_SPOTS[i % len(CRASH_SPOTS)]
        # A 1 s lease: the worker processes cannot shift their clocks, so the dead holders'
        # leases must run out for real.
        orch = await harness.engine(lease_seconds=1.0)
        orch.crashpoints.arm(point, when=at(tx, name, kind))
        await run.run_until_crash(orch, orch.execute(order_saga(), inputs, tx_id=tx), point)
    await asyncio.sleep(1.2)
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "orchestrator.cli",
            "worker",
            "--db",
            harness.dbs.store,
            "--fake-shop",
            harness.dbs.provider,
            "--once",
            "--poll-seconds",
            "0.05",
            "--concurrency",
            "4",
            "--worker-id",
            f"proc-{i}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for i in range(workers)
    ]
    outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 180)
    codes = [p.returncode for p in procs]
    run.expect(all(c == 0 for c in codes), f"worker exit codes {codes}")
    run.detail["workers"] = [o[0].decode().strip()[-200:] for o in outs]
    reader = (await _workers(harness, 1, 0))[0]
    await reader.drain(timeout_seconds=10)  # anything a process left due (none expected)
    await _settled(run, reader, sagas)
    counts = await run.delta()
    return await run.finish(
        f"{workers} worker processes drain {sagas} in-doubt sagas",
        counts_text(counts, "reserve", "charge", "email"),
        counts=counts,
    )


def with_workers(scenario: Any, workers: int) -> Scenario:
    """``scenario`` with its ``workers`` parameter bound."""

    async def bound(harness: Harness) -> ScenarioResult:
        result: ScenarioResult = await scenario(harness, workers=workers)
        return result

    return bound


#: Backend-neutral concurrency scenarios (K = 4 workers).
CONCURRENCY_SCENARIOS: list[tuple[str, Scenario]] = [
    ("k_workers_drain", k_workers_drain),
    ("paused_worker_fenced", paused_worker_fenced),
]

#: PostgreSQL only: the database connections die under the workers.
POSTGRES_SCENARIOS: list[tuple[str, Scenario]] = [
    ("k_worker_processes_drain", k_worker_processes_drain),
    ("connection_loss_during_recovery", connection_loss_during_recovery),
]

#: PostgreSQL only, opt-in, always last: the server restarts under the workers.
SERVER_RESTART_SCENARIO: tuple[str, Scenario] = (
    "server_restart_during_recovery",
    server_restart_during_recovery,
)

__all__ = [
    "CONCURRENCY_SCENARIOS",
    "POSTGRES_SCENARIOS",
    "SERVER_RESTART_SCENARIO",
    "LocalCluster",
    "local_cluster",
    "wait_for_postgres",
    "with_workers",
]
