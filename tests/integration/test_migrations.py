"""The packaged Alembic migrations on both backends.

* upgrading an empty database reaches ``HEAD`` and builds exactly ``ledger.schema.metadata``;
* the database itself refuses UPDATE / DELETE (and TRUNCATE on PostgreSQL) of ledger rows;
* the CHECK constraints and the partial unique business-key index hold on both backends;
* ``upgrade()`` is one transaction, serialised across processes (advisory lock / SQLite's write
  lock), and concurrent callers on a fresh database all succeed;
* ``ensure_schema()`` upgrades only what it is allowed to and refuses unknown revisions.

SQLite runs each upgrade test twice: with a plain ``create_async_engine`` (the driver issues no
BEGIN before DDL) and with the store's recipe (driver transaction control off, ``BEGIN IMMEDIATE``
on begin). ``store`` uses the real engine factory, :func:`ledger.dialects.create_engine`.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import (
    CheckConstraint,
    Connection,
    event,
    func,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from ledger import dialects, events, migrate, schema
from ledger.errors import MigrationFailed, SchemaOutdated
from ledger.states import EffectState

if TYPE_CHECKING:
    from tests.conftest import DbUrls

FLAVORS = ("plain", "recipe", "store")
EngineFactory = Callable[..., AsyncEngine]


def _make_engine(url: str, flavor: str) -> AsyncEngine:
    if flavor == "store":
        return dialects.create_engine(url)
    engine = create_async_engine(url)
    if engine.dialect.name != "sqlite":
        return engine

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        if flavor == "recipe":
            dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    if flavor == "recipe":

        @event.listens_for(engine.sync_engine, "begin")
        def _on_begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


@pytest.fixture
async def make_engine(db_urls: DbUrls) -> AsyncIterator[EngineFactory]:
    """``make_engine(flavor="recipe")``: an engine on the test's store database, disposed after."""
    created: list[AsyncEngine] = []

    def make(flavor: str = "recipe") -> AsyncEngine:
        engine = _make_engine(db_urls.store, flavor)
        created.append(engine)
        return engine

    yield make
    for engine in created:
        await engine.dispose()


@pytest.fixture(params=FLAVORS)
def flavor(request: pytest.FixtureRequest, backend: str) -> str:
    name = str(request.param)
    if name == "recipe" and backend != "sqlite":
        pytest.skip("the BEGIN IMMEDIATE recipe is SQLite-only")
    return name


@pytest.fixture
async def engine(make_engine: EngineFactory) -> AsyncEngine:
    """A store-like engine on a database already upgraded to HEAD."""
    eng = make_engine("recipe")
    await migrate.upgrade(eng)
    return eng


# -- helpers ------------------------------------------------------------------------------------


