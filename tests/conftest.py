"""Shared fixtures: every storage test runs on SQLite and on PostgreSQL.

* ``backend`` is parametrized over ``sqlite`` and ``postgres``.
* ``db_urls`` gives a fresh pair of database URLs per test: ours (``store``) and the fake
  provider's (``provider``) — two databases, so rolling back ours never undoes a provider effect.
  SQLite: two files under ``tmp_path``. PostgreSQL: two new databases on the server named by
  ``AGENT_TXN_TEST_PG_URL`` (default ``postgresql+asyncpg://postgres@127.0.0.1:5432/postgres``),
  named ``agt_<session tag>_...``, dropped after the test (in the background, see
  :mod:`tests.support.pg_databases`).
* Those databases are copies of templates already migrated (ours) / holding the fake provider's
  tables, exactly what the first ``Store.open`` / ``FakeShop.open`` of an empty database builds,
  so tests do not pay for the migrations: on PostgreSQL ``CREATE DATABASE ... TEMPLATE``, on
  SQLite a copy of a template file built once per session (a fresh SQLite store's first open
  costs about 70 ms here, a copy's about 4). A test that must start from truly
  empty databases (it migrates them itself, or checks that nothing was created) is marked
  ``@pytest.mark.empty_databases``; the modules in :data:`EMPTY_DATABASE_MODULES` are, as a whole.
* PostgreSQL tests skip with a clear reason when no server is reachable, unless
  ``AGENT_TXN_REQUIRE_PG=1`` (CI), where they fail instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import sqlite3
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from ledger.store import SQLITE_WRITERS, Store
from orchestrator.engine import Orchestrator
from providers.fake.shop import FakeShop
from tests.support.pg_databases import PgDatabases
from tests.support.server_lock import ServerLock
from tests.support.world import World, fast_settings

DEFAULT_PG_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
BACKENDS = ("sqlite", "postgres")

# Modules whose tests all need empty databases from ``db_urls`` (as if marked
# ``empty_databases``): the migration tests upgrade / downgrade / inspect an empty database
# themselves (on a migrated copy many would pass without testing anything), and the crash
# matrix checks that a victim sent home created no table at all.
EMPTY_DATABASE_MODULES = frozenset(
    {
        "tests/integration/test_migrations.py",
        "tests/fault/test_crash_matrix.py",
    }
)
# A create waits while more drops than this are still queued: bounds the databases (and disk)
# a slow server can accumulate behind the tests.
MAX_PENDING_DROPS = 20


#: Where SQLite stores commit their groups in this run (``ledger.store.DEFAULT_SQLITE_WRITER``):
#: ``inline`` or ``process``; unset, the library's default (``process``). ``.ci/run`` runs the
#: SQLite tests once with each. Subprocesses the tests start (the CLI, workers) keep the default.
SQLITE_WRITER = os.environ.get("AGENT_TXN_TEST_SQLITE_WRITER")


def pytest_configure(config: pytest.Config) -> None:
    if SQLITE_WRITER is not None and SQLITE_WRITER not in SQLITE_WRITERS:
        raise pytest.UsageError(
            f"AGENT_TXN_TEST_SQLITE_WRITER must be inline or process, not {SQLITE_WRITER!r}"
        )
    import ledger.store

    if SQLITE_WRITER is not None:
        ledger.store.DEFAULT_SQLITE_WRITER = SQLITE_WRITER  # type: ignore[assignment]
    config.addinivalue_line(
        "markers",
        "empty_databases: db_urls gives empty databases (no SQLite file yet), not template copies",
    )
    config.addinivalue_line(
        "markers",
        "restarts_postgres: restarts the test server, so it runs with no other test on it",
    )


def pg_admin_url() -> str:
    """The server tests create their databases on."""
    return os.environ.get("AGENT_TXN_TEST_PG_URL", DEFAULT_PG_URL)


async def pg_connect(url: str) -> Any:
    """A raw asyncpg connection to the database a SQLAlchemy ``url`` names (its host, port,
    user and password)."""
    import asyncpg

    parsed = make_url(url)
    return await asyncpg.connect(
        host=parsed.host or "127.0.0.1",
        port=parsed.port or 5432,
        user=parsed.username or "postgres",
        password=parsed.password,
        database=parsed.database or "postgres",
        timeout=5,
    )


async def _pg_execute(sql: str) -> None:
    conn = await pg_connect(pg_admin_url())
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


@pytest.fixture(autouse=True)
def _server_lock(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test holds the test server shared; one marked ``restarts_postgres`` holds it alone.

    The suite runs in several processes (``-n`` in pyproject), and a server restart would fail
    whatever the others were doing on it (:mod:`tests.support.server_lock`). A test run with the
    ``sqlite`` backend never talks to the server, so it takes no lock: among those are the
    longest tests of the suite (the SQLite random-schedule run and crash matrix), and a
    restarting test would otherwise sit idle until they end, with a second process queued
    behind it. Other tests (no backend, or ``postgres``) take it, as telling apart the unit
    tests that reach the server is not worth the risk of a restart failing one of them."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "sqlite":
        yield
        return
    lock = ServerLock(pg_admin_url())
    if request.node.get_closest_marker("restarts_postgres") is not None:
        with lock.exclusive():
            yield
    else:
        with lock.shared():
            yield


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """``sqlite`` or ``postgres``; PostgreSQL skips (or fails in CI) when unreachable."""
    name = str(request.param)
    if name == "postgres":
        require_pg()
    return name


async def _build_store_template(url: str) -> None:
    store = await Store.open(url)
    await store.close()


async def _build_provider_template(url: str) -> None:
    shop = await FakeShop.open(url)
    await shop.close()


@pytest.fixture(scope="session")
def pg_databases() -> Iterator[PgDatabases]:
    """This session's creator / background dropper of PostgreSQL test databases.

    Teardown waits until every queued drop has run, then drops the templates: a finished
    session leaves no ``agt_<tag>_...`` database behind.
    """
    databases = PgDatabases(
        make_url(pg_admin_url()),
        max_pending_drops=MAX_PENDING_DROPS,
        template_builders={"store": _build_store_template, "provider": _build_provider_template},
    )
    try:
        yield databases
    finally:
        databases.close()


@dataclass(frozen=True)
class SqliteTemplates:
    """This session's two SQLite template files: ours, migrated, and the fake provider's."""

    store: Path
    provider: Path


def _sqlite_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


async def _build_sqlite_templates(folder: Path) -> SqliteTemplates:
    templates = SqliteTemplates(folder / "agent.db", folder / "provider.db")
    await _build_store_template(_sqlite_url(templates.store))
    await _build_provider_template(_sqlite_url(templates.provider))
    for path in (templates.store, templates.provider):
        # A copy takes the main file only: whatever a closed store left in its write-ahead log
        # goes into the file first, and the log is emptied.
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return templates


@pytest.fixture(scope="session")
def sqlite_templates(tmp_path_factory: pytest.TempPathFactory) -> SqliteTemplates:
    """Built on first use, in a thread of its own: no test's event loop is involved."""
    folder = tmp_path_factory.mktemp("sqlite-templates")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _build_sqlite_templates(folder)).result()


