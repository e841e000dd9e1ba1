"""PostgreSQL group commit: concurrent blind transactions of one shape share a round trip.

Why: on PostgreSQL each happy-path local transaction is already one statement sent without
``BEGIN`` (:mod:`ledger.batched`), and what is left of the engine's client CPU per saga is
mostly the socket write and the driver's per-call work around those four statements
(``docs/benchmarks-log.md``). Sagas in flight together produce many such statements at once, and
those of the same transition (say, "record a step, claim the next") have the same SQL text. So
when a statement's shape is already on its way to the server, the transactions that end with
the same shape wait for it and are then sent together: as one execution of the statement's
batch form (:class:`ledger.batched.BatchStatement`: every member's arguments in one JSON
argument, so the server runs the statement once for all of them), or, for a statement without
one, as one asyncpg ``executemany``. Either way one prepared statement, one round trip, one
implicit transaction, one commit. It is the SQLite commit group's idea (DESIGN "Commit
economy"). A transaction alone in the store is sent at once, exactly as before, so a single
saga is unchanged; with others open, an idle shape's statement waits at most one turn of the
event loop (below, "Two cohorts").

Each member's transaction stays its own in every outcome that matters:

* **Success**: the batch is atomic (one statement, or one ``executemany``), so every member's
  writes are committed together, each member's as a whole.
* **The server refuses the batch** (a stale fence's ``CAST``, a duplicate key, any SQL error):
  nothing of it was committed, and every member sends its own statement again, alone, on its
  own connection — so each learns its own outcome, with its own error, as if there had been
  no group.
* **The outcome is unknown** (the sending connection was lost, or its task cancelled, with the
  batch in flight): every member fails as :class:`~ledger.errors.StoreUnavailable`, as a
  transaction whose connection drops during its commit does. What was committed is durable
  and recovery reads it back.

Members wait on futures. The member that sent a batch, once its own writes are committed, sends
the next one (everyone who queued meanwhile) itself, on its own connection, at once; what queues
during that second batch it hands to the first of those members, which sends it on its own
connection. A member cancelled while queued leaves the queue; one cancelled just as the batch
was handed to it passes it on.

**Two cohorts, not one convoy.** With that rule alone, sagas in flight together move as one
convoy (``docs/benchmarks-log.md``, "Where a PostgreSQL saga's time goes"): the first statement of a
stage goes alone, every other saga's queues behind it, and the batch then runs on the server
while the client waits, after which the client runs every member's continuation while the server
waits. Throughput is then one saga per *client + server* time, with both cores half idle. So
when other write transactions are open on the store (``population``, counted by the store), the
sender keeps two cohorts instead:

* an idle shape's first statement is held until the loop's next turn instead of leaving alone
  (the others of its stage, whose continuations run in this turn, join it), unless at most
  two transactions are open — a lone saga's statement still leaves at once — or the shape's
  last batch had one member: a shape whose statements come alone (a mixed workload, where
  the open transactions are of other shapes) is sent at once, as before;
* as soon as the queue holds half the open transactions, the member that filled it sends it on
  its own connection, beside whatever batch of the shape is already in flight.

One half's batch then runs on the server while the client runs the other half's continuations.
Each member's outcome is decided exactly as before: a split batch is one more batch, with the
same refusal and unknown-outcome rules.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from ledger.batched import BatchStatement
from ledger.errors import StoreUnavailable


@dataclass(eq=False, slots=True)
class _Member:
    args: Sequence[Any]
    #: Resolved with the member's outcome: ``True`` committed, ``False`` send alone, a
    #: :class:`_Lead` (send this batch), or an exception (outcome unknown). A member that
    #: sends at once never waits on it.
    woken: asyncio.Future[Any]


@dataclass(frozen=True, slots=True)
class _Lead:
    batch: list[_Member]


class _Shape:
    __slots__ = ("busy", "company", "waiting")

    def __init__(self) -> None:
        #: A batch of this shape is on its way (or has been handed to a member to send).
        self.busy = False
        #: The last batch of this shape had more than one member: its statements come in
        #: company, so holding an idle one for the loop's turn is worth it.
        self.company = False
        self.waiting: list[_Member] = []


def _others(batch: list[_Member], me: _Member) -> list[_Member]:
    """The members of ``batch`` ``me`` sends beside its own statement. A member cancelled
    while it queued has left (its future is done): its writes are not sent."""
    return [m for m in batch if m is not me and not m.woken.done()]


class GroupSender:
    """Per store: sends blind transactions' statements, grouping those of one shape that
    arrive while another of that shape is in flight (in two cohorts when told the store's
    open write transactions; see the module's doc)."""

    def __init__(
        self,
        grouped: Callable[[int], None],
        population: Callable[[], int] | None = None,
        batch: Callable[[str], BatchStatement | None] = lambda _sql: None,
    ) -> None:
        #: Called with the number of member transactions whose commit rode on another's.
        self._grouped = grouped
        #: A statement's batch statement (:class:`ledger.batched.BatchStatement`): a batch of it
        #: then runs as one execution instead of an ``executemany`` (``None``: it has none).
        self._batch = batch
        #: The number of write transactions open on the store, the sender's own included
        #: (``None``: one convoy, no holding or splitting; see the module's doc).
        self._population = population
        self._shapes: dict[str, _Shape] = {}

    async def send(self, driver: asyncpg.Connection, sql: str, args: Sequence[Any]) -> bool:
        """Run ``sql`` with ``args`` in an implicit transaction of its own or of a group.

        ``True``: committed. ``False``: it went in a batch the server refused, and nothing of
        it was committed — the caller sends it alone to learn its own outcome. A server error
        of a statement sent alone, and any error whose outcome is unknown, is raised."""
        shape = self._shapes.get(sql)
        if shape is None:
            shape = self._shapes[sql] = _Shape()
        loop = asyncio.get_running_loop()
        me = _Member(args, loop.create_future())
        open_writes = 0 if self._population is None else self._population()
        if not shape.busy:
            shape.busy = True
            if open_writes <= 2 or not shape.company:
                # Alone, or half of two: no cohort to wait for. Or this shape's statements
                # have come alone: holding them would only add a turn (a mixed workload).
                return await self._lead(driver, sql, shape, [me], me)
            # Others may reach this shape in this turn: hold the statement until the next one.
            loop.call_soon(self._hand_off, shape)
            shape.waiting.append(me)
        else:
            shape.waiting.append(me)
            if open_writes and 2 * len(shape.waiting) >= open_writes:
                # Half of the open transactions are queued: they leave now, as one cohort.
                batch, shape.waiting = shape.waiting, []
                return await self._send_batch(driver, sql, shape, me, _others(batch, me))
        try:
            outcome = await me.woken
        except asyncio.CancelledError:
            if not me.woken.done() or me.woken.cancelled():
                if me in shape.waiting:
                    shape.waiting.remove(me)
            elif isinstance(me.woken.result(), _Lead):
                # Handed a batch but cancelled before sending it: the others go first in line.
                rest = [m for m in me.woken.result().batch if m is not me]
                shape.waiting[:0] = rest
                self._hand_off(shape)
            raise
        if isinstance(outcome, _Lead):
            return await self._lead(driver, sql, shape, outcome.batch, me)
        if isinstance(outcome, BaseException):
            raise outcome
        return bool(outcome)

    async def _lead(
        self,
        driver: asyncpg.Connection,
        sql: str,
        shape: _Shape,
        batch: list[_Member],
        me: _Member,
    ) -> bool:
        try:
            committed = await self._send_batch(driver, sql, shape, me, _others(batch, me))
            if committed:
                await self._send_queued(driver, sql, shape)
            return committed
        finally:
            self._hand_off(shape)

    async def _send_queued(self, driver: asyncpg.Connection, sql: str, shape: _Shape) -> None:
        """Send, on the leader's connection, what queued while its own batch was in flight.

        Why: handing the queue to one of its members costs a turn of the event loop before that
        member's task runs and sends it, and with many sagas in flight a turn is long; the
        leader's connection is free and the leader is running now. The queue then leaves at once,
        and in a larger batch, which on PostgreSQL costs less of both sides' CPU per member than
        several smaller ones (``docs/benchmarks-log.md``, item 36). Once only: whatever queues
        during this batch is handed off as before, so a leader waits at most one extra round
        trip — its own writes are already committed. If this batch's outcome is unknown (the
        connection failed, or the leader was cancelled), the members fail as unavailable and the
        leader raises too: its own commit is durable, and reporting it as unknown is the
        conservative answer that recovery settles by reading it back."""
        queued = [m for m in shape.waiting if not m.woken.done()]
        shape.waiting = []
        if queued:
            await self._send_batch(driver, sql, shape, None, queued)

    async def _send_batch(
        self,
        driver: asyncpg.Connection,
        sql: str,
        shape: _Shape,
        leader: _Member | None,
        members: list[_Member],
    ) -> bool:
        """Send ``leader``'s arguments (if any) and ``members``' in one implicit transaction and
        resolve every member's future with the outcome. ``True``: committed. ``False``: the
        server refused the batch and nothing of it was committed (each member resends alone).
        The leader's own statement refused with nobody beside it raises its own error; an
        unknown outcome raises."""
        rows = (
            [m.args for m in members]
            if leader is None
            else [leader.args, *(m.args for m in members)]
        )
        shape.company = len(rows) > 1
        committed: bool | None = True  # None: unknown
        try:
            if len(rows) > 1:
                batch = self._batch(sql)
                arguments = None if batch is None else batch.arguments(rows)
                if batch is None or arguments is None:
                    await driver.executemany(sql, rows)
                else:
                    await driver.execute(batch.sql, *arguments)
                self._grouped(len(rows) - 1)
            else:
                await driver.execute(sql, *rows[0])
        except asyncpg.PostgresError:
            if leader is not None and not members:
                raise  # alone: its own error, handled by the caller as any statement's
            committed = False  # nothing committed: each member resends alone
        except BaseException:
            committed = None
            raise
        finally:
            for m in members:
                if not m.woken.done():
                    m.woken.set_result(
                        StoreUnavailable("the grouped commit's connection failed: outcome unknown")
                        if committed is None
                        else committed
                    )
        return bool(committed)

    @staticmethod
    def _hand_off(shape: _Shape) -> None:
        waiting = [m for m in shape.waiting if not m.woken.done()]
        shape.waiting = []
        if not waiting:
            shape.busy = False
            return
        waiting[0].woken.set_result(_Lead(waiting))
