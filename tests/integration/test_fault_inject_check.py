"""``agent-txn fault-inject check`` on a pair of databases that is not one, on both backends.

A ``--provider-db`` without the fake shop's tables failed on the checker's first query: a
driver traceback on PostgreSQL (``relation "effects" does not exist``), "database operational
error" on SQLite. It is one line saying so, and a pair given the wrong way round is named.
"""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import create_async_engine
from typer.testing import CliRunner

from fault_injection import cli
from ledger.dialects import normalize_url
from providers.fake import schema as shop_schema
from tests.conftest import DbUrls


async def _drop_shop_tables(url: str) -> None:
    engine = create_async_engine(normalize_url(url))
    try:
        async with engine.begin() as conn:
            await conn.run_sync(shop_schema.metadata.drop_all)
    finally:
        await engine.dispose()


def _check(db: str, provider_db: str) -> tuple[int, str]:
    got = CliRunner().invoke(cli.app, ["check", "--db", db, "--provider-db", provider_db])
    return got.exit_code, got.output


def test_a_pair_of_the_right_databases_is_checked(db_urls: DbUrls) -> None:
    code, output = _check(db_urls.store, db_urls.provider)
    assert code == 0, output
    assert '"ok": true' in output


def test_a_provider_database_without_the_shops_tables_is_one_line(db_urls: DbUrls) -> None:
    asyncio.run(_drop_shop_tables(db_urls.provider))
    code, output = _check(db_urls.store, db_urls.provider)
    assert code == 2, output
    assert output.strip() == (
        "error: --provider-db has no fake-shop tables (calls, charges, effects, reservations): "
        "give the database the fake provider wrote to"
    )


def test_a_pair_the_wrong_way_round_is_named(db_urls: DbUrls) -> None:
    code, output = _check(db_urls.provider, db_urls.store)
    assert code == 2, output
    assert output.strip() == (
        "error: --db and --provider-db are the wrong way round: --provider-db holds "
        "agent-txn's tables and --db the fake shop's"
    )
