"""Hot-path DML on the driver connection (ledger/hot.py), against SQLAlchemy's own path.

What could break: a statement taking the hot path with different SQL, parameters or JSON
encoding than SQLAlchemy would have used (checked by reading rows back through SQLAlchemy on
both backends); a driver error escaping untranslated (a duplicate key must still be
:class:`DuplicateKey`, a stale ledger head still :class:`LeaseLost`); an ineligible statement
(``RETURNING``, a Python-side default) taking the hot path; the statement counter missing the
hot statements; and — a cost — the hot statements of a saga quietly falling back to
SQLAlchemy's execute path on SQLite.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import (
    JSON,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    bindparam,
    event,
    insert,
    select,
    text,
    update,
)

from ledger import events, sqlite_inline, transactions
from ledger.errors import DuplicateKey, LeaseLost, StoreUnavailable
from ledger.hot import Compiled, _builder, _compile
from ledger.schema import ledger as ledger_table
from ledger.schema import transactions as tx_table
from ledger.states import TxState
from ledger.store import Chain, Store
from tests.conftest import DbUrls, _pg_execute
from tests.support.bare_store import bare_store, insert_tx


@pytest.fixture
async def store(db_urls: DbUrls) -> AsyncIterator[Store]:
    async with bare_store(db_urls.store) as store:
        yield store


def _cursor_events(store: Store) -> list[str]:
    """Statements that went through SQLAlchemy's execute path (its cursor events)."""
    seen: list[str] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if not statement.startswith(("BEGIN", "PRAGMA", "COMMIT")):
            seen.append(statement)

    event.listen(store.engine.sync_engine, "before_cursor_execute", on_execute)
    return seen


async def _insert_tx(store: Store, tx_id: str, inputs: dict[str, Any]) -> transactions.TxClaim:
    async with store.transaction() as work:
        return await insert_tx(work, tx_id, inputs, context={"nested": {"k": [1, "two", None]}})


async def test_hot_writes_read_back_as_sqlalchemy_wrote_them(store: Store) -> None:
    inputs = {"amount": 1200, "note": 'für Ω "quoted"', "list": [1, 2.5, None, True]}
    txc = await _insert_tx(store, "tx-hot-1", inputs)
    async with store.transaction() as work:
        chain = await events.chain_of(work.conn, "tx-hot-1")
        await transactions.transition(
            work, chain, txc, TxState.FAILED, action="fail", error={"code": "x", "n": 1}
        )
    async with store.read() as conn:
        record = await transactions.get(conn, "tx-hot-1")
        rows = (await conn.execute(select(ledger_table.c.action, ledger_table.c.to_state))).all()
    assert record is not None
    assert record.inputs == inputs
    assert record.context == {"nested": {"k": [1, "two", None]}}
    assert record.status is TxState.FAILED
    assert record.error == {"code": "x", "n": 1}
    assert record.lease_owner is None and record.fence == 1
    assert [tuple(r) for r in rows] == [
        ("prepare", "prepared"),
        ("start", "executing"),
        ("fail", "failed"),
    ]


async def test_a_duplicate_key_on_the_hot_path_is_still_duplicate_key(store: Store) -> None:
    await _insert_tx(store, "tx-dup", {})
    with pytest.raises(DuplicateKey):
        await _insert_tx(store, "tx-dup", {})
    async with store.read() as conn:
        assert len(await events.read(conn, "tx-dup")) == 2  # nothing of the second attempt


async def test_a_stale_chain_head_on_the_hot_path_is_still_lease_lost(store: Store) -> None:
    txc = await _insert_tx(store, "tx-stale", {})
    stale = Chain("tx-stale")  # genesis head: the ledger already has two rows after it
    with pytest.raises(LeaseLost):
        async with store.transaction() as work:
            await transactions.transition(work, stale, txc, TxState.FAILED, action="fail")
    async with store.read() as conn:
        record = await transactions.get(conn, "tx-stale")
    assert record is not None and record.status is TxState.EXECUTING  # rolled back whole


