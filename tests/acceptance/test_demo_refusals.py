"""``agent-txn demo`` refuses what it cannot use before it writes anything, on both backends.

Its refusals came after writes: a ``--db`` in a missing folder, or naming a database with
transactions, was refused after the demo's folder had been marked and the shop's database
stocked; a ``--db`` holding another application's tables got agent-txn's schema and three
demo transactions; two spellings of one SQLite file ran both stores in one file; an
``agent.db`` folder in the demo's own folder was an ``IsADirectoryError`` traceback.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from rich.console import Console

from orchestrator.cli import DEMO_MARK
from orchestrator.demo import run_demo
from tests.acceptance.test_cli import assert_clean_failure, cli
from tests.conftest import pg_url_for
from tests.support.sync_db import execute, table_names

if TYPE_CHECKING:
    from tests.conftest import DbUrls

DEFAULT_FOLDER = "agent-txn-demo"


def test_a_db_in_a_missing_folder_is_refused_before_the_demo_folder_is_made(
    tmp_path: Path,
) -> None:
    run = cli("demo", "--db", f"sqlite:///{tmp_path / 'nodir' / 'agent.db'}", cwd=tmp_path)
    assert_clean_failure(run)
    assert "nodir/agent.db does not exist" in run.err
    assert not (tmp_path / DEFAULT_FOLDER).exists()
    assert not (tmp_path / "nodir").exists()


def test_a_provider_db_that_cannot_be_reached_leaves_no_folder(
    backend: str, tmp_path: Path
) -> None:
    if backend == "sqlite":
        missing = f"sqlite+aiosqlite:///{tmp_path / 'nodir' / 'provider.db'}"
    else:
        missing = pg_url_for("agent_txn_f8_no_such_database")
    run = cli("demo", "--provider-db", missing, cwd=tmp_path)
    assert_clean_failure(run)
    assert not (tmp_path / DEFAULT_FOLDER).exists()


def test_a_store_with_transactions_is_refused_before_the_shop_is_stocked(
    db_urls: DbUrls, tmp_path: Path
) -> None:
    assert asyncio.run(run_demo(db_urls.store, db_urls.provider, out=Console(file=io.StringIO())))
    fresh = tmp_path / "fresh.db"
    run = cli("demo", "--db", db_urls.store, "--provider-db", f"sqlite:///{fresh}", cwd=tmp_path)
    assert_clean_failure(run)
    assert "needs an empty agent-txn database; this one already holds 3" in run.err
    assert not fresh.exists()


@pytest.mark.empty_databases
def test_a_store_holding_other_tables_is_refused_untouched(db_urls: DbUrls, tmp_path: Path) -> None:
    execute(db_urls.store, "CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    provider_before = set() if db_urls.backend == "sqlite" else table_names(db_urls.provider)
    run = cli("demo", "--db", db_urls.store, "--provider-db", db_urls.provider, cwd=tmp_path)
    assert_clean_failure(run)
    assert "needs an agent-txn database of its own; this one holds other tables (invoices)" in (
        run.err
    )
    assert table_names(db_urls.store) == {"invoices"}
    if db_urls.backend == "sqlite":
        assert not (tmp_path / "provider.db").exists()
    else:
        assert table_names(db_urls.provider) == provider_before


def test_two_spellings_of_one_sqlite_file_are_one_database(tmp_path: Path) -> None:
    run = cli(
        "demo",
        "--db",
        "sqlite:///one.db",
        "--provider-db",
        f"sqlite+aiosqlite:///{tmp_path / 'one.db'}",
        cwd=tmp_path,
    )
    assert_clean_failure(run)
    assert "--db and --provider-db must be two different databases" in run.err
    assert not (tmp_path / "one.db").exists()


def test_a_folder_where_the_demo_keeps_a_file_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    (folder / "agent.db").mkdir(parents=True)
    (folder / DEMO_MARK).touch()
    (folder / "provider.db").write_bytes(b"an earlier run's")
    run = cli("demo", "--dir", "d", cwd=tmp_path)
    assert_clean_failure(run)
    assert "--dir d: its agent.db is a folder, not the demo's file" in run.err
    assert (folder / "agent.db").is_dir()
    assert (folder / "provider.db").read_bytes() == b"an earlier run's"  # nothing deleted