async def _tables(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        names = await conn.run_sync(lambda c: inspect(c).get_table_names())
    return set(names)


async def _seed_tx(engine: AsyncEngine, tx_id: str = "tx1", **overrides: Any) -> None:
    values: dict[str, Any] = {
        "tx_id": tx_id,
        "definition_digest": "d" * 64,
        "saga_name": "saga",
        "business_key": None,
        "inputs": {"order": 42},
        "status": "executing",
        "created_at": 1,
        "updated_at": 1,
    }
    values.update(overrides)
    async with engine.begin() as conn:
        exists = await conn.scalar(
            select(schema.saga_definitions.c.digest).where(
                schema.saga_definitions.c.digest == "d" * 64
            )
        )
        if exists is None:
            await conn.execute(
                insert(schema.saga_definitions).values(
                    digest="d" * 64, name="saga", definition={"steps": []}, created_at=1
                )
            )
        await conn.execute(insert(schema.transactions).values(**values))


def _op_row(op_key: str, **overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "op_key": op_key,
        "tx_id": "tx1",
        "step": op_key,
        "provider": "bank",
        "action": "charge",
        "ordinal": 0,
        "state": "pending",
        "updated_at": 1,
    }
    row.update(overrides)
    return row


async def _insert(engine: AsyncEngine, table: Any, row: dict[str, Any]) -> None:
    async with engine.begin() as conn:
        await conn.execute(insert(table).values(**row))


# -- upgrade ------------------------------------------------------------------------------------


def test_the_written_out_revisions_are_the_packaged_scripts() -> None:
    # migrate.REVISIONS is written out so that opening a store needs no Alembic; this is what
    # keeps it honest when a migration is added.
    scripts = ScriptDirectory.from_config(migrate.alembic_config())
    oldest_first = tuple(reversed([script.revision for script in scripts.walk_revisions()]))
    assert oldest_first == migrate.REVISIONS
    assert scripts.get_heads() == [migrate.HEAD]
    assert set(oldest_first) == migrate.KNOWN_REVISIONS
    assert migrate.MIGRATIONS_DIR.joinpath("versions", "0001_initial.py").is_file()


async def test_opening_a_store_at_head_does_not_import_alembic(engine: AsyncEngine) -> None:
    # Every command opens a store; importing Alembic and parsing its scripts was a tenth of
    # each command's start-up. Only migrating imports it now. On both backends: the revision
    # is read through each dialect's has_table.
    url = engine.url.render_as_string(hide_password=False)
    code = (
        "import asyncio, sys\n"
        "from ledger.store import Store\n"
        "async def main():\n"
        f"    store = await Store.open({url!r})\n"
        "    await store.close()\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))\n"
    )
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await child.communicate()
    assert child.returncode == 0, err.decode()
    assert out.decode().strip() == "[]"


async def test_upgrade_empty_database_reaches_head(make_engine: EngineFactory, flavor: str) -> None:
    eng = make_engine(flavor)
    assert await migrate.current_revision(eng) is None
    await migrate.upgrade(eng)
    assert await migrate.current_revision(eng) == migrate.HEAD
    assert set(schema.metadata.tables) <= await _tables(eng)
    await migrate.upgrade(eng)  # idempotent at head
    assert await migrate.current_revision(eng) == migrate.HEAD


def _schema_diff(connection: Connection) -> list[Any]:
    dialect = connection.dialect.name

    def exists_here(_obj: Any, name: str | None, *_: Any) -> bool:
        return schema.exists_on(dialect, name)

    context = MigrationContext.configure(
        connection,
        opts={
            "compare_type": True,
            "compare_server_default": True,
            "include_object": exists_here,
        },
    )
    return list(compare_metadata(context, schema.metadata))


async def test_migrated_schema_matches_metadata(engine: AsyncEngine) -> None:
    # Alembic compares tables, columns (types, nullability, server defaults), indexes, unique
    # constraints and foreign keys. It never compares CHECK constraints or index predicates;
    # the two tests below check those against the metadata by name / by behaviour.
    async with engine.connect() as conn:
        diff = await conn.run_sync(_schema_diff)
    assert diff == []


def _checks(connection: Connection, tables: Iterable[str]) -> dict[str, dict[str, str]]:
    """Per table, its CHECK constraints as the database holds them: name → condition."""
    inspector = inspect(connection)
    return {
        table: {str(c["name"]): str(c["sqltext"]) for c in inspector.get_check_constraints(table)}
        for table in tables
    }


def _check_names(connection: Connection) -> dict[str, set[str]]:
    return {t: set(checks) for t, checks in _checks(connection, schema.metadata.tables).items()}


async def test_check_constraints_match_metadata_by_name(engine: AsyncEngine) -> None:
    dialect = engine.dialect.name
    expected = {
        name: {
            str(c.name)
            for c in table.constraints
            if isinstance(c, CheckConstraint) and schema.exists_on(dialect, str(c.name))
        }
        for name, table in schema.metadata.tables.items()
    }
    async with engine.connect() as conn:
        actual = await conn.run_sync(_check_names)
    assert actual == expected
    if dialect == "sqlite":  # one CHECK per rule
        assert "ck_operations_executing_has_lease" in actual["operations"]
    else:  # one CHECK per table, naming the failed rule when it refuses (migration 0006)
        assert actual["operations"] == {"ck_operations_rules"}


def _business_key_index(connection: Connection) -> dict[str, Any]:
    for index in inspect(connection).get_indexes("transactions"):
        if index["name"] == "uq_transactions_business_key_live":
            return dict(index)
    raise AssertionError("uq_transactions_business_key_live missing")


async def test_business_key_index_is_partial(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        index = await conn.run_sync(_business_key_index)
    assert index["unique"]
    assert index["column_names"] == ["business_key"]
    predicate = " ".join(str(v) for v in index.get("dialect_options", {}).values()).lower()
    assert "business_key is not null" in predicate
    assert "failed" in predicate
    assert "compensated" in predicate


def _triggers(connection: Connection) -> set[str]:
    if connection.dialect.name == "postgresql":
        rows = connection.exec_driver_sql(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'ledger'::regclass AND NOT tgisinternal"
        )
    else:
        rows = connection.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'ledger'"
        )
    return {str(r[0]) for r in rows}


async def test_append_only_triggers_installed(engine: AsyncEngine, backend: str) -> None:
    async with engine.connect() as conn:
        names = await conn.run_sync(_triggers)
    expected = {"ledger_append_only_update", "ledger_append_only_delete"}
    if backend == "postgres":
        expected.add("ledger_append_only_truncate")
    assert names == expected


# -- the ledger is append-only ------------------------------------------------------------------


async def _seed_ledger(engine: AsyncEngine) -> dict[str, Any]:
    await _seed_tx(engine)
    row = {
        "tx_id": "tx1",
        "subject": None,
        "action": "tx.created",
        "from_state": None,
        "to_state": "executing",
        "detail": "{}",
        "created_at": 1,
        "prev_hash": "0" * 64,
        "hash": "a" * 64,
    }
    await _insert(engine, schema.ledger, row)
    return row


async def _ledger_rows(engine: AsyncEngine) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        result = await conn.execute(select(schema.ledger).order_by(schema.ledger.c.seq))
        return [dict(r._mapping) for r in result]


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE ledger SET action = 'x'",
        "UPDATE ledger SET hash = 'b' WHERE seq = 1",
        "DELETE FROM ledger",
        "DELETE FROM ledger WHERE tx_id = 'tx1'",
    ],
)
async def test_ledger_update_and_delete_refused(engine: AsyncEngine, sql: str) -> None:
    row = await _seed_ledger(engine)
    before = await _ledger_rows(engine)
    assert len(before) == 1
    assert before[0]["seq"] == 1
    assert {k: before[0][k] for k in row} == row

    with pytest.raises(IntegrityError, match="append-only"):
        async with engine.begin() as conn:
            await conn.execute(text(sql))
    assert await _ledger_rows(engine) == before


async def test_ledger_core_update_refused(engine: AsyncEngine) -> None:
    await _seed_ledger(engine)
    before = await _ledger_rows(engine)
    with pytest.raises(IntegrityError, match="append-only"):
        async with engine.begin() as conn:
            await conn.execute(update(schema.ledger).values(detail='{"forged":true}'))
    assert await _ledger_rows(engine) == before


async def test_ledger_insert_still_allowed(engine: AsyncEngine) -> None:
    await _seed_ledger(engine)
    await _insert(
        engine,
        schema.ledger,
        {
            "tx_id": "tx1",
            "action": "op.claimed",
            "detail": "{}",
            "created_at": 2,
            "prev_hash": "a" * 64,
            "hash": "c" * 64,
        },
    )
    assert [r["seq"] for r in await _ledger_rows(engine)] == [1, 2]


