"""The ``agent-txn`` CLI end to end, in a subprocess, as a user would run it.

The demo runs once per module on SQLite (``--dir``); the ledger and db commands then work on the
databases it left behind. One more demo run per backend (SQLite via ``--dir``, PostgreSQL via
``--db`` / ``--provider-db``) proves the same seed outcome on both.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import structlog
from rich.console import Console

from ledger.dialects import create_engine, table_names
from orchestrator.cli import DEMO_MARK
from orchestrator.demo import DemoError, run_demo
from orchestrator.logging import configure_logging
from tests.conftest import DbUrls

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Run:
    """One finished CLI invocation."""

    code: int
    out: str
    err: str

    def line(self, needle: str) -> str:
        """The first stdout line containing ``needle``."""
        for line in self.out.splitlines():
            if needle in line:
                return line
        raise AssertionError(f"no line with {needle!r} in:\n{self.out}")


def cli(*args: str, cwd: Path) -> Run:
    """Run ``python -m orchestrator.cli *args`` and capture everything."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_TXN_")}
    env.pop("COLUMNS", None)  # the CLI picks a wide layout for pipes; keep it deterministic
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    return Run(done.returncode, done.stdout, done.stderr)


def assert_clean_failure(run: Run, code: int = 2) -> None:
    """Exit ``code`` with a one-line ``error:`` on stderr and no traceback."""
    assert run.code == code, (run.out, run.err)
    assert "Traceback" not in run.err
    assert run.err.startswith("error: "), run.err
    assert len(run.err.strip().splitlines()) == 1, run.err


def assert_demo_outcome(run: Run) -> None:
    """The seed's outcome: one charge despite the lost response, release for the rejection."""
    assert run.code == 0, (run.out, run.err)
    assert "Traceback" not in run.err
    happy = run.line("provider effects for order-41")
    assert happy.startswith("PASS") and "reserve=1 charge=1 email=1" in happy
    lost = run.line("provider effects for order-42")
    assert lost.startswith("PASS") and "reserve=1 charge=1 email=1" in lost
    rejected = run.line("provider effects for order-43")
    assert rejected.startswith("PASS")
    assert "reserve=1 release=1 charge=0 email=0" in rejected
    assert "outcome unknown (ResponseLost)" in run.out
    assert "lookup found: ch_" in run.out
    assert "committed" in run.line("order-42 ·") and "compensated" in run.line("order-43 ·")
    totals = run.line("provider totals")
    assert "reserve=3 release=1 charge=2 refund=0 email=2" in totals
    assert "ledger OK: 3 transactions" in run.out
    # The engine's info logs go to stderr and are filtered at WARNING: none on stdout.
    assert '"event"' not in run.out and "[info" not in run.out


