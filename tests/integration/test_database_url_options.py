"""A PostgreSQL URL's connection options reach asyncpg as what it takes: a URL gives strings,
and asyncpg compared ``timeout`` and ``statement_cache_size`` as numbers (a ``TypeError`` at
the first connection). Both backends: a SQLite URL's query is aiosqlite's, and left as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from ledger import dialects
from tests.conftest import pg_admin_url, require_pg


@pytest.fixture
def server() -> str:
    """The test server's URL, once it is known to answer (checked outside the event loop)."""
    require_pg()
    return pg_admin_url()


async def test_numeric_postgresql_options_in_the_url_take_effect(server: str) -> None:
    base = make_url(server)
    url = base.update_query_dict(
        {"timeout": "7", "statement_cache_size": "0", "sslmode": "disable"}
    ).render_as_string(hide_password=False)
    engine = dialects.create_engine(url)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT 1"))).scalar() == 1
            raw = await conn.get_raw_connection()
            driver = raw.driver_connection
            assert driver is not None
            assert driver._stmt_cache.get_max_size() == 0  # statement_cache_size=0 held
    finally:
        await engine.dispose()


async def test_a_sqlite_url_keeps_its_query(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'x.db'}?timeout=5"
    assert dialects.normalize_url(url) == url
    engine = dialects.create_engine(url)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT 1"))).scalar() == 1
    finally:
        await engine.dispose()


@pytest.mark.parametrize("option", ["timeout=x", "bogus=1"])
def test_a_postgresql_url_with_an_option_asyncpg_cannot_take_opens_nothing(option: str) -> None:
    with pytest.raises(ValueError):
        dialects.create_engine(f"postgresql://postgres@127.0.0.1/postgres?{option}")