@pytest.mark.parametrize(
    ("sql", "refusal"),
    [
        ("TRUNCATE ledger", "append-only"),
        # Migration 0007: the transactions' own trigger, where the ledger's key used to cascade.
        ("TRUNCATE transactions CASCADE", "transactions are kept"),
    ],
)
async def test_ledger_truncate_refused_on_postgres(
    engine: AsyncEngine, backend: str, sql: str, refusal: str
) -> None:
    if backend != "postgres":
        pytest.skip("SQLite has no TRUNCATE (DELETE is covered above)")
    await _seed_ledger(engine)
    before = await _ledger_rows(engine)
    with pytest.raises(IntegrityError, match=refusal):
        async with engine.begin() as conn:
            await conn.execute(text(sql))
    assert await _ledger_rows(engine) == before
    async with engine.connect() as conn:
        assert await conn.scalar(select(func.count()).select_from(schema.transactions)) == 1


def _orphan_entry(tx_id: str) -> dict[str, Any]:
    return {
        "tx_id": tx_id,
        "subject": None,
        "action": "prepare",
        "from_state": None,
        "to_state": "prepared",
        "detail": "{}",
        "created_at": 1,
        "prev_hash": "0" * 64,
        "hash": "f" * 64,
    }


async def test_a_transaction_with_ledger_entries_cannot_be_deleted(engine: AsyncEngine) -> None:
    # SQLite: the ledger's foreign key refuses it. PostgreSQL (migration 0007): no key, and the
    # transactions' statement trigger refuses any DELETE.
    await _seed_ledger(engine)
    with pytest.raises(IntegrityError):
        async with engine.begin() as conn:
            await conn.execute(text("DELETE FROM transactions WHERE tx_id = 'tx1'"))
    async with engine.connect() as conn:
        assert await conn.scalar(select(func.count()).select_from(schema.transactions)) == 1


async def test_an_entry_for_no_transaction_is_refused_or_reported(
    engine: AsyncEngine, backend: str
) -> None:
    await _seed_ledger(engine)
    if backend == "sqlite":
        with pytest.raises(IntegrityError, match="FOREIGN KEY"):
            await _insert(engine, schema.ledger, _orphan_entry("ghost"))
        return
    # PostgreSQL has no key to refuse it at insert (migration 0007); verify reports it.
    await _insert(engine, schema.ledger, _orphan_entry("ghost"))
    async with engine.connect() as conn:
        problems = await events.verify(conn)
    assert ("ghost", None, "ledger entries for no transaction") in [
        (p.tx_id, p.seq, p.problem) for p in problems
    ]
    assert all(p.tx_id != "tx1" or "no transaction" not in p.problem for p in problems)


async def test_0007_drops_the_ledger_key_on_postgresql_only_and_goes_back(
    make_engine: EngineFactory, backend: str
) -> None:
    eng = make_engine("recipe" if backend == "sqlite" else "store")
    await migrate.upgrade(eng, "0006")
    await _seed_ledger(eng)
    assert await _ledger_foreign_keys(eng) == {"fk_ledger_tx_id_transactions"}

    await migrate.upgrade(eng, "0007")
    kept = await _ledger_foreign_keys(eng)
    assert kept == (set() if backend == "postgres" else {"fk_ledger_tx_id_transactions"})
    assert len(await _ledger_rows(eng)) == 1

    await migrate.downgrade(eng, "0006")
    assert await _ledger_foreign_keys(eng) == {"fk_ledger_tx_id_transactions"}
    if backend == "postgres":
        async with eng.connect() as conn:
            left = await conn.scalar(
                text("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'transactions_kept_%'")
            )
        assert left == 0
    with pytest.raises(IntegrityError):  # the key refuses an entry for no transaction again
        await _insert(eng, schema.ledger, _orphan_entry("ghost"))


def _orphan_rows() -> list[tuple[Any, dict[str, Any], str]]:
    """One row of each kind whose parent does not exist, and what ``verify`` calls it."""
    effect = {
        "provider": "bank",
        "action": "charge",
        "ordinal": 0,
        "state": "pending",
        "updated_at": 1,
        "tx_id": "ghost",
    }
    return [
        (schema.operations, {**effect, "op_key": "op-ghost", "step": "charge"}, "operations"),
        (schema.outbox, {**effect, "event_key": "ev-ghost", "kind": "receipt"}, "outbox events"),
        (
            schema.compensation_steps,
            {**effect, "op_key": "comp-ghost", "forward_op_key": "op-real", "step": "charge"},
            "compensation steps",
        ),
    ]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["operations", "outbox", "compensation_steps"])
async def test_an_effect_for_no_transaction_is_refused_or_reported(
    engine: AsyncEngine, backend: str, index: int
) -> None:
    await _seed_ledger(engine)
    await _insert(engine, schema.operations, _op_row("op-real"))  # a compensation's forward op
    table, row, kind = _orphan_rows()[index]
    if backend == "sqlite":
        with pytest.raises(IntegrityError, match="FOREIGN KEY"):
            await _insert(engine, table, row)
        return
    # PostgreSQL has no key to refuse it at insert (migration 0008); verify reports it.
    await _insert(engine, table, row)
    async with engine.connect() as conn:
        problems = [(p.tx_id, p.seq, p.problem) for p in await events.verify(conn)]
    assert ("ghost", None, f"{kind} for no transaction") in problems
    assert [p for p in problems if p[0] == "tx1" and "no transaction" in p[2]] == []


async def test_a_transaction_of_no_definition_is_refused_or_reported(
    engine: AsyncEngine, backend: str
) -> None:
    await _seed_ledger(engine)
    if backend == "sqlite":
        with pytest.raises(IntegrityError, match="FOREIGN KEY"):
            await _seed_tx(engine, "tx-lost", definition_digest="e" * 64)
        return
    await _seed_tx(engine, "tx-lost", definition_digest="e" * 64)
    async with engine.connect() as conn:
        problems = [(p.tx_id, p.problem) for p in await events.verify(conn)]
    assert ("tx-lost", "a transaction of no definition") in problems
    assert ("tx1", "a transaction of no definition") not in problems