def tx_of(db: Path, order_id: str) -> str:
    """The transaction id of a demo order, read straight from our database."""
    with sqlite3.connect(db) as conn:
        row = conn.execute(
            # Stored with the demo's tenant in front (orchestrator.keys.tenant_business_key).
            "SELECT tx_id FROM transactions WHERE business_key = ?",
            (f"default/order:{order_id}",),
        ).fetchone()
    assert row is not None, order_id
    return str(row[0])


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory the SQLite demo ran in (twice: the second run must start fresh)."""
    base = tmp_path_factory.mktemp("demo")
    first = cli("demo", "--dir", str(base / "demo"), cwd=base)
    assert_demo_outcome(first)
    again = cli("demo", "--dir", str(base / "demo"), cwd=base)
    assert_demo_outcome(again)
    return base / "demo"


@pytest.fixture
def store(demo_dir: Path) -> str:
    return f"sqlite+aiosqlite:///{demo_dir / 'agent.db'}"


def test_demo_leaves_two_databases(demo_dir: Path) -> None:
    assert (demo_dir / "agent.db").exists()
    assert (demo_dir / "provider.db").exists()
    # Reproducible: the second run replaced the first one's files rather than adding to them.
    with sqlite3.connect(demo_dir / "agent.db") as conn:
        assert conn.execute("SELECT count(*) FROM transactions").fetchone() == (3,)


@pytest.mark.parametrize("name", ["agent.db", "provider.db", "agent.db-wal"])
@pytest.mark.parametrize("folder", ["", ".", "given"])
def test_demo_never_deletes_files_it_did_not_make(name: str, folder: str, tmp_path: Path) -> None:
    # ``--dir ""`` and ``--dir .`` named the working folder, whose agent.db (every other
    # command's default --db) the demo deleted and recreated.
    (tmp_path / "given").mkdir()
    theirs = tmp_path / (folder or ".") / name
    theirs.write_bytes(b"a store the demo did not make")
    run = cli("demo", "--dir", folder, cwd=tmp_path)
    assert_clean_failure(run)
    assert f"its {name.removesuffix('-wal')} was not made by the demo" in run.err
    assert theirs.read_bytes() == b"a store the demo did not make"
    assert not (tmp_path / folder / DEMO_MARK).exists()


@pytest.mark.parametrize(
    "command", [["status"], ["db", "upgrade"], ["worker", "--once"], ["principals", "list"]]
)
def test_a_file_that_is_not_a_database_is_one_clean_line(
    command: list[str], tmp_path: Path
) -> None:
    # SQLite opens any file and fails at its first read with a DatabaseError that no
    # translation knew: every command printed a traceback.
    other = tmp_path / "notes.db"
    other.write_text("root:x:0:0:root:/root:/bin/bash\n" * 200)
    run = cli(*command, "--db", f"sqlite+aiosqlite:///{other}", cwd=tmp_path)
    assert_clean_failure(run)
    assert "not a SQLite database file, or a damaged one" in run.err
    assert other.read_text() == "root:x:0:0:root:/root:/bin/bash\n" * 200


@pytest.mark.parametrize("url", ["sqlite+aiosqlite://", "sqlite:///:memory:"])
@pytest.mark.parametrize("command", [["db", "upgrade"], ["db", "current"], ["status"]])
def test_an_in_memory_database_is_refused_where_it_would_vanish(
    command: list[str], url: str, tmp_path: Path
) -> None:
    # ``db upgrade`` said "schema upgraded" for a database gone when it returned.
    run = cli(*command, "--db", url, cwd=tmp_path)
    assert_clean_failure(run)
    assert "an in-memory SQLite database lasts only as long as this command" in run.err


def test_ledger_verify_ok(store: str, tmp_path: Path) -> None:
    run = cli("ledger", "verify", "--db", store, cwd=tmp_path)
    assert run.code == 0, run.err
    assert "ledger OK: 3 transactions" in run.out


def test_ledger_verify_one_transaction(store: str, demo_dir: Path, tmp_path: Path) -> None:
    tx = tx_of(demo_dir / "agent.db", "order-43")
    run = cli("ledger", "verify", "--db", store, "--tx", tx, cwd=tmp_path)
    assert run.code == 0, run.err
    assert "ledger OK: 1 transactions" in run.out


def test_ledger_verify_reads_the_environment(store: str, tmp_path: Path) -> None:
    env_run = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "ledger", "verify"],
        cwd=tmp_path,
        env={**os.environ, "AGENT_TXN_DB": store},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert env_run.returncode == 0, env_run.stderr
    assert "ledger OK: 3 transactions" in env_run.stdout


def test_ledger_show_lost_response_order(store: str, demo_dir: Path, tmp_path: Path) -> None:
    tx = tx_of(demo_dir / "agent.db", "order-42")
    run = cli("ledger", "show", tx, "--db", store, cwd=tmp_path)
    assert run.code == 0, run.err
    assert tx in run.out and "order:order-42" in run.out
    assert "executing → unknown" in run.out
    assert "unknown → executing" in run.out
    assert "lookup" in run.out and "validating → committed" in run.out


def test_ledger_show_json(store: str, demo_dir: Path, tmp_path: Path) -> None:
    tx = tx_of(demo_dir / "agent.db", "order-42")
    run = cli("ledger", "show", tx, "--db", store, "--json", cwd=tmp_path)
    assert run.code == 0, run.err
    rows = json.loads(run.out)
    assert [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)
    assert rows[0]["action"] == "prepare" and all(r["time"].endswith("Z") for r in rows)
    lost = next(r for r in rows if r["to"] == "unknown")
    assert lost["detail"]["reason"] == "ResponseLost"
    lookup = next(r for r in rows if r["action"] == "lookup")
    assert lookup["detail"]["lookup"] == "found" and lookup["to"] == "confirmed"
    assert lookup["subject"] == lost["subject"]  # the same op key, reconciled, not re-sent


def test_ledger_show_unknown_tx(store: str, tmp_path: Path) -> None:
    run = cli("ledger", "show", "nope", "--db", store, cwd=tmp_path)
    assert_clean_failure(run)
    assert "transaction_not_found" in run.err


def test_an_id_is_printed_as_given_not_as_an_emoji(store: str, tmp_path: Path) -> None:
    # rich drew ":x:" as a cross mark, in an error line and in a module name alike.
    run = cli("ledger", "show", ":x:", "--db", store, cwd=tmp_path)
    assert_clean_failure(run)
    assert '{"tx_id":":x:"}' in run.err
    app = cli("worker", "--once", "--app", "no_such_module:x", "--db", store, cwd=tmp_path)
    assert_clean_failure(app)
    assert "cannot load no_such_module:x" in app.err


@pytest.mark.parametrize(
    "args", [["ledger", "show", "\udcff\udcfe"], ["principals", "add", "\udcff", "--name", "x"]]
)
def test_an_argument_that_is_not_utf8_is_one_line(
    store: str, args: list[str], tmp_path: Path
) -> None:
    # Bytes that are not UTF-8 (\xff\xfe on the command line) reached the store as lone
    # surrogates and failed in the driver with a traceback.
    run = cli(*args, "--db", store, cwd=tmp_path)
    assert_clean_failure(run)
    assert "is not valid UTF-8 text" in run.err and "\\xff" in run.err


def test_ledger_verify_unknown_tx(store: str, tmp_path: Path) -> None:
    assert_clean_failure(cli("ledger", "verify", "--db", store, "--tx", "nope", cwd=tmp_path))


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("mysql://x", "unsupported database 'mysql'"),
        ("not a url", "Could not parse"),
    ],
)
def test_ledger_verify_bad_url(url: str, hint: str, tmp_path: Path) -> None:
    run = cli("ledger", "verify", "--db", url, cwd=tmp_path)
    assert_clean_failure(run)
    assert hint in run.err


def test_read_commands_do_not_create_a_database(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    run = cli("ledger", "verify", "--db", f"sqlite+aiosqlite:///{missing}", cwd=tmp_path)
    assert_clean_failure(run)
    assert "agent-txn db upgrade" in run.err
    assert not missing.exists()
    # The default URL is agent.db in the working directory: also refused, also not created.
    assert_clean_failure(cli("ledger", "show", "x", cwd=tmp_path))
    assert not (tmp_path / "agent.db").exists()


def test_schema_missing_is_a_clean_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    run = cli("ledger", "verify", "--db", f"sqlite+aiosqlite:///{empty}", cwd=tmp_path)
    assert_clean_failure(run)
    assert "schema_outdated" in run.err and "agent-txn db upgrade" in run.err


from ledger.migrate import HEAD  # noqa: E402


def test_db_upgrade_creates_the_schema(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'new.db'}"
    first = cli("db", "upgrade", "--db", url, cwd=tmp_path)
    assert first.code == 0, first.err
    assert f"(empty) → {HEAD}" in first.out
    again = cli("db", "upgrade", "--db", url, cwd=tmp_path)
    assert again.code == 0 and f"already at {HEAD}" in again.out
    current = cli("db", "current", "--db", url, cwd=tmp_path)
    assert current.code == 0 and f"schema at {HEAD}" in current.out
    verify = cli("ledger", "verify", "--db", url, cwd=tmp_path)
    assert verify.code == 0, verify.err
    assert "ledger OK: 0 transactions, 0 rows verified" in verify.out


def test_db_upgrade_needs_an_existing_directory(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'nowhere' / 'x.db'}"
    run = cli("db", "upgrade", "--db", url, cwd=tmp_path)
    assert_clean_failure(run)
    assert "does not exist" in run.err


@pytest.mark.empty_databases
async def test_db_upgrade_refused_by_the_database_is_one_line(
    db_urls: DbUrls, tmp_path: Path
) -> None:
    # A stray table where the first migration creates its own: the database refuses it.
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from ledger.dialects import normalize_url

    engine = create_async_engine(normalize_url(db_urls.store))
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE ledger (x INTEGER)"))
    await engine.dispose()
    run = cli("db", "upgrade", "--db", db_urls.store, cwd=tmp_path)
    assert_clean_failure(run)
    assert "MigrationFailed" in run.err and "ledger" in run.err, run.err
    assert "none was applied" in run.err


def test_ledger_verify_detects_tampering(demo_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "tampered.db"
    shutil.copy(demo_dir / "agent.db", copy)
    with sqlite3.connect(copy) as conn:
        # Only someone with raw file access can do this: the triggers refuse it otherwise.
        conn.execute("DROP TRIGGER ledger_append_only_update")
        conn.execute(
            "UPDATE ledger SET detail = '{\"forged\":true}' WHERE seq = "
            "(SELECT min(seq) FROM ledger WHERE action = 'lookup')"
        )
    run = cli("ledger", "verify", "--db", f"sqlite+aiosqlite:///{copy}", cwd=tmp_path)
    assert run.code == 1, (run.out, run.err)
    assert "row content does not match its hash" in run.out
    assert "ledger verification FAILED: 1 problem(s)" in run.out


def test_demo_with_postgres_db_needs_provider_db(tmp_path: Path) -> None:
    run = cli("demo", "--db", "postgresql+asyncpg://u@127.0.0.1:1/x", cwd=tmp_path)
    assert_clean_failure(run)
    assert "--provider-db is required" in run.err


@pytest.mark.parametrize("url", ["sqlite+aiosqlite://", "sqlite+aiosqlite:///:memory:"])
def test_demo_refuses_an_in_memory_provider_db_before_making_its_folder(
    url: str, tmp_path: Path
) -> None:
    # The shop refused it, but only after the demo had made and marked its --dir folder.
    run = cli("demo", "--dir", "fresh", "--provider-db", url, cwd=tmp_path)
    assert_clean_failure(run)
    assert "--provider-db: the fake shop needs a SQLite file" in run.err
    assert not (tmp_path / "fresh").exists()


def test_bad_log_level_is_a_usage_error(tmp_path: Path) -> None:
    run = cli("--log-level", "LOUD", "ledger", "verify", cwd=tmp_path)
    assert run.code == 2 and "Traceback" not in run.err


async def test_demo_on_both_backends(db_urls: DbUrls, tmp_path: Path) -> None:
    """SQLite through ``--dir``, PostgreSQL through ``--db``/``--provider-db``: same outcome."""
    if db_urls.backend == "sqlite":
        args = ["demo", "--dir", str(tmp_path / "demo")]
        store = f"sqlite+aiosqlite:///{tmp_path / 'demo' / 'agent.db'}"
    else:
        args = ["demo", "--db", db_urls.store, "--provider-db", db_urls.provider]
        store = db_urls.store
    # In a thread: the fixture's databases live on this event loop, the CLI runs its own.
    run = await asyncio.to_thread(cli, *args, cwd=tmp_path)
    assert_demo_outcome(run)
    verify = await asyncio.to_thread(cli, "ledger", "verify", "--db", store, cwd=tmp_path)
    assert verify.code == 0, verify.err
    assert "ledger OK: 3 transactions" in verify.out
    if db_urls.backend == "postgres":
        # A database the user named is never wiped: a second run is refused, not merged.
        again = await asyncio.to_thread(cli, *args, cwd=tmp_path)
        assert_clean_failure(again)
        assert "needs an empty provider database" in again.err  # checked first


async def test_the_demo_refuses_a_provider_database_that_holds_anything(
    db_urls: DbUrls, tmp_path: Path
) -> None:
    quiet = Console(file=io.StringIO())
    assert (await run_demo(db_urls.store, db_urls.provider, out=quiet)).ok
    # --provider-db naming the agent-txn database: the shop wrote its tables and stock there.
    with pytest.raises(DemoError, match=r"holds other tables \(action_settings, "):
        await run_demo(db_urls.store, db_urls.store, out=quiet)
    engine = create_engine(db_urls.store)
    try:
        async with engine.connect() as conn:
            tables = await table_names(conn)
    finally:
        await engine.dispose()
    assert "effects" not in tables and "stock" not in tables
    # The shop's own database after a run: its effects would be counted as the next run's.
    with pytest.raises(DemoError, match="already holds 9 effect"):
        await run_demo(db_urls.store, db_urls.provider, out=quiet)
    # A fresh provider database, and the store of the first run: refused for the store.
    fresh = f"sqlite+aiosqlite:///{tmp_path / 'fresh-provider.db'}"
    with pytest.raises(DemoError, match="needs an empty agent-txn database; this one already"):
        await run_demo(db_urls.store, fresh, out=quiet)


async def test_run_demo_report(db_urls: DbUrls) -> None:
    """The library entry point returns a report tests (and callers) can assert on."""
    buffer = io.StringIO()
    report = await run_demo(db_urls.store, db_urls.provider, out=Console(file=buffer, width=140))
    assert report.ok, buffer.getvalue()
    assert [(o.order_id, o.status) for o in report.orders] == [
        ("order-41", "committed"),
        ("order-42", "committed"),
        ("order-43", "compensated"),
    ]
    assert report.order("order-42").counts == {
        "reserve": 1,
        "release": 0,
        "charge": 1,
        "refund": 0,
        "email": 1,
    }
    assert report.order("order-43").counts_line == "reserve=1 release=1 charge=0 email=0"
    assert report.totals["charge"] == 2 and report.problems == []


def test_configure_logging_filters_and_renders_json() -> None:
    stream = io.StringIO()
    try:
        configure_logging("WARNING", stream=stream)
        log = structlog.get_logger("agent-txn-test")
        log.info("dropped", tx_id="t1")
        log.warning("kept", tx_id="t2")
        configure_logging("info", json=True, stream=stream)
        log.info("now kept", tx_id="t3")
    finally:
        structlog.reset_defaults()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(e["event"], e["level"], e["tx_id"]) for e in lines] == [
        ("kept", "warning", "t2"),
        ("now kept", "info", "t3"),
    ]
    assert all(e["timestamp"].endswith("Z") for e in lines)
    with pytest.raises(ValueError, match="log level"):
        configure_logging("LOUD", stream=stream)


@pytest.mark.parametrize(
    "args",
    [
        ["worker", "--db", "mysql://x", "--once"],
        ["fault-inject", "run", "--suite", "seed", "--db", "mysql://x"],
        ["fault-inject", "check", "--db", "mysql://x", "--provider-db", "mysql://y"],
        ["bench", "--db", "mysql://x", "--sagas", "1"],
    ],
)
def test_bad_database_urls_are_one_clean_line(args: list[str]) -> None:
    import subprocess as sp
    import sys as _sys

    done = sp.run(
        [_sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "unsupported database" in done.stderr


#: A PostgreSQL URL nothing listens on: port 1 refuses the connection at once.
UNREACHABLE_PG = "postgresql://postgres@127.0.0.1:1/postgres"


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--db", UNREACHABLE_PG, "--sagas", "1"],
        ["fault-inject", "run", "--suite", "seed", "--db", UNREACHABLE_PG],
        ["fault-inject", "check", "--db", UNREACHABLE_PG, "--provider-db", UNREACHABLE_PG],
    ],
)
def test_unreachable_database_is_one_clean_line(args: list[str], tmp_path: Path) -> None:
    """The suite's commands report a server they cannot reach as the engine's commands do: one
    ``error:`` line and exit code 2 (they printed the driver's traceback before)."""
    run = cli(*args, cwd=tmp_path)
    assert run.code == 2, (run.out, run.err)
    assert "Traceback" not in run.err
    assert run.err.strip() == "error: StoreUnavailable: database unreachable", run.err


@pytest.mark.parametrize("command", [["bench", "--sagas", "1"], ["fault-inject", "run"]])
@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("missing/bench.db", "--db: no folder {tmp}/missing for the run's SQLite files"),
        (":memory:", "--db: an in-memory SQLite database cannot be shared"),
    ],
)
def test_a_sqlite_db_for_fresh_databases_must_name_a_folder_that_is_there(
    command: list[str], where: str, message: str, tmp_path: Path
) -> None:
    """A run makes fresh SQLite files in the folder of the file ``--db`` names (its disk is what
    a commit waits for); a folder that is not there is refused before anything runs."""
    url = f"sqlite+aiosqlite:///{where if where == ':memory:' else tmp_path / where}"
    run = cli(*command, "--db", url, cwd=tmp_path)
    assert run.code == 2, (run.out, run.err)
    assert "Traceback" not in run.err
    assert run.err.startswith("error: " + message.format(tmp=tmp_path)), run.err
    assert not (tmp_path / "missing").exists()


