"""The suite's own databases (tests/conftest.py, tests/support/pg_databases.py).

What could break: a template copy that is not what a first open builds (tests would then pass
on a schema the product never makes), an ``empty_databases`` test handed a copy (a migration
test would pass without migrating anything), and copies made ahead that outlive the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from ledger import migrate
from ledger.dialects import table_names
from ledger.schema import metadata
from providers.fake.schema import metadata as shop_metadata
from tests.conftest import DbUrls, pg_admin_url, pg_connect, require_pg
from tests.support.pg_databases import PgDatabases


async def _tables(url: str) -> set[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return await table_names(conn)
    finally:
        await engine.dispose()


def _sqlite_file(url: str) -> Path:
    return Path(str(make_url(url).database))


async def test_db_urls_are_copies_of_what_a_first_open_builds(db_urls: DbUrls) -> None:
    ours = await _tables(db_urls.store)
    assert ours >= {t.name for t in metadata.sorted_tables} | {"alembic_version"}
    engine = create_async_engine(db_urls.store)
    try:
        assert await migrate.current_revision(engine) == migrate.HEAD
    finally:
        await engine.dispose()
    assert await _tables(db_urls.provider) == {t.name for t in shop_metadata.sorted_tables}


@pytest.mark.empty_databases
async def test_an_empty_databases_test_gets_nothing_made(db_urls: DbUrls) -> None:
    if db_urls.backend == "sqlite":
        assert not _sqlite_file(db_urls.store).exists()
        assert not _sqlite_file(db_urls.provider).exists()
        return
    assert await _tables(db_urls.store) == set()
    assert await _tables(db_urls.provider) == set()


async def _tagged(tag: str) -> set[str]:
    conn = await pg_connect(pg_admin_url())
    try:
        rows = await conn.fetch(
            "SELECT datname FROM pg_database WHERE starts_with(datname, $1)", f"agt_{tag}_"
        )
    finally:
        await conn.close()
    return {str(r[0]) for r in rows}


def _wait_for_stock(databases: PgDatabases, wanted: int) -> None:
    deadline = time.monotonic() + 30
    while databases.ready_sets() < wanted:
        assert time.monotonic() < deadline, "no set was made ahead within 30 s"
        time.sleep(0.05)


@contextlib.contextmanager
def _own_databases(stock: int) -> Iterator[tuple[PgDatabases, str]]:
    """A creator of its own (its own tag), and a check that closing it left nothing behind:
    neither a set made ahead nor a half-made one."""
    require_pg()
    tag = f"fx{uuid.uuid4().hex[:6]}"
    databases = PgDatabases(make_url(pg_admin_url()), tag=tag, stock=stock)
    try:
        yield databases, tag
    finally:
        databases.close()
    assert asyncio.run(_tagged(tag)) == set()


def test_sets_made_ahead_are_handed_out_once_and_dropped_at_close() -> None:
    with _own_databases(stock=2) as (databases, tag):
        first = databases.create(("store", "provider"), migrated=False)
        _wait_for_stock(databases, 2)
        on_server = asyncio.run(_tagged(tag))
        assert set(first) <= on_server and len(on_server) == 6  # the set taken, two ahead

        second = databases.create(("store", "provider"), migrated=False)
        third = databases.create(("store", "provider"), migrated=False)
        assert len({*first, *second, *third}) == 6  # each set went to one caller only
        assert {*second, *third} <= on_server  # both were the ones made ahead
        databases.drop_later([*first, *second, *third])


def test_no_stock_makes_every_set_on_demand() -> None:
    with _own_databases(stock=0) as (databases, tag):
        names = databases.create(("store",), migrated=False)
        time.sleep(0.2)
        assert databases.ready_sets() == 0
        assert asyncio.run(_tagged(tag)) == set(names)


def test_two_kinds_are_made_ahead_side_by_side() -> None:
    # A lone database and a pair: a session asks for several kinds, and fills both stocks.
    with _own_databases(stock=2) as (databases, tag):
        databases.create(("store",), migrated=False)
        databases.create(("store", "provider"), migrated=False)
        _wait_for_stock(databases, 4)  # each kind's two, neither filler lost to the other
        assert len(asyncio.run(_tagged(tag))) == 1 + 2 + 2 * 1 + 2 * 2
        assert len(databases.create(("store",), migrated=False)) == 1
        assert len(databases.create(("store", "provider"), migrated=False)) == 2
