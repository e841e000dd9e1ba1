"""``agent-txn bench`` and ``fault-inject`` on the ``--db`` URLs users give them.

Each engine, bare driver connection and libpq connection these commands open on a user's URL
takes the URL's options as the store's own engine does (``ledger.dialects.create_engine``): its
numeric options as numbers, ``sslmode`` / ``ssl`` and ``command_timeout`` where the driver takes
them. A role that may not create databases, or a server that never answers, ends the command
in one line at its first connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from fault_injection import bench_driver, harness
from fault_injection._evidence import table_names
from fault_injection.bench_dbos import _psycopg_url, dbos_available
from fault_injection.bench_driver import asyncpg_arguments, measure_driver
from fault_injection.harness import (
    PROBE_CONNECT_SECONDS,
    DatabasePair,
    Harness,
    fresh_databases,
    probe_url,
)
from fault_injection.scenarios import run_scenarios
from ledger import dialects
from providers.fake import store as shop_store
from providers.fake.shop import FakeShop
from tests.conftest import DbUrls, pg_admin_url, pg_connect, require_pg

ROOT = Path(__file__).resolve().parents[2]
#: Options of every kind a PostgreSQL URL may give: numbers (asyncpg compares them as such),
#: libpq's sslmode (written as asyncpg's ``ssl``) and one asyncpg takes as a string.
OPTIONS = "timeout=20&statement_cache_size=0&sslmode=disable&command_timeout=30"
#: A hang guard only (the commands below end in seconds): never a timing assertion.
HANG_GUARD_SECONDS = 100


def _with_options(url: str, options: str = OPTIONS) -> str:
    return f"{url}{'&' if '?' in url else '?'}{options}"


def _cli(*args: str, timeout: float = HANG_GUARD_SECONDS) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
        check=False,
    )


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# -- finding 1: numeric options reach every engine --------------------------------------------


def test_the_fake_shop_keeps_the_ledgers_numeric_options() -> None:
    # providers may not import ledger, so the shop has its own copy of the table.
    assert shop_store._PG_NUMBERS == dialects._PG_NUMBERS


async def test_fake_shop_opens_on_a_url_with_numeric_options(db_urls: DbUrls) -> None:
    if db_urls.backend != "postgres":
        pytest.skip("the options are PostgreSQL's")
    url = _with_options(db_urls.provider, "timeout=20&statement_cache_size=0")
    shop = await FakeShop.open(url)
    try:
        await shop.seed_stock({"sku-1": 3})  # a write on the engine's connection
    finally:
        await shop.close()


def test_fake_shop_refuses_a_numeric_option_that_is_not_a_number() -> None:
    with pytest.raises(shop_store.ShopDatabaseError, match="timeout must be a number"):
        asyncio.run(shop_store.Store.open("postgresql://u@127.0.0.1:1/x?timeout=soon"))


async def test_the_checkers_reader_takes_the_urls_options(db_urls: DbUrls) -> None:
    if db_urls.backend != "postgres":
        pytest.skip("the options are PostgreSQL's")
    assert "effects" in await table_names(_with_options(db_urls.provider))


def test_fresh_databases_take_the_urls_options(tmp_path: Path) -> None:
    require_pg()

    async def made_and_dropped() -> int:
        async with fresh_databases(_with_options(pg_admin_url()), tmp_path) as dbs:
            shop = await FakeShop.open(dbs.provider)
            await shop.close()
            names = [make_url(dbs.store).database, make_url(dbs.provider).database]
        conn = await pg_connect(pg_admin_url())
        try:
            left: int = await conn.fetchval(
                "SELECT count(*) FROM pg_database WHERE datname = any($1::text[])", names
            )
        finally:
            await conn.close()
        return left

    assert asyncio.run(made_and_dropped()) == 0


def test_fault_inject_run_on_a_url_with_options() -> None:
    require_pg()
    run = _cli("fault-inject", "run", "--suite", "seed", "--db", _with_options(pg_admin_url()))
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr


def test_fault_inject_check_on_urls_with_options(db_urls: DbUrls) -> None:
    if db_urls.backend != "postgres":
        pytest.skip("the options are PostgreSQL's")
    got = _cli(
        "fault-inject", "check", "--db", _with_options(db_urls.store),
        "--provider-db", _with_options(db_urls.provider),
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["ok"] is True


async def test_the_concurrency_suites_admin_takes_the_urls_options(db_urls: DbUrls) -> None:
    if db_urls.backend != "postgres":
        pytest.skip("the scenario terminates PostgreSQL backends")
    from fault_injection.scenarios_concurrency import connection_loss_during_recovery

    pair = DatabasePair(
        *(dialects.normalize_url(_with_options(u)) for u in (db_urls.store, db_urls.provider)),
        db_urls.backend,
    )
    world = await Harness.open(pair)
    try:
        (result,) = await run_scenarios(
            world,
            [("connection_loss_during_recovery", connection_loss_during_recovery)],
            suite="concurrency",
        )
    finally:
        await world.close()
    assert result.passed, result.line
    assert result.detail["backends_terminated"] >= 1


# -- finding 2: the raw driver takes the options as keywords ----------------------------------


def test_asyncpg_arguments_are_keywords_not_server_settings() -> None:
    got = asyncpg_arguments(f"postgresql://u:pw@db.example:6543/app?{OPTIONS}")
    assert got == {
        "host": "db.example",
        "port": 6543,
        "user": "u",
        "password": "pw",
        "database": "app",
        "timeout": 20.0,
        "statement_cache_size": 0,
        "ssl": "disable",
        "command_timeout": "30",
    }


def test_bench_on_a_url_with_options_keeps_its_results(tmp_path: Path) -> None:
    require_pg()
    out = tmp_path / "bench.json"
    got = _cli(
        "bench", "--db", _with_options(pg_admin_url()), "--sagas", "4", "--warmup", "0",
        "--driver-seconds", "0.1", "--json", str(out),
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    data = json.loads(out.read_text())
    assert data["check_ok"] is True
    assert (data["raw_driver_commits_per_s"] or 0) > 0


async def test_a_failed_raw_measurement_is_a_note_not_a_lost_run(
    db_urls: DbUrls, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def refused(*_args: object, **_kwargs: object) -> float:
        raise OSError("the raw driver was refused")

    monkeypatch.setattr(bench_driver, "raw_commit_rate", refused)
    rates = await measure_driver(
        db_urls.store, seconds=0.05, connections=1, sqlite_synchronous="NORMAL"
    )
    assert rates.engine > 0
    assert rates.raw is None
    err = capsys.readouterr().err
    assert "note: the raw driver rate could not be measured" in err
    assert "the raw driver was refused" in err


async def test_a_bug_in_the_raw_measurement_still_raises(
    db_urls: DbUrls, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*_args: object, **_kwargs: object) -> float:
        raise TypeError("a bug")

    monkeypatch.setattr(bench_driver, "raw_commit_rate", broken)
    with pytest.raises(TypeError, match="a bug"):
        await measure_driver(db_urls.store, seconds=0.05, connections=1, sqlite_synchronous="FULL")


def test_dbos_gets_the_url_as_libpq_takes_it() -> None:
    url = _psycopg_url(f"postgresql://u@h:5432/app?{OPTIONS}")
    assert url.drivername == "postgresql+psycopg"
    assert dict(url.query) == {"sslmode": "disable", "connect_timeout": "20"}


def test_dbos_database_on_a_url_with_options(tmp_path: Path) -> None:
    require_pg()
    if not dbos_available():
        pytest.skip("the bench extra (dbos, psycopg) is not installed")
    from fault_injection.bench_dbos import _database

    with _database(_with_options(pg_admin_url()), tmp_path) as (url, backend):
        assert backend == "postgres"
        assert "ssl=" not in url


# -- finding 3: a role that cannot create databases --------------------------------------------


@pytest.fixture
def nocreatedb_url() -> Iterator[str]:
    require_pg()
    role = f"agt_nocreatedb_{uuid.uuid4().hex[:8]}"

    async def execute(sql: str) -> None:
        conn = await pg_connect(pg_admin_url())
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(execute(f'CREATE ROLE "{role}" LOGIN NOCREATEDB'))
    try:
        yield (
            make_url(pg_admin_url())
            .set(username=role, password=None)
            .render_as_string(hide_password=False)
        )
    finally:
        asyncio.run(execute(f'DROP ROLE "{role}"'))


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "--sagas", "1", "--warmup", "0"],
        ["fault-inject", "run", "--suite", "seed"],
        ["fault-inject", "fleet", "--sagas", "1", "--workers", "1"],
    ],
)
def test_a_role_without_createdb_is_one_line(nocreatedb_url: str, command: list[str]) -> None:
    got = _cli(*command, "--db", nocreatedb_url)
    assert got.returncode == 2, got.stderr
    assert _error_lines(got.stderr) == [
        "error: --db: this role cannot create databases (the run makes fresh ones on the "
        "server, dropped after)"
    ]


# -- finding 5: a server that accepts and never answers -------------------------------------------


def test_probe_url_sets_a_short_connect_timeout_unless_the_url_gives_one() -> None:
    got = make_url(probe_url("postgresql://u@h/x"))
    assert float(got.query["timeout"]) == PROBE_CONNECT_SECONDS
    assert make_url(probe_url("postgresql://u@h/x?timeout=3")).query["timeout"] == "3"
    assert "timeout" not in make_url(probe_url("sqlite:///x.db")).query


def _against_a_silent_server(
    command: list[str], options: str, *, guard: float = HANG_GUARD_SECONDS
) -> tuple[int, str, int]:
    """Run ``command`` with a ``--db`` on a local socket that accepts and never replies; the
    exit code, stderr, and how many connections the socket accepted."""

    async def main() -> tuple[int, str, int]:
        accepted: list[asyncio.StreamWriter] = []

        async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)  # kept open, never written to

        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        url = f"postgresql://u@127.0.0.1:{port}/x{options}"
        try:
            got = await asyncio.to_thread(_cli, *command, "--db", url, timeout=guard)
        finally:
            for writer in accepted:
                writer.close()
            server.close()
            await server.wait_closed()
        return got.returncode, got.stderr, len(accepted)

    return asyncio.run(main())


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "--sagas", "1", "--warmup", "0"],
        ["fault-inject", "run", "--suite", "seed"],
        ["fault-inject", "fleet", "--sagas", "1", "--workers", "1"],
    ],
)
def test_a_silent_server_ends_the_command_at_its_first_connection(command: list[str]) -> None:
    # The URL's own timeout, so the test does not wait for the default (tested below).
    code, stderr, accepted = _against_a_silent_server(command, "?timeout=1")
    assert code == 2, stderr
    assert _error_lines(stderr) == ["error: StoreUnavailable: database unreachable"]
    assert accepted == 1


#: The hang guard of a run against a silent server with no ``timeout`` in its URL: generous
#: next to the probes' connect timeout, short of asyncpg's own 60 s default a connection.
SILENT_DEFAULT_GUARD_SECONDS = 50
assert SILENT_DEFAULT_GUARD_SECONDS > 3 * PROBE_CONNECT_SECONDS


def test_a_silent_server_without_a_url_timeout_ends_within_the_probes() -> None:
    # Before, each of four connections waited asyncpg's 60 s; now the first gives up after
    # the probe's timeout and nothing else connects.
    code, stderr, accepted = _against_a_silent_server(
        ["bench", "--sagas", "1"], "", guard=SILENT_DEFAULT_GUARD_SECONDS
    )
    assert code == 2, stderr
    assert _error_lines(stderr) == ["error: StoreUnavailable: database unreachable"]
    assert accepted == 1


def test_fresh_databases_drop_nothing_when_nothing_was_made(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    connects: list[str] = []

    class Refusing:
        def connect(self) -> object:
            connects.append("connect")
            raise OSError("unreachable")

        async def dispose(self) -> None:
            return None

    monkeypatch.setattr(harness, "admin_engine", lambda _url: Refusing())

    async def enter() -> None:
        async with fresh_databases("postgresql://u@127.0.0.1:1/x", tmp_path):
            raise AssertionError("no databases were made")

    with pytest.raises(OSError, match="unreachable"):
        asyncio.run(enter())
    assert connects == ["connect"]  # the CREATE's; no DROP
