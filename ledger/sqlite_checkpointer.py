"""SQLite's WAL checkpoints on a thread of their own, not inside commits on the event loop.

Why: in WAL mode SQLite copies the log back into the database file (a *checkpoint*) from inside
the commit that takes the log past ``wal_autocheckpoint`` pages (1 000 by default). Our commits
run on the event loop (:mod:`ledger.sqlite_inline`), so every few dozen sagas one commit wrote a
thousand pages and fsynced the database file while no other saga could run: those commits were
the bench's p99 (about 30 ms against a p50 of 5) and a good part of the SQLite commit time.

Here every connection of a store's engine sets ``wal_autocheckpoint=0``, and one thread per
engine runs ``PRAGMA wal_checkpoint(PASSIVE)`` on a connection of its own after every
:data:`EVERY_COMMITS` writing commits (or within :data:`IDLE_SECONDS` of the last one). SQLite
releases the GIL while it copies, so on a machine with two cores the checkpoint overlaps the
sagas instead of stopping them. A PASSIVE checkpoint never waits for and never blocks a writer
or a reader: it copies what no reader still needs, and the log restarts from its beginning at
the next write once all of it was copied.

Only under ``synchronous=NORMAL``/``OFF``, where a commit appends to the log without an fsync.
Under ``FULL``/``EXTRA`` every commit already waits for the disk, and a checkpoint's writes and
fsync running beside it queue ahead of those waits: measured, sequential sagas under ``FULL``
ran 12 % slower with the thread (``docs/benchmarks-log.md``), so there SQLite's auto-checkpoint
stays.

**Starting the log again.** SQLite writes the log from its beginning again only when a write
transaction begins with *all* of it copied. The thread's checkpoint copies all of it, but under a
steady stream of commits the writer has committed again before the thread is done, so that moment
never came: the log grew by about 40 KB a saga for as long as the stream lasted (476 MB after 12 000
sagas in the bench), every commit appending to new blocks of an ever larger file. So the thread
notes a checkpoint that copied the whole log, and the writer's next commit copies, on its own
connection, the few pages it committed since (:meth:`Checkpointer.catch_up`, from
:meth:`Checkpointer.after_commit`, which the writing connections call after every commit), and the
write transaction after it starts the log again. That catch-up is a PASSIVE checkpoint of a few
dozen pages, but it syncs the log and the database file as every checkpoint does (3 to 7 ms,
measured): once per thread checkpoint, so about once per hundred commits under load. A store that
paused needs none (its log started again by itself) and pays one anyway, at the first commit after
the pause: a few pages, once per quiet spell. The log then stays at about the size of one checkpoint
interval (16 to 17 MB in the bench) instead of growing for as long as the load lasts
(``docs/benchmarks-log.md``, item 54).

The durability rules are SQLite's own and unchanged: a commit is durable when it is in the log
(fsynced under ``FULL``); a checkpoint only moves durable pages into the database file, and
SQLite syncs the database file before any write may reuse the log. If the thread falls behind,
the log grows until it catches up; if a checkpoint fails (another process checkpointing the
same file at that moment), the next one retries. When the last connection closes, SQLite
checkpoints and removes the log as always.

**Two users.** The engine's own connections (:mod:`ledger.sqlite_inline`), and the SQLite
writer process (:mod:`ledger.sqlite_writer_child`), which runs its groups' commits on a
connection of its own and loads this file by path. So this module needs nothing but the
standard library: a failure is reported through the ``warn`` function its user passes.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import Any

#: How a failed checkpoint is reported: ``warn(what, error)``.
Warn = Callable[[str, str], None]


def _unreported(what: str, error: str) -> None:
    """The default ``warn``: failures are only counted (:attr:`Checkpointer.failures`)."""


#: Writing commits between two checkpoints: a saga's commits append about ten pages each, so
#: this is close to SQLite's own default of one checkpoint per 1 000 log pages.
EVERY_COMMITS = 100
#: A store that went quiet has its last commits checkpointed this soon.
IDLE_SECONDS = 1.0
#: Copies what no reader still needs; never waits for, never blocks a reader or a writer.
_PASSIVE = "PRAGMA wal_checkpoint(PASSIVE)"


def for_synchronous(path: str, synchronous: str, **options: Any) -> Checkpointer | None:
    """The checkpoint thread's keeper for ``path`` under this ``synchronous`` (``options``: the
    :class:`Checkpointer`'s), or ``None`` under ``FULL``/``EXTRA``, where SQLite's own
    auto-checkpoint stays (the module doc says why)."""
    if synchronous.upper() in {"FULL", "EXTRA"}:
        return None
    return Checkpointer(path, **options)


class Checkpointer:
    """The checkpoint thread of one engine's SQLite file; it runs while a connection is open."""

    def __init__(
        self,
        path: str,
        *,
        every_commits: int = EVERY_COMMITS,
        idle_seconds: float = IDLE_SECONDS,
        warn: Warn = _unreported,
    ) -> None:
        self._path = path
        self._warn = warn
        self._every = every_commits
        self._idle = idle_seconds
        self._lock = threading.Lock()
        self._users = 0
        self._commits = 0
        self._wake = threading.Event()
        self._stop: threading.Event | None = None
        #: The running thread, if any (tests join it).
        self.thread: threading.Thread | None = None
        #: Checkpoints run, and those SQLite refused (retried at the next one).
        self.checkpoints = 0
        self.failures = 0
        # Set by the thread when a checkpoint copied the whole log; taken by the next writing
        # commit (see the module's doc). A plain flag: one thread sets it, the loop takes it,
        # and a pass that sets it again between the two is only taken at the next commit.
        self._copied_all = False

    def take_over(self, conn: sqlite3.Connection) -> None:
        """``conn``'s commits stop checkpointing (``wal_autocheckpoint=0``); this thread does
        it for them (and runs while ``conn`` is open: :meth:`detach` when it closes)."""
        conn.execute("PRAGMA wal_autocheckpoint=0")
        self.attach()

    def after_commit(self, conn: sqlite3.Connection) -> None:
        """A writing commit on ``conn``, one :meth:`take_over` gave this thread: count it, and
        catch up if the log may start again (:meth:`catch_up`)."""
        self.note_commit()
        self.catch_up(conn)

    def attach(self) -> None:
        """A connection opened: make sure the thread runs."""
        with self._lock:
            self._users += 1
            if self.thread is None:
                self._stop = threading.Event()
                self.thread = threading.Thread(
                    target=self._run,
                    args=(self._stop,),
                    name="agent-txn-sqlite-checkpoint",
                    daemon=True,
                )
                self.thread.start()

    def detach(self) -> None:
        """A connection closed: the last one stops the thread (it finishes what it is doing)."""
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._stop is not None:
                self._stop.set()
                self._wake.set()
                self._stop = None
                self.thread = None

    def note_commit(self) -> None:
        """A writing commit happened (called on the event loop: a counter and, now and then,
        one event)."""
        self._commits += 1
        if self._commits >= self._every:
            self._wake.set()

    def checkpoint(self, conn: sqlite3.Connection) -> None:
        """One PASSIVE checkpoint on ``conn`` (the thread's own connection), noting whether
        it copied the whole log."""
        busy, logged, copied = conn.execute(_PASSIVE).fetchone()
        self.checkpoints += 1
        if not busy and logged == copied:
            self._copied_all = True

    def catch_up(self, conn: sqlite3.Connection) -> None:
        """After a writing commit on ``conn`` (the writer's, on the event loop): if a checkpoint
        copied the whole log since the last call, copy what ``conn`` committed since, so that
        its next write transaction starts the log again (see the module's doc). The commit
        before it is durable whatever happens here, so a failure is counted and logged (the
        thread's next checkpoint tries again), never raised."""
        if not self._copied_all:
            return
        self._copied_all = False
        try:
            conn.execute(_PASSIVE).fetchall()
        except sqlite3.Error as exc:
            self.failures += 1
            self._warn("sqlite catch-up checkpoint failed", str(exc))

    def _run(self, stop: threading.Event) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while True:
                self._wake.wait(self._idle)
                self._wake.clear()
                if stop.is_set():
                    return
                if self._commits == 0:
                    continue
                self._commits = 0  # a commit counted meanwhile is only checkpointed later
                try:
                    if conn is None:
                        conn = sqlite3.connect(
                            self._path, isolation_level=None, check_same_thread=False
                        )
                    self.checkpoint(conn)
                except sqlite3.Error as exc:
                    self.failures += 1
                    self._warn("sqlite checkpoint failed", str(exc))
        finally:
            if conn is not None:
                conn.close()