@pytest.mark.parametrize(
    "sql", ["DELETE FROM saga_definitions", "TRUNCATE saga_definitions CASCADE"]
)
async def test_a_definition_in_use_cannot_be_deleted(
    engine: AsyncEngine, backend: str, sql: str
) -> None:
    # SQLite: the transaction's key refuses it. PostgreSQL (migration 0008): no key, and the
    # definitions' statement triggers refuse any DELETE or TRUNCATE.
    if backend == "sqlite" and sql.startswith("TRUNCATE"):
        pytest.skip("SQLite has no TRUNCATE")
    await _seed_ledger(engine)
    with pytest.raises(IntegrityError, match="FOREIGN KEY" if backend == "sqlite" else "kept"):
        async with engine.begin() as conn:
            await conn.execute(text(sql))
    async with engine.connect() as conn:
        assert await conn.scalar(select(func.count()).select_from(schema.saga_definitions)) == 1


async def test_0008_drops_the_hot_keys_on_postgresql_only_and_goes_back(
    make_engine: EngineFactory, backend: str
) -> None:
    eng = make_engine("recipe" if backend == "sqlite" else "store")
    await migrate.upgrade(eng, "0007")
    await _seed_ledger(eng)
    await _insert(eng, schema.operations, _op_row("op-real"))
    every = await _hot_foreign_keys(eng)
    assert every == HOT_KEYS

    await migrate.upgrade(eng, "0008")
    assert await _hot_foreign_keys(eng) == (set() if backend == "postgres" else HOT_KEYS)
    async with eng.connect() as conn:
        assert await conn.scalar(select(func.count()).select_from(schema.operations)) == 1

    await migrate.downgrade(eng, "0007")
    assert await _hot_foreign_keys(eng) == HOT_KEYS
    if backend == "postgres":
        async with eng.connect() as conn:
            left = await conn.scalar(
                text("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'saga_definitions_kept_%'")
            )
        assert left == 0
    for table, row, _ in _orphan_rows()[:2]:  # the keys refuse an effect for no transaction again
        with pytest.raises(IntegrityError):
            await _insert(eng, table, row)


#: The keys migration 0008 drops on PostgreSQL, by name.
HOT_KEYS = {
    "fk_transactions_definition_digest_saga_definitions",
    "fk_operations_tx_id_transactions",
    "fk_compensation_steps_tx_id_transactions",
    "fk_outbox_tx_id_transactions",
}


async def _hot_foreign_keys(engine: AsyncEngine) -> set[str]:
    tables = ("transactions", "operations", "compensation_steps", "outbox")

    def names(conn: Any) -> set[str]:
        inspector = inspect(conn)
        return {str(k["name"]) for t in tables for k in inspector.get_foreign_keys(t)}

    async with engine.connect() as conn:
        found = await conn.run_sync(names)
    return found - {"fk_compensation_steps_forward_op_key_operations"}  # kept everywhere


async def _ledger_foreign_keys(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        keys = await conn.run_sync(lambda c: inspect(c).get_foreign_keys("ledger"))
    return {str(k["name"]) for k in keys}


# -- CHECK constraints and the business key -----------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "constraint"),
    [
        ({"state": "executing", "lease_until": 10, "fence": 1}, "executing_has_lease"),
        ({"state": "executing", "lease_owner": "w1", "lease_until": 10}, "executing_has_lease"),
        ({"state": "executing", "lease_owner": "w1", "fence": 1}, "executing_has_lease"),
        ({"state": "pending", "lease_owner": "w1"}, "pending_unowned"),
        ({"state": "confirmed"}, "confirmed_has_id"),
        ({"state": "exploded"}, "state"),
        ({"state": "unknown", "fence": -1}, "fence"),
    ],
)
@pytest.mark.parametrize("table_name", ["operations", "compensation_steps", "outbox"])
async def test_effect_check_constraints(
    engine: AsyncEngine, table_name: str, overrides: dict[str, Any], constraint: str
) -> None:
    await _seed_tx(engine)
    table = schema.metadata.tables[table_name]

    def row(key: str, **extra: Any) -> dict[str, Any]:
        base = _op_row(key, **extra)
        if table_name == "compensation_steps":
            base["forward_op_key"] = f"fwd_{key}"  # one reversal per forward op
        if table_name == "outbox":
            base["event_key"] = base.pop("op_key")
            base["kind"] = base.pop("step")
        return base

    if table_name == "compensation_steps":
        for key in ("bad", "ok_exec", "ok_done"):
            await _insert(engine, schema.operations, _op_row(f"fwd_{key}"))

    with pytest.raises(IntegrityError) as excinfo:
        await _insert(engine, table, row("bad", **overrides))
    assert f"ck_{table_name}_{constraint}" in str(excinfo.value)

    # The legal shapes of the same states are accepted (the refusal above was the CHECK).
    await _insert(
        engine, table, row("ok_exec", state="executing", lease_owner="w1", lease_until=10, fence=1)
    )
    await _insert(engine, table, row("ok_done", state="confirmed", remote_id="r-1"))


async def test_transaction_status_check(engine: AsyncEngine) -> None:
    with pytest.raises(IntegrityError, match="ck_transactions_status"):
        await _seed_tx(engine, status="exploded")
    with pytest.raises(IntegrityError, match="ck_transactions_fence"):
        await _seed_tx(engine, fence=-1)
    await _seed_tx(engine, status="staged")


