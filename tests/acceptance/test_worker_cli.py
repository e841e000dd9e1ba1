"""``agent-txn worker``'s refusals, on both backends where a database is involved.

A worker runs on a store made by ``agent-txn db upgrade`` (or the application): it created a
schema in whatever it was given (a mistyped file, the shop's database, an in-memory database
gone at exit) and reported ``claimed 0``, exit 0. Its ``--app`` failures printed tracebacks;
``--fake-shop`` and ``--app`` serving the same provider name replaced one silently; a blank
``--worker-id`` was taken as a lease owner.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from typer.testing import CliRunner, Result

from orchestrator.cli import app
from orchestrator.workerproc import close_all, load_providers
from tests.support.sync_db import execute, table_names

if TYPE_CHECKING:
    from tests.conftest import DbUrls

#: The fake shop's tables, and one of agent-txn's: what must not land in the other's database.
SHOP_TABLES = {"stock", "effects"}
AGENT_TABLE = "transactions"


def _worker(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, ["worker", "--once", "--poll-seconds", "0.05", *args], env=env)


def _assert_refused(got: Result, message: str) -> None:
    assert got.exit_code == 2, got.output
    assert "Traceback" not in got.output
    assert message in got.output, got.output
    errors = [line for line in got.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, got.output
    assert "claimed" not in got.output


# -- the store ----------------------------------------------------------------------------------


def test_a_missing_sqlite_file_is_refused_not_created(tmp_path: Path) -> None:
    typo = tmp_path / "typo.db"
    _assert_refused(_worker("--db", f"sqlite:///{typo}"), f"no agent-txn database at {typo}")
    assert not typo.exists()


@pytest.mark.parametrize("url", ["sqlite://", "sqlite+aiosqlite:///:memory:"])
def test_an_in_memory_store_is_refused(url: str) -> None:
    _assert_refused(_worker("--db", url), "an in-memory SQLite database lasts only")


@pytest.mark.empty_databases
@pytest.mark.parametrize("holding", ["nothing", "other tables"])
def test_a_database_without_the_schema_is_refused_not_migrated(
    db_urls: DbUrls, holding: str
) -> None:
    if db_urls.backend == "sqlite":
        execute(db_urls.store, "SELECT 1")  # the file exists, and holds no table
    if holding == "other tables":
        execute(db_urls.store, "CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    before = table_names(db_urls.store)
    _assert_refused(_worker("--db", db_urls.store), "agent-txn db upgrade")
    assert "schema_outdated" in _worker("--db", db_urls.store).output
    assert table_names(db_urls.store) == before


def test_swapped_databases_are_refused_before_anything_is_written(db_urls: DbUrls) -> None:
    # --db names the shop's database, --fake-shop ours: the shop wrote its tables into ours
    # and the store its schema into the shop's, then the worker idled, exit 0.
    store_before, shop_before = table_names(db_urls.store), table_names(db_urls.provider)
    assert shop_before >= SHOP_TABLES and AGENT_TABLE not in shop_before
    got = _worker("--db", db_urls.provider, "--fake-shop", db_urls.store)
    _assert_refused(got, "schema_outdated")
    # Not "empty, run db upgrade": that would advise migrating the shop's database.
    assert "holds other tables (calls, charges, effects, ...)" in got.output
    assert table_names(db_urls.store) == store_before
    assert table_names(db_urls.provider) == shop_before


def test_a_prepared_store_still_runs(db_urls: DbUrls) -> None:
    got = _worker("--db", db_urls.store, "--fake-shop", db_urls.provider)
    assert got.exit_code == 0, got.output
    assert "claimed 0" in got.output


# -- the providers ------------------------------------------------------------------------------


@pytest.fixture
def app_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder of modules, on no ``sys.path`` entry (as under the console script);
    ``sys.path`` and the modules imported are restored afterwards."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("ref", "source", "named"),
    [
        (".relative:build", None, "TypeError"),
        ("broken_syntax_app:build", "def build(:\n", "SyntaxError"),
        ("raising_app:build", "raise RuntimeError('no config file')\n", "RuntimeError"),
    ],
)
def test_an_app_that_fails_to_import_is_one_line(
    db_urls: DbUrls, app_folder: Path, ref: str, source: str | None, named: str
) -> None:
    if source is not None:
        (app_folder / f"{ref.partition(':')[0]}.py").write_text(source)
    got = _worker("--db", db_urls.store, "--app", ref)
    _assert_refused(got, f"cannot load {ref}: {named}")
    assert "definition_invalid" in got.output


async def test_an_app_module_in_the_current_folder_is_found(
    db_urls: DbUrls, app_folder: Path
) -> None:
    (app_folder / "local_shop_app.py").write_text(
        "import os\n"
        "from providers.fake.shop import FakeShop\n\n\n"
        "async def build():\n"
        "    return await FakeShop.open(os.environ['LOCAL_SHOP_URL'])\n"
    )
    os.environ["LOCAL_SHOP_URL"] = db_urls.provider
    try:
        providers, closer = await load_providers("local_shop_app:build")
    finally:
        del os.environ["LOCAL_SHOP_URL"]
    await close_all([closer])
    assert {p.name for p in providers} == {"inventory", "payments", "email"}


def test_the_same_provider_name_twice_is_refused(db_urls: DbUrls) -> None:
    got = _worker(
        "--db",
        db_urls.store,
        "--fake-shop",
        db_urls.provider,
        "--app",
        "tests.support.slowshop:build",
        env={"AGENT_TXN_TEST_PROVIDER_URL": db_urls.provider},
    )
    _assert_refused(
        got, "two providers are named 'inventory' (--fake-shop and --app tests.support.slowshop"
    )


@pytest.mark.parametrize("blank", [" ", "   ", "\t"])
def test_a_blank_worker_id_is_refused(tmp_path: Path, blank: str) -> None:
    db = tmp_path / "store.db"
    _assert_refused(
        _worker("--db", f"sqlite:///{db}", "--worker-id", blank), "--worker-id must not be blank"
    )
    assert not db.exists()
