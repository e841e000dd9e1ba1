"""An aiosqlite-shaped connection over stdlib :mod:`sqlite3` that runs statements on the loop.

Why: aiosqlite runs every call on a driver thread, and SQLAlchemy's async layer makes about four
such calls per statement (cursor, execute, fetch, close). Each hop between the event loop and that
thread costs ≈ 115 to 140 µs of latency here (DESIGN "Commit economy") and GIL hand-offs on both
sides; a saga of 13 statements and 4 commits paid about 60 of them, more than the SQL itself. A
statement on a local SQLite file whose write lock is already held is a few microseconds of C, so
it runs on the event loop thread.

What still goes to a thread, because it can *wait*:

* ``BEGIN IMMEDIATE`` when another process holds SQLite's single write lock: it waits up to
  ``busy_timeout``, and the loop must not stop meanwhile. It is first tried on the loop with a
  zero timeout; writers of this process already queue on the store's own lock, so it is free
  unless another process writes;
* ``COMMIT`` under ``synchronous=FULL``/``EXTRA`` while the loop has other callbacks ready
  to run: the fsync-class wait then overlaps their work. With
  nothing else ready — a saga run alone, a quiet moment — the commit runs on the loop: the
  thread would hand the same wait back at about 0.2 ms of client CPU per hop, three quarters
  of a sequential saga's overhead under FULL (``docs/benchmarks-log.md``). The cost of that choice
  is that I/O arriving during the fsync waits for it. Under ``NORMAL``/``OFF`` a WAL commit
  appends without an fsync and stays on the loop, and no commit runs a WAL checkpoint
  (SQLite's auto-checkpoint, every ~1 000 log pages, is off): a thread of the engine's does
  (:mod:`ledger.sqlite_checkpointer`). Under ``FULL`` the auto-checkpoint stays in the commit.

A reader (``BEGIN DEFERRED`` that changed nothing) stays on the loop throughout: in WAL its BEGIN
takes no lock and its COMMIT writes nothing.

Everything between them runs inline. That is the departure from DESIGN's "aiosqlite" engine: the
dialect is still SQLAlchemy's ``sqlite+aiosqlite`` (its SQL, types and error classes are
untouched); only the connection it drives is this one, plugged in through
``create_async_engine(async_creator=...)``. The hops per write transaction go from ≈ 15 to
none (under FULL with other work ready: one, the commit).

One connection is only ever used by one coroutine at a time (SQLAlchemy's pool checks it out), so
using the :class:`sqlite3.Connection` from the loop and from the worker thread in turn is safe
(``check_same_thread=False``; sqlite3 is built serialized).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog

from ledger.sqlite_checkpointer import Checkpointer, for_synchronous

T = TypeVar("T")
log = structlog.get_logger(__name__)

#: SQLite's primary result code for "the lock is held by another connection".
SQLITE_BUSY = 5


class _InlineQueue:
    """Stands in for aiosqlite's request queue: SQLAlchemy's ``isolation_level`` setter posts a
    ``(future, function)`` pair to ``connection._tx``; here the function runs at once."""

    def put_nowait(self, item: tuple[asyncio.Future[Any] | None, Callable[[], Any]]) -> None:
        future, function = item
        try:
            result = function()
        except BaseException as exc:  # handed to the waiting coroutine, as aiosqlite does
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        if future is not None and not future.done():
            future.set_result(result)


class InlineCursor:
    """The cursor surface SQLAlchemy's aiosqlite adapter uses, over a :class:`sqlite3.Cursor`."""

    def __init__(self, connection: InlineConnection) -> None:
        self._connection = connection
        self._cursor = connection._conn.cursor()

    @property
    def description(self) -> Any:
        return self._cursor.description

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def lastrowid(self) -> int | None:
        return self._cursor.lastrowid

    async def execute(self, sql: str, parameters: Sequence[Any] | None = None) -> InlineCursor:
        args = () if parameters is None else parameters
        connection = self._connection
        head = sql.lstrip()[:16].upper()
        if head.startswith("BEGIN"):
            connection._begun(head)
            if connection._reader:
                connection._wait_for_locks()
                self._cursor.execute(sql, args)  # DEFERRED takes no lock: nothing to wait for
            else:
                await connection._begin_write(self._cursor, sql, args)
        elif head.startswith(("COMMIT", "END")):
            await connection._commit_with(self._cursor.execute, sql, args)
        else:
            if not connection._holds_write_lock():
                connection._wait_for_locks()
            self._cursor.execute(sql, args)
        return self

    async def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> InlineCursor:
        self._cursor.executemany(sql, seq)
        return self

    async def fetchone(self) -> Any:
        return self._cursor.fetchone()

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        return self._cursor.fetchmany(size if size is not None else self._cursor.arraysize)

    async def fetchall(self) -> list[Any]:
        return self._cursor.fetchall()

    async def close(self) -> None:
        self._cursor.close()