def _wants_empty_databases(request: pytest.FixtureRequest) -> bool:
    if request.node.get_closest_marker("empty_databases") is not None:
        return True
    path = Path(str(request.node.path)).resolve()
    rootdir = Path(str(request.config.rootpath)).resolve()
    try:
        relative = path.relative_to(rootdir).as_posix()
    except ValueError:
        return False
    return relative in EMPTY_DATABASE_MODULES


@pytest.fixture
def db_urls(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[DbUrls]:
    """Fresh databases (ours + the fake provider's) on the parametrized backend."""
    if backend == "sqlite":
        store, provider = tmp_path / "agent.db", tmp_path / "provider.db"
        if not _wants_empty_databases(request):
            templates: SqliteTemplates = request.getfixturevalue("sqlite_templates")
            shutil.copyfile(templates.store, store)
            shutil.copyfile(templates.provider, provider)
        yield DbUrls(backend, store=_sqlite_url(store), provider=_sqlite_url(provider))
        return
    databases: PgDatabases = request.getfixturevalue("pg_databases")
    # Synchronous on purpose: the server work runs on the dropper's own loop and thread, so this
    # fixture needs no event loop and works for sync and async tests alike.
    names = databases.create(("store", "provider"), migrated=not _wants_empty_databases(request))
    try:
        yield DbUrls(
            backend, store=databases.url_for(names[0]), provider=databases.url_for(names[1])
        )
    finally:
        # Not awaited: the drop runs while the next test does (FORCE ends leftover connections).
        databases.drop_later(names)


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


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fault suites ``fault-inject run`` started: none, when a run is refused (the option
    tests assert that); a suite that does start finds nothing to do."""
    from fault_injection import cli as fault_cli

    started: list[str] = []

    async def run_one(name: str, *_: object, **__: object) -> list[object]:
        started.append(name)
        return []

    monkeypatch.setattr(fault_cli, "_run_one", run_one)
    return started
