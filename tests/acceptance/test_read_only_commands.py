"""Read-only commands leave no file behind, and a database the CLI cannot open is named.

* ``sqlite:///file:x.db?uri=true`` (a SQLite URI) made each read command create the empty
  ``x.db`` it then refused: the existence check skipped every ``file:`` name.
* A folder given as the database, or a ``--fake-shop`` / ``--provider-db`` / ``--db`` in a folder
  that does not exist, said only ``StoreUnavailable: database operational error``.
* A PostgreSQL database that does not exist said ``refused the connection (3D000)``.
* ``ops acknowledge`` exited 0 when a named execution was not found.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from typer.testing import CliRunner, Result

from orchestrator import cli
from tests.conftest import pg_url_for, require_pg

if TYPE_CHECKING:
    from tests.conftest import DbUrls

READ_COMMANDS = [
    ["status"],
    ["principals", "list"],
    ["ops", "prune"],
    ["db", "current"],
    ["ledger", "verify"],
]


def run(*args: str, cwd: Path | None = None) -> Result:
    env = {k: None for k in os.environ if k.startswith("AGENT_TXN_")}
    if cwd is None:
        return CliRunner().invoke(cli.app, list(args), env=env)
    here = Path.cwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(cli.app, list(args), env=env)
    finally:
        os.chdir(here)


def refused(result: Result) -> str:
    """Exit 2, one ``error:`` line, no traceback; returns the line."""
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("command", READ_COMMANDS, ids=lambda c: "-".join(c))
@pytest.mark.parametrize(
    "database",
    [
        "file:uri_1.db",
        "file:{dir}/uri_1.db",
        "file://{dir}/uri_1.db",
        "file://localhost{dir}/uri_1.db",
    ],
)
def test_a_missing_sqlite_uri_file_is_refused_not_created(
    tmp_path: Path, command: list[str], database: str
) -> None:
    url = f"sqlite:///{database.format(dir=tmp_path)}?uri=true"
    line = refused(run(*command, "--db", url, cwd=tmp_path))
    assert "no agent-txn database at" in line and "db upgrade" in line
    assert list(tmp_path.iterdir()) == []


def test_an_existing_sqlite_uri_file_is_read(tmp_path: Path) -> None:
    url = "sqlite:///file:uri_1.db?uri=true"
    assert run("db", "upgrade", "--db", url, cwd=tmp_path).exit_code == 0
    assert (tmp_path / "uri_1.db").exists()
    result = run("status", "--db", url, cwd=tmp_path)
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("command", [*READ_COMMANDS, ["db", "upgrade"]], ids=lambda c: "-".join(c))
def test_a_folder_given_as_the_database_is_named(tmp_path: Path, command: list[str]) -> None:
    line = refused(run(*command, "--db", f"sqlite:///{tmp_path}"))
    assert line == f"error: --db: {tmp_path} is a directory, not a SQLite database file"


@pytest.mark.parametrize(
    ("option", "command"),
    [
        ("--fake-shop", ["worker", "--once"]),
        ("--provider-db", ["demo"]),
        ("--db", ["db", "upgrade"]),
    ],
)
def test_a_file_in_a_missing_folder_names_its_option(
    tmp_path: Path, option: str, command: list[str]
) -> None:
    store = f"sqlite:///{tmp_path / 'agent.db'}"
    if option != "--db":
        assert run("db", "upgrade", "--db", store).exit_code == 0
    missing = tmp_path / "nodir" / "x.db"
    args = [*command, option, f"sqlite:///{missing}"]
    if option == "--fake-shop":
        args += ["--db", store]
    if option == "--provider-db":
        args += ["--dir", str(tmp_path / "demo")]
    line = refused(run(*args))
    assert line.startswith(f"error: {option}: {missing} does not exist"), line
    assert f"directory {missing.parent} does not exist" in line
    assert not missing.parent.exists()


@pytest.mark.parametrize("command", [*READ_COMMANDS, ["db", "upgrade"]], ids=lambda c: "-".join(c))
def test_a_missing_postgres_database_is_named(command: list[str]) -> None:
    require_pg()  # PostgreSQL's own refusal; SQLite's missing files are the tests above
    line = refused(run(*command, "--db", pg_url_for("agent_txn_no_such_database")))
    assert 'database "agent_txn_no_such_database" does not exist' in line, line


def test_acknowledge_exits_1_when_an_execution_is_not_found(db_urls: DbUrls) -> None:
    assert run("db", "upgrade", "--db", db_urls.store).exit_code == 0
    for mode in ([], ["--execute"]):
        result = run(
            "ops", "acknowledge", "r1", "-e", "nope", *mode, "--json", "--db", db_urls.store
        )
        assert result.exit_code == 1, (result.stdout, result.stderr)
        markers = json.loads(result.stdout)["markers"]
        assert markers == [{"execution_id": "nope", "result": "not_found"}]


@pytest.mark.parametrize(
    "command", [*READ_COMMANDS, ["worker", "--once"]], ids=lambda c: "-".join(c)
)
def test_another_applications_sqlite_file_is_refused_unchanged(
    tmp_path: Path, command: list[str]
) -> None:
    # SQLite only: the engine's first connection switched the file to WAL (journal_mode is a
    # SQLite setting), changing a database the command then refused as not agent-txn's.
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY)")
    conn.close()
    before = path.read_bytes()
    line = refused(run(*command, "--db", f"sqlite:///{path}"))
    assert line.startswith("error: schema_outdated: database holds other tables (customers)")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]  # no -wal, no -shm
