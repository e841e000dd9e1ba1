"""agent-txn creates its schema by itself only in an empty database, on both backends.

``ensure_schema`` (what ``Store.open`` / ``Orchestrator.open`` call, ``auto_upgrade="empty"``
by default) took "no ``alembic_version`` table" for an empty database: a ``--db`` naming
another application's database got agent-txn's eleven tables written beside its own. It is
refused now (``ForeignDatabase``, ``schema_outdated`` through the engine), nothing written;
``migrate.upgrade`` (``agent-txn db upgrade``) still adds them there on purpose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from sqlalchemy import text

from ledger import dialects, migrate
from ledger.errors import ForeignDatabase
from ledger.store import Store
from orchestrator.engine import Orchestrator
from orchestrator.errors import SchemaOutdatedError

if TYPE_CHECKING:
    from tests.conftest import DbUrls

pytestmark = pytest.mark.empty_databases


async def _make_foreign(url: str) -> None:
    engine = dialects.create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE invoices (id INTEGER PRIMARY KEY)"))
    finally:
        await engine.dispose()


async def _tables(url: str) -> set[str]:
    engine = dialects.create_engine(url)
    try:
        async with engine.connect() as conn:
            return await dialects.table_names(conn)
    finally:
        await engine.dispose()


@pytest.mark.parametrize("mode", ["empty", "always", "never"])
async def test_the_schema_is_not_created_beside_other_tables(db_urls: DbUrls, mode: str) -> None:
    await _make_foreign(db_urls.store)
    engine = dialects.create_engine(db_urls.store)
    try:
        with pytest.raises(ForeignDatabase, match=r"other tables \(invoices\)"):
            await migrate.ensure_schema(engine, auto_upgrade=mode)  # type: ignore[arg-type]
    finally:
        await engine.dispose()
    assert await _tables(db_urls.store) == {"invoices"}


async def test_the_engine_refuses_it_with_the_registered_code(db_urls: DbUrls) -> None:
    await _make_foreign(db_urls.store)
    with pytest.raises(SchemaOutdatedError) as caught:
        await Orchestrator.open(db_urls.store)
    assert caught.value.code == "schema_outdated"
    assert "agent-txn db upgrade" in caught.value.message
    assert await _tables(db_urls.store) == {"invoices"}


async def test_db_upgrade_adds_the_schema_beside_them_on_purpose(db_urls: DbUrls) -> None:
    await _make_foreign(db_urls.store)
    engine = dialects.create_engine(db_urls.store)
    try:
        await migrate.upgrade(engine)
        assert await migrate.current_revision(engine) == migrate.HEAD
    finally:
        await engine.dispose()
    store = await Store.open(db_urls.store)  # the schema is there now: opened as any other
    await store.close()


async def test_an_empty_database_and_one_downgraded_to_base_are_still_created(
    db_urls: DbUrls,
) -> None:
    store = await Store.open(db_urls.store)
    await store.close()
    engine = dialects.create_engine(db_urls.store)
    try:
        await migrate.downgrade(engine, "base")  # leaves an empty alembic_version behind
        assert await migrate.current_revision(engine) is None
        await migrate.ensure_schema(engine)
        assert await migrate.current_revision(engine) == migrate.HEAD
    finally:
        await engine.dispose()
