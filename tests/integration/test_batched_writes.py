"""Held-back writes (ledger/batched.py, Work.write): one statement per transaction on PostgreSQL.

On SQLite every write runs at once (except with the writer process, where they are held back and
shipped: ``test_sqlite_writer.py``, and this module again in CI's second SQLite pass); on
PostgreSQL they are held back and sent with the ledger rows as one statement of data-modifying
CTEs. The observable behaviour must be the same on both — checked here on both backends — and
only the cost differs. What could break: a lease lost in the combined statement committing the
transaction's other writes; a read inside the transaction not seeing an earlier write; two
writes to one row in one statement (one snapshot) losing the second; ledger rows of one
statement landing out of ``seq`` order (the chain would not verify); a duplicate transaction
reported as anything but :class:`DuplicateKey`; and — a cost — a transaction of blind writes
taking more than one statement and one round trip.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from ledger import events, transactions
from ledger.errors import DuplicateKey, LeaseLost
from ledger.states import TxState
from ledger.store import Chain, Store
from tests.conftest import DbUrls
from tests.support.bare_store import bare_store, insert_tx


@pytest.fixture
async def store(db_urls: DbUrls) -> AsyncIterator[Store]:
    async with bare_store(db_urls.store) as store:
        yield store


_insert = insert_tx


async def _status(store: Store, tx_id: str) -> TxState | None:
    async with store.read() as conn:
        record = await transactions.get(conn, tx_id)
    return None if record is None else record.status


async def test_a_lost_lease_undoes_the_transactions_other_writes(store: Store) -> None:
    async with store.transaction() as work:
        txc = await _insert(work, "tx-a")
    stale = transactions.TxClaim("tx-a", txc.fence + 1, txc.status, txc.owner)
    with pytest.raises(LeaseLost) as lost:
        async with store.transaction() as work:
            await _insert(work, "tx-b")  # a good write first
            chain = await events.chain_of(work.conn, "tx-a")
            await transactions.transition(work, chain, stale, TxState.FAILED, action="fail")
    assert "transaction tx-a" in str(lost.value)
    assert await _status(store, "tx-b") is None  # nothing of that transaction was committed
    assert await _status(store, "tx-a") is TxState.EXECUTING


async def test_a_read_inside_the_transaction_sees_its_earlier_writes(store: Store) -> None:
    async with store.transaction() as work:
        txc = await _insert(work, "tx-r")
        inside = await transactions.get(work.conn, "tx-r")  # a read through SQLAlchemy
        assert inside is not None and inside.status is TxState.EXECUTING
        chain = Chain("tx-r", work._heads["tx-r"][1])
        await transactions.transition(work, chain, txc, TxState.FAILED, action="fail")
        after = await transactions.get(work.conn, "tx-r")
        assert after is not None and after.status is TxState.FAILED
    assert await _status(store, "tx-r") is TxState.FAILED


async def test_two_writes_to_one_row_in_one_transaction_both_apply(store: Store) -> None:
    async with store.transaction() as work:
        txc = await _insert(work, "tx-2")
    async with store.transaction() as work:
        chain = await events.chain_of(work.conn, "tx-2")
        txc = await transactions.transition(
            work, chain, txc, TxState.COMPENSATING, action="compensate"
        )
        # The same row again: on PostgreSQL the first write must be sent before this one.
        await transactions.transition(work, chain, txc, TxState.FAILED, action="fail")
    assert await _status(store, "tx-2") is TxState.FAILED
    async with store.read() as conn:
        entries = await events.read(conn, "tx-2")
        assert await events.verify(conn, "tx-2") == []
    assert [e.to_state for e in entries] == ["prepared", "executing", "compensating", "failed"]


async def test_many_ledger_rows_of_one_statement_keep_their_chain_order(store: Store) -> None:
    async with store.transaction() as work:
        for n in range(6):
            await _insert(work, f"tx-l{n}")  # two ledger rows each, twelve in all
    async with store.read() as conn:
        for n in range(6):
            assert await events.verify(conn, f"tx-l{n}") == []
            assert [e.action for e in await events.read(conn, f"tx-l{n}")] == ["prepare", "start"]


async def test_send_writes_raises_a_lost_lease_inside_the_block(store: Store) -> None:
    async with store.transaction() as work:
        txc = await _insert(work, "tx-s")
    stale = transactions.TxClaim("tx-s", txc.fence + 1, txc.status, txc.owner)
    caught = False
    with pytest.raises(LeaseLost):  # the block still fails: its transaction is spoiled
        async with store.transaction() as work:
            chain = await events.chain_of(work.conn, "tx-s")
            try:
                await transactions.transition(work, chain, stale, TxState.FAILED, action="fail")
                await work.send_writes()
            except LeaseLost:
                caught = True
                raise
    assert caught


async def test_a_transaction_of_blind_writes_is_one_statement_and_one_round_trip(
    store: Store, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_begins = [0]
    if backend == "postgres":
        from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_connection as A

        start = A._start_transaction

        async def counting(self: Any) -> None:
            server_begins[0] += 1
            await start(self)  # type: ignore[no-untyped-call]

        monkeypatch.setattr(A, "_start_transaction", counting)
    before = store.stats.snapshot()
    async with store.transaction() as work:
        await _insert(work, "tx-one")  # a transaction row and two ledger rows
    statements = store.stats.statements - before.statements
    assert store.stats.commits - before.commits == 1
    if backend == "postgres":
        # One statement, sent as the transaction's first and only one: no BEGIN went out.
        assert statements == 1
        assert server_begins == [0]
        async with store.transaction() as work:
            await events.chain_of(work.conn, "tx-one")  # a read: now it is a real transaction
            await _insert(work, "tx-two")
        assert server_begins == [1]
    else:
        assert statements == 2  # the insert, then the ledger rows
    assert await _status(store, "tx-one") is TxState.EXECUTING


async def test_a_stale_fence_is_reported_before_a_later_writes_duplicate_key(
    store: Store,
) -> None:
    # As one by one: the fenced write fails first, so the caller learns it lost the lease (a
    # stale holder re-recording what the new holder already wrote), not a duplicate key.
    async with store.transaction() as work:
        txc = await _insert(work, "tx-o")
        await _insert(work, "tx-taken")
    stale = transactions.TxClaim("tx-o", txc.fence + 1, txc.status, txc.owner)
    with pytest.raises(LeaseLost) as lost:
        async with store.transaction() as work:
            chain = await events.chain_of(work.conn, "tx-o")
            await transactions.transition(work, chain, stale, TxState.FAILED, action="fail")
            await _insert(work, "tx-taken")  # would be a DuplicateKey
    assert "transaction tx-o" in str(lost.value)


async def test_a_held_writes_error_surfaces_at_the_next_read_and_spoils_nothing_else(
    store: Store,
) -> None:
    async with store.transaction() as work:
        await _insert(work, "tx-d")
    with pytest.raises(DuplicateKey):
        async with store.transaction() as work:
            await _insert(work, "tx-fresh")
            await _insert(work, "tx-d")  # SQLite: raised here; PostgreSQL: at the next read
            await transactions.get(work.conn, "tx-d")
    assert await _status(store, "tx-fresh") is None
    # The store (and its pool) is fine afterwards.
    async with store.transaction() as work:
        await _insert(work, "tx-after")
    assert await _status(store, "tx-after") is TxState.EXECUTING
