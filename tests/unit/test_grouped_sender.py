"""The group sender's hand-offs (ledger/grouped.py), against a driver whose round trips the test
holds open: who sends what, and that no member is lost or left waiting in any outcome."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import asyncpg
import pytest

from ledger.errors import StoreUnavailable
from ledger.grouped import GroupSender

SQL = "WITH w0 AS (INSERT ...) SELECT c0"
OTHER_SQL = "WITH w0 AS (UPDATE ...) SELECT c0"


class HeldDriver:
    """Each call waits until the test releases it; ``fail`` makes the next call raise."""

    def __init__(self, calls: list[tuple[str, str, Any]], name: str) -> None:
        self.calls = calls
        self.name = name
        self.release = asyncio.Event()
        self.fail: BaseException | None = None

    async def execute(self, sql: str, *args: Any) -> str:
        self.calls.append((self.name, "execute", list(args)))
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return "SELECT 1"

    async def executemany(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        self.calls.append((self.name, "executemany", [list(a) for a in args]))
        await self.release.wait()
        if self.fail is not None:
            raise self.fail


class Harness:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.grouped: list[int] = []
        self.sender = GroupSender(self.grouped.append)
        self.drivers: dict[str, HeldDriver] = {}

    def driver(self, name: str) -> HeldDriver:
        return self.drivers.setdefault(name, HeldDriver(self.calls, name))

    def send(self, name: str, arg: int, sql: str = SQL) -> asyncio.Task[bool]:
        driver = cast(asyncpg.Connection, self.driver(name))
        return asyncio.create_task(self.sender.send(driver, sql, [arg]))


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_an_idle_shape_is_sent_at_once_alone() -> None:
    h = Harness()
    task = h.send("a", 1)
    await _settle()
    assert h.calls == [("a", "execute", [1])]
    h.driver("a").release.set()
    assert await task is True
    assert h.grouped == []


async def test_those_arriving_during_a_send_go_next_as_one_executemany_in_order() -> None:
    h = Harness()
    first = h.send("a", 1)
    await _settle()
    queued = [h.send(name, n) for name, n in (("b", 2), ("c", 3), ("d", 4))]
    await _settle()
    assert len(h.calls) == 1  # they wait for the send in flight
    h.driver("a").release.set()
    await _settle()
    # The first of them sends the batch, on its own connection.
    assert h.calls[1] == ("b", "executemany", [[2], [3], [4]])
    assert await first is True
    h.driver("b").release.set()
    assert await asyncio.gather(*queued) == [True, True, True]
    assert h.grouped == [2]  # two transactions' commits rode on b's


async def test_a_refused_batch_sends_every_member_back_to_send_alone() -> None:
    h = Harness()
    first = h.send("a", 1)
    await _settle()
    queued = [h.send("b", 2), h.send("c", 3)]
    await _settle()
    h.driver("b").fail = asyncpg.exceptions.UniqueViolationError("duplicate key")
    h.driver("a").release.set()
    h.driver("b").release.set()
    assert await first is True
    assert await asyncio.gather(*queued) == [False, False]  # nothing committed: resend alone
    assert h.grouped == []


async def test_a_statement_refused_alone_raises_its_own_error() -> None:
    h = Harness()
    h.driver("a").fail = asyncpg.exceptions.UniqueViolationError("duplicate key")
    h.driver("a").release.set()
    with pytest.raises(asyncpg.exceptions.UniqueViolationError):
        await h.send("a", 1)


async def test_a_batch_lost_in_flight_fails_every_member_as_unavailable() -> None:
    h = Harness()
    first = h.send("a", 1)
    await _settle()
    queued = [h.send("b", 2), h.send("c", 3)]
    await _settle()
    h.driver("b").fail = ConnectionResetError("server closed the connection")
    h.driver("a").release.set()
    h.driver("b").release.set()
    assert await first is True
    leader, member = await asyncio.gather(*queued, return_exceptions=True)
    assert isinstance(leader, ConnectionResetError)  # the sender's own error, for its pool
    assert isinstance(member, StoreUnavailable)  # the outcome is unknown
    later = h.send("d", 4)  # the shape is free again
    h.driver("d").release.set()
    assert await later is True


async def test_a_member_cancelled_while_queued_is_not_sent() -> None:
    h = Harness()
    first = h.send("a", 1)
    await _settle()
    gone, kept = h.send("b", 2), h.send("c", 3)
    await _settle()
    gone.cancel()
    await _settle()
    h.driver("a").release.set()
    h.driver("c").release.set()
    assert await first is True and await kept is True
    assert h.calls[1] == ("c", "execute", [3])  # b left: c is alone
    assert gone.cancelled()


async def test_a_member_cancelled_as_it_is_handed_the_batch_passes_it_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness()
    first = h.send("a", 1)
    await _settle()
    handed, rest = h.send("b", 2), [h.send("c", 3), h.send("d", 4)]
    await _settle()
    hand_off = GroupSender._hand_off
    cancelled: list[bool] = []

    def hand_off_then_cancel(shape: Any) -> None:
        hand_off(shape)  # a hands the batch to b ...
        if not cancelled:
            cancelled.append(handed.cancel())  # ... whose task is cancelled before it runs

    monkeypatch.setattr(GroupSender, "_hand_off", staticmethod(hand_off_then_cancel))
    h.driver("a").release.set()
    assert await first is True
    await _settle()
    assert cancelled == [True] and handed.cancelled()
    assert h.calls[1] == ("c", "executemany", [[3], [4]])  # c took the batch over
    h.driver("c").release.set()
    assert await asyncio.gather(*rest) == [True, True]


async def test_different_shapes_do_not_wait_for_each_other() -> None:
    h = Harness()
    first = h.send("a", 1)
    other = h.send("b", 2, sql=OTHER_SQL)
    await _settle()
    assert [c[:2] for c in h.calls] == [("a", "execute"), ("b", "execute")]
    h.driver("a").release.set()
    h.driver("b").release.set()
    assert await first is True and await other is True