async def test_business_key_unique_among_live_transactions(engine: AsyncEngine) -> None:
    await _seed_tx(engine, "tx1", business_key="order-42", status="executing")
    with pytest.raises(IntegrityError):
        await _seed_tx(engine, "tx2", business_key="order-42", status="prepared")

    # Retire the first: a failed attempt no longer holds the key.
    async with engine.begin() as conn:
        await conn.execute(
            update(schema.transactions)
            .where(schema.transactions.c.tx_id == "tx1")
            .values(status="failed")
        )
    await _seed_tx(engine, "tx2", business_key="order-42", status="prepared")
    # ... and a compensated one neither; but two live ones still collide.
    await _seed_tx(engine, "tx3", business_key="order-43", status="compensated")
    await _seed_tx(engine, "tx4", business_key="order-43", status="staged")
    with pytest.raises(IntegrityError):
        await _seed_tx(engine, "tx5", business_key="order-42", status="committed")
    # Transactions without a business key never collide.
    await _seed_tx(engine, "tx6")
    await _seed_tx(engine, "tx7")


# -- ensure_schema ------------------------------------------------------------------------------


async def test_ensure_schema_empty_upgrades_empty_database(make_engine: EngineFactory) -> None:
    eng = make_engine()
    await migrate.ensure_schema(eng, auto_upgrade="empty")
    assert await migrate.current_revision(eng) == migrate.HEAD
    await migrate.ensure_schema(eng, auto_upgrade="empty")  # at head: nothing to do
    await migrate.ensure_schema(eng, auto_upgrade="never")


async def test_ensure_schema_never_refuses_empty_database(make_engine: EngineFactory) -> None:
    eng = make_engine()
    with pytest.raises(SchemaOutdated) as excinfo:
        await migrate.ensure_schema(eng, auto_upgrade="never")
    message = str(excinfo.value)
    assert migrate.HEAD in message
    assert "agent-txn db upgrade" in message
    assert "empty" in message
    assert await migrate.current_revision(eng) is None
    assert await _tables(eng) == set()


async def test_ensure_schema_always_upgrades(make_engine: EngineFactory) -> None:
    eng = make_engine()
    await migrate.ensure_schema(eng, auto_upgrade="always")
    assert await migrate.current_revision(eng) == migrate.HEAD


async def test_ensure_schema_rejects_bad_mode(make_engine: EngineFactory) -> None:
    with pytest.raises(ValueError, match="auto_upgrade"):
        await migrate.ensure_schema(make_engine(), auto_upgrade="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["empty", "always", "never"])
async def test_unknown_revision_is_refused(engine: AsyncEngine, mode: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    with pytest.raises(SchemaOutdated, match="9999_future") as excinfo:
        await migrate.ensure_schema(engine, auto_upgrade=mode)  # type: ignore[arg-type]
    assert "newer agent-txn" in str(excinfo.value)
    with pytest.raises(SchemaOutdated, match="9999_future"):
        await migrate.upgrade(engine)
    assert await migrate.current_revision(engine) == "9999_future"


async def test_a_version_table_with_two_revisions_is_refused(engine: AsyncEngine) -> None:
    # Alembic keeps one row per branch head; ours is one line, so two rows mean hand edits.
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO alembic_version (version_num) VALUES ('0001')"))
    with pytest.raises(SchemaOutdated, match=r"several revisions at once \(0001, ") as excinfo:
        await migrate.ensure_schema(engine, auto_upgrade="always")
    assert "leave one row" in str(excinfo.value)
    with pytest.raises(SchemaOutdated, match="several revisions"):
        await migrate.upgrade(engine)


async def test_an_empty_version_table_reads_as_no_revision(make_engine: EngineFactory) -> None:
    engine = make_engine()
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32))"))
    assert await migrate.current_revision(engine) is None


# -- concurrency and atomicity ------------------------------------------------------------------


async def _switch_to_wal_first(engine: AsyncEngine, flavor: str) -> None:
    """Let one store connection switch a fresh SQLite file to WAL before the race starts.

    Known issue in ``ledger.dialects`` (not in the migrations): ``PRAGMA journal_mode=WAL`` on
    connect needs an exclusive lock and fails at once with "database is locked" (no busy wait)
    when another connection holds a lock on a file still in rollback-journal mode, i.e. when
    several processes open a brand-new file concurrently (about 1 run in 10 here). The schema is
    still empty afterwards, so the migration race below is unchanged.
    """
    if flavor == "store" and engine.dialect.name == "sqlite":
        async with engine.connect():
            pass


async def test_concurrent_upgrades_on_fresh_database(
    make_engine: EngineFactory, flavor: str
) -> None:
    engines = [make_engine(flavor) for _ in range(4)]
    await _switch_to_wal_first(engines[0], flavor)
    await asyncio.gather(*(migrate.upgrade(e) for e in engines))
    for eng in engines:
        assert await migrate.current_revision(eng) == migrate.HEAD
    async with engines[0].connect() as conn:
        versions = (await conn.execute(text("SELECT version_num FROM alembic_version"))).all()
    assert [v[0] for v in versions] == [migrate.HEAD]


async def test_concurrent_ensure_schema_on_fresh_database(
    make_engine: EngineFactory, flavor: str
) -> None:
    engines = [make_engine(flavor) for _ in range(3)]
    await _switch_to_wal_first(engines[0], flavor)
    await asyncio.gather(*(migrate.ensure_schema(e) for e in engines))
    assert await migrate.current_revision(engines[0]) == migrate.HEAD


async def test_upgrade_waits_for_the_migration_lock(
    make_engine: EngineFactory, flavor: str, backend: str
) -> None:
    # SQLite: the holder's BEGIN IMMEDIATE is the write lock. The store engine switches the file
    # to WAL on connect, which needs the file unlocked: the holder uses the same engine recipe.
    holder_engine = make_engine("store" if flavor == "store" else "recipe")
    migrating = make_engine(flavor)
    async with holder_engine.connect() as holder:
        async with holder.begin():
            if backend == "postgres":
                await holder.execute(
                    text("SELECT pg_advisory_xact_lock(:k)"), {"k": migrate.PG_MIGRATION_LOCK_KEY}
                )
            task = asyncio.create_task(migrate.upgrade(migrating))
            await asyncio.sleep(0.5)
            assert not task.done(), "upgrade ran while another migrator held the lock"
        await asyncio.wait_for(task, timeout=30)
    assert await migrate.current_revision(migrating) == migrate.HEAD


