"""The SQLite connection that runs statements on the event loop (ledger/sqlite_inline.py).

SQLite-only by nature: PostgreSQL's asyncpg driver has no thread to hop to. What could break:
a writer waiting on another process's lock must not stop the loop; the busy timeout must still
bound that wait; the zero timeout of a write transaction's BEGIN must not leak into reads or
anything outside a write transaction (and is set once for a run of writes); and the hops
to the driver thread per transaction are a deterministic cost (none for a read, none for a
write under synchronous=NORMAL; under FULL one — the fsync of the commit — when other work is
ready to run on the loop meanwhile, none when nothing else is).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import text

from ledger import dialects, sqlite_inline
from ledger.errors import StoreBusy
from ledger.store import Store


@pytest.fixture
async def store_at(tmp_path: Path) -> AsyncIterator[tuple[Store, Path]]:
    path = tmp_path / "agent.db"
    store = await Store.open(f"sqlite+aiosqlite:///{path}")
    try:
        yield store, path
    finally:
        await store.close()


def _hold_write_lock(path: Path, seconds: float, held: threading.Event) -> threading.Thread:
    """Another process's writer, as far as SQLite can tell: its own connection, lock held."""

    def hold() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        held.set()
        threading.Event().wait(seconds)
        conn.execute("ROLLBACK")
        conn.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    return thread


async def _ticks_while(awaitable: asyncio.Future[object] | asyncio.Task[object]) -> int:
    ticks = 0
    while not awaitable.done():
        await asyncio.sleep(0.01)
        ticks += 1
    return ticks


async def test_a_writer_waiting_on_another_connections_lock_leaves_the_loop_running(
    store_at: tuple[Store, Path],
) -> None:
    store, path = store_at
    held = threading.Event()
    # 2 s, not less: the count below needs the write to wait for a good part of the hold, and
    # on a loaded machine the hold may be mostly over before the write even starts.
    holder = _hold_write_lock(path, 2.0, held)
    await asyncio.to_thread(held.wait, 5)

    async def write() -> object:
        async with store.transaction() as work:
            await work.conn.execute(text("CREATE TABLE IF NOT EXISTS t (x INTEGER)"))
            await work.conn.execute(text("INSERT INTO t VALUES (1)"))
        return None

    task = asyncio.ensure_future(write())
    ticks = await _ticks_while(task)
    await task
    holder.join()
    # The wait was up to 2 s; a loop blocked by it would have ticked about once.
    assert ticks >= 10
    async with store.read() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar_one() == 1


async def test_the_busy_timeout_still_bounds_the_wait(tmp_path: Path) -> None:
    path = tmp_path / "agent.db"
    from ledger import dialects

    engine = dialects.create_engine(f"sqlite+aiosqlite:///{path}", sqlite_busy_timeout_ms=200)
    store = Store(engine, url=f"sqlite+aiosqlite:///{path}")
    try:
        async with store.transaction() as work:  # the schema-less file exists and is WAL
            await work.conn.execute(text("CREATE TABLE t (x INTEGER)"))
        held = threading.Event()
        holder = _hold_write_lock(path, 2.0, held)
        await asyncio.to_thread(held.wait, 5)
        with pytest.raises(StoreBusy):
            async with store.transaction() as work:
                await work.conn.execute(text("INSERT INTO t VALUES (1)"))
        holder.join()
        # The zero timeout of the first, on-loop try was put back for what follows.
        async with store.read() as conn:
            assert (await conn.execute(text("PRAGMA busy_timeout"))).scalar_one() == 200
    finally:
        await store.close()