async def test_a_fenced_write_that_matches_no_row_reports_zero(store: Store) -> None:
    txc = await _insert_tx(store, "tx-fence", {})
    wrong = transactions.TxClaim("tx-fence", txc.fence + 1, txc.status, txc.owner)
    with pytest.raises(LeaseLost):
        async with store.transaction() as work:
            chain = await events.chain_of(work.conn, "tx-fence")
            await transactions.transition(work, chain, wrong, TxState.FAILED, action="fail")


async def test_hot_statements_are_counted_and_skip_sqlalchemys_execute_path(
    store: Store, backend: str
) -> None:
    seen = _cursor_events(store)
    before = store.stats.snapshot()
    txc = await _insert_tx(store, "tx-count", {"a": 1})
    async with store.transaction() as work:
        chain = await events.chain_of(work.conn, "tx-count")
        await transactions.transition(work, chain, txc, TxState.FAILED, action="fail")
    counted = store.stats.statements - before.statements
    if backend == "sqlite":
        # insert, ledger rows; the chain's read, transition, ledger row
        assert counted == 5
    else:
        # insert + ledger rows as one statement; the chain's read; transition + ledger row
        assert counted == 3
    # Every write went to the driver directly; only the chain's read used SQLAlchemy's path.
    assert [s for s in seen if "SELECT" not in s] == []
    assert len(seen) == 1


class _CursorCounting(sqlite3.Connection):
    """A SQLite connection that counts the calls making a cursor of their own."""

    made = 0

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        _CursorCounting.made += 1
        return super().cursor(*args, **kwargs)

    def execute(self, *args: Any) -> Any:
        _CursorCounting.made += 1
        return super().execute(*args)

    def executemany(self, *args: Any) -> Any:
        _CursorCounting.made += 1
        return super().executemany(*args)


async def test_sqlite_hot_statements_share_one_cursor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cost: each cursor is an object and a weak reference the connection registers. The
    # cursors a write transaction makes (its BEGIN, its reads) must not grow with its writes.
    connect = sqlite3.connect
    monkeypatch.setattr(
        sqlite_inline.sqlite3,
        "connect",
        lambda *args, **kwargs: connect(*args, factory=_CursorCounting, **kwargs),
    )
    made: list[int] = []
    async with bare_store(f"sqlite+aiosqlite:///{tmp_path / 'agent.db'}") as store:
        touch = store.statement(
            ("test", "touch"),
            lambda _now: (
                update(tx_table)
                .where(tx_table.c.tx_id == bindparam("t"))
                .values(updated_at=bindparam("u"))
            ),
        )
        for n, writes in enumerate((1, 6)):
            txc = await _insert_tx(store, f"tx-cursor-{n}", {})
            before = _CursorCounting.made
            async with store.transaction() as work:
                chain = await events.chain_of(work.conn, txc.tx_id)
                for u in range(writes):
                    assert await work.execute(touch, {"t": txc.tx_id, "u": u}) == 1
                await transactions.transition(work, chain, txc, TxState.FAILED, action="fail")
            made.append(_CursorCounting.made - before)
    assert made[0] == made[1], made


