"""``agent-txn ops prune`` and ``agent-txn ops requeue-callbacks`` end to end, on both backends.

Most runs go through typer's ``CliRunner`` against the real ``agent-txn`` app; one subprocess
run proves the sub-app is registered when ``agent-txn`` runs as a real process. The databases are
prepared through the repositories with a clock set back 200 days, so the CLI (on the real clock)
finds records past the 180-day retention.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import select
from typer.testing import CliRunner, Result

from ledger.schema import callback_runs, executions
from ledger.store import Store
from orchestrator import cli, ops_cli
from tests.support.audit_rows import seed_callbacks, seed_command, seed_execution

if TYPE_CHECKING:
    from tests.conftest import DbUrls

REPO = Path(__file__).resolve().parents[2]
DAY_S = 86_400


def run(*args: str) -> Result:
    env = {k: None for k in os.environ if k.startswith("AGENT_TXN_")}
    return CliRunner().invoke(cli.app, list(args), env=env)


def ok(*args: str) -> str:
    result = run(*args)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result.stdout


def clean_failure(result: Result) -> str:
    """Exit 2 with one ``error:`` line on stderr and no traceback; returns the line."""
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def with_store(url: str, job: Callable[[Store], Awaitable[Any]], *, days_ago: float = 0) -> Any:
    async def main() -> Any:
        store = await Store.open(
            url, auto_upgrade="never", clock=lambda: time.time() - days_ago * DAY_S
        )
        try:
            return await job(store)
        finally:
            await store.close()

    return asyncio.run(main())


@pytest.fixture
def db(db_urls: DbUrls) -> str:
    """A migrated database with a command: two old finished records, one old staged, one young
    succeeded; each with a pending callback run."""
    ok("db", "upgrade", "--db", db_urls.store)

    async def old(store: Store) -> None:
        await seed_command(store)
        for execution_id, status in (("old-ok", "succeeded"), ("old-ko", "failed"),
                                     ("old-staged", "staged")):  # fmt: skip
            await seed_execution(store, execution_id, status=status)
            await seed_callbacks(store, execution_id, ["http://127.0.0.1:9/hook"])

    async def young(store: Store) -> None:
        await seed_execution(store, "young", status="succeeded")
        await seed_callbacks(store, "young", ["http://127.0.0.1:9/hook"])

    with_store(db_urls.store, old, days_ago=200)
    with_store(db_urls.store, young)
    return db_urls.store


def _execution_ids(db: str) -> set[str]:
    async def job(store: Store) -> set[str]:
        async with store.read() as conn:
            return set((await conn.execute(select(executions.c.execution_id))).scalars())

    return set(with_store(db, job))


def test_prune_json_is_exactly_the_api_answer(db: str) -> None:
    before = time.time()
    data = json.loads(ok("ops", "prune", "--db", db, "--json"))
    assert set(data) == {"pruned", "retention_days", "cutoff"}
    assert (data["pruned"], data["retention_days"]) == (2, 180)
    assert data["cutoff"].endswith("Z")
    cutoff_s = datetime.fromisoformat(data["cutoff"].replace("Z", "+00:00")).timestamp()
    assert before - 180 * DAY_S - 1 <= cutoff_s <= time.time() - 180 * DAY_S
    assert _execution_ids(db) == {"old-staged", "young"}
    assert json.loads(ok("ops", "prune", "--db", db, "--json"))["pruned"] == 0


def test_prune_prints_one_line_for_people(db: str) -> None:
    out = ok("ops", "prune", "--db", db)
    assert out.startswith("pruned 2 execution record(s) created before ")
    assert out.strip().endswith("(retention 180 days)")
    assert len(out.strip().splitlines()) == 1


def test_requeue_callbacks_republishes_stale_runs_within_the_limit(db: str) -> None:
    args = ("ops", "requeue-callbacks", "--db", db, "--json")
    # The young run is seconds old: only the three 200-day-old runs are stale at 300 s.
    assert json.loads(ok(*args, "--limit", "2")) == {"republished": 2, "retried": 0, "reclaimed": 0}
    assert json.loads(ok(*args)) == {"republished": 1, "retried": 0, "reclaimed": 0}
    out = ok("ops", "requeue-callbacks", "--db", db, "--older-than-seconds", "0")
    assert out.strip() == "republished 4, retried 0, reclaimed 0"

    async def states(store: Store) -> list[tuple[str, int | None]]:
        async with store.read() as conn:
            rows = await conn.execute(
                select(callback_runs.c.state, callback_runs.c.next_attempt_at)
            )
            return [tuple(r) for r in rows]

    assert with_store(db, states) == [("pending", None)] * 4


def test_tenant_scopes_both_jobs_to_that_tenants_records(db: str) -> None:
    # Every record of the fixture is an execution of tenant acme's command.
    requeue = ("ops", "requeue-callbacks", "--db", db, "--json")
    assert json.loads(ok(*requeue, "--tenant", "other"))["republished"] == 0
    assert json.loads(ok("ops", "prune", "--db", db, "--tenant", "other", "--json"))["pruned"] == 0
    assert _execution_ids(db) == {"old-ok", "old-ko", "old-staged", "young"}
    assert json.loads(ok(*requeue, "--tenant", "acme"))["republished"] == 3
    assert json.loads(ok("ops", "prune", "--db", db, "--tenant", "acme", "--json"))["pruned"] == 2
    assert _execution_ids(db) == {"old-staged", "young"}
    for command in ("prune", "requeue-callbacks"):
        result = run("ops", command, "--db", db, "--tenant", "")
        assert result.exit_code == 2 and "--tenant" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "extra",
    [("--limit", "0"), ("--limit", "2001"), ("--older-than-seconds", "-1")],
)
def test_requeue_callbacks_refuses_out_of_range_values_in_one_line(
    db: str, extra: tuple[str, str]
) -> None:
    line = clean_failure(run("ops", "requeue-callbacks", "--db", db, *extra))
    assert "request_invalid" in line
    assert extra[0].lstrip("-").replace("-", "_") in line


def test_a_missing_database_is_one_line_and_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "missing.db"
    for command in ("prune", "requeue-callbacks"):
        line = clean_failure(run("ops", command, "--db", f"sqlite+aiosqlite:///{path}"))
        assert "agent-txn db upgrade" in line
    assert not path.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["deliveries", ""],
        ["deliveries", " room-1"],
        ["deliveries", "r" * 65],
        ["acknowledge", "", "-e", "x"],
    ],
)
def test_a_room_no_marker_can_have_is_refused_not_answered_with_nothing(
    tmp_path: Path, args: list[str]
) -> None:
    # Before: "no delivery markers in this room", as if the room were right and empty.
    path = tmp_path / "agent.db"
    result = run("ops", *args, "--db", f"sqlite+aiosqlite:///{path}")
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert "ROOM" in result.stderr and "Traceback" not in result.stderr
    assert not path.exists()  # refused before the database is opened


def test_options_match_the_rest_of_the_cli() -> None:
    assert (ops_cli.DB_ENV, ops_cli.DEFAULT_DB) == (cli.DB_ENV, cli.DEFAULT_DB)


def test_the_installed_cli_has_ops(db: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_TXN_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "ops", "prune", "--db", db, "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["pruned"] == 2
