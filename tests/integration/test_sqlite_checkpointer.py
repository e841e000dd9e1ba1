"""WAL checkpoints on the engine's own thread (ledger/sqlite_checkpointer.py).

SQLite-only by nature: PostgreSQL checkpoints in its own server process. What could break: a
commit still running SQLite's auto-checkpoint on the event loop under NORMAL (and, under FULL,
SQLite's own checkpoints off with no thread to replace them); the thread not copying the log
into the database file (the log would grow without bound); a quiet store never checkpointed;
the thread outliving the store's connections; one failed checkpoint stopping the thread; a
writer that never pauses keeping SQLite from ever starting the log again.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from sqlalchemy import text

from ledger.sqlite_checkpointer import Checkpointer
from ledger.sqlite_inline import InlineConnection
from ledger.store import Store


@pytest.fixture
async def store_at(tmp_path: Path) -> AsyncIterator[tuple[Store, Path]]:
    path = tmp_path / "agent.db"
    store = await Store.open(f"sqlite+aiosqlite:///{path}", sqlite_synchronous="NORMAL")
    async with store.transaction() as work:
        await work.conn.execute(text("CREATE TABLE t (n INTEGER)"))
    try:
        yield store, path
    finally:
        await store.close()


async def _checkpointer(store: Store) -> Checkpointer:
    async with store.transaction() as work:
        driver = work.conn.sync_connection.connection.driver_connection  # type: ignore[union-attr]
        assert driver.checkpointer is not None
        assert driver._conn.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
        return driver.checkpointer  # type: ignore[no-any-return]


def _rows_in_database_file(path: Path) -> int:
    """Rows the database file itself holds, ignoring the log (what checkpoints copied)."""
    conn = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    try:
        return int(conn.execute("SELECT count(*) FROM t").fetchone()[0])
    except sqlite3.DatabaseError:
        # Not even the table was copied yet, or (immutable=1 takes no lock) a checkpoint was
        # copying pages while this read them: "malformed". The caller reads again.
        return 0
    finally:
        conn.close()


async def _until(condition: object, seconds: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_commits_leave_checkpoints_to_the_thread(store_at: tuple[Store, Path]) -> None:
    store, path = store_at
    checkpointer = await _checkpointer(store)  # commits never auto-checkpoint: the pragma is 0
    for n in range(250):
        async with store.transaction() as work:
            await work.conn.execute(text("INSERT INTO t VALUES (:n)"), {"n": n})
    # Every 100 writing commits the thread copies the log into the database file.
    await _until(lambda: checkpointer.checkpoints >= 2)
    # Read until the file shows them: a read taken while a checkpoint copies pages sees part of
    # its work (109 rows once, in CI's inline pass), and a PASSIVE checkpoint that met the
    # writer copies the rest at the next one.
    await _until(lambda: _rows_in_database_file(path) >= 150)
    assert checkpointer.failures == 0


async def test_a_quiet_store_is_checkpointed_within_the_idle_interval(
    store_at: tuple[Store, Path],
) -> None:
    store, path = store_at
    await _checkpointer(store)
    for n in range(5):
        async with store.transaction() as work:
            await work.conn.execute(text("INSERT INTO t VALUES (:n)"), {"n": n})
    await _until(lambda: _rows_in_database_file(path) == 5)


async def test_the_thread_stops_with_the_last_connection(tmp_path: Path) -> None:
    path = tmp_path / "agent.db"
    store = await Store.open(f"sqlite+aiosqlite:///{path}", sqlite_synchronous="NORMAL")
    checkpointer = await _checkpointer(store)
    thread = checkpointer.thread
    assert thread is not None and thread.is_alive()
    await store.close()
    thread.join(5)
    assert not thread.is_alive() and checkpointer.thread is None
    # The last connection closed: SQLite checkpointed and removed the log, as it always does.
    assert not await asyncio.to_thread(Path(f"{path}-wal").exists)


async def test_under_full_commits_keep_sqlites_own_checkpoints(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'agent.db'}")  # FULL
    try:
        async with store.transaction() as work:
            driver = work.conn.sync_connection.connection.driver_connection  # type: ignore[union-attr]
            assert driver.checkpointer is None
            assert driver._conn.execute("PRAGMA wal_autocheckpoint").fetchone() == (1000,)
    finally:
        await store.close()


async def test_a_failed_checkpoint_does_not_stop_the_thread(tmp_path: Path) -> None:
    checkpointer = Checkpointer(str(tmp_path / "no such dir" / "agent.db"), every_commits=1)
    checkpointer.attach()
    try:
        checkpointer.note_commit()
        await _until(lambda: checkpointer.failures == 1)
        checkpointer.note_commit()
        await _until(lambda: checkpointer.failures == 2)
        assert checkpointer.thread is not None and checkpointer.thread.is_alive()
        assert checkpointer.checkpoints == 0
    finally:
        thread = checkpointer.thread
        checkpointer.detach()
        assert thread is not None
        thread.join(5)


async def _commit_rows(
    writer: InlineConnection, first: int, count: int, meanwhile: Callable[[], None]
) -> None:
    """A write transaction of ``count`` rows; ``meanwhile`` runs while it is open."""
    await writer.begin_immediate()
    cursor = await writer.cursor()
    for n in range(first, first + count):
        await cursor.execute("INSERT INTO t VALUES (?, ?)", (n, "x" * 500))
    meanwhile()
    await writer.commit()


def _writer_on_a_fresh_file(path: Path) -> tuple[Checkpointer, sqlite3.Connection]:
    """A WAL file with table ``t``, and a checkpointer whose own thread never runs a
    checkpoint (the test runs them, in order); the caller wraps the connection."""
    setup = sqlite3.connect(path)
    setup.execute("PRAGMA journal_mode=WAL")
    setup.execute("CREATE TABLE t (n INTEGER, pad TEXT)")
    setup.close()
    raw = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    raw.execute("PRAGMA synchronous=NORMAL")
    return Checkpointer(str(path), every_commits=10**9, idle_seconds=3600), raw


@pytest.mark.parametrize("catch_up", [True, False], ids=["with-catch-up", "without"])
async def test_a_writer_that_never_pauses_still_starts_the_log_again(
    tmp_path: Path, catch_up: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLite writes the log from its beginning again only when a write transaction begins
    # with all of it copied. Here the thread's checkpoint (driven by the test, in order) always
    # copies all of it, but while the writer has a transaction open, whose commit then follows
    # it, as under a steady stream of sagas: without the writer's catch-up the log file grows by
    # every commit; with it, it stops growing once it holds a round.
    path = tmp_path / "agent.db"
    checkpointer, raw = _writer_on_a_fresh_file(path)
    if not catch_up:
        monkeypatch.setattr(checkpointer, "catch_up", lambda _conn: None)
    writer = InlineConnection(
        raw, busy_timeout_ms=1000, synchronous="NORMAL", checkpointer=checkpointer
    )
    thread_side = sqlite3.connect(path, isolation_level=None)
    log = Path(f"{path}-wal")
    sizes = []
    try:
        for round_ in range(30):
            # The thread's checkpoint copies every committed page while the writer's next
            # transaction is open; that transaction's commit then lands after it.
            await _commit_rows(
                writer, 50 * round_, 50, lambda: checkpointer.checkpoint(thread_side)
            )
            sizes.append(os.path.getsize(log))  # noqa: ASYNC240  (a stat, test only)
        total = int(thread_side.execute("SELECT count(*) FROM t").fetchone()[0])
    finally:
        thread_side.close()
        writer.stop()
    assert total == 1500 and checkpointer.failures == 0
    if catch_up:
        assert sizes[-1] < 2 * sizes[2], sizes  # the log starts again every round
    else:
        assert sizes[-1] > 5 * sizes[2], sizes  # what the catch-up is for


class _CheckpointRefused:
    """A sqlite3 connection whose ``PRAGMA wal_checkpoint`` fails (as when the file's
    directory vanished mid-run); everything else is the real connection's."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> object:
        return getattr(self._conn, name)

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if sql.startswith("PRAGMA wal_checkpoint"):
            raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)


async def test_a_failed_catch_up_does_not_fail_the_commit_before_it(tmp_path: Path) -> None:
    # The catch-up runs after a commit that is already durable: raising there would tell the
    # caller that a committed transaction failed.
    path = tmp_path / "agent.db"
    checkpointer, raw = _writer_on_a_fresh_file(path)
    writer = InlineConnection(
        raw, busy_timeout_ms=1000, synchronous="NORMAL", checkpointer=checkpointer
    )
    writer._conn = _CheckpointRefused(raw)  # type: ignore[assignment]
    thread_side = sqlite3.connect(path, isolation_level=None)
    try:
        await _commit_rows(writer, 0, 10, lambda: checkpointer.checkpoint(thread_side))
        assert checkpointer.failures == 1  # the catch-up was tried, and failed
        total = int(thread_side.execute("SELECT count(*) FROM t").fetchone()[0])
    finally:
        thread_side.close()
        writer.stop()
    assert total == 10