def test_fault_inject_check_needs_existing_sqlite_files(tmp_path: Path) -> None:
    """``check`` reads a pair of databases: a SQLite path that is not there is one error line,
    and no empty file is left behind (connecting would have created one)."""
    ours, theirs = tmp_path / "agent.db", tmp_path / "provider.db"
    run = cli(
        *("fault-inject", "check", "--db", f"sqlite:///{ours}"),
        *("--provider-db", f"sqlite:///{theirs}"),
        cwd=tmp_path,
    )
    assert_clean_failure(run)
    assert run.err.strip() == f"error: --db: no database at {ours}"
    assert not ours.exists() and not theirs.exists()


def test_fault_inject_replay_runs_a_saved_schedule_alone(tmp_path: Path) -> None:
    """The command a shrunk failure prints (``fault-inject replay FILE``) runs that file."""
    from tests.fault.test_random_schedules import RIDER_CRASH_IN_FLUSH

    saved = tmp_path / "shrunk-1205-207.json"
    saved.write_text(json.dumps(RIDER_CRASH_IN_FLUSH))
    run = cli("fault-inject", "replay", str(saved), "--report", "out/replay", cwd=tmp_path)
    assert run.code == 0, (run.out, run.err)
    assert "PASS schedule 207 (seed 1205): 1 saga, 1 fault, 1 crash, 1 worker" in run.out
    report = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert report["ok"] is True and report["crashes"] == 1
    assert report["results"][0]["repro"] == f"agent-txn fault-inject replay {saved}"


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "cannot be read"),
        ("not json", "not a schedule"),
        ('{"sagas": 3, "seed": 1, "index": 2}', "not a schedule"),
        ('{"seed": 1, "index": 2}', "schedule field 'sagas' is missing"),
    ],
)
def test_fault_inject_replay_refuses_what_is_not_a_schedule(
    content: str | None, why: str, tmp_path: Path
) -> None:
    target = tmp_path / "schedule.json"
    if content is not None:
        target.write_text(content)
    run = cli("fault-inject", "replay", str(target), cwd=tmp_path)
    assert_clean_failure(run)
    assert run.err.startswith(f"error: {target}: ") and why in run.err, run.err


