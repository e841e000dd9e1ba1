"""The saga path's statements find their rows by key: none reads a whole table.

What could break: a statement whose plan scans ``transactions``, ``operations``, ``outbox`` or
``ledger`` costs time in proportion to everything ever written, so throughput falls as the
database grows, silently (the tests' databases are small, so nothing else would notice). On
PostgreSQL the trap is the *generic* plan a prepared statement settles on after five
executions: made once, from the table sizes of that moment, and kept. A correlated
``EXISTS`` on ``transactions`` was such a statement: planned on a young database it joined a
sequential scan of ``transactions``, and every claim read the whole table from then on
(``docs/benchmarks-log.md``, item 32).

How: on PostgreSQL the store's database is set to ``plan_cache_mode = force_generic_plan`` (the
plan from the first execution on is the one a long-lived connection would keep) and the
server's own counters say how many rows were read by sequential scans; on SQLite every
statement any of the store's connections ran is explained (``EXPLAIN QUERY PLAN``) and must not
``SCAN`` those tables (a ``_due`` partial index may be read whole: it holds only work in
flight). The sagas cover both claims that take the fence check (the happy path's blind
``claim_fresh`` and, after a lost response, ``claim`` with ``RETURNING``) and a worker's claim
pass over several sagas.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from ledger import events, transactions
from ledger.states import TxState
from ledger.store import Chain, Store, Work
from orchestrator.engine import Orchestrator
from providers.fake.faults import FaultKind, FaultRule
from providers.fake.shop import FakeShop
from tests.conftest import DbUrls, pg_connect
from tests.support.bare_store import bare_store, insert_tx
from tests.support.sagas import order, order_saga
from tests.support.world import fast_settings

HOT_TABLES = ("transactions", "operations", "outbox", "ledger")


@pytest.fixture
async def shop(db_urls: DbUrls) -> AsyncIterator[FakeShop]:
    shop = await FakeShop.open(db_urls.provider)
    await shop.seed_stock({"sku-1": 100})
    try:
        yield shop
    finally:
        await shop.close()


async def _in_call(orch: Orchestrator, shop: FakeShop) -> list[str]:
    """Sagas run in the caller (all committed there): their ids."""
    saga = order_saga()
    await orch.register(saga)
    tx_ids = []
    for n in range(8):  # more than five: a generic plan would be chosen by then in any mode
        result = await orch.execute(saga, order(f"plan-{n}"))
        assert result.status is TxState.COMMITTED
        tx_ids.append(result.tx_id)
    # Sagas in flight together: their transactions of one shape leave in batches, each one
    # execution of the statement's batch form (ledger/batched.py), planned here as well.
    for round_ in range(3):
        batch = [orch.execute(saga, order(f"plan-{round_}-{n}")) for n in range(8)]
        for result in await asyncio.gather(*batch):
            assert result.status is TxState.COMMITTED
            tx_ids.append(result.tx_id)
    # A charge whose response is lost: unknown, the lookup, then a claim with RETURNING.
    shop.faults.add(FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", times=1))
    result = await orch.execute(saga, order("plan-lost"))
    assert result.status is TxState.COMMITTED
    assert shop.faults.fired == {FaultKind.LOSE_RESPONSE: 1}
    return [*tx_ids, result.tx_id]


async def _by_workers(orch: Orchestrator) -> list[str]:
    """Sagas handed to the workers: one claim pass takes them all (claim_due, then the heads
    of their chains, several at once), then each is driven."""
    saga = order_saga()
    await orch.register(saga)
    queued = [await orch.enqueue(saga, order(f"plan-queued-{n}")) for n in range(3)]
    await orch.drain()
    for q in queued:
        assert (await orch.result(q.tx_id)).status is TxState.COMMITTED
    return [q.tx_id for q in queued]


async def _ledger_rows(orch: Orchestrator, tx_ids: list[str]) -> int:
    async with orch.store.read() as conn:
        # Read by transaction (the index), not counted: a count would scan the table.
        return sum([len(await events.read(conn, tx_id)) for tx_id in tx_ids])


async def _pg_rows_read_by_scans(url: str, expected_ledger_rows: int) -> dict[str, int]:
    """Rows read by sequential scans per hot table since the last reset, once every closed
    backend's counters are in (a backend reports them as it exits, just after its client has
    gone); then the counters are reset."""
    conn = await pg_connect(url)
    try:
        for _ in range(100):
            rows = await conn.fetch(
                "SELECT relname, seq_tup_read, n_tup_ins FROM pg_stat_user_tables "
                "WHERE relname = ANY($1::text[])",
                list(HOT_TABLES),
            )
            by_name = {r["relname"]: r for r in rows}
            if by_name["ledger"]["n_tup_ins"] >= expected_ledger_rows > 0:
                await conn.execute("SELECT pg_stat_reset()")
                return {name: int(r["seq_tup_read"]) for name, r in by_name.items()}
            await asyncio.sleep(0.1)
        raise AssertionError("the server's table counters never caught up")
    finally:
        await conn.close()


async def _open(db_urls: DbUrls, shop: FakeShop) -> Orchestrator:
    return await Orchestrator.open(
        db_urls.store, providers=shop.providers(), settings=fast_settings()
    )


async def test_saga_statements_read_no_table_whole(
    db_urls: DbUrls, shop: FakeShop, monkeypatch: pytest.MonkeyPatch
) -> None:
    if db_urls.backend == "postgres":
        await _check_postgres(db_urls, shop, monkeypatch)
    else:
        await _check_sqlite(db_urls, shop, monkeypatch)


def _spied_batches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The batch statements (ledger/batched.py) every asyncpg connection runs from now on."""
    batches: list[str] = []
    execute = asyncpg.Connection.execute

    async def spy(self: asyncpg.Connection, query: str, *args: Any, **kw: Any) -> Any:
        if "jsonb_array_elements(" in query:
            batches.append(query)
        return await execute(self, query, *args, **kw)

    monkeypatch.setattr(asyncpg.Connection, "execute", spy)
    return batches