class InlineConnection:
    """The connection surface SQLAlchemy's aiosqlite adapter uses (see the module doc)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        busy_timeout_ms: int,
        synchronous: str,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        self._conn = conn
        #: Runs the WAL checkpoints this connection's commits no longer run themselves.
        self.checkpointer = checkpointer
        if checkpointer is not None:
            checkpointer.take_over(conn)
        self._busy_timeout_ms = int(busy_timeout_ms)
        # In WAL mode only FULL and EXTRA fsync at every commit.
        self._syncs_on_commit = synchronous.upper() in {"FULL", "EXTRA"}
        self._tx = _InlineQueue()
        # A DEFERRED transaction that changed nothing is a reader: its BEGIN takes no lock and
        # its COMMIT writes nothing, so neither leaves the loop.
        self._reader = False
        self._changes_at_begin = 0
        # Whether SQLite's busy timeout is the configured one (set at connect) or zero (set for
        # a write transaction's BEGIN and kept while this connection only writes).
        self._waits_for_locks = True
        # One thread per connection: the waits of one connection never queue behind another's.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-txn-sqlite")
        #: The cursor the hot path's statements run on (:mod:`ledger.hot`), one for the
        #: connection's life. Why: ``sqlite3.Connection.execute`` makes a cursor per call, and
        #: the connection registers a weak reference to each (and sweeps the dead ones every
        #: 200); about twenty statements a saga paid that for a row count. Those statements
        #: are writes and savepoints, run one at a time on the loop and finished when
        #: ``execute`` returns (SQLite has reset them), so reusing the cursor holds nothing
        #: open.
        self.statements = conn.cursor()

    def _begun(self, head: str) -> None:
        self._reader = head.startswith("BEGIN DEFERRED") or head.rstrip() == "BEGIN"
        self._changes_at_begin = self._conn.total_changes

    async def _off_loop(self, function: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, lambda: function(*args))

    @property
    def isolation_level(self) -> str | None:
        return self._conn.isolation_level

    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction

    async def cursor(self) -> InlineCursor:
        return InlineCursor(self)

    async def execute(self, sql: str, parameters: Sequence[Any] | None = None) -> InlineCursor:
        return await (await self.cursor()).execute(sql, parameters)

    async def create_function(self, *args: Any, **kwargs: Any) -> None:
        self._conn.create_function(*args, **kwargs)

    async def commit(self) -> None:
        if not self._conn.in_transaction:
            return
        await self._commit_with(self._conn.commit)

    async def begin_immediate(self) -> None:
        """``BEGIN IMMEDIATE`` as :meth:`InlineCursor.execute` runs it, for a caller that holds
        this connection and writes its own ``BEGIN`` (the store's writer)."""
        self._begun("BEGIN IMMEDIATE")
        await self._begin_write(self._conn, "BEGIN IMMEDIATE", ())

    def _holds_write_lock(self) -> bool:
        return self._conn.in_transaction and not self._reader

    def _wait_for_locks(self) -> None:
        """Give the connection its busy timeout back before a statement that may have to wait
        for a lock (a read, or anything outside a write transaction)."""
        if not self._waits_for_locks:
            self._conn.execute(f"PRAGMA busy_timeout={self._busy_timeout_ms}")
            self._waits_for_locks = True

    async def _begin_write(
        self, cursor: sqlite3.Cursor | sqlite3.Connection, sql: str, args: Sequence[Any]
    ) -> None:
        """``BEGIN IMMEDIATE`` on the loop when the write lock is free — the usual case, since
        this process's writers already queue on the store's lock — else wait for it off the
        loop, with the connection's busy timeout.

        The zero timeout stays set after a BEGIN that got the lock: inside a write transaction
        nothing waits (in WAL a commit never waits for readers, and an auto-checkpoint is
        passive), so a connection that only writes — the store's writer — sets it once, not
        twice per transaction; :meth:`_wait_for_locks` restores it before anything else."""
        if self._waits_for_locks:
            self._conn.execute("PRAGMA busy_timeout=0")
            self._waits_for_locks = False
        try:
            cursor.execute(sql, args)
            return
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF != SQLITE_BUSY:
                raise
        self._wait_for_locks()
        await self._off_loop(cursor.execute, sql, args)

    async def _commit_with(self, commit: Callable[..., Any], *args: Any) -> None:
        if self._reader and self._conn.total_changes == self._changes_at_begin:
            commit(*args)  # ends a read: releases the snapshot, touches no disk
            return
        await self._write_commit(commit, *args)
        if self.checkpointer is not None:
            self.checkpointer.after_commit(self._conn)

    async def _write_commit(self, commit: Callable[..., Any], *args: Any) -> None:
        if self._syncs_on_commit and others_ready():
            await self._off_loop(commit, *args)  # the fsync-class wait, while the others run
        elif self._syncs_on_commit:
            # Nothing else is ready to run: a thread would only hand the same wait back, at
            # ≈ 0.2 ms of client CPU per hop (three quarters of a sequential saga's overhead
            # under FULL), so the fsync runs here.
            commit(*args)
        else:
            commit(*args)  # WAL + synchronous=NORMAL/OFF: a commit appends to the WAL, no fsync

    async def rollback(self) -> None:
        # Undoing in-memory pages and dropping the lock never waits.
        self._conn.rollback()

    async def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        """Close now (SQLAlchemy's terminate path; also what :meth:`close` does)."""
        self._conn.close()
        self._thread.shutdown(wait=False)
        checkpointer, self.checkpointer = self.checkpointer, None
        if checkpointer is not None:
            checkpointer.detach()


#: At most this many ready callbacks are looked at by :func:`others_ready`.
_READY_SCANNED = 64


def others_ready() -> bool:
    """Whether the event loop has other callbacks ready to run now (a loop that does not say,
    such as uvloop, is taken to have some). Cancelled callbacks do not count: they will not
    run. A sequential saga leaves one or two behind at the end of a transaction (the riders'
    flush, :mod:`ledger.riders`, that the transaction just made unnecessary, among them), and
    counting them sent its commits the long way: a loop turn in-process, a round trip to the
    SQLite writer process (:mod:`ledger.sqlite_writer`)."""
    ready = getattr(asyncio.get_running_loop(), "_ready", None)
    if ready is None or len(ready) > _READY_SCANNED:
        # Many: there are others, or cancelled ones piled up behind a caller that has not let
        # the loop turn for a while (each saga of a sequential caller that never waits leaves
        # one). Either way the long way is taken once, and its loop turn clears the pile.
        return True
    # A copy first: other threads append to this deque while we look (every
    # call_soon_threadsafe: the driver's worker threads, the checkpointer, executors), and
    # iterating it in Python while one does raises "deque mutated during iteration" in the
    # middle of a commit. The copy is one C call, which no other thread interrupts under the
    # GIL.
    handles = tuple(ready)
    return any(not handle.cancelled() for handle in handles)


def _warn_checkpoint(what: str, error: str) -> None:
    log.warning(what, error=error)


def connector(path: str, *, busy_timeout_ms: int, synchronous: str) -> Callable[[], Any]:
    """An ``async_creator`` for :func:`sqlalchemy.ext.asyncio.create_async_engine`. The
    engine's connect listener still sets the pragmas; ``synchronous`` here only says whether
    a commit waits on the disk. Under ``NORMAL``/``OFF`` the engine's connections share one
    checkpoint thread (:mod:`ledger.sqlite_checkpointer` says why not under ``FULL``)."""
    checkpointer = for_synchronous(path, synchronous, warn=_warn_checkpoint)

    async def connect() -> InlineConnection:
        conn = sqlite3.connect(
            path, timeout=busy_timeout_ms / 1000, check_same_thread=False, isolation_level=None
        )
        return InlineConnection(
            conn,
            busy_timeout_ms=busy_timeout_ms,
            synchronous=synchronous,
            checkpointer=checkpointer,
        )

    return connect
