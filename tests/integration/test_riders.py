"""The delivered outbox record rides on a later transaction (ledger/riders.py), on both backends:
it lands by itself a loop turn later, before any read, on whatever transaction comes next; a
host that fails hands it on; a record whose lease another holder took changes nothing and
fails no host."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import select

from ledger.errors import StoreUnavailable
from ledger.riders import Rider
from ledger.schema import outbox
from ledger.states import EffectState, TxState
from ledger.store import Store, Work
from orchestrator.engine import Orchestrator
from tests.support.sagas import order, order_saga
from tests.support.world import World


async def _event(store: Store, tx_id: str) -> tuple[str, int]:
    """The outbox event's (state, fence), read past the store's read() (which would land the
    riders first)."""
    async with store.engine.connect() as conn:
        row = (
            await conn.execute(
                select(outbox.c.state, outbox.c.fence).where(outbox.c.tx_id == tx_id)
            )
        ).one()
    return row.state, row.fence


async def _held_record(world: World, monkeypatch: pytest.MonkeyPatch, tx: str) -> tuple[str, Rider]:
    """Run a saga whose delivered record is held back instead of queued: (tx_id, its rider)."""
    held: list[Rider] = []
    monkeypatch.setattr(world.orch.store, "ride", held.append)
    result = await world.orch.execute(order_saga(), order(tx))
    monkeypatch.undo()
    assert result.status is TxState.COMMITTED
    assert len(held) == 1
    return result.tx_id, held[0]


async def _confirmations(orch: Orchestrator, tx_id: str, key: str) -> list[int]:
    """The fences of the ledger's ``executing → confirmed`` rows for ``key``."""
    return [
        e.detail["fence"]
        for e in await orch.ledger(tx_id)
        if e.subject == key and e.to_state == EffectState.CONFIRMED.value
    ]


async def test_the_record_lands_by_itself_a_loop_turn_later(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("1"))
    assert result.status is TxState.COMMITTED
    # Queued, not written: nothing in this task has yielded since the provider answered.
    assert world.orch.store.riders.queued
    # Up to 30 s: the store's own commit, under a loaded CI machine, is not this test's subject.
    for _ in range(3000):
        if not world.orch.store.riders.waiting:
            break
        await asyncio.sleep(0.01)
    assert await _event(world.orch.store, result.tx_id) == ("confirmed", 1)
    assert await world.orch.verify_ledger(result.tx_id) == []


async def test_a_read_lands_the_record_before_it_reads(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("2"))
    assert world.orch.store.riders.queued
    view = await world.orch.get(result.tx_id)
    assert [e.state for e in view.outbox] == [EffectState.CONFIRMED]
    assert not world.orch.store.riders.waiting


