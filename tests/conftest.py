"""Shared fixtures: every storage test runs on SQLite and on PostgreSQL.

* ``backend`` is parametrized over ``sqlite`` and ``postgres``.
* ``db_urls`` gives a fresh pair of database URLs per test: ours (``store``) and the fake
  provider's (``provider``) — two databases, so rolling back ours never undoes a provider effect.
  SQLite: two files under ``tmp_path``. PostgreSQL: two new databases on the server named by
  ``AGENT_TXN_TEST_PG_URL`` (default ``postgresql+asyncpg://postgres@127.0.0.1:5432/postgres``),
  dropped after the test.
* PostgreSQL tests skip with a clear reason when no server is reachable, unless
  ``AGENT_TXN_REQUIRE_PG=1`` (CI), where they fail instead.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from orchestrator.engine import Orchestrator
from providers.fake.shop import FakeShop
from tests.support.world import World, fast_settings

DEFAULT_PG_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
BACKENDS = ("sqlite", "postgres")


def pg_admin_url() -> str:
    """The server tests create their databases on."""
    return os.environ.get("AGENT_TXN_TEST_PG_URL", DEFAULT_PG_URL)


async def _pg_execute(sql: str) -> None:
    import asyncpg

    url = make_url(pg_admin_url())
    conn = await asyncpg.connect(
        host=url.host or "127.0.0.1",
        port=url.port or 5432,
        user=url.username or "postgres",
        password=url.password,
        database=url.database or "postgres",
        timeout=5,
    )
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


_pg_reachable: bool | None = None


def pg_reachable() -> bool:
    """True when the test PostgreSQL server answers (checked once per session)."""
    global _pg_reachable
    if _pg_reachable is None:
        try:
            asyncio.run(_pg_execute("SELECT 1"))
            _pg_reachable = True
        except Exception:
            _pg_reachable = False
    return _pg_reachable


def require_pg() -> None:
    """Skip (or, under AGENT_TXN_REQUIRE_PG=1, fail) when PostgreSQL is not reachable."""
    if pg_reachable():
        return
    reason = f"PostgreSQL not reachable at {make_url(pg_admin_url()).render_as_string()}"
    if os.environ.get("AGENT_TXN_REQUIRE_PG") == "1":
        pytest.fail(f"{reason} and AGENT_TXN_REQUIRE_PG=1")
    pytest.skip(f"{reason} (set AGENT_TXN_TEST_PG_URL to run the PostgreSQL half)")


def pg_url_for(database: str) -> str:
    """URL of ``database`` on the test server."""
    return make_url(pg_admin_url()).set(database=database).render_as_string(hide_password=False)


@dataclass(frozen=True)
class DbUrls:
    """A fresh pair of databases for one test."""

    backend: str
    store: str
    provider: str


async def create_pg_database(name: str) -> str:
    await _pg_execute(f'CREATE DATABASE "{name}"')
    return pg_url_for(name)


async def drop_pg_database(name: str) -> None:
    await _pg_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """``sqlite`` or ``postgres``; PostgreSQL skips (or fails in CI) when unreachable."""
    name = str(request.param)
    if name == "postgres":
        require_pg()
    return name


@pytest.fixture
async def db_urls(backend: str, tmp_path: Path) -> AsyncIterator[DbUrls]:
    """Fresh databases (ours + the fake provider's) on the parametrized backend."""
    if backend == "sqlite":
        yield DbUrls(
            backend,
            store=f"sqlite+aiosqlite:///{tmp_path / 'agent.db'}",
            provider=f"sqlite+aiosqlite:///{tmp_path / 'provider.db'}",
        )
        return
    suffix = uuid.uuid4().hex[:12]
    names = (f"agt_{suffix}", f"agt_{suffix}_provider")
    store_url = await create_pg_database(names[0])
    provider_url = await create_pg_database(names[1])
    try:
        yield DbUrls(backend, store=store_url, provider=provider_url)
    finally:
        for name in names:
            await drop_pg_database(name)


@pytest.fixture
def anyio_backend() -> Iterator[str]:
    yield "asyncio"


# -- engine fixtures ---------------------------------------------------------------------------


@pytest.fixture
async def world(db_urls: DbUrls) -> AsyncIterator[World]:
    """A fresh engine and fake shop (stock sku-1 = 100) on the parametrized backend."""
    shop = await FakeShop.open(db_urls.provider)
    await shop.seed_stock({"sku-1": 100})
    orch = await Orchestrator.open(
        db_urls.store, providers=shop.providers(), settings=fast_settings()
    )
    w = World(db_urls, shop, orch, [])
    try:
        yield w
    finally:
        for o in [orch, *w.extra]:
            await o.close()
        await shop.close()