async def test_a_connection_lost_under_a_hot_statement_is_unavailable_and_replaced(
    store: Store, backend: str
) -> None:
    if backend != "postgres":
        pytest.skip("a SQLite file has no server connection to lose")
    txc = await _insert_tx(store, "tx-lost", {})
    with pytest.raises(StoreUnavailable):
        async with store.transaction() as work:
            chain = await events.chain_of(work.conn, "tx-lost")
            pid = (await work.conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            await _pg_execute(f"SELECT pg_terminate_backend({int(pid)})")
            await transactions.transition(work, chain, txc, TxState.FAILED, action="fail")
    # SQLAlchemy invalidated the connection (and the pool's older ones): the next one is new.
    async with store.read() as conn:
        record = await transactions.get(conn, "tx-lost")
    assert record is not None and record.status is TxState.EXECUTING


_meta = MetaData()
_defaulted = Table(
    "defaulted",
    _meta,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("v", String(8), default="dflt"),
    Column("w", String(8), onupdate="upd"),
)


def test_only_statements_sqlalchemy_does_nothing_with_are_eligible(store: Store) -> None:
    dialect = store.engine.sync_engine.dialect
    assert _compile(insert(_defaulted), dialect, ("id", "v")) is not None
    # A Python-side default SQLAlchemy would fill in, an onupdate, or RETURNING rows: not hot.
    assert _compile(insert(_defaulted), dialect, ("id",)) is None
    assert _compile(update(_defaulted).values(v="x"), dialect, ()) is None
    returning = insert(_defaulted).returning(_defaulted.c.id)
    assert _compile(returning, dialect, ("id", "v", "w")) is None
    assert _compile(select(_defaulted.c.id), dialect, ()) is None


_mixed = Table(
    "mixed",
    _meta,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("doc", JSON),
    Column("state", String(16)),
    Column("odd name%", String(8)),  # a bind name SQLAlchemy has to escape
)


def _as_sqlalchemy_builds_them(compiled: Compiled, params: dict[str, Any]) -> tuple[Any, ...]:
    values = compiled.compiled.construct_params(params, _check=False)
    return tuple(
        values[name] if proc is None else proc(values[name])
        for name, proc in zip(compiled.names, compiled.processors, strict=True)
    )


def test_arguments_are_what_sqlalchemy_would_bind(store: Store) -> None:
    dialect = store.engine.sync_engine.dialect
    stmt = (
        update(_mixed)
        .where(_mixed.c.id == bindparam("id_"))
        .values(doc=bindparam("doc"), state="executing", **{"odd name%": bindparam("odd")})
    )
    compiled = _compile(stmt, dialect, ("id_", "doc", "odd"))
    assert compiled is not None and compiled.build is not None
    params = {"id_": 3, "doc": {"k": [1, "é", None]}, "odd": "x"}
    assert compiled.arguments(params) == _as_sqlalchemy_builds_them(compiled, params)
    rows = insert(_mixed)
    compiled = _compile(rows, dialect, ("id", "doc", "state"))
    assert compiled is not None and compiled.build is not None
    params = {"id": 1, "doc": None, "state": "pending"}
    assert compiled.arguments(params) == _as_sqlalchemy_builds_them(compiled, params)
    # One position: the generated tuple display needs its trailing comma.
    compiled = _compile(insert(_mixed), dialect, ("id",))
    assert compiled is not None and compiled.build is not None
    assert compiled.arguments({"id": 7}) == (7,) == _as_sqlalchemy_builds_them(compiled, {"id": 7})
    # The generated function embeds keys as string literals: any text is a key.
    odd_keys = ("it's", 'say "x"', "back\\slash", "new\nline", "é")
    build = _builder((*((k, None, None) for k in odd_keys), (None, None, "c")))
    assert build({k: i for i, k in enumerate(odd_keys)}) == (0, 1, 2, 3, 4, "c")
    # A value computed per execution is left to SQLAlchemy, every time.
    ticks = iter(range(100))
    per_call = (
        update(_mixed)
        .where(_mixed.c.id == bindparam("id_"))
        .values(state=bindparam("s", callable_=lambda: f"t{next(ticks)}"))
    )
    compiled = _compile(per_call, dialect, ("id_",))
    assert compiled is not None and compiled.build is None
    assert compiled.arguments({"id_": 1}) != compiled.arguments({"id_": 1})


async def test_every_hot_statement_of_a_transaction_binds_what_sqlalchemy_would(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = Compiled.arguments
    checked: list[str] = []

    def both(self: Compiled, params: Any) -> tuple[Any, ...]:
        args = fast(self, params)
        assert args == _as_sqlalchemy_builds_them(self, dict(params)), self.sql
        checked.append(self.sql)
        return args

    monkeypatch.setattr(Compiled, "arguments", both)
    txc = await _insert_tx(store, "tx-args", {"amount": 5, "note": "ü"})
    async with store.transaction() as work:
        chain = await events.chain_of(work.conn, "tx-args")
        await transactions.transition(
            work, chain, txc, TxState.FAILED, action="fail", error={"code": "x"}
        )
    assert len(set(checked)) >= 3  # the insert, its ledger rows, the transition