async def test_the_next_saga_carries_the_record(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, rider = await _held_record(world, monkeypatch, "3")
    world.orch.store.ride(rider)
    before = world.orch.store.stats.snapshot()
    second = await world.orch.execute(order_saga(), order("4"))
    assert second.status is TxState.COMMITTED
    # Carried by the second saga's first commit: three commits for the second saga, and the
    # first one's event confirmed under its own fence.
    assert world.orch.store.stats.commits - before.commits == 3
    assert await _event(world.orch.store, first) == ("confirmed", 1)
    assert await world.orch.verify_ledger(first) == []


async def test_a_record_whose_event_was_taken_over_changes_nothing_and_fails_no_host(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    tx_id, rider = await _held_record(world, monkeypatch, "5")
    # Our "process" stalls; the lease runs out and another worker takes the event over: it
    # claims it (fence 2), looks it up and records it.
    other = await world.engine()
    other.store.advance_clock(31)
    await other.drain(timeout_seconds=10)
    assert await _event(world.orch.store, tx_id) == ("confirmed", 2)
    key = (await world.orch.get(tx_id)).outbox[0].key
    assert await _confirmations(world.orch, tx_id, key) == [2]
    # Our record finally rides, on another saga's first commit: that saga is not failed by it,
    # and it writes neither the row nor its ledger link.
    world.orch.store.ride(rider)
    later = await world.orch.execute(order_saga(), order("6"))
    assert later.status is TxState.COMMITTED
    assert await _event(world.orch.store, tx_id) == ("confirmed", 2)
    assert await _confirmations(world.orch, tx_id, key) == [2]
    assert await world.orch.verify_ledger(tx_id) == []
    assert (await world.shop.counts())["email.send"] == 2  # one per saga: the takeover looked up


class _FailsOnce:
    """A rider whose first write fails as a store that went away would."""

    def __init__(self) -> None:
        self.writes = 0
        self.landings = 0

    async def write(self, work: Work) -> None:
        self.writes += 1
        if self.writes == 1:
            raise StoreUnavailable("gone for a moment")

    def landed(self) -> None:
        self.landings += 1


async def test_a_host_that_fails_hands_its_riders_on(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    tx_id, rider = await _held_record(world, monkeypatch, "7")
    flaky = _FailsOnce()
    store = world.orch.store
    store.ride(flaky)
    store.ride(rider)
    with pytest.raises(StoreUnavailable):
        async with store.transaction():
            pass  # the host: it boards both riders as it ends, and the first one fails it
    # Both went back to the queue; nothing of the failed host was committed.
    assert store.riders.queued
    assert await _event(store, tx_id) == ("executing", 1)
    await store.riders.settle()
    assert (flaky.writes, flaky.landings) == (2, 1)
    assert await _event(store, tx_id) == ("confirmed", 1)
    assert await _confirmations(world.orch, tx_id, (await world.orch.get(tx_id)).outbox[0].key) == [
        1
    ]
    assert await world.orch.verify_ledger(tx_id) == []


async def test_an_abandoned_store_drops_its_riders(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    tx_id, rider = await _held_record(world, monkeypatch, "8")
    world.orch.store.ride(rider)
    await world.orch.abandon()  # a crash: nothing more is written, the record included
    other = await world.engine()
    assert await _event(other.store, tx_id) == ("executing", 1)
    # Recovery settles it by lookup, and the provider was asked once.
    other.store.advance_clock(31)
    await other.drain(timeout_seconds=10)
    assert await _event(other.store, tx_id) == ("confirmed", 2)
    assert (await world.shop.counts())["email.send"] == 1


async def test_riding_pays_on_sqlite_always_and_on_postgresql_only_alone(world: World) -> None:
    store = world.orch.store
    assert store.riding_pays()
    inside = asyncio.Event()
    leave = asyncio.Event()

    async def hold_a_transaction() -> None:
        async with store.transaction():
            inside.set()
            await leave.wait()

    holder = asyncio.create_task(hold_a_transaction())
    await inside.wait()
    try:
        # With another write open, a PostgreSQL record commits in its own transaction, which
        # is batched with the others' (ledger/grouped.py); SQLite's joins a commit group anyway.
        assert store.riding_pays() is (world.urls.backend == "sqlite")
    finally:
        leave.set()
        await holder


def test_a_lone_cancelled_callback_is_not_other_work() -> None:
    from ledger.sqlite_inline import others_ready

    async def main() -> tuple[bool, bool, bool]:
        loop = asyncio.get_running_loop()
        alone = others_ready()
        handle = loop.call_soon(lambda: None)
        pending = others_ready()
        handle.cancel()
        return alone, pending, others_ready()

    assert asyncio.run(main()) == (False, True, False)


def test_the_ready_queue_may_grow_while_it_is_looked_at() -> None:
    """Other threads append to the loop's ready queue at any moment (call_soon_threadsafe).
    Looking at it must not fail when that happens mid-look: it once raised "deque mutated
    during iteration" inside a commit (the concurrency suite on SQLite, under load in CI)."""
    from ledger.sqlite_inline import others_ready

    class AppendsWhileLookedAt:
        """A cancelled callback whose look adds one more, as another thread could then."""

        def __init__(self, ready: Any) -> None:
            self.ready = ready

        def cancelled(self) -> bool:
            if len(self.ready) < 3:
                self.ready.append(AppendsWhileLookedAt(self.ready))
            return True

    async def main() -> bool:
        ready = asyncio.get_running_loop()._ready  # type: ignore[attr-defined]
        ready.append(AppendsWhileLookedAt(ready))
        try:
            return others_ready()
        finally:
            # Never run: they stand in for callbacks, they are not ones.
            for fake in [h for h in ready if isinstance(h, AppendsWhileLookedAt)]:
                ready.remove(fake)

    assert asyncio.run(main()) is False  # all it saw were cancelled


def test_cancelled_callbacks_are_not_other_work_however_many_until_they_pile_up() -> None:
    """A sequential caller whose sagas never let the loop turn leaves one cancelled riders'
    flush per saga in the ready queue: a few are not other work (it commits at once), a pile
    is taken as some (once: the long way's loop turn clears it), so the check stays cheap."""
    from ledger.sqlite_inline import _READY_SCANNED, others_ready

    async def main() -> list[bool]:
        loop = asyncio.get_running_loop()
        seen = []
        for count in (2, _READY_SCANNED, _READY_SCANNED + 1):
            handles = [loop.call_soon(lambda: None) for _ in range(count)]
            for h in handles:
                h.cancel()
            seen.append(others_ready())
            live = loop.call_soon(lambda: None)  # behind the cancelled ones
            seen.append(others_ready())
            live.cancel()
            await asyncio.sleep(0)  # the loop turns: the queue is empty again
        return seen

    assert asyncio.run(main()) == [False, True, False, True, True, True]
