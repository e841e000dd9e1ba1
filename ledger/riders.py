"""Riders: records that need not be durable before anything is acted on, written in the next
local transaction of the store instead of one of their own.

Why: the last write of a happy saga, "the outbox event was delivered", is the only one after
which nothing is sent. Everything else the engine writes is an intent or an outcome that the
next call depends on, so it must be durable first (DESIGN "Effect protocol"); this one only
settles a fact the provider already holds. Giving it a transaction of its own was a quarter of a
sequential saga's commits and about 8 % of its client instructions (``docs/benchmarks-log.md``,
item 55). So it *rides*: :meth:`Riders.add` queues it, and the next transaction that ends on the
store (any saga's, or the flush one loop turn later when none comes, or a read, or ``close``)
writes it with its own writes, in the same commit.

What a rider must be, for that to be safe:

* **Its loss is recoverable.** If the process dies before a host commits it, the row it would
  have settled stays as it was (the outbox event ``executing`` under this worker's lease),
  which recovery settles by a lookup exactly as for a crash between a provider's answer and
  its record today.
* **It cannot fail its host.** Its writes are fenced and blind: when the lease has passed to
  another holder since (the fence moved), they change nothing and the host commits anyway
  (:func:`ledger.effects.record` with ``may_be_taken``).
* **It can be written twice.** A host whose outcome is unknown (its connection lost during the
  commit) hands its riders on; writing one again after it did commit finds the fence spent and
  changes nothing.

A host that fails or is cancelled hands its riders back to the queue, and a flush is scheduled
(after a short, growing pause when the store itself failed). A host that dies of anything else
(a simulated crash, ``SystemExit``) drops them: the process is going away, and what it held is
recovery's. :meth:`Riders.settle` lands every queued rider before a read, so a process always
reads its own writes.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import structlog

if TYPE_CHECKING:
    from ledger.store import Work

log = structlog.get_logger(__name__)

#: Pauses before flushing again after the store refused a flush, growing to the last.
RETRY_PAUSES_S = (0.05, 0.1, 0.25, 0.5, 1.0)


class Rider(Protocol):
    """One record waiting for a host transaction."""

    async def write(self, work: Work) -> None:
        """Write the record in ``work`` (blind, fenced writes that cannot fail it)."""
        ...

    def landed(self) -> None:
        """The host committed (called after the commit, once per landing)."""
        ...


class Riders:
    """The store's queue of riders, and its flush.

    ``flush`` opens one (empty) transaction on the store; every transaction boards the queue
    when it ends (:meth:`board`), so the flush's carries them."""

    def __init__(self, flush: Callable[[], Awaitable[None]]) -> None:
        self._flush = flush
        self._queue: collections.deque[Rider] = collections.deque()
        #: Riders boarded on a host that has not ended yet.
        self._boarded = 0
        self._handle: asyncio.Handle | None = None
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        #: Woken whenever a host with riders ends (:meth:`settle` waits on it).
        self._ended: asyncio.Event | None = None

    @property
    def queued(self) -> bool:
        """Whether any rider waits for a host."""
        return bool(self._queue)

    @property
    def waiting(self) -> bool:
        """Whether any rider is queued or on a host that has not ended."""
        return bool(self._queue) or self._boarded > 0

    def add(self, rider: Rider) -> None:
        """Queue ``rider`` for the next transaction; flush one loop turn later if none comes."""
        self._queue.append(rider)
        if self._handle is None and self._task is None:
            self._handle = asyncio.get_running_loop().call_soon(self._due)

    def board(self) -> list[Rider]:
        """Take every queued rider onto the transaction ending now (its caller writes them)."""
        riders = list(self._queue)
        self._queue.clear()
        self._boarded += len(riders)
        if self._handle is not None:
            # Nothing left to flush. A cancelled handle still sits in the loop's ready queue
            # until its turn, which ledger.sqlite_inline.others_ready knows to ignore.
            self._handle.cancel()
            self._handle = None
        return riders

    def landed(self, riders: Sequence[Rider]) -> None:
        """The host of ``riders`` committed."""
        self._boarded -= len(riders)
        self._failures = 0
        self._wake()
        for rider in riders:
            rider.landed()

    def failed(self, riders: Sequence[Rider], exc: BaseException) -> None:
        """The host of ``riders`` did not commit (or may not have): queue them again, unless
        the process is going away."""
        self._boarded -= len(riders)
        self._wake()
        if not isinstance(exc, Exception | asyncio.CancelledError):
            log.warning("riders dropped", riders=len(riders), error=type(exc).__name__)
            return
        self._queue.extendleft(reversed(riders))
        if isinstance(exc, Exception):
            self._failures += 1
        self._schedule()

    def drop(self) -> None:
        """Forget every queued rider (the store is abandoned as a dead process)."""
        self._queue.clear()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    async def settle(self) -> None:
        """Return once every rider queued before the call has landed (or its host failed and
        raised to whoever opened it; a flush that fails raises here)."""
        while self.waiting:
            if self._queue:
                await self._flush()
                continue
            ended = self._ended = self._ended or asyncio.Event()
            await ended.wait()

    def _wake(self) -> None:
        ended, self._ended = self._ended, None
        if ended is not None:
            ended.set()

    def _schedule(self) -> None:
        if self._handle is not None or self._task is not None or not self._queue:
            return
        loop = asyncio.get_running_loop()
        if self._failures:
            pause = RETRY_PAUSES_S[min(self._failures, len(RETRY_PAUSES_S)) - 1]
            self._handle = loop.call_later(pause, self._due)
        else:
            self._handle = loop.call_soon(self._due)

    def _due(self) -> None:
        self._handle = None
        if self._queue and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run_flush())
            self._task.add_done_callback(_retrieved)

    async def _run_flush(self) -> None:
        try:
            await self._flush()
        except Exception as exc:
            # The riders went back to the queue with a pause (failed()); a store that stays
            # down leaves them to the lease's expiry and recovery's lookup.
            log.warning("riders' flush failed", error=type(exc).__name__)
        except BaseException:
            self._task = None  # cancelled, or the process is going away: nothing to reschedule
            raise
        self._task = None
        self._schedule()


def _retrieved(task: asyncio.Task[None]) -> None:
    # A flush that died with its process (a simulated crash) has no one to tell; retrieving its
    # exception keeps asyncio from logging it as lost.
    if not task.cancelled():
        task.exception()
