"""The group sender's hand-offs (ledger/grouped.py), against a driver whose round trips the test
holds open: who sends what, and that no member is lost or left waiting in any outcome."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import asyncpg
import pytest

from ledger.batched import BatchStatement
from ledger.errors import StoreUnavailable
from ledger.grouped import GroupSender

SQL = "WITH w0 AS (INSERT ...) SELECT c0"
OTHER_SQL = "WITH w0 AS (UPDATE ...) SELECT c0"


class HeldDriver:
    """Each call waits until the test releases it (that call, or every call from then on);
    ``fail[n]`` makes this driver's call number ``n`` raise once released."""

    def __init__(self, calls: list[tuple[str, str, Any]], name: str) -> None:
        self.calls = calls
        self.name = name
        self.gates: list[asyncio.Event] = []
        self.fail: dict[int, BaseException] = {}
        self._open = False

    def release(self, call: int | None = None) -> None:
        """Let call number ``call`` (``None``: every call, now and later) come back."""
        if call is None:
            self._open = True
            for gate in self.gates:
                gate.set()
        else:
            self.gates[call].set()

    async def _round_trip(self, kind: str, args: Any) -> None:
        number = len(self.gates)
        gate = asyncio.Event()
        self.gates.append(gate)
        self.calls.append((self.name, kind, args))
        if self._open:
            gate.set()
        await gate.wait()
        if number in self.fail:
            raise self.fail[number]

    async def execute(self, sql: str, *args: Any) -> str:
        await self._round_trip("execute", list(args))
        return "SELECT 1"

    async def executemany(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        await self._round_trip("executemany", [list(a) for a in args])


class Harness:
    """``population``: the open write transactions the sender is told of (``None``: it is told
    nothing, and keeps one convoy)."""

    def __init__(
        self, population: int | None = None, batches: dict[str, BatchStatement] | None = None
    ) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.grouped: list[int] = []
        self.population = population
        self.sender = GroupSender(
            self.grouped.append,
            None if population is None else lambda: self.population or 0,
            (batches or {}).get,
        )
        self.drivers: dict[str, HeldDriver] = {}

    def driver(self, name: str) -> HeldDriver:
        return self.drivers.setdefault(name, HeldDriver(self.calls, name))

    def send(self, name: str, arg: int, sql: str = SQL) -> asyncio.Task[bool]:
        driver = cast(asyncpg.Connection, self.driver(name))
        return asyncio.create_task(self.sender.send(driver, sql, [arg]))


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def _queued_behind_a(
    h: Harness, *members: tuple[str, int]
) -> tuple[asyncio.Task[bool], list[asyncio.Task[bool]]]:
    """a's statement in flight, alone; then ``members`` queued behind it."""
    first = h.send("a", 1)
    await _settle()
    queued = [h.send(name, n) for name, n in members]
    await _settle()
    return first, queued


async def test_an_idle_shape_is_sent_at_once_alone() -> None:
    h = Harness()
    task = h.send("a", 1)
    await _settle()
    assert h.calls == [("a", "execute", [1])]
    h.driver("a").release()
    assert await task is True
    assert h.grouped == []


async def test_those_arriving_during_a_send_go_next_on_the_senders_connection_in_order() -> None:
    h = Harness()
    first, queued = await _queued_behind_a(h, ("b", 2), ("c", 3), ("d", 4))
    assert len(h.calls) == 1  # they wait for the send in flight
    h.driver("a").release(0)
    await _settle()
    # a's own writes are committed; a sends the queue at once, as one batch, on its connection.
    assert h.calls[1] == ("a", "executemany", [[2], [3], [4]])
    assert not first.done()  # a waits for that batch too (one extra round trip)
    h.driver("a").release(1)
    assert await first is True
    assert await asyncio.gather(*queued) == [True, True, True]
    assert h.grouped == [2]  # three transactions, one commit: two rode on another's


async def test_a_sender_sends_one_batch_beyond_its_own_then_hands_the_queue_on() -> None:
    h = Harness()
    first, (second,) = await _queued_behind_a(h, ("b", 2))
    h.driver("a").release(0)
    await _settle()
    assert h.calls[1] == ("a", "execute", [2])  # b's, alone, on a's connection
    later = [h.send("c", 3), h.send("d", 4)]  # queue while that batch is in flight
    await _settle()
    h.driver("a").release(1)
    assert await first is True and await second is True
    await _settle()
    # a is done: the queue goes to its first member, c, on c's own connection.
    assert h.calls[2] == ("c", "executemany", [[3], [4]])
    h.driver("c").release()
    assert await asyncio.gather(*later) == [True, True]
    assert h.grouped == [1]


async def test_a_refused_batch_sends_every_member_back_to_send_alone() -> None:
    h = Harness()
    first, queued = await _queued_behind_a(h, ("b", 2), ("c", 3))
    h.driver("a").fail[1] = asyncpg.exceptions.UniqueViolationError("duplicate key")
    h.driver("a").release()
    assert await first is True  # its own writes were committed before the batch was refused
    assert await asyncio.gather(*queued) == [False, False]  # nothing committed: resend alone
    assert h.grouped == []


async def test_a_member_refused_in_the_senders_next_batch_alone_resends_alone() -> None:
    h = Harness()
    first, (queued,) = await _queued_behind_a(h, ("b", 2))
    h.driver("a").fail[1] = asyncpg.exceptions.UniqueViolationError("duplicate key")
    h.driver("a").release()
    assert await first is True  # b's error is b's: a is not told of it
    assert await queued is False  # b learns its own outcome by sending alone


async def test_a_statement_refused_alone_raises_its_own_error() -> None:
    h = Harness()
    h.driver("a").fail[0] = asyncpg.exceptions.UniqueViolationError("duplicate key")
    h.driver("a").release()
    with pytest.raises(asyncpg.exceptions.UniqueViolationError):
        await h.send("a", 1)


async def test_a_batch_lost_in_flight_fails_every_member_as_unavailable() -> None:
    h = Harness()
    first, chained = await _queued_behind_a(h, ("b", 2), ("c", 3))
    h.driver("a").release(0)
    await _settle()
    handed = [h.send("d", 4), h.send("e", 5)]  # queue while a's second batch is in flight
    await _settle()
    h.driver("a").fail[1] = ConnectionResetError("server closed the connection")
    h.driver("a").release(1)
    # a's own writes were committed, but its connection failed: it raises, for its pool.
    with pytest.raises(ConnectionResetError):
        await first
    outcomes = await asyncio.gather(*chained, return_exceptions=True)
    assert all(isinstance(o, StoreUnavailable) for o in outcomes)  # the outcome is unknown
    await _settle()
    # The queue behind them was handed on: d sends it, and its connection fails too.
    assert h.calls[2] == ("d", "executemany", [[4], [5]])
    h.driver("d").fail[0] = ConnectionResetError("server closed the connection")
    h.driver("d").release()
    leader, member = await asyncio.gather(*handed, return_exceptions=True)
    assert isinstance(leader, ConnectionResetError)  # the sender's own error, for its pool
    assert isinstance(member, StoreUnavailable)
    later = h.send("f", 6)  # the shape is free again
    h.driver("f").release()
    assert await later is True


async def test_a_member_cancelled_while_queued_is_not_sent() -> None:
    h = Harness()
    first, (gone, kept) = await _queued_behind_a(h, ("b", 2), ("c", 3))
    gone.cancel()
    await _settle()
    h.driver("a").release()
    assert await first is True and await kept is True
    assert h.calls[1] == ("a", "execute", [3])  # b left: c is alone
    assert gone.cancelled()


async def test_a_member_cancelled_as_it_is_handed_the_batch_passes_it_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness()
    first, (second,) = await _queued_behind_a(h, ("b", 2))
    h.driver("a").release(0)
    await _settle()  # a now sends b's batch
    handed, rest = h.send("c", 3), [h.send("d", 4), h.send("e", 5)]
    await _settle()
    hand_off = GroupSender._hand_off
    cancelled: list[bool] = []

    def hand_off_then_cancel(shape: Any) -> None:
        hand_off(shape)  # a hands the queue to c ...
        if not cancelled:
            cancelled.append(handed.cancel())  # ... whose task is cancelled before it runs

    monkeypatch.setattr(GroupSender, "_hand_off", staticmethod(hand_off_then_cancel))
    h.driver("a").release(1)
    assert await first is True and await second is True
    await _settle()
    assert cancelled == [True] and handed.cancelled()
    assert h.calls[2] == ("d", "executemany", [[4], [5]])  # d took the batch over
    h.driver("d").release()
    assert await asyncio.gather(*rest) == [True, True]


async def test_different_shapes_do_not_wait_for_each_other() -> None:
    h = Harness()
    first = h.send("a", 1)
    other = h.send("b", 2, sql=OTHER_SQL)
    await _settle()
    assert [c[:2] for c in h.calls] == [("a", "execute"), ("b", "execute")]
    h.driver("a").release()
    h.driver("b").release()
    assert await first is True and await other is True


# -- two cohorts: holding an idle shape's first statement, splitting the queue at half ----------


async def _in_company(h: Harness) -> None:
    """Give the shape a batch of more than one member (a convoy's: one in flight, two queued
    behind it) on drivers of its own, then forget those calls: a shape is held only once its
    statements have come in company."""
    population, h.population = h.population, 0  # as if uncounted: one convoy
    first = h.send("w1", 1)
    await _settle()
    queued = [h.send("w2", 2), h.send("w3", 3)]
    await _settle()
    h.driver("w1").release()
    assert await first is True and await asyncio.gather(*queued) == [True, True]
    assert h.calls[-1] == ("w1", "executemany", [[2], [3]])
    h.calls.clear()
    h.grouped.clear()
    h.drivers.clear()
    h.population = population


def _in_one_turn(h: Harness, *members: tuple[str, int]) -> list[asyncio.Task[bool]]:
    """Tasks that all start in the same turn of the loop (as a batch's woken members do)."""
    return [h.send(name, n) for name, n in members]


async def test_a_lone_open_transaction_is_sent_at_once() -> None:
    h = Harness(population=1)
    task = h.send("a", 1)
    await asyncio.sleep(0)  # the task's first step: no turn is waited for
    assert h.calls == [("a", "execute", [1])]
    h.driver("a").release()
    assert await task is True


async def test_two_open_transactions_are_two_cohorts_of_one() -> None:
    h = Harness(population=2)
    tasks = _in_one_turn(h, ("a", 1), ("b", 2))
    await asyncio.sleep(0)  # their first steps: neither waits for the other
    assert h.calls == [("a", "execute", [1]), ("b", "execute", [2])]
    h.driver("a").release()
    h.driver("b").release()
    assert await asyncio.gather(*tasks) == [True, True]
    assert h.grouped == []


async def test_an_idle_shapes_statement_waits_one_turn_for_others_of_its_stage() -> None:
    h = Harness(population=3)
    await _in_company(h)
    first, second, third = _in_one_turn(h, ("a", 1), ("b", 2), ("c", 3))
    await asyncio.sleep(0)  # the three first steps, in one turn: a's statement is held
    assert h.calls == [("b", "executemany", [[2], [1]])]
    await _settle()
    # Half of three is two: b, which made the queue two, sent its own and a's; c, alone in the
    # queue then, went at the held hand-off's turn.
    assert h.calls == [("b", "executemany", [[2], [1]]), ("c", "execute", [3])]
    h.driver("b").release()
    h.driver("c").release()
    assert await asyncio.gather(first, second, third) == [True, True, True]
    assert h.grouped == [1]


async def test_a_held_statement_nobody_joins_leaves_alone_at_the_next_turn() -> None:
    h = Harness(population=3)
    await _in_company(h)
    task = h.send("a", 1)
    await asyncio.sleep(0)
    assert h.calls == []  # held
    await _settle()
    assert h.calls == [("a", "execute", [1])]
    h.driver("a").release()
    assert await task is True
    assert h.grouped == []


async def test_the_queue_leaves_in_two_cohorts_each_on_its_filler_s_connection() -> None:
    h = Harness(population=8)
    await _in_company(h)
    tasks = _in_one_turn(h, *((name, n) for n, name in enumerate("abcdefgh", start=1)))
    await _settle()
    # Two batches of the one shape in flight at once, each sent by the member that filled it
    # (its own statement first).
    assert h.calls == [
        ("d", "executemany", [[4], [1], [2], [3]]),
        ("h", "executemany", [[8], [5], [6], [7]]),
    ]
    h.driver("h").release()  # the second cohort's commit comes back first: it is not held
    assert await asyncio.gather(*tasks[4:]) == [True] * 4
    assert not any(t.done() for t in tasks[:4])
    h.driver("d").release()
    assert await asyncio.gather(*tasks[:4]) == [True] * 4
    assert h.grouped == [3, 3]
    later = h.send("i", 9)  # the shape is free again (the held hand-off found nobody)
    h.population = 1
    h.driver("i").release()
    assert await later is True and h.calls[-1] == ("i", "execute", [9])


async def test_a_refused_cohort_sends_every_member_back_to_send_alone() -> None:
    h = Harness(population=4)
    await _in_company(h)
    h.driver("b").fail[0] = asyncpg.exceptions.UniqueViolationError("duplicate key")
    h.driver("b").release()
    tasks = _in_one_turn(h, ("a", 1), ("b", 2))
    assert await asyncio.gather(*tasks) == [False, False]  # nothing committed: resend alone
    assert h.calls == [("b", "executemany", [[2], [1]])]
    assert h.grouped == []


async def test_a_cohort_lost_in_flight_fails_every_member_as_unavailable() -> None:
    h = Harness(population=4)
    await _in_company(h)
    h.driver("b").fail[0] = ConnectionResetError("server closed the connection")
    h.driver("b").release()
    member, sender = await asyncio.gather(
        *_in_one_turn(h, ("a", 1), ("b", 2)), return_exceptions=True
    )
    assert isinstance(sender, ConnectionResetError)  # the sender's own error, for its pool
    assert isinstance(member, StoreUnavailable)  # the outcome is unknown


async def test_a_held_member_cancelled_before_its_turn_is_not_sent() -> None:
    h = Harness(population=4)
    await _in_company(h)
    gone = h.send("a", 1)
    await asyncio.sleep(0)  # held
    gone.cancel()
    await _settle()
    assert gone.cancelled() and h.calls == []
    later = h.send("b", 2)  # the shape is free again
    await _settle()
    assert h.calls == [("b", "execute", [2])]
    h.driver("b").release()
    assert await later is True


async def test_a_shape_whose_statements_come_alone_is_not_held() -> None:
    # Many transactions open, but of other shapes (a mixed workload): this shape's last batch
    # had one member, so its statement leaves at once instead of waiting a turn for nobody.
    h = Harness(population=8)
    first = h.send("a", 1)
    await asyncio.sleep(0)
    assert h.calls == [("a", "execute", [1])]  # a fresh shape: nothing has come in company yet
    h.driver("a").release()
    assert await first is True
    second = h.send("b", 2)
    await asyncio.sleep(0)
    assert h.calls[-1] == ("b", "execute", [2])  # its last batch was alone: still not held
    h.driver("b").release()
    assert await second is True
    await _in_company(h)
    held = h.send("c", 3)
    await asyncio.sleep(0)
    assert h.calls == []  # now its statements have come in company: held for the turn
    await _settle()
    h.driver("c").release()
    assert await held is True


async def test_a_batch_of_a_statement_with_a_batch_form_is_one_execution_of_it() -> None:
    # ledger/batched.py: the members' arguments go as one JSON argument (then the member count,
    # when a fenced write is checked); a batch whose arguments JSON cannot carry exactly goes
    # as executemany, as does a shape with no batch form.
    h = Harness(batches={SQL: BatchStatement("BATCH", counted=True)})
    first, queued = await _queued_behind_a(h, ("b", 2), ("c", 3))
    h.driver("a").release()
    assert await first is True
    assert await asyncio.gather(*queued) == [True, True]
    assert h.calls[1] == ("a", "execute", ["[[2], [3]]", 2])

    h = Harness(batches={SQL: BatchStatement("BATCH", counted=False)})
    odd = h.send("a", 1)
    await _settle()
    driver = cast(asyncpg.Connection, h.driver("b"))
    floats = [asyncio.create_task(h.sender.send(driver, SQL, [x])) for x in (2.5, 3.5)]
    await _settle()
    h.driver("a").release()
    assert await odd is True and await asyncio.gather(*floats) == [True, True]
    assert h.calls[1] == ("a", "executemany", [[2.5], [3.5]])

    h = Harness(batches={SQL: BatchStatement("BATCH", counted=False)})
    first, queued = await _queued_behind_a(h, ("b", 2), ("c", 3))
    others = [h.send("d", 4, OTHER_SQL)]
    await _settle()
    h.driver("a").release()
    h.driver("d").release()
    assert await first is True and await asyncio.gather(*queued, *others) == [True] * 3
    assert ("a", "execute", ["[[2], [3]]"]) in h.calls  # no member count: nothing fenced
