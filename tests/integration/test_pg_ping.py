"""The PostgreSQL pre-ping and its bypass window (ledger/dialects.py: _ping_in_one_round_trip).

PostgreSQL only: SQLite has no server to lose. What could break: a connection whose backend
was killed while it sat in the pool being handed out after the window without a ping (the
transaction would fail instead of being rerouted); a connection used a moment ago being pinged
anyway (the round trip the window exists to save); and, inside the window, a dead connection
failing anything but the one transaction that met it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text

from ledger import dialects
from ledger.errors import StoreUnavailable
from ledger.store import Store
from tests.conftest import DbUrls, _pg_execute
from tests.support.postgres_only import postgres_backend  # noqa: F401  (the fixture)


@pytest.fixture
async def store(db_urls: DbUrls) -> AsyncIterator[Store]:
    store = await Store.open(db_urls.store)
    try:
        yield store
    finally:
        await store.close()


async def _backend_pid(store: Store) -> int:
    async with store.transaction() as work:
        return int((await work.conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())


def _count_pings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the pings that reach the server."""
    count = [0]
    ping = dialects._bare_ping

    def counting(dbapi_connection: object) -> None:
        count[0] += 1
        ping(dbapi_connection)

    monkeypatch.setattr(dialects, "_bare_ping", counting)
    return count


async def test_a_connection_used_a_moment_ago_is_not_pinged_but_an_idle_one_is(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    pings = _count_pings(monkeypatch)
    await _backend_pid(store)
    first = pings[0]  # the pool's first connection may or may not be pinged; not the point
    # A window no slow machine can overrun: the mechanism is under test, not the clock.
    monkeypatch.setattr(dialects, "PING_BYPASS_SECONDS", 3600.0)
    for _ in range(5):
        await _backend_pid(store)  # back to back: each checkout finds a fresh stamp
    assert pings[0] == first
    monkeypatch.setattr(dialects, "PING_BYPASS_SECONDS", 0.0)  # as if it sat idle
    await _backend_pid(store)
    assert pings[0] == first + 1


@pytest.mark.parametrize(
    ("window", "first_fails"),
    [
        (0.0, False),  # after the window the ping finds the dead connection; the pool reconnects
        (3600.0, True),  # inside it, the one transaction that meets it fails, the next is fine
    ],
    ids=["after-the-window-rerouted", "inside-the-window-one-fails"],
)
async def test_a_killed_backend(
    store: Store, monkeypatch: pytest.MonkeyPatch, window: float, first_fails: bool
) -> None:
    monkeypatch.setattr(dialects, "PING_BYPASS_SECONDS", window)
    pid = await _backend_pid(store)
    await _pg_execute(f"SELECT pg_terminate_backend({pid})")
    if first_fails:
        with pytest.raises(StoreUnavailable):
            await _backend_pid(store)
    assert await _backend_pid(store) != pid


async def test_a_connection_the_store_kept_idle_past_the_window_is_pinged(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store keeps the connection it committed on (Store._take_idle). Handed back to the pool
    # after sitting idle past the window, it must be pinged at its next checkout: the check-in
    # happens just now, so the pool would take it for fresh unless told when it was last used.
    monkeypatch.setattr(dialects, "PING_BYPASS_SECONDS", 1.0)
    pings = _count_pings(monkeypatch)
    await _backend_pid(store)
    await _backend_pid(store)  # kept: reused within the window, no checkout, no ping
    before = pings[0]
    await asyncio.sleep(1.2)
    await _backend_pid(store)
    assert pings[0] == before + 1


async def test_a_lost_connection_sends_every_kept_one_back_to_the_pool(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # If the server went away, so did every connection the store kept idle (Store._transaction):
    # they go back to the pool, which pings or replaces them, instead of failing one saga each.
    monkeypatch.setattr(dialects, "PING_BYPASS_SECONDS", 3600.0)
    kept_in_order: list[int] = []
    both_in = asyncio.Barrier(2)

    async def one() -> None:
        async with store.transaction() as work:
            pid = int((await work.conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())
            await both_in.wait()  # two connections held at once, so the store keeps two
        kept_in_order.append(pid)

    await asyncio.gather(one(), one())
    assert len(set(kept_in_order)) == 2
    pool = store.engine.sync_engine.pool
    assert pool.checkedout() == 2  # type: ignore[attr-defined]  # both kept by the store
    await _pg_execute(f"SELECT pg_terminate_backend({kept_in_order[-1]})")  # the one taken next
    with pytest.raises(StoreUnavailable):
        await _backend_pid(store)
    assert pool.checkedout() == 0  # type: ignore[attr-defined]  # the live one went back too
    assert await _backend_pid(store) != kept_in_order[-1]  # and the store goes on