async def _generic_plans_from_now_on(url: str) -> None:
    """The database's new sessions plan every prepared statement generic from its first run
    (what a long-lived connection settles on), and its scan counters start from zero."""
    admin = await pg_connect(url)
    try:
        database = make_url(url).database
        await admin.execute(f'ALTER DATABASE "{database}" SET plan_cache_mode = force_generic_plan')
        await admin.execute("SELECT pg_stat_reset()")
    finally:
        await admin.close()


async def _check_postgres(db_urls: DbUrls, shop: FakeShop, monkeypatch: pytest.MonkeyPatch) -> None:
    batches = _spied_batches(monkeypatch)
    await _generic_plans_from_now_on(db_urls.store)

    orch = await _open(db_urls, shop)
    try:
        rows = await _ledger_rows(orch, await _in_call(orch, shop))
    finally:
        await orch.close()
    assert await _pg_rows_read_by_scans(db_urls.store, rows) == dict.fromkeys(HOT_TABLES, 0)
    assert batches  # some of the sagas' transactions left together, as batch statements

    orch = await _open(db_urls, shop)
    try:
        rows = await _ledger_rows(orch, await _by_workers(orch))
    finally:
        await orch.close()
    scanned = await _pg_rows_read_by_scans(db_urls.store, rows)
    # The heads of the claimed chains are read by key, one index step each, at any size. The
    # other reads of a claim pass (due work, the claimed rows by id) are planned as scans on a
    # database this young, which is right at its size; a generic plan made then is kept until
    # the tables are analyzed (autovacuum's job; docs/benchmarks-log.md, item 33).
    assert scanned["ledger"] == 0


