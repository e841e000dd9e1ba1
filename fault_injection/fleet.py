"""A fleet of real worker processes over one database: recovery time, kills, a server restart.

:func:`run_fleet` leaves ``sagas`` transactions in doubt (each dies right after its intent was
made durable), starts ``workers`` ``agent-txn worker`` processes serving a fake shop that injects
provider faults (:mod:`fault_injection.faulty_shop`), optionally SIGKILLs one worker and
restarts the PostgreSQL server mid-run, waits until every transaction is terminal or parked,
and returns the timings. The caller checks the invariants.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from sqlalchemy import func, select

from fault_injection.harness import Harness
from fault_injection.sagas import order, order_saga
from fault_injection.scenarios_concurrency import local_cluster, wait_for_postgres
from ledger.effects import EffectKind, count_unsettled
from ledger.schema import ledger
from ledger.states import TX_TERMINAL, TxState
from ledger.transactions import count_by_status
from orchestrator.crashpoints import SimulatedCrash
from orchestrator.engine import Orchestrator

SETTLED = {s.value for s in TX_TERMINAL} | {TxState.MANUAL_REVIEW.value}


@dataclass
class FleetReport:
    """What a fleet run measured."""

    sagas: int
    workers: int
    seconds_to_settle: float
    statuses: dict[str, int]
    killed: bool = False
    restarted: bool = False
    exit_codes: list[int | None] = field(default_factory=list)
    #: Workers our SIGTERM reached before they were running (still importing or opening the
    #: store: the signal's default action ended them) and that left no trace in the ledger.
    stopped_while_starting: list[int] = field(default_factory=list)
    #: Every transaction terminal and every receipt sent when the run stopped.
    settled: bool = False
    #: The run stopped because no worker was left running (each died at start, say, of a bad
    #: ``--app`` or fault list), not at the deadline an hour on.
    workers_gone: bool = False

    @property
    def sagas_per_s(self) -> float:
        """Recovery throughput."""
        return self.sagas / self.seconds_to_settle if self.seconds_to_settle else 0.0


async def make_in_doubt(harness: Harness, sagas: int, *, prefix: str = "fleet") -> list[str]:
    """``sagas`` transactions whose first op is claimed and whose holder died (1 s lease)."""
    orch = await harness.engine(lease_seconds=1.0)
    await orch.register(order_saga())
    ids: list[str] = []
    for i in range(sagas):
        tx_id = f"{prefix}-{i}"
        orch.crashpoints.arm("prepare.after_commit")
        try:
            await orch.execute(order_saga(), order(tx_id), tx_id=tx_id)
        except SimulatedCrash:
            ids.append(tx_id)
    await harness.crash(orch)
    await asyncio.sleep(1.1)  # the dead holder's leases run out for real
    return ids


async def run_fleet(
    harness: Harness,
    *,
    sagas: int,
    workers: int,
    kill_one_after: float | None = None,
    restart_after: float | None = None,
    faults: str = "",
    deadline_seconds: float = 600.0,
    concurrency: int = 8,
) -> FleetReport:
    """Recover ``sagas`` in-doubt transactions with ``workers`` processes (see module doc)."""
    await make_in_doubt(harness, sagas)
    reader = await harness.engine()
    env = {
        **os.environ,
        "AGENT_TXN_FLEET_PROVIDER_URL": harness.dbs.provider,
        "AGENT_TXN_FLEET_FAULTS": faults,
    }
    started = time.monotonic()
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "orchestrator.cli",
            "worker",
            "--db",
            harness.dbs.store,
            "--app",
            "fault_injection.faulty_shop:build",
            "--poll-seconds",
            "0.05",
            "--concurrency",
            str(concurrency),
            "--lease-seconds",
            "5",
            "--worker-id",
            f"fleet-{i}",
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for i in range(workers)
    ]
    report = FleetReport(sagas, workers, 0.0, {})
    try:
        while True:
            elapsed = time.monotonic() - started
            if kill_one_after is not None and not report.killed and elapsed >= kill_one_after:
                procs[0].send_signal(signal.SIGKILL)
                report.killed = True
            if restart_after is not None and not report.restarted and elapsed >= restart_after:
                await _restart_server(harness)
                report.restarted = True
            try:
                async with reader.store.read() as conn:
                    report.statuses = await count_by_status(conn)
                    unsent = await count_unsettled(conn, EffectKind.OUTBOX)
            except Exception:  # the server is restarting: ask again
                await asyncio.sleep(0.2)
                continue
            settled = sum(n for s, n in report.statuses.items() if s in SETTLED)
            if settled >= sagas and unsent == 0:
                report.settled = True
                break
            if all(p.returncode is not None for p in procs):
                report.workers_gone = True
                break
            if elapsed > deadline_seconds:
                break
            await asyncio.sleep(0.1)
        report.seconds_to_settle = time.monotonic() - started
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            await asyncio.wait_for(p.wait(), 60)
        report.exit_codes = [p.returncode for p in procs]
        for i, code in enumerate(report.exit_codes):
            if code == -signal.SIGTERM and not await _left_a_trace(reader, f"fleet-{i}"):
                report.stopped_while_starting.append(i)
    return report


async def _left_a_trace(reader: Orchestrator, worker_id: str) -> bool:
    """Whether any ledger row names ``worker_id`` as its owner (it claimed something)."""
    async with reader.store.read() as conn:
        stmt = select(func.count()).where(ledger.c.detail.like(f'%"owner":"{worker_id}"%'))
        return int((await conn.execute(stmt)).scalar_one()) > 0


async def _restart_server(harness: Harness) -> None:
    cluster = await local_cluster(harness.dbs.store)
    if cluster is None:
        raise RuntimeError("no local PostgreSQL cluster to restart")
    proc = await asyncio.create_subprocess_exec(
        *cluster.ctl("restart"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await proc.wait()
    await wait_for_postgres(cluster.host, cluster.port)
