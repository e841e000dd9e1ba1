"""Group commit (ledger/store.py: Store.transaction, CommitGroup).

On SQLite the writers of one process that queue on the store's lock share one physical commit,
each in a savepoint of its own; on PostgreSQL every transaction commits itself. Either way a
transaction is durable when its block exits — checked here through a second engine, the way
another process would see it — and one writer's failure undoes only its own rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import event, text

from ledger.errors import StoreUnavailable
from ledger.store import Store
from tests.conftest import DbUrls

WRITERS = 12


@pytest.fixture
async def stores(db_urls: DbUrls) -> AsyncIterator[tuple[Store, Store]]:
    """The store under test and an independent one on the same database (an observer)."""
    store = await Store.open(db_urls.store)
    observer = await Store.open(db_urls.store)
    async with store.transaction() as work:
        await work.conn.execute(text("CREATE TABLE gc (writer INTEGER, row INTEGER)"))
    try:
        yield store, observer
    finally:
        await observer.close()
        await store.close()


async def _rows(observer: Store, writer: int | None = None) -> int:
    sql = "SELECT count(*) FROM gc" + ("" if writer is None else " WHERE writer = :w")
    async with observer.read() as conn:
        return int((await conn.execute(text(sql), {"w": writer})).scalar_one())


async def test_concurrent_writers_share_commits_and_each_is_durable_on_exit(
    stores: tuple[Store, Store], backend: str
) -> None:
    store, observer = stores
    seen_on_exit: dict[int, int] = {}

    async def writer(n: int) -> None:
        async with store.transaction() as work:
            for row in range(3):
                await work.conn.execute(text("INSERT INTO gc VALUES (:w, :r)"), {"w": n, "r": row})
        # The moment the block exits, another connection sees all of this writer's rows.
        seen_on_exit[n] = await _rows(observer, n)

    before = store.stats.snapshot()
    await asyncio.gather(*(writer(n) for n in range(WRITERS)))
    commits = store.stats.commits - before.commits

    assert seen_on_exit == {n: 3 for n in range(WRITERS)}
    assert await _rows(observer) == 3 * WRITERS
    if backend == "sqlite":
        # All twelve were ready together: far fewer physical commits than transactions.
        assert commits < WRITERS / 2
    else:
        assert commits == WRITERS


async def test_a_failing_writer_undoes_only_its_own_rows(stores: tuple[Store, Store]) -> None:
    store, observer = stores

    async def writer(n: int) -> None:
        async with store.transaction() as work:
            await work.conn.execute(text("INSERT INTO gc VALUES (:w, 0)"), {"w": n})
            if n % 3 == 1:
                raise RuntimeError(f"writer {n} fails after writing")

    results = await asyncio.gather(*(writer(n) for n in range(WRITERS)), return_exceptions=True)

    failed = {n for n, r in enumerate(results) if isinstance(r, RuntimeError)}
    assert failed == {n for n in range(WRITERS) if n % 3 == 1}
    for n in range(WRITERS):
        assert await _rows(observer, n) == (0 if n in failed else 1)


async def test_a_failing_writer_that_rewrote_many_pages_undoes_them_all(
    stores: tuple[Store, Store],
) -> None:
    # Its savepoint's journal holds the old content of every page it changed, far past the
    # 64 KiB at which SQLite used to spill it to a temporary file (now kept in memory).
    store, observer = stores
    async with store.transaction() as work:
        await work.conn.execute(
            text(
                "INSERT INTO gc WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n"
                " WHERE i < 19999) SELECT -1, i FROM n"
            )
        )

    async def writer(n: int) -> None:
        async with store.transaction() as work:
            if n == 1:
                await work.conn.execute(text("UPDATE gc SET row = row + 1000000"))
                raise RuntimeError("fails after rewriting every page of the table")
            await work.conn.execute(text("INSERT INTO gc VALUES (:w, 0)"), {"w": n})

    results = await asyncio.gather(*(writer(n) for n in range(4)), return_exceptions=True)

    assert [isinstance(r, RuntimeError) for r in results] == [False, True, False, False]
    async with observer.read() as conn:
        top = (await conn.execute(text("SELECT max(row) FROM gc WHERE writer = -1"))).scalar_one()
    assert top == 19999
    assert [await _rows(observer, n) for n in range(4)] == [1, 0, 1, 1]


async def test_a_lone_failing_writer_leaves_nothing_and_the_next_one_commits(
    stores: tuple[Store, Store],
) -> None:
    store, observer = stores
    with pytest.raises(RuntimeError):
        async with store.transaction() as work:
            await work.conn.execute(text("INSERT INTO gc VALUES (1, 0)"))
            raise RuntimeError("fails alone")
    assert await _rows(observer) == 0
    before = store.stats.snapshot()
    async with store.transaction() as work:
        await work.conn.execute(text("INSERT INTO gc VALUES (2, 0)"))
    assert store.stats.commits - before.commits == 1
    assert await _rows(observer) == 1


async def test_a_sequential_writer_pays_no_savepoint(stores: tuple[Store, Store]) -> None:
    store, _ = stores
    before = store.stats.snapshot()
    for n in range(5):
        async with store.transaction() as work:
            await work.conn.execute(text("INSERT INTO gc VALUES (:w, 0)"), {"w": n})
    # One INSERT and one commit per transaction: no SAVEPOINT/RELEASE when nobody joins.
    assert store.stats.statements - before.statements == 5
    assert store.stats.commits - before.commits == 5


async def test_a_lone_sqlite_writer_commits_at_once_without_a_committer_task(
    stores: tuple[Store, Store], backend: str
) -> None:
    if backend != "sqlite":
        pytest.skip("PostgreSQL commits each transaction itself: there is no group to schedule")
    store, observer = stores
    loop = asyncio.get_running_loop()
    created: list[object] = []

    def counting_factory(loop_: asyncio.AbstractEventLoop, coro: object, **kw: object) -> object:
        created.append(coro)
        return asyncio.Task(coro, loop=loop_, **kw)  # type: ignore[arg-type]

    loop.set_task_factory(counting_factory)  # type: ignore[arg-type]
    try:
        for n in range(5):
            async with store.transaction() as work:
                await work.conn.execute(text("INSERT INTO gc VALUES (:w, 0)"), {"w": n})
            # Durable on exit, as always.
            assert await _rows(observer, n) == 1
    finally:
        loop.set_task_factory(None)
    # Nobody waited for the lock and nothing else was ready: no group was scheduled (the
    # observer's reads create tasks of their own, closing their connections).
    assert [c for c in created if getattr(c, "__qualname__", "") == "Store._commit_group"] == []


@pytest.mark.parametrize("second_is", ["ready to run", "waiting for the lock"])
async def test_a_second_writer_in_the_wings_when_the_first_ends_joins_its_commit(
    stores: tuple[Store, Store], backend: str, second_is: str
) -> None:
    # The two cases the lone writer's immediate commit must tell apart from being alone:
    # a task ready to run (not yet at the lock) and a task already queued on it.
    if backend != "sqlite":
        pytest.skip("PostgreSQL commits each transaction itself: there is no group to join")
    store, observer = stores
    first_inside = asyncio.Event()
    queued = asyncio.Event()

    async def second() -> None:
        await first_inside.wait()
        queued.set()  # then straight to the lock: nothing in between yields
        async with store.transaction() as work:
            await work.conn.execute(text("INSERT INTO gc VALUES (1, 0)"))

    before = store.stats.snapshot()
    task = asyncio.ensure_future(second())
    async with store.transaction() as work:
        await work.conn.execute(text("INSERT INTO gc VALUES (0, 0)"))
        first_inside.set()
        if second_is == "waiting for the lock":
            await queued.wait()
        # else the second writer is ready to run, not yet at the lock, when this block ends
    await task
    assert store.stats.commits - before.commits == 1
    assert await _rows(observer) == 2


async def test_abandon_rolls_back_a_group_still_waiting_for_its_commit(
    stores: tuple[Store, Store], backend: str
) -> None:
    if backend != "sqlite":
        pytest.skip("PostgreSQL commits each transaction itself: there is no group to abandon")
    store, observer = stores
    abandoned: list[asyncio.Future[None]] = []

    async def writer(n: int) -> None:
        async with store.transaction() as work:
            await work.conn.execute(text("INSERT INTO gc VALUES (:w, 0)"), {"w": n})
            if n == 1:
                # The process "crashes" while both writers wait for their shared commit.
                abandoned.append(asyncio.ensure_future(store.abandon()))

    results = await asyncio.gather(writer(0), writer(1), return_exceptions=True)
    await abandoned[0]

    # Neither writer was told its rows were durable, and none are.
    assert all(isinstance(r, StoreUnavailable) for r in results), results
    assert await _rows(observer) == 0


async def test_a_writer_cancelled_while_waiting_does_not_stop_the_others(
    stores: tuple[Store, Store],
) -> None:
    store, observer = stores
    inside = asyncio.Event()

    async def writer(n: int) -> None:
        async with store.transaction() as work:
            await work.conn.execute(text("INSERT INTO gc VALUES (:w, 0)"), {"w": n})
            inside.set()

    tasks = [asyncio.ensure_future(writer(n)) for n in range(3)]
    await inside.wait()
    tasks[1].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)

    assert results[0] is None and results[2] is None
    assert await _rows(observer, 0) == 1 and await _rows(observer, 2) == 1
    # The store stays usable after a cancelled writer.
    async with store.transaction() as work:
        await work.conn.execute(text("INSERT INTO gc VALUES (9, 0)"))
    assert await _rows(observer, 9) == 1


async def test_sqlite_keeps_its_writer_connection_and_replaces_it_after_a_failure(
    stores: tuple[Store, Store], backend: str
) -> None:
    if backend != "sqlite":
        pytest.skip("PostgreSQL keeps its connections for a moment only (test_pg_pool.py)")
    store, observer = stores
    pool = store.engine.sync_engine.pool
    checkouts: list[int] = []
    event.listen(pool, "checkout", lambda *_: checkouts.append(1))

    for n in range(5):  # the fixture's CREATE TABLE already opened the writer connection
        async with store.transaction() as work:
            await work.conn.execute(text("INSERT INTO gc VALUES (:w, 0)"), {"w": n})
    assert checkouts == []
    assert pool.checkedout() == 1  # held by the store between transactions

    with pytest.raises(RuntimeError):
        async with store.transaction() as work:
            await work.conn.execute(text("INSERT INTO gc VALUES (7, 0)"))
            raise RuntimeError("fails alone")
    assert pool.checkedout() == 0  # a failed transaction's connection is not kept
    async with store.transaction() as work:
        await work.conn.execute(text("INSERT INTO gc VALUES (8, 0)"))
    assert checkouts == [1]
    assert await _rows(observer) == 6

    await store.close()
    assert pool.checkedout() == 0  # close() gives the writer back before disposing