async def _check_sqlite(db_urls: DbUrls, shop: FakeShop, monkeypatch: pytest.MonkeyPatch) -> None:
    traced: set[str] = set()
    connect = sqlite3.connect
    store_path = make_url(db_urls.store).database

    def tracing(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)
        if str(args[0] if args else kwargs.get("database")) == store_path:
            # The writer's statements and every reader's; not the shop's (its own database,
            # whose pool opens connections while the sagas run concurrently).
            conn.set_trace_callback(traced.add)
        return conn

    monkeypatch.setattr(sqlite3, "connect", tracing)
    orch = await _open(db_urls, shop)
    try:
        await _in_call(orch, shop)
        await _by_workers(orch)
    finally:
        await orch.close()

    assert any(s.startswith("UPDATE operations") for s in traced)  # the trace saw the sagas
    path = make_url(db_urls.store).database
    assert path is not None
    db = connect(path)
    try:
        scans, due_reads = [], []
        for sql in traced:
            if sql.split(None, 1)[0].upper() not in {
                "SELECT",
                "WITH",
                "INSERT",
                "UPDATE",
                "DELETE",
            }:
                continue  # transaction control, pragmas, the schema's DDL
            if "sqlite_master" in sql or "alembic_version" in sql:
                continue
            plan = [str(row[-1]) for row in db.execute(f"EXPLAIN QUERY PLAN {sql}")]
            for detail in plan:
                whole = detail.startswith("SCAN") and detail.split()[1] in HOT_TABLES
                # Reading the whole of a ``_due`` index is reading the work in flight only.
                if whole and not re.search(r"USING (COVERING )?INDEX ix_\w+_due$", detail):
                    scans.append((sql[:80], detail))
            if "next_attempt_at IS NULL OR" in sql and sql.startswith("SELECT outbox."):
                due_reads.append((sql[:60], [d for d in plan if "ix_outbox_due" in d]))
        assert scans == []
        # Due outbox events are read through the partial index holding only unsettled ones.
        assert due_reads
        assert [d for d in due_reads if not d[1]] == []
    finally:
        db.close()


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_batch_statements_read_no_table_whole(
    db_urls: DbUrls, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch of transactions of one shape runs as one statement over all its members
    # (ledger/batched.py): an UPDATE joins the members to its table, and a plain join made
    # on a young table is a sequential scan, kept by the generic plan as the table grows.
    # Here every transaction of a round ends at once, so each round's inserts and then its
    # fenced updates leave in batches, on a young database, planned generic from the start.
    batches = _spied_batches(monkeypatch)
    await _generic_plans_from_now_on(db_urls.store)
    members = 8
    async with bare_store(db_urls.store) as store:
        await _reset_scans(db_urls.store)  # the store's own set-up read is not counted
        tx_ids: list[str] = []
        for round_ in range(3):
            ids = [f"tx-{round_}-{n}" for n in range(members)]
            claims = await _all_at_once(store, [_inserting(i) for i in ids])
            async with store.read() as conn:
                chains = [await events.chain_of(conn, i) for i in ids]
            await _all_at_once(
                store,
                [_failing(chain, claim) for chain, claim in zip(chains, claims, strict=True)],
            )
            tx_ids += ids
        async with store.read() as conn:
            rows = sum([len(await events.read(conn, tx_id)) for tx_id in tx_ids])
            for tx_id in tx_ids:
                record = await transactions.get(conn, tx_id)
                assert record is not None and record.status is TxState.FAILED
                assert await events.verify(conn, tx_id) == []
    assert any("CROSS JOIN LATERAL" in q for q in batches)  # the updates', at least once
    assert any("generate_series" in q for q in batches)  # the inserts' ledger rows
    assert await _pg_rows_read_by_scans(db_urls.store, rows) == dict.fromkeys(HOT_TABLES, 0)


async def _reset_scans(url: str) -> None:
    conn = await pg_connect(url)
    try:
        await conn.execute("SELECT pg_stat_reset()")
    finally:
        await conn.close()


async def _all_at_once(store: Store, bodies: list[Callable[[Work], Awaitable[Any]]]) -> list[Any]:
    """One local transaction per body, all ending together; each body's result."""
    at_end = asyncio.Barrier(len(bodies))

    async def one(body: Callable[[Work], Awaitable[Any]]) -> Any:
        async with store.transaction() as work:
            result = await body(work)
            await at_end.wait()
        return result

    return list(await asyncio.gather(*(one(b) for b in bodies)))


def _inserting(tx_id: str) -> Callable[[Work], Awaitable[transactions.TxClaim]]:
    async def body(work: Work) -> transactions.TxClaim:
        return await insert_tx(work, tx_id)

    return body


def _failing(chain: Chain, claim: transactions.TxClaim) -> Callable[[Work], Awaitable[None]]:
    async def body(work: Work) -> None:
        await transactions.transition(work, chain, claim, TxState.FAILED, action="f")

    return body