async def test_failed_upgrade_leaves_nothing_behind(
    make_engine: EngineFactory, flavor: str
) -> None:
    eng = make_engine(flavor)
    # A stray table in the way of the last CREATE TABLE: the migration fails half-way ...
    async with eng.begin() as conn:
        await conn.execute(text("CREATE TABLE ledger (x INTEGER)"))
    with pytest.raises(MigrationFailed) as excinfo:
        await migrate.upgrade(eng)
    # ... named as such, with the database's reason (SQLite: "table ledger already exists";
    # PostgreSQL: 'relation "ledger" already exists') ...
    assert "ledger" in str(excinfo.value) and "already exists" in str(excinfo.value)
    assert isinstance(excinfo.value.__cause__, DBAPIError)
    # ... and, being one transaction, leaves no table and no version row behind.
    assert await _tables(eng) == {"ledger"}
    assert await migrate.current_revision(eng) is None


# -- downgrade ----------------------------------------------------------------------------------


def _leftovers(connection: Connection) -> set[str]:
    if connection.dialect.name == "postgresql":
        rows = connection.exec_driver_sql(
            "SELECT proname FROM pg_proc WHERE proname = 'ledger_append_only'"
        )
    else:
        rows = connection.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'trigger'")
    return {str(r[0]) for r in rows}


async def test_downgrade_to_base_drops_everything(engine: AsyncEngine) -> None:
    await _seed_ledger(engine)  # with data: dropping must not trip the append-only triggers
    await migrate.downgrade(engine, "base")
    assert await migrate.current_revision(engine) is None
    assert await _tables(engine) - {"alembic_version"} == set()
    async with engine.connect() as conn:
        assert await conn.run_sync(_leftovers) == set()
    # ... and the way back up works again.
    await migrate.upgrade(engine)
    assert await migrate.current_revision(engine) == migrate.HEAD


def _ledger_indexes(connection: Connection) -> set[str]:
    return {str(index["name"]) for index in inspect(connection).get_indexes("ledger")}


def _plans(connection: Connection) -> list[str]:
    """SQLite's plans for the ledger's per-transaction reads (the chain head and the log)."""
    queries = [
        "SELECT hash FROM ledger WHERE tx_id = 't' ORDER BY seq DESC LIMIT 1",
        "SELECT tx_id, hash FROM ledger WHERE seq IN "
        "(SELECT max(seq) FROM ledger WHERE tx_id IN ('a', 'b') GROUP BY tx_id)",
        "SELECT * FROM ledger WHERE tx_id = 't' ORDER BY seq",
    ]
    plans = []
    for sql in queries:
        rows = connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}").all()
        plans.append(" | ".join(str(row[-1]) for row in rows))
    return plans


async def test_the_ledger_has_its_tx_seq_index_on_postgresql_only(
    engine: AsyncEngine, backend: str
) -> None:
    async with engine.connect() as conn:
        indexes = await conn.run_sync(_ledger_indexes)
        assert ("ix_ledger_tx_seq" in indexes) is (backend == "postgres")
        if backend == "sqlite":
            # Without it, a transaction's rows are still found through the fork guard's
            # (tx_id, prev_hash) index, never by scanning the ledger.
            for plan in await conn.run_sync(_plans):
                assert "SCAN ledger" not in plan, plan
                assert "sqlite_autoindex_ledger_1 (tx_id=?)" in plan, plan


def _stored_checks(connection: Connection) -> dict[str, str]:
    """SQLite: each hot table's stored definition (where its CHECK conditions are written)."""
    rows = connection.exec_driver_sql(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name IN "
        "('transactions', 'operations', 'compensation_steps', 'outbox')"
    )
    return {str(name): str(sql) for name, sql in rows}


def _index_names(connection: Connection, table: str) -> set[str]:
    return {str(index["name"]) for index in inspect(connection).get_indexes(table)}


async def test_0005_keeps_rows_and_refusals_and_goes_back(
    make_engine: EngineFactory, backend: str
) -> None:
    eng = make_engine("recipe" if backend == "sqlite" else "store")
    await migrate.upgrade(eng, "0004")
    await _seed_tx(eng, "tx1", business_key="order-1")
    await _insert(eng, schema.operations, _op_row("op1", state="confirmed", remote_id="r-1"))
    event = _op_row("ev1")
    event["event_key"], event["kind"] = event.pop("op_key"), event.pop("step")
    await _insert(eng, schema.outbox, event)

    await migrate.upgrade(eng, "0005")
    async with eng.connect() as conn:
        assert "ix_operations_due" in await conn.run_sync(_index_names, "operations")
        assert "ix_operations_state_next" not in await conn.run_sync(_index_names, "operations")
        if backend == "sqlite":
            stored = await conn.run_sync(_stored_checks)
            assert all(
                "state IN (" not in sql and "status IN (" not in sql for sql in stored.values()
            )
            assert "state = 'manual_review' OR state = 'skipped'" in stored["outbox"]
        rows = (
            await conn.execute(select(schema.operations.c.op_key, schema.operations.c.state))
        ).all()
        assert [tuple(r) for r in rows] == [("op1", "confirmed")]
    # The rewritten conditions refuse and accept what the old ones did.
    with pytest.raises(IntegrityError) as excinfo:
        await _insert(eng, schema.operations, _op_row("op2", state="exploded"))
    assert "ck_operations_state" in str(excinfo.value)
    with pytest.raises(IntegrityError) as excinfo:
        await _seed_tx(eng, "tx2", status="exploded")
    assert "ck_transactions_status" in str(excinfo.value)
    with pytest.raises(IntegrityError):  # the live business key is still unique
        await _seed_tx(eng, "tx3", business_key="order-1")
    await _seed_tx(eng, "tx4", business_key="order-1", status="failed")  # retired: allowed

    await migrate.downgrade(eng, "0004")
    async with eng.connect() as conn:
        assert "ix_operations_state_next" in await conn.run_sync(_index_names, "operations")
        if backend == "sqlite":
            stored = await conn.run_sync(_stored_checks)
            assert all("state = 'pending' OR" not in sql for sql in stored.values())
            assert "state IN ('pending'" in stored["outbox"]
    with pytest.raises(IntegrityError):
        await _insert(eng, schema.operations, _op_row("op3", state="exploded"))


