"""The SQLite writer process (ledger/sqlite_writer.py, Store._shipped).

SQLite only: the writer process is how a SQLite store commits groups of concurrent
transactions (``sqlite_writer="process"``, the default; PostgreSQL batches its own,
ledger/grouped.py). The whole suite runs with it, and ``.ci/run`` runs the SQLite tests once
more with ``inline`` (``AGENT_TXN_TEST_SQLITE_WRITER=inline``); these tests pin what only
this mode can get wrong, checked in the database file itself where it matters:

* a group's members sharing one commit in the writer, each with its own outcome: a member
  whose write fails (a duplicate key, a lost lease) is refused with its own error and none
  of its writes land, while the others' do;
* a transaction that reads (or needs a row count) begins here, after the groups before it:
  it sees their writes;
* a writer that dies with a group in flight: that group's members are told the outcome is
  unknown (never "failed", never "committed"), and the next group starts a fresh writer;
* a lone transaction commits in-process (no writer is even started), and ``close`` waits for
  the group in flight;
* a writer that cannot run here (it ends before answering, twice) is given up, and the store
  commits in-process from then on; one that cannot even be started is given up before any
  group is handed to it, so no transaction fails for it;
* the writer's commits leave the WAL's checkpoints to a thread of the writer process (under
  ``NORMAL``), which it loads by path as it is started (``python -I -S``, no packages).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy.exc import DBAPIError

from ledger import definitions, dialects, events, transactions
from ledger.errors import DuplicateKey, LeaseLost, StoreUnavailable
from ledger.sqlite_writer import SILENT_DEATHS, WriterProcess, error_of
from ledger.sqlite_writer_child import Writer, checkpointer_for, connect, describe
from ledger.states import TxState
from ledger.store import Chain, Store
from tests.support.bare_store import DIGEST, SAGA, bare_store, insert_tx


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "agent.db"


@pytest.fixture
async def store(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Store]:
    monkeypatch.setattr("ledger.store.DEFAULT_SQLITE_WRITER", "process")
    async with bare_store(f"sqlite+aiosqlite:///{db_path}") as store:
        assert store.writer_process is not None
        yield store


def _statuses(db_path: Path) -> dict[str, str]:
    """The transactions' statuses as the database file holds them (a connection of its own)."""
    with sqlite3.connect(db_path) as conn:
        return dict(conn.execute("SELECT tx_id, status FROM transactions").fetchall())


async def _together(*blocks: Any) -> list[Any]:
    """Run coroutines as concurrent tasks (so their transactions meet in one group)."""
    return await asyncio.gather(*blocks, return_exceptions=True)


async def _insert(store: Store, tx_id: str) -> None:
    async with store.transaction() as work:
        await insert_tx(work, tx_id)


async def test_concurrent_transactions_share_commits_in_the_writer(
    store: Store, db_path: Path
) -> None:
    before = store.stats.snapshot()
    results = await _together(*(_insert(store, f"tx-{n}") for n in range(8)))
    assert results == [None] * 8
    assert store.writer_process is not None and store.writer_process.started == 1
    assert store.stats.commits - before.commits < 8  # shared, not one each
    assert _statuses(db_path) == {f"tx-{n}": "executing" for n in range(8)}
    async with store.read() as conn:
        for n in range(8):
            assert await events.verify(conn, f"tx-{n}") == []


async def test_a_failing_member_undoes_only_its_own_writes(store: Store, db_path: Path) -> None:
    async with store.transaction() as work:
        claim = await insert_tx(work, "tx-old")
    stale = transactions.TxClaim("tx-old", claim.fence + 1, claim.status, claim.owner)

    async def duplicate() -> None:
        async with store.transaction() as work:
            await insert_tx(work, "tx-dup-good")  # lands only if the member does
            await insert_tx(work, "tx-old")

    async def stale_fence() -> None:
        async with store.transaction() as work:
            await insert_tx(work, "tx-lost-good")
            chain = await _chain(store, "tx-old")
            await transactions.transition(work, chain, stale, TxState.FAILED, action="fail")

    results = await _together(
        _insert(store, "tx-a"), duplicate(), stale_fence(), _insert(store, "tx-b")
    )
    assert results[0] is None and results[3] is None
    assert isinstance(results[1], DuplicateKey)
    assert isinstance(results[2], LeaseLost) and "tx-old" in str(results[2])
    assert _statuses(db_path) == {"tx-old": "executing", "tx-a": "executing", "tx-b": "executing"}
    assert store.writer_process is not None and store.writer_process.started == 1


