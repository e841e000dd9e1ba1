"""The SQLite writer process: runs commit groups' writes, one physical transaction per group.

It is started by :class:`ledger.sqlite_writer.WriterProcess` as a script of its own
(``python -I -S this_file PATH SYNCHRONOUS BUSY_TIMEOUT_MS``), not as a module of the package:
it needs nothing but the standard library, and importing ``ledger`` would cost it the whole
engine's start-up (SQLAlchemy included) for nothing.

Why a process: a commit group's SQLite work (its statements' C, the WAL's frame writes and
their system calls) ran on the event loop's thread and took about a fifth of a saga's time at
sixteen sagas in flight (``docs/benchmarks-log.md``). A thread cannot take it: the GIL is needed
between every two statements, and a busy event loop hands it over only every switch interval.
Here it runs on the other core while the loop builds the next group.

The protocol, over the process's standard input and output, each message a 4-byte big-endian
length and a pickle:

* in: ``(new_sql, members)``. ``new_sql`` are SQL texts this process has not seen yet; they
  take the next numbers, in order. ``members`` is one list of writes per member transaction,
  each write ``(sql_number, args, fenced, rows)``: ``args`` one row's arguments (``rows`` == 1)
  or ``rows`` rows' end to end; ``fenced``: the write must change exactly one row.
* out: ``(outcomes, failure, statements, cpu_s)``. One outcome per member: ``None`` (its writes
  stand), ``("lost", i)`` (its fenced write ``i`` changed no row) or ``("error", i, error)``
  (its write ``i`` failed). Either way a failed member's writes are undone (each member runs
  inside a savepoint of its own) and the others' are not. ``failure``: ``None`` when the group
  committed, else the error that kept it from committing (``BEGIN`` or ``COMMIT`` failed):
  nothing of the group was written. ``statements``: how many were run, ``BEGIN`` and
  ``COMMIT`` not counted (the store's counters count the same way in-process). ``cpu_s``:
  this process's CPU time so far (the bench adds it to the engine's: the work moved here is
  still the engine's).
* An error is ``(class name, message, SQLite error code, SQLite error name)``, so the parent
  can raise the :mod:`sqlite3` exception the statement raised in-process.

End of input (the parent closed the pipe, or died) ends the process, and nothing else does:
it ignores ``SIGINT`` and ``SIGTERM``. A Ctrl-C in a terminal reaches the whole process group,
and a service manager's stop often every process of the service; either would end the writer
at once, failing as unknown the groups of the very sagas its parent is finishing before it
exits. Its parent closes the pipe when it closes the store, or dies, and then this process
ends after the group in hand. The process commits
each group before it reads the next, so a group is committed if and only if its answer says
so; a group whose answer never came (this process died) may or may not be.

The WAL's checkpoints run here too, on a thread of this process (:mod:`ledger.sqlite_checkpointer`,
loaded from its file: it needs only the standard library), under ``NORMAL``/``OFF`` as in the
engine's own connections. The writer's connection does not auto-checkpoint: one commit in a
few dozen groups then copied a thousand pages and synced the database file (p99 of a group 25 ms
against a p50 of 1.4, 38 groups in 1 228 holding 0.9 s of the writer's 2.5), while the groups
behind it, and the sagas waiting for them, stood still (``docs/benchmarks-log.md``, item 60). Under
``FULL`` SQLite's auto-checkpoint stays, as it does there.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import signal
import sqlite3
import struct
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from ledger.sqlite_checkpointer import Checkpointer

_LENGTH = struct.Struct(">I")

Error = tuple[str, str, int, str]


class _Lost(Exception):
    def __init__(self, index: int) -> None:
        self.index = index


class _Failed(Exception):
    def __init__(self, index: int, error: sqlite3.Error) -> None:
        self.index = index
        self.error = error


def split_rows(args: Sequence[Any], rows: int) -> list[Sequence[Any]]:
    """A multi-row write's arguments (``rows`` rows' end to end), one sequence per row. The
    parent's in-process path (``ledger.hot``) splits them with this too."""
    width = len(args) // rows
    return [args[i : i + width] for i in range(0, len(args), width)]


def describe(error: sqlite3.Error) -> Error:
    """What the parent needs to raise ``error`` again."""
    return (
        type(error).__name__,
        str(error),
        int(getattr(error, "sqlite_errorcode", 0) or 0),
        str(getattr(error, "sqlite_errorname", "") or ""),
    )


def connect(path: str, synchronous: str, busy_timeout_ms: int) -> sqlite3.Connection:
    """The writer's connection, with the pragmas the engine's own connections get
    (``ledger.dialects``)."""
    conn = sqlite3.connect(
        path, timeout=busy_timeout_ms / 1000, isolation_level=None, check_same_thread=False
    )
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA temp_store=MEMORY")
    return conn