# -- 0006: PostgreSQL checks each table's row rules with one CHECK -------------------------------


#: The effect rules, in the order migration 0006's function tests them.
_EFFECT_RULES = ("state", "executing_has_lease", "pending_unowned", "confirmed_has_id", "fence")

#: Every value each effect rule of migration 0001 reads, with one bad state and one bad fence.
_EFFECT_COLUMN_VALUES: dict[str, list[Any]] = {
    "state": [*(state.value for state in EffectState), "exploded"],
    "lease_owner": [None, "w1"],
    "lease_until": [None, 10],
    "fence": [-1, 0, 1],
    "remote_id": [None, "r-1"],
}


def _combinations() -> list[dict[str, Any]]:
    combos: list[dict[str, Any]] = [{}]
    for column, values in _EFFECT_COLUMN_VALUES.items():
        combos = [{**combo, column: value} for combo in combos for value in values]
    return combos


async def _rules_broken(conn: Any, row: dict[str, Any], rules: dict[str, str]) -> list[str]:
    """The rules (name → CHECK condition, as the database stored it) that ``row`` breaks, as
    the database itself evaluates them (a CHECK passes when its condition is NULL)."""
    broken = []
    for rule in _EFFECT_RULES:
        condition = rules[f"ck_operations_{rule}"]
        verdict = await conn.scalar(
            text(
                f"SELECT CASE WHEN NOT ({condition}) THEN 1 ELSE 0 END FROM (SELECT"
                " CAST(:state AS VARCHAR(32)) AS state,"
                " CAST(:lease_owner AS VARCHAR(128)) AS lease_owner,"
                " CAST(:lease_until AS BIGINT) AS lease_until,"
                " CAST(:fence AS BIGINT) AS fence,"
                " CAST(:remote_id AS VARCHAR(256)) AS remote_id) AS r"
            ),
            row,
        )
        if verdict == 1:
            broken.append(rule)
    return broken


async def _refusals(
    eng: AsyncEngine, rules: dict[str, str]
) -> list[tuple[dict[str, Any], list[str], str | None]]:
    """For every combination: the ``rules`` it breaks, and the constraint the insert's refusal
    named (``None``: the row was accepted)."""
    out = []
    for number, combo in enumerate(_combinations()):
        async with eng.connect() as conn:
            broken = await _rules_broken(conn, combo, rules)
        try:
            await _insert(eng, schema.operations, _op_row(f"combo{number}", **combo))
            named = None
        except IntegrityError as exc:
            message = str(exc.orig)
            named = next(
                (
                    rule
                    for rule in _EFFECT_RULES
                    if re.search(rf"\bck_operations_{rule}\b", message)
                ),
                message,  # not a rule's name: the assertion shows the whole message
            )
        out.append((combo, broken, named))
    return out


async def _check_conditions(eng: AsyncEngine) -> dict[str, dict[str, str]]:
    async with eng.connect() as conn:
        return await conn.run_sync(_checks, ("operations", "transactions"))


async def test_0006_refuses_exactly_what_the_rules_refused_and_goes_back(
    make_engine: EngineFactory, backend: str
) -> None:
    eng = make_engine("recipe" if backend == "sqlite" else "store")
    await migrate.upgrade(eng, "0005")
    await _seed_tx(eng, "tx1")
    await _insert(eng, schema.operations, _op_row("kept", state="confirmed", remote_id="r-1"))
    before = await _check_conditions(eng)

    await migrate.upgrade(eng, "0006")
    after = await _check_conditions(eng)
    if backend == "sqlite":
        assert after == before  # SQLite keeps one CHECK per rule
    else:
        assert set(after["operations"]) == {"ck_operations_rules"}
        assert "agent_txn_effect_row_ok('operations'" in after["operations"]["ck_operations_rules"]
        assert set(after["transactions"]) == {"ck_transactions_rules"}
    async with eng.connect() as conn:
        kept = (await conn.execute(select(schema.operations.c.op_key))).scalars().all()
    assert kept == ["kept"]

    # Every combination of the columns the rules read: accepted exactly when no rule is broken
    # — the rules as this database stored them before 0006, evaluated by it — else refused
    # naming a broken rule (on PostgreSQL the first in the function's order).
    results = await _refusals(eng, before["operations"])
    assert len(results) == 192
    for combo, broken, named in results:
        if not broken:
            assert named is None, (combo, named)
        elif backend == "sqlite":
            assert named in broken, (combo, broken, named)
        else:
            assert named == broken[0], (combo, broken, named)
    assert sum(1 for _, broken, _ in results if not broken) > 0  # both outcomes were exercised

    if backend == "postgres":  # the refusal carries the rule's name where drivers look for it
        with pytest.raises(IntegrityError) as excinfo:
            await _seed_tx(eng, "tx_bad", fence=-1)
        cause = excinfo.value.orig.__cause__  # type: ignore[union-attr]
        assert getattr(cause, "constraint_name", None) == "ck_transactions_fence"
        assert getattr(cause, "table_name", None) == "transactions"
        assert getattr(cause, "sqlstate", None) == "23514"

    await migrate.downgrade(eng, "0005")
    assert await _check_conditions(eng) == before
    if backend == "postgres":
        async with eng.connect() as conn:
            left = await conn.scalar(
                text("SELECT count(*) FROM pg_proc WHERE proname LIKE 'agent_txn_%'")
            )
        assert left == 0
    with pytest.raises(IntegrityError) as excinfo:
        await _insert(eng, schema.operations, _op_row("after", state="pending", lease_owner="w"))
    assert "ck_operations_pending_unowned" in str(excinfo.value)