async def _chain(store: Store, tx_id: str) -> Chain:
    async with store.read() as conn:
        return await events.chain_of(conn, tx_id)


async def test_a_transaction_that_reads_sees_the_groups_before_it(store: Store) -> None:
    seen: list[Any] = []

    async def reader() -> None:
        await asyncio.sleep(0)  # after the writers below have joined their group
        async with store.transaction() as work:
            seen.extend([await transactions.get(work.conn, f"tx-{n}") for n in range(4)])
            await insert_tx(work, "tx-reader")

    results = await _together(*(_insert(store, f"tx-{n}") for n in range(4)), reader())
    assert results == [None] * 5
    assert [r is not None and r.status for r in seen] == [TxState.EXECUTING] * 4
    async with store.read() as conn:
        assert await transactions.get(conn, "tx-reader") is not None


async def test_a_writer_that_dies_in_flight_leaves_the_outcome_unknown(
    store: Store, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = store.writer_process
    assert writer is not None
    submit = WriterProcess.submit

    def submit_then_die(self: WriterProcess, *args: Any) -> None:
        submit(self, *args)
        if self._proc is not None:  # (a second group finds the pipe broken already)
            os.kill(self._proc.pid, signal.SIGKILL)  # before it can answer, with the group

    monkeypatch.setattr(WriterProcess, "submit", submit_then_die)
    results = await _together(*(_insert(store, f"tx-{n}") for n in range(4)))
    assert results and all(isinstance(r, StoreUnavailable) for r in results), results
    assert "unknown" in str(results[0])
    monkeypatch.setattr(WriterProcess, "submit", submit)
    killed = writer.started  # one or two: a second group may have started (and lost) a second
    results = await _together(*(_insert(store, f"tx-next-{n}") for n in range(4)))
    assert results == [None] * 4
    assert writer.started == killed + 1  # a fresh writer took over
    assert not writer.unusable  # killed is not "cannot run here": no giving up on it
    assert {f"tx-next-{n}" for n in range(4)} <= set(_statuses(db_path))


async def test_a_ctrl_c_or_a_service_stop_leaves_the_writer_to_its_parent(
    store: Store, db_path: Path
) -> None:
    """SIGINT (a terminal's Ctrl-C reaches the whole process group) and SIGTERM (a service
    manager's stop, often every process of the service) do not end the writer: its parent
    finishes the sagas in hand first, and their groups still commit. The parent's pipe alone
    ends it."""
    writer = store.writer_process
    assert writer is not None
    assert await _together(*(_insert(store, f"tx-{n}") for n in range(4))) == [None] * 4
    child = writer._proc
    assert child is not None and writer.started == 1

    for stop in (signal.SIGINT, signal.SIGTERM):
        os.kill(child.pid, stop)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=0.5)  # time for a child that heeded them to end

    assert child.poll() is None
    results = await _together(*(_insert(store, f"tx-after-{n}") for n in range(4)))
    assert results == [None] * 4
    assert writer.started == 1 and writer._proc is child  # the same writer committed them
    assert {f"tx-after-{n}" for n in range(4)} <= set(_statuses(db_path))


async def test_a_relative_path_names_the_same_file_after_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child starts with the first group, which may come after the process changed its
    working directory: a relative URL must still name the store's file, not a new one."""
    monkeypatch.setattr("ledger.store.DEFAULT_SQLITE_WRITER", "process")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    async with bare_store("sqlite+aiosqlite:///agent.db") as store:
        monkeypatch.chdir(tmp_path / "elsewhere")
        results = await _together(*(_insert(store, f"tx-{n}") for n in range(4)))
        assert results == [None] * 4
        assert store.writer_process is not None and store.writer_process.started == 1
    assert set(_statuses(tmp_path / "agent.db")) == {f"tx-{n}" for n in range(4)}
    assert not (tmp_path / "elsewhere" / "agent.db").exists()


async def test_a_lone_transaction_commits_without_a_writer(store: Store, db_path: Path) -> None:
    await _insert(store, "tx-alone")
    assert store.writer_process is not None and store.writer_process.started == 0
    assert _statuses(db_path) == {"tx-alone": "executing"}