@pytest.mark.parametrize(
    ("command", "option"),
    [(["bench", "--sagas", "1", "--warmup", "0"], "--json"), (["fault-inject", "run"], "--report")],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(
    command: list[str], option: str, tmp_path: Path
) -> None:
    """A results path is checked before a run of minutes starts: a folder given as the file,
    or a file standing where its folder should be, is one error line (it was a traceback
    after the whole run)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for target, why in ((tmp_path, "is a folder"), (blocker / "out.json", "is not a folder")):
        run = cli(*command, option, str(target), cwd=tmp_path)
        assert_clean_failure(run)
        assert why in run.err and "check OK" not in run.out and "PASS" not in run.out


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_that_refuses_files_is_refused_before_the_run(tmp_path: Path) -> None:
    """/proc is a folder that says it is writable (to root) and refuses new files: the bench
    learned that only when it wrote its results, after the run, with a traceback."""
    run = cli(
        "bench", "--sagas", "1", "--warmup", "0", "--json", "/proc/agent-txn.json", cwd=tmp_path
    )
    assert_clean_failure(run)
    assert run.err.startswith("error: --json: cannot write /proc/agent-txn.json"), run.err
    assert "check OK" not in run.out


def test_checking_a_results_path_leaves_no_file_behind(tmp_path: Path) -> None:
    """The check opens the file the run will write; if the run is then refused, no empty file
    is left where there was none."""
    target = tmp_path / "bench.json"
    run = cli("bench", "--provider", "smtp", "--json", str(target), cwd=tmp_path)
    assert run.code == 2, (run.out, run.err)
    assert not target.exists()


def test_bench_json_creates_its_folder(tmp_path: Path) -> None:
    """As ``fault-inject run --report`` does, the folder of ``--json`` is made if missing."""
    target = tmp_path / "results" / "today" / "bench.json"
    run = cli("bench", "--sagas", "2", "--warmup", "0", "--json", str(target), cwd=tmp_path)
    assert run.code == 0, (run.out, run.err)
    assert json.loads(target.read_text())["sagas"] == 2