async def test_0006_refused_leaves_0005_and_says_why(
    make_engine: EngineFactory, backend: str
) -> None:
    eng = make_engine("recipe" if backend == "sqlite" else "store")
    await migrate.upgrade(eng, "0005")
    if backend == "sqlite":  # 0006 changes nothing on SQLite: nothing there to refuse
        await migrate.upgrade(eng, "0006")
        assert await migrate.current_revision(eng) == "0006"
        return
    async with eng.begin() as conn:  # someone else's function where 0006 creates its own
        await conn.execute(
            text(
                "CREATE FUNCTION agent_txn_transaction_row_ok(tbl text, status text, fence bigint)"
                " RETURNS boolean LANGUAGE sql AS 'SELECT true'"
            )
        )
    with pytest.raises(MigrationFailed) as excinfo:
        await migrate.upgrade(eng)
    assert "agent_txn_transaction_row_ok" in str(excinfo.value)
    assert await migrate.current_revision(eng) == "0005"
    assert "ck_operations_state" in (await _check_conditions(eng))["operations"]


# -- 0009: business keys are unique per tenant -----------------------------------------------------


async def _seed_command_of(engine: AsyncEngine, command_id: str, tenant: str) -> None:
    await _insert(
        engine,
        schema.commands,
        {
            "command_id": command_id,
            "tenant": tenant,
            "name": command_id,
            "scope_kind": "company",
            "scope_id": "company-1",
            "version": 2,
            "mode": "execute",
            "definition": {"steps": []},
            "digest": "c" * 64,
            "created_by": "u1",
            "created_at": 1,
            "updated_at": 1,
        },
    )


async def _seed_execution_of(
    engine: AsyncEngine, execution_id: str, command_id: str, tx_id: str | None
) -> None:
    await _insert(
        engine,
        schema.executions,
        {
            "execution_id": execution_id,
            "command_id": command_id,
            "command_digest": "c" * 64,
            "tx_id": tx_id,
            "status": "running",
            "invoker_kind": "user",
            "invoker_id": "u1",
            "actor_bucket": "user:u1",
            "origin": "manual",
            "input_snapshot": {},
            "authorization_snapshot": {},
            "created_at": 1,
            "updated_at": 1,
        },
    )


async def _business_keys(engine: AsyncEngine) -> dict[str, str | None]:
    t = schema.transactions
    async with engine.connect() as conn:
        rows = await conn.execute(select(t.c.tx_id, t.c.business_key))
        return {str(r.tx_id): r.business_key for r in rows}


async def test_0009_gives_every_stored_business_key_its_tenant_and_goes_back(
    make_engine: EngineFactory, backend: str
) -> None:
    from orchestrator.keys import tenant_business_key

    eng = make_engine("recipe" if backend == "sqlite" else "store")
    await migrate.upgrade(eng, "0008")
    odd = "a/b%c" + "x" * 95  # the longest tenant, with both escaped characters
    await _seed_command_of(eng, "c-acme", "acme")
    await _seed_command_of(eng, "c-odd", odd)
    # In flight across the upgrade: linked by the transaction's execution id, by the
    # execution's tx id only, or not at all (a Python-API saga); and a retired one.
    await _seed_tx(eng, "tx-linked", business_key="order-1", execution_id="e-linked")
    await _seed_execution_of(eng, "e-linked", "c-acme", "tx-linked")
    await _seed_tx(eng, "tx-named", business_key="k" * 256)
    await _seed_execution_of(eng, "e-named", "c-odd", "tx-named")
    await _seed_tx(eng, "tx-api", business_key="order-2")  # no execution: tenant unknown
    await _seed_tx(eng, "tx-old", business_key="order-9", status="compensated")
    await _seed_tx(eng, "tx-none")

    await migrate.upgrade(eng, "0009")
    assert await _business_keys(eng) == {
        "tx-linked": tenant_business_key("acme", "order-1"),
        "tx-named": tenant_business_key(odd, "k" * 256),
        "tx-api": tenant_business_key("default", "order-2"),
        "tx-old": tenant_business_key("default", "order-9"),
        "tx-none": None,
    }
    assert tenant_business_key(odd, "k" * 256).startswith("a%2Fb%25c")
    assert len(tenant_business_key(odd, "k" * 256)) < schema.STORED_BUSINESS_KEY_LENGTH
    with pytest.raises(IntegrityError):  # the order in flight still holds its key
        await _seed_tx(eng, "tx-again", business_key=tenant_business_key("acme", "order-1"))
    await _seed_tx(eng, "tx-other", business_key=tenant_business_key("other", "order-1"))
    async with eng.connect() as conn:
        assert await conn.run_sync(_schema_diff) == []

    # Back: the tenant is stripped, which two tenants holding one key live would forbid.
    async with eng.begin() as conn:
        await conn.execute(
            update(schema.transactions)
            .where(schema.transactions.c.tx_id == "tx-other")
            .values(status="failed")
        )
    await migrate.downgrade(eng, "0008")
    keys = await _business_keys(eng)
    assert (keys["tx-linked"], keys["tx-named"], keys["tx-api"]) == (
        "order-1",
        "k" * 256,
        "order-2",
    )
    with pytest.raises(IntegrityError):
        await _seed_tx(eng, "tx-again", business_key="order-1")
