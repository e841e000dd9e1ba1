"""Delivery of lifecycle callbacks: claim due runs, POST them, record each outcome under its fence.

The outcome of an execution and the callbacks it owes commit together (:mod:`orchestrator.audit`);
this module is the sending half, run by every worker pass (:class:`orchestrator.worker.Worker`).

What a receiver can rely on:

* the body is the run's stored payload as JSON, and the header
  ``X-Agent-Txn-Callback-Run-ID`` carries the run id, the same on every attempt — the
  correctness boundary is the receiver deduplicating on it, not exactly-once sending (a worker
  may die after the receiver answered and before the outcome was recorded);
* at most :data:`ledger.callbacks.MAX_ATTEMPTS` (5) attempts, with exponential backoff and full
  jitter between them, so N failed runs do not hammer a recovering receiver in lockstep;
* any 2xx ends the run ``delivered``; any other status, timeout or network error is retried.
  A target that can never work (not an http(s) URL) fails at once; an operator may requeue it.

Nothing the receiver answers is stored: ``last_error`` is ``http <status>`` or the exception's
type name, never its body or message (which could hold the receiver's data or secrets).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Final

import httpx
import structlog

from ledger import callbacks
from ledger.callbacks import CallbackRunRow
from ledger.errors import StorageError
from ledger.store import Store

log = structlog.get_logger(__name__)

RUN_ID_HEADER: Final = "X-Agent-Txn-Callback-Run-ID"
#: Backoff before attempt n + 1 is drawn from [0, min(cap, base * 2 ** (n - 1))].
BACKOFF_BASE_MS: Final = 1_000
BACKOFF_CAP_MS: Final = 300_000


@dataclass
class DeliveryReport:
    """What one :func:`deliver_due` call did."""

    claimed: int = 0
    delivered: int = 0
    #: Failed attempts with attempts left: back to ``pending`` after their backoff.
    retrying: int = 0
    #: Runs that ended ``failed`` (5th attempt, or a target that can never work).
    failed: int = 0
    #: Outcomes refused because the fence moved: another holder owns the run now.
    fenced_out: int = 0
    #: Outcomes that could not be written (storage error); the lease expiry hands the run on.
    errors: int = 0


def backoff_ms(attempts: int, *, rng: random.Random | None = None) -> int:
    """Delay before the next attempt after ``attempts`` failed ones: full-jitter exponential
    (AWS architecture blog), so retries of many runs spread out instead of arriving together."""
    ceiling = min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** max(0, attempts - 1))
    return int((rng or random).uniform(0, ceiling))


async def deliver_due(
    store: Store,
    *,
    owner: str,
    lease_ms: int,
    limit: int = 50,
    client: httpx.AsyncClient | None = None,
    timeout_seconds: float = 5.0,
) -> DeliveryReport:
    """Claim up to ``limit`` due runs as ``owner`` and deliver them concurrently.

    A read probe comes first, so an idle pass takes no write lock (SQLite has one writer).
    ``client`` lets a caller share a connection pool (or a test inject a transport); without it
    one client is opened for this call and closed after. ``timeout_seconds`` bounds each POST
    and should stay well under ``lease_ms``: a lease that expires mid-request lets another worker
    send the run again (harmless to a deduplicating receiver, but an attempt spent).
    """
    report = DeliveryReport()
    async with store.read() as conn:
        if not await callbacks.has_due(store, conn):
            return report
    async with store.transaction() as work:
        runs = await callbacks.claim_due(work, owner=owner, lease_ms=lease_ms, limit=limit)
    report.claimed = len(runs)
    if not runs:
        return report
    limits = httpx.Timeout(timeout_seconds)
    if client is not None:
        await _Batch(store, client, limits, report).deliver(runs)
        return report
    async with httpx.AsyncClient(timeout=limits) as own:
        await _Batch(store, own, limits, report).deliver(runs)
    return report


@dataclass
class _Batch:
    """One claimed batch: where outcomes go, how runs are sent, what is counted."""

    store: Store
    client: httpx.AsyncClient
    limits: httpx.Timeout
    report: DeliveryReport

    async def deliver(self, runs: list[CallbackRunRow]) -> None:
        # Each run records its own outcome as soon as it is known: a crash mid-batch re-sends
        # only the runs whose outcome was not written yet.
        await asyncio.gather(*(self._deliver_one(run) for run in runs))

    async def _deliver_one(self, run: CallbackRunRow) -> None:
        error, permanent = await self._send(run)
        delivered = error is None
        retry_in = None if permanent else backoff_ms(run.attempts)
        report = self.report
        try:
            async with self.store.transaction() as work:
                recorded = await callbacks.record(
                    work,
                    run.run_id,
                    fence=run.fence,
                    delivered=delivered,
                    error=error,
                    retry_in_ms=retry_in,
                )
        except StorageError as exc:
            report.errors += 1
            log.warning(
                "callback outcome not recorded", run_id=run.run_id, error=type(exc).__name__
            )
            return
        if not recorded:
            report.fenced_out += 1
            log.info("callback outcome refused: fence moved", run_id=run.run_id, fence=run.fence)
        elif delivered:
            report.delivered += 1
        elif permanent or run.attempts >= callbacks.MAX_ATTEMPTS:
            report.failed += 1
            log.warning("callback failed for good", run_id=run.run_id, attempts=run.attempts)
        else:
            report.retrying += 1

    async def _send(self, run: CallbackRunRow) -> tuple[str | None, bool]:
        """POST the run; ``(None, False)`` when delivered, else ``(safe error text, permanent)``."""
        try:
            # Streamed and never read: only the status matters, and a receiver answering with a
            # huge body must not cost the worker memory.
            async with self.client.stream(
                "POST",
                run.target,
                json=run.payload,
                headers={RUN_ID_HEADER: run.run_id},
                timeout=self.limits,
            ) as response:
                status = response.status_code
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            return type(exc).__name__, True
        except Exception as exc:  # any transport failure is one failed attempt, never a crash
            return type(exc).__name__, False
        if 200 <= status < 300:
            return None, False
        return f"http {status}", False


__all__ = ["RUN_ID_HEADER", "DeliveryReport", "backoff_ms", "deliver_due"]
