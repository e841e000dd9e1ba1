"""The PostgreSQL connection pool is sized for the transactions in flight (pg_pool_size).

PostgreSQL only: a SQLite store keeps one writer connection (test_group_commit.py). What could
break: a pool smaller than the local transactions a process runs at once. SQLAlchemy closes a
burst ("overflow") connection as soon as it is checked in, so each transaction above the pool
opened a new connection, authenticated and prepared its statements again; with 16 sagas in
flight that was half of the engine's CPU per saga.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import event, text

from ledger.store import Store
from orchestrator.config import EngineSettings
from orchestrator.workerproc import WORKER_OWN_CONNECTIONS, worker_settings
from tests.conftest import DbUrls
from tests.support.postgres_only import postgres_backend  # noqa: F401  (the fixture)

IN_FLIGHT = 16


async def _rounds_of_concurrent_transactions(store: Store, rounds: int) -> list[int]:
    """New server connections opened in each round of IN_FLIGHT transactions held at once."""
    opened = [0]

    def on_connect(*_: object) -> None:
        opened[0] += 1

    event.listen(store.engine.sync_engine.pool, "connect", on_connect)
    per_round = []
    try:
        for _ in range(rounds):
            before = opened[0]
            all_in = asyncio.Barrier(IN_FLIGHT)

            async def one(all_in: asyncio.Barrier = all_in) -> None:
                async with store.transaction() as work:
                    await work.conn.execute(text("SELECT 1"))
                    await all_in.wait()  # every transaction holds its connection at once

            await asyncio.gather(*(one() for _ in range(IN_FLIGHT)))
            per_round.append(opened[0] - before)
    finally:
        event.remove(store.engine.sync_engine.pool, "connect", on_connect)
    return per_round


async def test_transactions_in_flight_within_the_pool_reuse_their_connections(
    db_urls: DbUrls,
) -> None:
    assert EngineSettings().pg_pool_size >= IN_FLIGHT
    store = await Store.open(db_urls.store, pg_pool_size=EngineSettings().pg_pool_size)
    try:
        first, *later = await _rounds_of_concurrent_transactions(store, 3)
    finally:
        await store.close()
    assert first <= IN_FLIGHT
    assert later == [0, 0]  # nothing reopened: every connection went back to the pool


async def test_above_the_pool_every_round_reopens_its_burst_connections(db_urls: DbUrls) -> None:
    # The cost the default pool size exists to avoid, shown with a pool of 10.
    store = await Store.open(db_urls.store, pg_pool_size=10)
    try:
        _, *later = await _rounds_of_concurrent_transactions(store, 3)
    finally:
        await store.close()
    assert later == [IN_FLIGHT - 10] * 2


async def test_the_engine_setting_sizes_the_stores_pool(db_urls: DbUrls) -> None:
    from orchestrator.engine import Orchestrator

    orch = await Orchestrator.open(db_urls.store, settings=EngineSettings(pg_pool_size=7))
    try:
        assert orch.store.engine.sync_engine.pool.size() == 7  # type: ignore[attr-defined]
    finally:
        await orch.close()


def test_a_worker_keeps_one_commit_cohort_unless_told_otherwise() -> None:
    assert EngineSettings().pg_commit_cohorts is True  # a process driving sagas as they come
    assert worker_settings(EngineSettings(), 8).pg_commit_cohorts is False
    assert worker_settings(EngineSettings(pg_commit_cohorts=True), 8).pg_commit_cohorts is True
    kept = EngineSettings(pg_pool_size=100, pg_commit_cohorts=False, sqlite_writer="process")
    assert worker_settings(kept, 8) is kept  # nothing to change: the same settings


def test_a_worker_commits_sqlite_groups_inline_unless_told_otherwise() -> None:
    assert EngineSettings().sqlite_writer is None  # the store's default: the writer process
    assert worker_settings(EngineSettings(), 8).sqlite_writer == "inline"
    told = EngineSettings(sqlite_writer="process")
    assert worker_settings(told, 8).sqlite_writer == "process"
    # As `agent-txn worker --sqlite-writer process` passes it: set on a copy, still "set".
    copied = EngineSettings(lease_seconds=30).model_copy(update={"sqlite_writer": "process"})
    assert worker_settings(copied, 8).sqlite_writer == "process"


async def test_a_worker_sizes_the_pool_for_the_sagas_it_holds(db_urls: DbUrls) -> None:
    from orchestrator.engine import Orchestrator

    assert worker_settings(EngineSettings(pg_pool_size=100), 8).pg_pool_size == 100  # larger: kept
    settings = worker_settings(EngineSettings(), 50)
    orch = await Orchestrator.open(db_urls.store, settings=settings)
    try:
        pool = orch.store.engine.sync_engine.pool
        assert pool.size() == 50 + WORKER_OWN_CONNECTIONS  # type: ignore[attr-defined]
    finally:
        await orch.close()


async def test_back_to_back_transactions_keep_their_connection_out_of_the_pool(
    db_urls: DbUrls, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Store._take_idle: a connection committed on moments ago is used again without a pool
    # checkout (the pool's fairy, events and reset cost more than a small transaction's SQL).
    from ledger import dialects

    monkeypatch.setattr(dialects, "PING_BYPASS_SECONDS", 3600.0)  # the mechanism, not the clock
    store = await Store.open(db_urls.store)
    checkouts = [0]

    def on_checkout(*_: object) -> None:
        checkouts[0] += 1

    event.listen(store.engine.sync_engine.pool, "checkout", on_checkout)
    try:
        pids = []
        for _ in range(5):
            async with store.transaction() as work:
                pids.append((await work.conn.execute(text("SELECT pg_backend_pid()"))).scalar())
        assert checkouts[0] == 1
        assert len(set(pids)) == 1
        monkeypatch.setattr(dialects, "PING_BYPASS_SECONDS", 0.0)  # as if it sat idle
        async with store.transaction() as work:
            await work.conn.execute(text("SELECT 1"))
        assert checkouts[0] == 2  # stale: back to the pool, checked out (and pinged) again
    finally:
        event.remove(store.engine.sync_engine.pool, "checkout", on_checkout)
        await store.close()
    pool = store.engine.sync_engine.pool
    assert pool.checkedout() == 0  # type: ignore[attr-defined]  # close() returned the kept ones


async def test_a_failed_transaction_returns_its_connection_to_the_pool(db_urls: DbUrls) -> None:
    store = await Store.open(db_urls.store)
    try:
        with pytest.raises(RuntimeError, match="the block failed"):
            async with store.transaction() as work:
                await work.conn.execute(text("SELECT 1"))
                raise RuntimeError("the block failed")
        pool = store.engine.sync_engine.pool
        assert pool.checkedout() == 0  # type: ignore[attr-defined]
        async with store.transaction() as work:  # and the store goes on
            assert (await work.conn.execute(text("SELECT 1"))).scalar() == 1
    finally:
        await store.close()