async def test_close_waits_for_the_group_in_flight(db_path: Path) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{db_path}", sqlite_writer="process")
    try:
        async with store.transaction() as work:
            await definitions.put(work, digest=DIGEST, name=SAGA, definition={"name": SAGA})
        tasks = [asyncio.ensure_future(_insert(store, f"tx-{n}")) for n in range(6)]
        for _turn in range(100):
            await asyncio.sleep(0)
            if store.writer_process is not None and store.writer_process.in_flight:
                break
        else:
            pytest.fail("no group reached the writer")
    finally:
        await store.close()
    assert all(t.done() and t.exception() is None for t in tasks)
    assert set(_statuses(db_path)) == {f"tx-{n}" for n in range(6)}


# -- the child's side, on its own ---------------------------------------------------------


def test_the_child_runs_each_member_in_a_savepoint_of_its_own(tmp_path: Path) -> None:
    conn = connect(str(tmp_path / "w.db"), "NORMAL", 1000)
    conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER NOT NULL)")
    conn.execute("INSERT INTO t VALUES ('x', 1)")
    writer = Writer(conn)
    insert, bump = "INSERT INTO t VALUES (?, ?)", "UPDATE t SET v = v + 1 WHERE k = ? AND v = ?"
    outcomes, failure, statements = writer.run(
        [insert, bump],
        [
            [(0, ("a", 1), False, 1), (1, ("x", 1), True, 1)],  # both stand
            [(0, ("b", 1), False, 1), (0, ("a", 9), False, 1)],  # duplicate key: undone
            [(0, ("c", 1), False, 1), (1, ("x", 1), True, 1)],  # stale: x is 2 now
            [(0, ("d", 1, "e", 2), False, 2)],  # two rows in one write
        ],
    )
    assert failure is None
    assert outcomes[0] is None and outcomes[3] is None
    assert outcomes[1][:2] == ("error", 1) and outcomes[1][2][0] == "IntegrityError"
    assert outcomes[2] == ("lost", 1)
    rows = dict(conn.execute("SELECT k, v FROM t").fetchall())
    assert rows == {"x": 2, "a": 1, "d": 1, "e": 2}
    # Writes run (2 + 2 + 2 + 1), a SAVEPOINT and a RELEASE per member, two ROLLBACK TOs.
    assert statements == 7 + 4 * 2 + 2


def test_the_childs_commits_leave_checkpoints_to_a_thread(tmp_path: Path) -> None:
    path = str(tmp_path / "c.db")
    conn = connect(path, "NORMAL", 1000)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT NOT NULL)")
    empty_file = os.path.getsize(path)  # the table's pages are in the log, not yet in the file
    checkpointer = checkpointer_for(path, "NORMAL", every_commits=3, idle_seconds=60.0)
    assert checkpointer is not None
    writer = Writer(conn, checkpointer)
    try:
        assert conn.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
        insert = ["INSERT INTO t VALUES (?, ?)"]
        for k in range(3):
            _, failure, _ = writer.run(insert if k == 0 else [], [[(0, (k, "x" * 500), False, 1)]])
            assert failure is None
        deadline = time.monotonic() + 10
        while not checkpointer.checkpoints and time.monotonic() < deadline:
            time.sleep(0.01)
        assert checkpointer.checkpoints >= 1 and checkpointer.failures == 0
        # The thread's checkpoint copied the log into the database file.
        assert os.path.getsize(path) > empty_file
        thread = checkpointer.thread
    finally:
        writer.close()
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive()


def test_under_full_the_childs_commits_checkpoint_as_sqlite_does(tmp_path: Path) -> None:
    path = str(tmp_path / "f.db")
    assert checkpointer_for(path, "FULL") is None
    writer = Writer(connect(path, "FULL", 1000))
    try:
        assert writer.conn.execute("PRAGMA wal_autocheckpoint").fetchone() == (1000,)
    finally:
        writer.close()


def test_the_child_loads_its_checkpointer_as_it_is_started(tmp_path: Path) -> None:
    # Started as the store starts it (python -I -S, no site-packages, no package on the
    # path), with nothing to do: it loads the checkpoint thread, starts it, and ends cleanly.
    argv = WriterProcess(str(tmp_path / "s.db"), synchronous="NORMAL", busy_timeout_ms=1000)._argv
    ended = subprocess.run(argv, input=b"", capture_output=True, timeout=60)
    assert (ended.returncode, ended.stderr) == (0, b"")


