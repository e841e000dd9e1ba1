"""The worker: a long-running recovery loop over one store, many of them over one PostgreSQL.

Each loop iteration claims a batch of due transactions in **one statement** (``UPDATE …
WHERE tx_id IN (SELECT … FOR UPDATE SKIP LOCKED LIMIT n) RETURNING`` on PostgreSQL, a plain
scan + compare-and-set on SQLite, see :func:`ledger.transactions.claim_due`), drives each with
the same driver ``execute`` uses (lookup before any re-apply), dispatches due outbox events,
delivers due lifecycle callbacks (:mod:`orchestrator.callback_delivery`), and sleeps with
jitter when there is nothing to do. :meth:`Worker.stop` (SIGTERM / SIGINT in the CLI) stops
claiming; every saga in hand finishes its current provider call and its write, then
gives its lease back instead of taking the next step. A worker that dies simply lets its leases
expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

import structlog

from ledger.errors import LeaseLost, StorageError
from orchestrator.callback_delivery import deliver_due
from orchestrator.config import MAX_POLL_SECONDS
from orchestrator.driver import SagaRun
from orchestrator.engine import Orchestrator

log = structlog.get_logger(__name__)


@dataclass
class WorkerStats:
    """What a worker did since it started."""

    claimed: int = 0
    finished: int = 0
    events: int = 0
    callbacks: int = 0
    lease_lost: int = 0
    errors: int = 0
    passes: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


class Worker:
    """Recovery loops for one process; ``concurrency`` sagas in hand at most."""

    def __init__(
        self,
        orch: Orchestrator,
        *,
        concurrency: int = 8,
        poll_seconds: float = 0.5,
        refill_at: int | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        # A range that must hold, so NaN fails it too; inf would make an idle worker wait for
        # ever before it polls again.
        if not 0 < poll_seconds <= MAX_POLL_SECONDS:
            raise ValueError(f"poll_seconds must be above 0 and at most {MAX_POLL_SECONDS:g}")
        if refill_at is not None and not 1 <= refill_at <= concurrency:
            raise ValueError("refill_at must be between 1 and concurrency")
        self.orch = orch
        self.concurrency = concurrency
        #: Free slots a worker with sagas in hand waits for before it claims again.
        self.refill_at = max(1, concurrency // 2) if refill_at is None else refill_at
        self.poll_seconds = poll_seconds
        self.stats = WorkerStats()
        self._stopping = asyncio.Event()
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()

    def stop(self) -> None:
        """Stop claiming; sagas in hand finish their current write and release their lease."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stopping.is_set()

    async def run(self, *, once: bool = False) -> WorkerStats:
        """Loop until stopped (or, with ``once``, until nothing is due)."""
        log.info("worker started", worker=self.orch.settings.worker_id, once=once)
        try:
            while not self.stopping:
                did = await self.run_pass()
                if once and not did and not self._tasks:
                    break
                if not did:
                    await self._refresh_metrics()
                    await self._idle()
        finally:
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        log.info("worker stopped", worker=self.orch.settings.worker_id, **self.stats.__dict__)
        return self.stats

    async def run_pass(self) -> int:
        """Claim what fits in the free slots, start driving it; returns how much was started."""
        free = self.concurrency - len(self._tasks)
        if free < self.refill_at and self._tasks:
            # A claim pass costs about as much as a saga's own writes (the claim, its ledger
            # rows, the batch's reads), whether it brings one saga or eight: claim in batches.
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            return 1
        self.stats.passes += 1
        try:
            claimed = await self._claim(free)
            due_events = await self.orch.due_outbox(limit=free) if len(claimed) < free else []
        except StorageError as exc:
            self.stats.errors += 1
            log.warning("claim pass failed", error=type(exc).__name__)
            return 0
        for run in claimed:
            self._spawn(self._drive(run))
        for tx_id in due_events:
            self._spawn(self._dispatch(tx_id))
        return len(claimed) + len(due_events) + await self._deliver_callbacks()

    async def _deliver_callbacks(self) -> int:
        """Send due lifecycle callbacks; how many were claimed.

        Inline, after this pass's sagas were started (they run as tasks meanwhile): an idle
        check is one read, and a batch holds the next claim back by at most one POST timeout.
        """
        s = self.orch.settings
        try:
            report = await deliver_due(self.orch.store, owner=s.worker_id, lease_ms=s.lease_ms)
        except StorageError as exc:
            self.stats.errors += 1
            log.warning("callback claim failed", error=type(exc).__name__)
            return 0
        self.stats.callbacks += report.delivered
        return report.claimed

    def _spawn(self, job: asyncio.Future[None] | asyncio.Task[None] | object) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(job)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refresh_metrics(self) -> None:
        try:
            await self.orch.metrics.refresh(self.orch.store)
        except StorageError as exc:
            log.warning("metrics refresh failed", error=type(exc).__name__)

    async def _idle(self) -> None:
        # Jitter keeps N idle workers from polling the database in lockstep.
        delay = self.poll_seconds * (0.5 + random.random())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)

    async def _claim(self, limit: int) -> list[SagaRun]:
        with self.orch.metrics.claim_latency.time():
            runs = await self.orch.claim_due(limit=limit)
        self.stats.claimed += len(runs)
        return runs

    async def _drive(self, run: SagaRun) -> None:
        try:
            status = await self.orch.drive_claimed(run, should_stop=lambda: self.stopping)
        except LeaseLost:
            self.stats.lease_lost += 1
            self.orch.metrics.lease_losses.inc()
            return
        except StorageError as exc:
            self.stats.errors += 1
            log.warning("drive failed", tx_id=run.tx_id, error=type(exc).__name__)
            return
        self.stats.finished += 1
        self.stats.by_status[status.value] = self.stats.by_status.get(status.value, 0) + 1

    async def _dispatch(self, tx_id: str) -> None:
        try:
            if await self.orch.dispatch_outbox(tx_id):
                self.stats.events += 1
        except LeaseLost:
            self.stats.lease_lost += 1
        except StorageError as exc:
            self.stats.errors += 1
            log.warning("outbox dispatch failed", tx_id=tx_id, error=type(exc).__name__)


__all__ = ["Worker", "WorkerStats"]