def checkpointer_for(path: str, synchronous: str, **options: Any) -> Checkpointer | None:
    """The engine's rule for a connection's checkpoints
    (:func:`ledger.sqlite_checkpointer.for_synchronous`: a thread under ``NORMAL``/``OFF``,
    ``None`` under ``FULL``/``EXTRA``), from ``sqlite_checkpointer.py`` beside this file, loaded
    by its path: this process has no ``ledger`` package to import it from."""
    where = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sqlite_checkpointer.py")
    spec = importlib.util.spec_from_file_location("agent_txn_sqlite_checkpointer", where)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checkpointer: Checkpointer | None = module.for_synchronous(
        path, synchronous, warn=_warn, **options
    )
    return checkpointer


def _warn(what: str, error: str) -> None:
    """A failed checkpoint (the next one tries again): one line on this process's standard
    error, which is the engine's."""
    sys.stderr.write(f"agent-txn sqlite writer: {what}: {error}\n")
    sys.stderr.flush()


class Writer:
    """Runs groups on one connection (see the module doc for the message shapes); with a
    ``checkpointer``, the connection's commits no longer checkpoint, its thread does."""

    def __init__(self, conn: sqlite3.Connection, checkpointer: Checkpointer | None = None) -> None:
        self.conn = conn
        self.cursor = conn.cursor()
        self.sql: list[str] = []
        self.checkpointer = checkpointer
        if checkpointer is not None:
            checkpointer.take_over(conn)

    def close(self) -> None:
        """Stop the checkpoint thread (it finishes what it is doing) and close the
        connection."""
        checkpointer, self.checkpointer = self.checkpointer, None
        if checkpointer is not None:
            checkpointer.detach()
        self.conn.close()

    def run(self, new_sql: list[str], members: list[list[Any]]) -> tuple[Any, ...]:
        self.sql.extend(new_sql)
        cursor = self.cursor
        try:
            cursor.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            return [None] * len(members), describe(exc), 0
        outcomes: list[Any] = []
        statements = 0
        for writes in members:
            cursor.execute("SAVEPOINT agent_txn_member")
            statements += 2  # the SAVEPOINT and its RELEASE
            try:
                statements += self._member(writes)
            except (_Lost, _Failed) as exc:
                statements += exc.index + 1  # the writes it ran, the failing one included
                cursor.execute("ROLLBACK TO SAVEPOINT agent_txn_member")
                statements += 1
                outcomes.append(
                    ("lost", exc.index)
                    if isinstance(exc, _Lost)
                    else ("error", exc.index, describe(exc.error))
                )
            else:
                outcomes.append(None)
            cursor.execute("RELEASE SAVEPOINT agent_txn_member")
        try:
            cursor.execute("COMMIT")
        except sqlite3.Error as exc:
            if self.conn.in_transaction:
                self.conn.rollback()
            return outcomes, describe(exc), statements
        if self.checkpointer is not None:
            self.checkpointer.after_commit(self.conn)
        return outcomes, None, statements

    def _member(self, writes: list[Any]) -> int:
        cursor = self.cursor
        sql = self.sql
        for index, (number, args, fenced, rows) in enumerate(writes):
            try:
                if rows == 1:
                    changed = cursor.execute(sql[number], args).rowcount
                else:
                    cursor.executemany(sql[number], split_rows(args, rows))
                    continue
            except sqlite3.Error as exc:
                raise _Failed(index, exc) from None
            if fenced and changed != 1:
                raise _Lost(index)
        return len(writes)


def _read(stream: BinaryIO, size: int) -> bytes | None:
    data = stream.read(size)
    if len(data) < size:
        return None  # the parent closed the pipe (or died): nothing more will come
    return data


def serve(source: BinaryIO, sink: BinaryIO, writer: Writer) -> None:
    """Answer groups until ``source`` ends."""
    while True:
        head = _read(source, _LENGTH.size)
        if head is None:
            return
        body = _read(source, _LENGTH.unpack(head)[0])
        if body is None:
            return
        new_sql, members = pickle.loads(body)
        answer = pickle.dumps(
            (*writer.run(new_sql, members), time.process_time()), protocol=pickle.HIGHEST_PROTOCOL
        )
        sink.write(_LENGTH.pack(len(answer)) + answer)
        sink.flush()


def main(argv: list[str]) -> int:
    for stop in (signal.SIGINT, signal.SIGTERM):  # the parent's pipe decides (module doc)
        signal.signal(stop, signal.SIG_IGN)
    path, synchronous, busy_timeout_ms = argv[1], argv[2], int(argv[3])
    conn = connect(path, synchronous, busy_timeout_ms)
    writer = Writer(conn, checkpointer_for(path, synchronous))
    try:
        serve(sys.stdin.buffer, sys.stdout.buffer, writer)
    finally:
        writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