def test_a_childs_error_is_raised_again_as_sqlite_raised_it(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "e.db")
    conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY)")
    conn.execute("INSERT INTO t VALUES ('x')")
    with pytest.raises(sqlite3.IntegrityError) as raised:
        conn.execute("INSERT INTO t VALUES ('x')")
    again = error_of(describe(raised.value))
    assert type(again) is sqlite3.IntegrityError
    assert str(again) == str(raised.value)
    assert again.sqlite_errorcode == raised.value.sqlite_errorcode
    wrapped = DBAPIError.instance("INSERT", None, again, sqlite3.Error)
    assert isinstance(dialects.translate(wrapped), DuplicateKey)


async def test_writers_that_cannot_be_shipped_still_share_commits(
    store: Store, db_path: Path
) -> None:
    async def reading_writer(n: int) -> None:
        async with store.transaction() as work:
            await transactions.get(work.conn, "tx-none")  # a read: this one begins here
            await insert_tx(work, f"tx-{n}")

    before = store.stats.snapshot()
    results = await _together(*(reading_writer(n) for n in range(6)))
    assert results == [None] * 6
    # The first begins here and opens an in-process group; the others join it.
    assert store.stats.commits - before.commits < 6
    assert store.writer_process is not None and store.writer_process.started == 0
    assert set(_statuses(db_path)) == {f"tx-{n}" for n in range(6)}


async def test_a_writer_that_cannot_run_is_given_up_for_in_process_commits(
    store: Store, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = store.writer_process
    assert writer is not None
    # A "Python" that ends at once, as a host whose sys.executable is not one would.
    monkeypatch.setattr(writer, "_argv", [sys.executable, "-c", "raise SystemExit(3)"])
    results: list[Any] = []
    for attempt in range(2 * SILENT_DEATHS):
        results += await _together(*(_insert(store, f"tx-{attempt}-{n}") for n in range(4)))
        if writer.unusable:
            break
    assert writer.unusable and store.sqlite_writer == "inline"
    assert writer.started == SILENT_DEATHS  # given up after that many, with a warning
    # Each group given to a child that died failed as unknown; a lone one committed here.
    assert any(isinstance(r, StoreUnavailable) for r in results)
    assert all(r is None or isinstance(r, StoreUnavailable) for r in results)
    started = writer.started
    results = await _together(*(_insert(store, f"tx-after-{n}") for n in range(4)))
    assert results == [None] * 4  # committed in-process, in one group
    assert writer.started == started  # no further attempt
    assert {f"tx-after-{n}" for n in range(4)} <= set(_statuses(db_path))


async def test_a_writer_that_cannot_even_start_is_given_up_before_any_group_fails(
    store: Store, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default starts a process; a host where none can start (no such executable, a
    sandbox that forbids it) must not cost a single transaction: the store notices before it
    hands a group over, and commits in-process from then on."""
    writer = store.writer_process
    assert writer is not None
    monkeypatch.setattr(writer, "_argv", [str(db_path.parent / "no-such-python")])

    results = await _together(*(_insert(store, f"tx-{n}") for n in range(4)))

    assert results == [None] * 4  # every one committed, none failed as unknown
    assert writer.unusable and store.sqlite_writer == "inline"
    assert writer.started == 0
    assert set(_statuses(db_path)) == {f"tx-{n}" for n in range(4)}
    results = await _together(*(_insert(store, f"tx-after-{n}") for n in range(4)))
    assert results == [None] * 4
    assert {f"tx-after-{n}" for n in range(4)} <= set(_statuses(db_path))


async def test_a_group_that_cannot_be_sent_fails_at_once_instead_of_waiting(
    db_path: Path,
) -> None:
    writer = WriterProcess(str(db_path), synchronous="NORMAL", busy_timeout_ms=1000)
    unsendable = SimpleNamespace(
        compiled=SimpleNamespace(sql="INSERT INTO t VALUES (?)"),
        args=(lambda: None,),  # nothing a pipe can carry
        lost=None,
        rows=1,
    )
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    try:
        writer.submit([[unsendable]], done)  # type: ignore[list-item]
        assert done.done() and done.exception() is not None
        assert writer.in_flight == 0
    finally:
        await writer.close()