@pytest.mark.parametrize("then", ["BEGIN DEFERRED", "SELECT 1"])
async def test_a_writing_connection_sets_the_zero_timeout_once_and_gives_it_back(
    tmp_path: Path, then: str
) -> None:
    conn = await sqlite_inline.connector(
        str(tmp_path / "agent.db"), busy_timeout_ms=200, synchronous="NORMAL"
    )()
    traced: list[str] = []
    conn._conn.set_trace_callback(traced.append)
    try:
        for n in range(3):
            await conn.execute("BEGIN IMMEDIATE")
            await conn.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
            await conn.execute("INSERT INTO t VALUES (?)", (n,))
            await conn.execute("COMMIT")
        # Three write transactions, one pragma: nothing inside them waits for a lock.
        assert [t for t in traced if t.startswith("PRAGMA")] == ["PRAGMA busy_timeout=0"]
        # Anything else on the connection waits for locks again, as configured.
        await conn.execute(then)
        assert [t for t in traced if t.startswith("PRAGMA")][-1] == "PRAGMA busy_timeout=200"
        cursor = await conn.execute("PRAGMA busy_timeout")
        assert await cursor.fetchone() == (200,)
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("synchronous", "others_ready", "write_hops"),
    [("FULL", True, 1), ("FULL", False, 0), ("NORMAL", True, 0), ("NORMAL", False, 0)],
    ids=["FULL-busy-loop", "FULL-idle-loop", "NORMAL-busy-loop", "NORMAL-idle-loop"],
)
async def test_hops_to_the_driver_thread_per_transaction(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    synchronous: str,
    others_ready: bool,
    write_hops: int,
) -> None:
    # Under FULL the commit's fsync leaves the loop only when other work is ready to run on
    # it meanwhile; alone, the hop would cost CPU and save nothing.
    url = f"sqlite+aiosqlite:///{tmp_path / 'agent.db'}"
    store = await Store.open(url, sqlite_synchronous=synchronous)
    hops = 0
    original = sqlite_inline.InlineConnection._off_loop

    async def counting(self: sqlite_inline.InlineConnection, *args: object) -> object:
        nonlocal hops
        hops += 1
        return await original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(sqlite_inline.InlineConnection, "_off_loop", counting)
    loop = asyncio.get_running_loop()
    ticking = others_ready

    def other_work() -> None:  # always ready to run again while ticking: the loop is never idle
        if ticking:
            loop.call_soon(other_work)

    other_work()
    try:
        async with store.transaction() as work:
            await work.conn.execute(text("CREATE TABLE t (x INTEGER)"))
        hops = 0
        async with store.transaction() as work:
            for i in range(5):
                await work.conn.execute(text("INSERT INTO t VALUES (:x)"), {"x": i})
        assert hops == write_hops
        hops = 0
        async with store.read() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar_one() == 5
        assert hops == 0
    finally:
        ticking = False
        await store.close()


async def test_a_rolled_back_write_leaves_nothing(store_at: tuple[Store, Path]) -> None:
    store, _ = store_at
    async with store.transaction() as work:
        await work.conn.execute(text("CREATE TABLE t (x INTEGER)"))
    with pytest.raises(RuntimeError):
        async with store.transaction() as work:
            await work.conn.execute(text("INSERT INTO t VALUES (1)"))
            raise RuntimeError("the caller failed mid-transaction")
    async with store.read() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar_one() == 0


async def test_savepoint_and_statement_journals_stay_in_memory(
    store_at: tuple[Store, Path],
) -> None:
    # A commit group's members each write inside a SAVEPOINT; past 64 KiB SQLite spilled its
    # journal to a temporary file on disk (docs/benchmarks-log.md item 41). 2 = MEMORY.
    store, _ = store_at
    async with store.transaction() as work:
        assert (await work.conn.execute(text("PRAGMA temp_store"))).scalar_one() == 2
    async with store.read() as conn:
        assert (await conn.execute(text("PRAGMA temp_store"))).scalar_one() == 2


async def test_a_relative_url_names_one_file_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool opens connections when they are needed, maybe after the process changed its
    working directory: a relative URL is resolved when the engine is made."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    engine = dialects.create_engine("sqlite+aiosqlite:///agent.db", sqlite_synchronous="NORMAL")
    monkeypatch.chdir(tmp_path / "elsewhere")
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(text("PRAGMA database_list"))).all()
    finally:
        await engine.dispose()
    assert rows[0][2] == str(tmp_path / "agent.db")
    assert not (tmp_path / "elsewhere" / "agent.db").exists()
