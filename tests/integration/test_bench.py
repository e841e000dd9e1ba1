"""``agent-txn bench`` on both backends: commit economy and one effect per intent, never speed.

Speed belongs in the benchmark (docs/benchmarks.md), not in tests: a loaded CI machine would make
any wall-clock assertion flaky. What must hold on every machine is counted: commits per
happy-path saga (DESIGN "Commit economy": at most N + 3 for N = 2 steps and one outbox event)
and exactly one reserve, charge and email per saga at the provider.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import sqlite3
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy
from typer.testing import CliRunner, Result

from fault_injection import bench, bench_cli, bench_dbos, bench_steady
from fault_injection import sweep as sweep_module
from fault_injection.bench import UNGROUPED_COMMITS_PER_SAGA, BenchConfig, run_bench
from fault_injection.bench_cli import app
from fault_injection.bench_dbos import (
    MATCH_CAP,
    SWEEP_CONCURRENCY,
    ComparePair,
    DbosResult,
    dbos_available,
    matched_sagas,
)
from fault_injection.bench_driver import raw_commit_rate
from fault_injection.bench_environment import describe, filesystem_of, package_version
from fault_injection.contract_checks import check_provider_contract
from fault_injection.harness import DatabasePair
from fault_injection.server_cpu import is_local_postgres, read_server, server_cpu_seconds
from fault_injection.steal import CpuTimes, read_cpu_times
from fault_injection.sweep import SWEEP_ROUNDS
from ledger import dialects
from ledger.store import StoreStats
from providers.contract import Confirmed, FencedOut, Rejected
from providers.memory import MemoryShop
from tests.conftest import DbUrls, pg_admin_url, pg_connect
from tests.support.dbos_results import dbos_result

#: 2 steps + 1 outbox event.
MAX_COMMITS_PER_SAGA = 2 + 3
#: The keys ``--json`` promises in every mode.
STABLE_KEYS = (
    "sagas_per_s",
    "p50_ms",
    "p99_ms",
    "commits_per_saga",
    "statements_per_saga",
    "cpu_ms_per_saga",
    "driver_commits_per_s",
    "efficiency",
    "provider_calls_per_saga",
    "backend",
    "sagas",
    "concurrency",
    "provider",
    "mode",
    "workers",
)


@pytest.fixture(autouse=True)
def _no_sweep_reruns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweeps here count their runs: this machine's own stolen CPU must not add one
    (``fault_injection.sweep.SWEEP_RERUNS``; the rerun is tested where the steal is set)."""
    monkeypatch.setattr(sweep_module, "SWEEP_RERUNS", 0)


def _pair(db_urls: DbUrls) -> DatabasePair:
    return DatabasePair(db_urls.store, db_urls.provider, db_urls.backend)


@pytest.mark.parametrize("provider", ["memory", "fake"])
@pytest.mark.parametrize("concurrency", [1, 4])
async def test_bench_counts_commits_and_effects(
    db_urls: DbUrls, provider: str, concurrency: int
) -> None:
    config = BenchConfig(
        sagas=20,
        concurrency=concurrency,
        provider="memory" if provider == "memory" else "fake",
        warmup=2,
        driver_seconds=0.2,
    )
    result = await run_bench(config, urls=_pair(db_urls))

    assert result.check.ok, result.check.problems
    assert result.check.expected == 22
    for name in ("inventory.reserve", "payments.charge", "email.send"):
        assert result.check.counts[name] == 22
    assert result.commits_per_saga is not None
    assert 0 < result.commits_per_saga <= MAX_COMMITS_PER_SAGA
    assert (result.statements_per_saga or 0) >= result.commits_per_saga
    assert (result.provider_calls_per_saga or 0) >= 3
    assert result.driver_commits_per_s > 0
    assert (result.raw_driver_commits_per_s or 0) > 0
    assert (result.efficiency or 0) > 0
    # The second reading of the efficiency divides by the commits a saga makes sharing none
    # (test_engine.py pins that count on a lone saga). Sequentially nothing is shared, so no
    # run counts fewer (a short one counts a few more: the drain's last receipt records have
    # no next saga to ride on), and that reading is never above the counted one.
    assert result.efficiency is not None and result.efficiency_ungrouped is not None
    assert result.efficiency_ungrouped > 0
    if concurrency == 1:
        assert result.commits_per_saga >= UNGROUPED_COMMITS_PER_SAGA
        assert result.efficiency_ungrouped <= result.efficiency
    if db_urls.backend == "sqlite":
        assert result.server_cpu_ms_per_saga is None
    elif is_local_postgres(db_urls.store):
        assert result.server_cpu_ms_per_saga is not None and result.server_cpu_ms_per_saga >= 0


async def test_the_servers_cpu_is_read_around_the_work_it_did(db_urls: DbUrls) -> None:
    """``server_cpu_ms_per_saga``: the CPU the server's own processes spent between two
    readings, here a backend spinning for half a second of the clock."""
    if db_urls.backend == "sqlite":
        assert read_server(db_urls.store) is None
        return
    if not is_local_postgres(db_urls.store):
        pytest.skip("the test server is not on this host: its processes cannot be read")
    conn = await pg_connect(db_urls.store)
    try:
        before = read_server(db_urls.store)
        # A busy loop for a span of the clock, not an amount of work: the same CPU time on a
        # fast machine as on a slow one.
        await conn.execute(
            "DO $$ BEGIN WHILE clock_timestamp() < now() + interval '500 ms' LOOP END LOOP; END $$"
        )
        # Read while the backend lives: an ended process takes its time with it.
        spent = server_cpu_seconds(before, read_server(db_urls.store))
    finally:
        await conn.close()

    # 0.5 s of CPU on an idle machine; a tenth of it even if the suite's other processes
    # leave the backend a tenth of a core. Other tests' work on the server only adds.
    assert spent is not None and spent >= 0.05


async def test_the_bare_drivers_loop_commits_on_the_bench_database_and_drops_its_table(
    db_urls: DbUrls,
) -> None:
    """``raw_driver_commits_per_s``: stdlib sqlite3 or asyncpg on the store's own database,
    several connections at once on PostgreSQL, and nothing left behind."""
    rate = await raw_commit_rate(
        db_urls.store, seconds=0.1, connections=2, sqlite_synchronous="NORMAL"
    )

    assert rate is not None and rate > 0
    engine = dialects.create_engine(dialects.normalize_url(db_urls.store))
    try:
        async with engine.connect() as conn:
            tables = await conn.run_sync(lambda sync: sqlalchemy.inspect(sync).get_table_names())
    finally:
        await engine.dispose()
    assert "bench_scratch_raw" not in tables


async def test_the_bare_drivers_loop_needs_a_sqlite_file() -> None:
    rate = await raw_commit_rate("sqlite+aiosqlite:///:memory:", seconds=0.1, connections=1)
    assert rate is None


def test_bench_cli_writes_stable_json_keys(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    runner = CliRunner()
    got = runner.invoke(
        app,
        ["--sagas", "5", "--warmup", "1", "--driver-seconds", "0.1", "--json", str(out)],
    )
    assert got.exit_code == 0, got.output
    assert "check OK" in got.output
    data = json.loads(out.read_text())
    for key in STABLE_KEYS:
        assert key in data
    assert data["backend"] == "sqlite"
    assert data["sagas"] == 5
    assert data["raw_driver_commits_per_s"] > 0
    assert "raw driver commits/s (1 conn)" in got.output
    environment = data["environment"]
    assert environment["python"].endswith(platform.python_version())
    assert environment["sqlite"] == sqlite3.sqlite_version
    assert environment["postgresql"] is None and environment["dbos"] is None
    assert f"SQLite {sqlite3.sqlite_version}" in got.output


async def test_bench_environment_names_the_server_it_ran_on(db_urls: DbUrls) -> None:
    """On PostgreSQL the server's own version (read here through another connection), on
    SQLite none; the SQLite library is named either way (DBOS links the same one)."""
    on_postgres = db_urls.backend == "postgres"
    environment = await describe(db_urls.store if on_postgres else None, compare="dbos")

    assert environment["sqlite"] == sqlite3.sqlite_version
    assert environment["dbos"] == package_version("dbos")
    assert environment["agent_txn"] == package_version("agent-txn") is not None
    if not on_postgres:
        assert environment["postgresql"] is None
        return
    engine = dialects.create_engine(dialects.normalize_url(db_urls.store))
    try:
        async with engine.connect() as conn:
            row = await conn.exec_driver_sql("SELECT current_setting('server_version')")
            assert environment["postgresql"] == row.scalar_one()
    finally:
        await engine.dispose()


@pytest.mark.parametrize("writer", ["inline", "process"])
def test_bench_cli_says_where_sqlite_committed_and_counts_the_writers_cpu(
    tmp_path: Path, writer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "bench.json"
    writer_cpu: list[float] = []
    snapshot = StoreStats.snapshot

    def seen(self: StoreStats) -> StoreStats:
        writer_cpu.append(self.writer_cpu_s)
        return snapshot(self)

    monkeypatch.setattr(StoreStats, "snapshot", seen)
    args = ["--sagas", "40", "--concurrency", "8", "--warmup", "1", "--driver-seconds", "0.1"]
    got = CliRunner().invoke(app, [*args, "--sqlite-writer", writer, "--json", str(out)])
    assert got.exit_code == 0, got.output
    data = json.loads(out.read_text())
    assert data["sqlite_writer"] == writer
    assert data["check_ok"] is True
    if writer == "process":
        # The groups ran in the writer, whose CPU time its answers carried to the store.
        assert max(writer_cpu) > 0
    else:
        assert max(writer_cpu) == 0


def test_bench_cli_refuses_an_unknown_sqlite_writer() -> None:
    got = CliRunner().invoke(app, ["--sagas", "1", "--sqlite-writer", "thread"])
    assert got.exit_code == 2
    assert "--sqlite-writer must be inline or process" in got.output


@pytest.mark.parametrize(
    "option", [["--sqlite-synchronous", "NORMAL"], ["--sqlite-writer", "inline"]]
)
def test_bench_cli_refuses_sqlite_settings_on_postgresql(option: list[str]) -> None:
    # They did nothing there: the run was not the one asked for.
    got = CliRunner().invoke(app, ["--sagas", "1", "--db", "postgresql://server/x", *option])
    assert got.exit_code == 2, got.output
    assert f"{option[0]} is for a SQLite --db; this one is PostgreSQL" in got.output
    assert "Traceback" not in got.output


def test_bench_cli_refuses_dbos_sqlite_settings_on_postgresql() -> None:
    args = ["--db", "postgresql://server/x", "--compare", "dbos", "--dbos-sqlite", "default"]
    got = CliRunner().invoke(app, ["--sagas", "1", *args])
    assert got.exit_code == 2, got.output
    assert "--dbos-sqlite is for a SQLite --db; this one is PostgreSQL" in got.output


def test_bench_cli_refuses_unknown_provider() -> None:
    got = CliRunner().invoke(app, ["--provider", "smtp"])
    assert got.exit_code == 2


@pytest.mark.parametrize(
    "args",
    [
        ["--workers", "2"],  # SQLite: worker processes need PostgreSQL
        ["--recovery", "--provider", "memory"],  # recovery runs the fleet's fake shop
        ["--recovery", "--provider", "fake", "--latency-ms", "5"],  # and adds no latency
        ["--compare", "temporal"],
        ["--match-time"],  # sizes the halves of a DBOS comparison: nothing to match alone
        ["--dbos-concurrency", "4"],  # DBOS's half of a comparison: there is none
        ["--pairs", "5"],  # likewise: silently one run before
        ["--dbos-sqlite", "default"],
        # auto sweeps the in-process modes; a worker's sagas in hand are a number
        ["--concurrency", "auto", "--db", "postgresql://server/x", "--workers", "2"],
        ["--concurrency", "auto", "--recovery", "--provider", "fake"],
    ],
)
def test_bench_cli_refuses_bad_mode_combinations(args: list[str]) -> None:
    got = CliRunner().invoke(app, ["--sagas", "1", *args])
    assert got.exit_code == 2, got.output
    assert "Traceback" not in got.output


@pytest.mark.parametrize(
    ("option", "value"),
    [
        # inf passed the options' lower bounds and then ran for ever: the driver loop, or
        # every provider call's sleep (and past the call timeout, its lookup's too).
        ("--latency-ms", "inf"),
        ("--latency-ms", "5001"),
        ("--latency-ms", "nan"),
        ("--driver-seconds", "inf"),
        ("--driver-seconds", "61"),
        ("--driver-seconds", "nan"),
    ],
)
def test_bench_cli_refuses_a_time_without_end(option: str, value: str) -> None:
    got = CliRunner().invoke(app, ["--sagas", "1", option, value])
    assert got.exit_code == 2, got.output
    assert f"Invalid value for '{option}'" in got.output
    assert "Traceback" not in got.output


@pytest.mark.parametrize(
    "values",
    [
        {"latency_ms": math.inf},
        {"latency_ms": math.nan},
        {"driver_seconds": math.inf},
        {"driver_seconds": math.nan},
    ],
)
def test_bench_config_refuses_times_that_are_not_finite(values: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="finite"):
        BenchConfig(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["fast", "0", "1025", "4.5", ""])
def test_bench_cli_refuses_a_concurrency_that_is_neither_a_number_nor_auto(value: str) -> None:
    got = CliRunner().invoke(app, ["--sagas", "1", "--concurrency", value])
    assert got.exit_code == 2, got.output
    assert "--concurrency must be a number from 1 to 1024, or auto" in got.output
    assert "Traceback" not in got.output


@pytest.mark.parametrize("value", ["fast", "0", "1025", "4.5", ""])
def test_bench_cli_refuses_a_dbos_concurrency_that_is_neither_a_number_nor_auto(
    value: str,
) -> None:
    got = CliRunner().invoke(
        app, ["--sagas", "1", "--compare", "dbos", "--dbos-concurrency", value]
    )
    assert got.exit_code == 2, got.output
    assert "--dbos-concurrency must be a number from 1 to 1024, or auto" in got.output
    assert "Traceback" not in got.output


async def test_bench_over_http_counts_commits_and_effects(db_urls: DbUrls) -> None:
    """The fake shop served by its own process; every provider call is a real HTTP request."""
    config = BenchConfig(sagas=10, concurrency=2, provider="http", warmup=1, driver_seconds=0.1)
    result = await run_bench(config, urls=_pair(db_urls))

    assert result.check.ok, result.check.problems
    assert result.check.counts["email.send"] == 11
    assert 0 < (result.commits_per_saga or 0) <= MAX_COMMITS_PER_SAGA
    assert result.provider_calls_per_saga == 3


def test_bench_cli_http_provider_writes_json_keys(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    got = CliRunner().invoke(
        app,
        [
            *("--provider", "http", "--sagas", "4", "--warmup", "1", "--driver-seconds", "0.1"),
            *("--json", str(out)),
        ],
    )
    assert got.exit_code == 0, got.output
    data = json.loads(out.read_text())
    for key in STABLE_KEYS:
        assert key in data, key
    assert data["provider"] == "http"
    assert data["check_ok"] is True


@pytest.mark.parametrize("backend", ["postgres"])
async def test_bench_workers_one_effect_per_intent(db_urls: DbUrls, tmp_path: Path) -> None:
    """Two worker processes drain prepared sagas; the shop's own database is the judge."""
    config = BenchConfig(
        sagas=24, concurrency=4, provider="fake", warmup=1, workers=2, driver_seconds=0.1
    )
    result = await run_bench(config, urls=_pair(db_urls), workdir=tmp_path)

    assert result.check.ok, result.check.problems
    assert result.mode == "workers"
    expected = 24 + 2 * 1  # the measured sagas and each worker's warm-up
    assert result.check.expected == expected
    for name in ("inventory.reserve", "payments.charge", "email.send"):
        assert result.check.counts[name] == expected
    assert result.check.counts["inventory.release"] == 0
    per_worker = result.extra["per_worker"]
    assert len(per_worker) == 2
    assert sum(w["finished"] for w in per_worker) >= 24
    assert result.commits_per_saga is not None and result.commits_per_saga > 0
    assert (result.raw_driver_commits_per_s or 0) > 0


@pytest.mark.parametrize("backend", ["postgres"])
async def test_bench_workers_memory_shops_add_up(db_urls: DbUrls, tmp_path: Path) -> None:
    """Memory provider: one shop per worker process, their counts added up by the checker."""
    config = BenchConfig(sagas=12, concurrency=4, warmup=0, workers=2, driver_seconds=0.1)
    result = await run_bench(config, urls=_pair(db_urls), workdir=tmp_path)

    assert result.check.ok, result.check.problems
    assert result.check.counts["payments.charge"] == 12
    # Enqueued sagas are applied without a lookup: reserve, charge, email — no fourth call.
    assert result.provider_calls_per_saga == 3


@pytest.mark.parametrize("backend", ["postgres"])
async def test_bench_recovery_drives_in_doubt_sagas_to_terminal(db_urls: DbUrls) -> None:
    config = BenchConfig(
        sagas=8, concurrency=4, provider="fake", workers=2, recovery=True, driver_seconds=0.1
    )
    result = await run_bench(config, urls=_pair(db_urls))

    assert result.check.ok, result.check.problems
    assert result.mode == "recovery"
    assert result.extra["statuses"] == {"committed": 8}
    assert result.check.counts["payments.charge"] == 8
    assert result.elapsed_s > 0
    assert result.sagas_per_s > 0
    assert (result.raw_driver_commits_per_s or 0) > 0


@pytest.fixture
def dbos_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """DBOS's console log handlers set aside for one test. DBOS makes its handler once, on the
    ``sys.stderr`` of the moment (here a ``CliRunner``'s), and flushes it at every launch; a
    second test's launch then met the first runner's closed stream."""
    monkeypatch.setattr(logging.getLogger("dbos"), "handlers", [])


def _bench_json(
    tmp_path: Path, *flags: str, sagas: int = 6, backend: str = "sqlite", exit_code: int = 0
) -> tuple[Result, dict[str, Any]]:
    """``agent-txn bench`` at its smallest (``sagas``, one warm-up saga, the shortest driver
    loop) with ``flags``, on fresh SQLite files or fresh databases of the test server; its
    output and its JSON, once it exited with ``exit_code``."""
    out = tmp_path / "bench.json"
    db = ["--db", pg_admin_url()] if backend == "postgres" else []
    got = CliRunner().invoke(
        app,
        [
            *("--sagas", str(sagas), "--warmup", "1", "--driver-seconds", "0.1"),
            *("--json", str(out), *db, *flags),
        ],
    )
    assert got.exit_code == exit_code, got.output
    return got, json.loads(out.read_text())


def _compare_dbos(
    tmp_path: Path, *flags: str, backend: str = "sqlite", exit_code: int = 0
) -> tuple[Result, dict[str, Any]]:
    """:func:`_bench_json` with ``--compare dbos``, 5 sagas a half."""
    return _bench_json(
        tmp_path, "--compare", "dbos", *flags, sagas=5, backend=backend, exit_code=exit_code
    )


@pytest.mark.skipif(not dbos_available(), reason="dbos is not installed (extra: bench)")
@pytest.mark.usefixtures("dbos_console")
def test_bench_cli_makes_both_engines_sqlite_files_in_the_folder_a_sqlite_db_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SQLite ``--db`` names the disk: every run's fresh files (ours and DBOS's) are made in
    the folder of the file it names, and removed after. It was ignored before: the files went
    to the temporary folder, on tmpfs on some systems, whatever the URL said."""
    disk = tmp_path / "disk"
    disk.mkdir()
    workdirs: list[Path] = []
    ours, theirs = bench.fresh_databases, bench_dbos._database

    def our_databases(db: str | None, workdir: Path) -> Any:
        workdirs.append(workdir)
        return ours(db, workdir)

    def dboss_database(db: str | None, workdir: Path) -> Any:
        workdirs.append(workdir)
        return theirs(db, workdir)

    monkeypatch.setattr(bench, "fresh_databases", our_databases)
    monkeypatch.setattr(bench_dbos, "_database", dboss_database)
    got, data = _compare_dbos(
        tmp_path, "--pairs", "1", "--db", f"sqlite+aiosqlite:///{disk / 'bench.db'}"
    )

    assert len(workdirs) == 2  # our half, DBOS's half
    assert [w.parent for w in workdirs] == [disk, disk]
    assert list(disk.iterdir()) == []  # removed after the run
    files = {"folder": str(disk), "filesystem": filesystem_of(disk)}
    assert data["environment"]["sqlite_files"] == files
    assert f"(files in {disk}, {files['filesystem']})" in got.output


@pytest.mark.skipif(not dbos_available(), reason="dbos is not installed (extra: bench)")
@pytest.mark.usefixtures("dbos_console")
def test_bench_cli_compare_dbos_writes_ratio(tmp_path: Path, backend: str) -> None:
    got, data = _compare_dbos(tmp_path, "--pairs", "1", backend=backend)
    assert "pair 1/1" in got.output and "ratio" in got.output
    for key in (*STABLE_KEYS, "dbos_sagas_per_s", "ratio_vs_dbos"):
        assert key in data, key
    assert data["dbos_sagas_per_s"] > 0
    assert data["ratio_vs_dbos"] == pytest.approx(
        data["pairs"][0]["sagas_per_s"] / data["pairs"][0]["dbos_sagas_per_s"]
    )
    assert data["check_ok"] is True
    assert data["pairs"][0]["sagas"] == data["pairs"][0]["dbos_sagas"] == 5
    assert data["backend"] == backend
    if backend == "sqlite":  # no server process to read, on either side
        assert data["server_cpu_ms_per_saga"] is None
        assert data["dbos_server_cpu_ms_per_saga"] is None
        assert ", server " not in got.output
    elif is_local_postgres(pg_admin_url()):
        # The server's CPU, read for each half (/proc counts in clock ticks: five workflows may
        # take less than one, so zero is a reading too).
        assert data["server_cpu_ms_per_saga"] >= 0 and data["dbos_server_cpu_ms_per_saga"] >= 0
        assert got.output.count(", server ") == 2
    if read_cpu_times() is not None:  # Linux: each half's stolen share is reported
        assert "steal " in got.output
        for key in ("steal_share", "dbos_steal_share"):
            assert 0.0 <= data["pairs"][0][key] <= 1.0


@pytest.mark.skipif(not dbos_available(), reason="dbos is not installed (extra: bench)")
@pytest.mark.usefixtures("dbos_console")
def test_bench_cli_runs_dbos_at_its_own_concurrency(tmp_path: Path) -> None:
    """``--dbos-concurrency``: each engine at its own setting, and the report says which."""
    got, data = _compare_dbos(tmp_path, "--pairs", "1", "--dbos-concurrency", "3")
    assert "C=1 vs DBOS C=3" in got.output
    assert data["concurrency"] == data["pairs"][0]["concurrency"] == 1
    assert data["dbos_concurrency"] == data["pairs"][0]["dbos_concurrency"] == 3
    assert data["check_ok"] is True


@pytest.mark.skipif(not dbos_available(), reason="dbos is not installed (extra: bench)")
@pytest.mark.usefixtures("dbos_console")
def test_bench_cli_finds_dboss_fastest_setting_first(tmp_path: Path, backend: str) -> None:
    """``--dbos-concurrency auto``: DBOS alone at every setting of the sweep, each round, then
    the pairs at the setting of the highest mean rate; the output and the JSON say which."""
    # Ours at 3, a setting the sweep never tries: DBOS's half cannot run at it by mistake.
    got, data = _compare_dbos(
        tmp_path,
        "--pairs",
        "1",
        "--concurrency",
        "3",
        "--dbos-concurrency",
        "auto",
        backend=backend,
    )
    sweep = data["dbos_concurrency_sweep"]
    assert sweep["sagas"] == 5
    assert [run["concurrency"] for run in sweep["runs"]] == list(SWEEP_CONCURRENCY)
    for run in sweep["runs"]:
        assert len(run["workflows_per_s"]) == len(run["steal_share"]) == SWEEP_ROUNDS
        assert all(rate > 0 for rate in run["workflows_per_s"])
        if read_cpu_times() is not None:  # Linux: each run's stolen share, printed too
            assert all(0.0 <= share <= 1.0 for share in run["steal_share"])
    means = {run["concurrency"]: statistics.fmean(run["workflows_per_s"]) for run in sweep["runs"]}
    assert sweep["fastest"] == max(means, key=lambda c: (means[c], -c))
    # The pairs ran DBOS at the setting the sweep found, and said so.
    assert data["dbos_concurrency"] == data["pairs"][0]["dbos_concurrency"] == sweep["fastest"]
    assert f"DBOS's fastest here: C={sweep['fastest']}" in got.output
    assert f"pair 1/1 · {backend} · C=3 vs DBOS C={sweep['fastest']}:" in got.output
    assert got.output.count("· DBOS C=") == len(SWEEP_CONCURRENCY) * SWEEP_ROUNDS
    assert data["check_ok"] is True


def test_bench_cli_finds_our_fastest_setting_first(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--concurrency auto``: ours alone at every setting of the sweep, each round, then the
    measured run at the setting of the highest mean rate; the output and the JSON say which.

    Every run is real (fresh databases, the checker); only the sweep runs' rates are set, so
    that the fastest is known: 2 in flight, neither the first nor the last setting tried."""
    monkeypatch.setattr(bench_cli, "OURS_SWEEP_CONCURRENCY", (1, 2, 4))
    real_run_bench = bench_cli.run_bench
    set_rates = {1: [100.0, 110.0], 2: [300.0, 290.0], 4: [200.0, 250.0]}
    runs: list[int] = []

    async def rated(config: BenchConfig, **kwargs: Any) -> Any:
        result = await real_run_bench(config, **kwargs)
        runs.append(config.concurrency)
        if len(runs) <= 6:  # the sweep's two rounds of three
            result.sagas_per_s = set_rates[config.concurrency][(len(runs) - 1) // 3]
        return result

    monkeypatch.setattr(bench_cli, "run_bench", rated)
    got, data = _bench_json(tmp_path, "--concurrency", "auto", backend=backend)
    assert runs == [1, 2, 4, 1, 2, 4, 2]  # rounds interleaved, then the measured run at 2
    sweep = data["concurrency_sweep"]
    steal = [run.pop("steal_share") for run in sweep["runs"]]  # each run's, read around it
    assert sweep == {
        "sagas": 6,
        "fastest": 2,
        "runs": [{"concurrency": c, "sagas_per_s": set_rates[c]} for c in (1, 2, 4)],
        "set_aside": [],
    }
    assert [len(shares) for shares in steal] == [SWEEP_ROUNDS] * 3
    assert data["concurrency"] == 2
    assert "our fastest here: C=2 (mean sagas/s: C=1 105.0 · C=2 295.0 · C=4 225.0)" in got.output
    assert "6 sagas · concurrency 2" in got.output
    assert got.output.count("· ours C=") == 3 * SWEEP_ROUNDS
    # The measured run's own figures, not a sweep run's.
    assert data["sagas_per_s"] not in (100.0, 110.0, 300.0, 290.0, 200.0, 250.0)
    assert data["check_ok"] is True and data["sagas"] == 6
    assert data["check"]["counts"]["payments.charge"] == 6 + 1


def test_bench_cli_json_says_no_sweep_ran_for_a_given_concurrency(tmp_path: Path) -> None:
    got, data = _bench_json(tmp_path, "--concurrency", "2")
    assert data["concurrency_sweep"] is None
    assert data["concurrency"] == 2
    assert "alone first" not in got.output


def test_bench_cli_runs_a_sweep_run_again_when_the_hypervisor_took_its_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep run that lost 5 % or more of the CPU is said to be set aside and runs once
    more; the JSON keeps its reading apart from the rates that choose the setting."""
    monkeypatch.setattr(bench_cli, "OURS_SWEEP_CONCURRENCY", (1, 2))
    monkeypatch.setattr(sweep_module, "SWEEP_RERUNS", 1)
    # Around each sweep run, 1 000 ticks: the first run lost 300 of them, the rest none.
    stolen = iter([0, 300] + [300] * 20)
    ticks = iter(range(0, 100_000, 1000))
    monkeypatch.setattr(
        sweep_module, "read_cpu_times", lambda: CpuTimes(total=next(ticks), steal=next(stolen))
    )
    got, data = _bench_json(tmp_path, "--concurrency", "auto")
    sweep = data["concurrency_sweep"]
    assert [run["concurrency"] for run in sweep["set_aside"]] == [1]
    assert sweep["set_aside"][0]["steal_share"] == 0.3
    assert [len(run["sagas_per_s"]) for run in sweep["runs"]] == [SWEEP_ROUNDS] * 2
    assert "set aside: the hypervisor took 30% of the machine's CPU" in got.output
    assert got.output.count("· ours C=") == 2 * SWEEP_ROUNDS + 1


def test_bench_cli_fails_when_our_checker_fails_in_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep run is not the measured run, and its checker still counts: exit 1, the problem
    printed, the measured run still made and reported."""
    monkeypatch.setattr(bench_cli, "OURS_SWEEP_CONCURRENCY", (1, 2))
    real_run_bench = bench_cli.run_bench
    runs: list[int] = []

    async def second_run_double_charges(config: BenchConfig, **kwargs: Any) -> Any:
        result = await real_run_bench(config, **kwargs)
        runs.append(config.concurrency)
        if len(runs) == 2:
            result.check.ok = False
            result.check.problems.append("payments.charge: 2 effects for 1 intents")
        return result

    monkeypatch.setattr(bench_cli, "run_bench", second_run_double_charges)
    got, data = _bench_json(tmp_path, "--concurrency", "auto", exit_code=1)
    assert runs == [1, 2, 1, 2, data["concurrency"]]  # the sweep, then the measured run
    assert "check FAILED: ours alone at C=2: payments.charge: 2 effects for 1 intents" in (
        got.output
    )
    assert data["check_ok"] is False
    assert data["sagas_per_s"] > 0


@pytest.mark.skipif(not dbos_available(), reason="dbos is not installed (extra: bench)")
def test_bench_cli_compare_with_our_auto_finds_both_engines_fastest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--compare dbos --concurrency auto`` with no ``--dbos-concurrency``: DBOS's half is
    ``auto`` too, so each engine runs at its own fastest setting."""
    monkeypatch.setattr(bench_cli, "OURS_SWEEP_CONCURRENCY", (1, 2))
    dbos_calls = _dbos_failing_on(monkeypatch, failing_call=0)  # stood in for; never fails
    got, data = _compare_dbos(tmp_path, "--pairs", "1", "--concurrency", "auto")
    ours, theirs = data["concurrency_sweep"], data["dbos_concurrency_sweep"]
    assert [run["concurrency"] for run in ours["runs"]] == [1, 2]
    assert ours["sagas"] == 5  # as long as the measured half (no --match-time)
    assert [run["concurrency"] for run in theirs["runs"]] == list(SWEEP_CONCURRENCY)
    assert len(dbos_calls) == len(SWEEP_CONCURRENCY) * SWEEP_ROUNDS + 1  # the sweep, the pair
    assert data["pairs"][0]["concurrency"] == ours["fastest"]
    assert data["pairs"][0]["dbos_concurrency"] == theirs["fastest"]
    label = f"C={ours['fastest']}"
    if theirs["fastest"] != ours["fastest"]:
        label += f" vs DBOS C={theirs['fastest']}"
    assert f"pair 1/1 · sqlite · {label}:" in got.output
    assert data["check_ok"] is True


def test_bench_cli_sweeps_ours_with_runs_as_long_as_the_matched_halves_up_to_a_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--match-time`` our halves run up to 20 times ``--sagas``, so the sweep's runs are
    that long too, up to ``OURS_SWEEP_SAGAS``: shorter runs misread the higher settings."""
    monkeypatch.setattr(bench_cli, "OURS_SWEEP_CONCURRENCY", (1, 2))
    monkeypatch.setattr(bench_cli, "OURS_SWEEP_SAGAS", 60)  # under 20 x 5
    _dbos_failing_on(monkeypatch, failing_call=0)
    got, data = _compare_dbos(tmp_path, "--pairs", "1", "--concurrency", "auto", "--match-time")
    assert data["concurrency_sweep"]["sagas"] == 60
    assert "ours alone first, to find its fastest setting (60 sagas a run" in got.output
    monkeypatch.setattr(bench_cli, "OURS_SWEEP_SAGAS", 1000)  # over it: 20 x 5
    _, data = _compare_dbos(tmp_path, "--pairs", "1", "--concurrency", "auto", "--match-time")
    assert data["concurrency_sweep"]["sagas"] == 100


def _dbos_failing_on(monkeypatch: pytest.MonkeyPatch, failing_call: int) -> list[tuple[int, int]]:
    """DBOS's runs stood in for (``bench_dbos.run_dbos``): the ``failing_call``-th run's
    checker reports a double charge, every other run passes. Returns the calls made,
    (number, concurrency)."""
    calls: list[tuple[int, int]] = []

    def run_dbos(db: str | None, workdir: Path, **kwargs: Any) -> DbosResult:
        calls.append((len(calls), kwargs["concurrency"]))
        problems = ["charge: 2 effects for 1 workflows"] if len(calls) == failing_call else None
        return dbos_result(concurrency=kwargs["concurrency"], per_s=100.0, problems=problems)

    monkeypatch.setattr(bench_dbos, "run_dbos", run_dbos)
    return calls


@pytest.mark.skipif(not dbos_available(), reason="dbos is not installed (extra: bench)")
def test_bench_cli_fails_when_dboss_checker_fails_in_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep run is not a pair, and its checker still counts: exit 1, the problem printed."""
    calls = _dbos_failing_on(monkeypatch, failing_call=3)
    got, data = _compare_dbos(tmp_path, "--pairs", "1", "--dbos-concurrency", "auto", exit_code=1)
    assert len(calls) == len(SWEEP_CONCURRENCY) * SWEEP_ROUNDS + 1  # the sweep, then the pair
    assert "check FAILED: DBOS alone at C=4: charge: 2 effects for 1 workflows" in got.output
    assert data["dbos_check_ok"] is False and data["check_ok"] is False
    assert data["pairs"][0]["ratio_vs_dbos"] > 0  # the pairs still ran and were reported


@pytest.mark.skipif(not dbos_available(), reason="dbos is not installed (extra: bench)")
def test_bench_cli_fails_when_a_checker_fails_in_the_pilot_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pilot pair of ``--match-time`` is not counted, and its checker still counts."""
    calls = _dbos_failing_on(monkeypatch, failing_call=1)
    got, data = _compare_dbos(tmp_path, "--pairs", "1", "--match-time", exit_code=1)
    assert len(calls) == 2  # the pilot, then the one counted pair
    assert "check FAILED: charge: 2 effects for 1 workflows" in got.output
    assert data["match_time_pilot"]["check_ok"] is False
    assert data["dbos_check_ok"] is False and data["check_ok"] is False


@pytest.mark.skipif(not dbos_available(), reason="dbos is not installed (extra: bench)")
@pytest.mark.usefixtures("dbos_console")
def test_bench_cli_json_says_no_sweep_ran_without_auto(tmp_path: Path) -> None:
    """Without ``auto`` the key is there, and empty: a reader can tell a chosen setting from a
    found one."""
    _got, data = _compare_dbos(tmp_path, "--pairs", "1", "--dbos-concurrency", "2")
    assert data["dbos_concurrency_sweep"] is None
    assert data["match_time_pilot"] is None  # nor a pilot, without --match-time
    assert data["dbos_concurrency"] == 2


@pytest.mark.parametrize(
    ("provider", "action", "payload", "other"),
    [
        ("inventory", "reserve", {"sku": "sku-1", "quantity": 1}, {"sku": "sku-1", "quantity": 2}),
        (
            "payments",
            "charge",
            {"amount": 100, "currency": "EUR"},
            {"amount": 9, "currency": "EUR"},
        ),
        (
            "email",
            "send",
            {"to": "a@example.com", "template": "t"},
            {"to": "b@x.y", "template": "t"},
        ),
    ],
)
async def test_memory_provider_keeps_the_fake_shops_contracts(
    provider: str, action: str, payload: dict[str, object], other: dict[str, object]
) -> None:
    """The memory provider promises what the fake shop promises, probed by the contract checks."""
    shop = MemoryShop()
    shop.seed_stock({"sku-1": 10})
    target = {p.name: p for p in shop.providers()}[provider]
    checks = await check_provider_contract(target, action, payload, other_payload=other)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]


async def test_memory_provider_effects_and_reversals() -> None:
    shop = MemoryShop()
    shop.seed_stock({"sku-1": 1})
    first = await shop.inventory.apply(
        "reserve", key="k1", payload={"sku": "sku-1", "quantity": 1}, fence=2
    )
    assert isinstance(first, Confirmed)
    assert shop.stock("sku-1") == 0
    # Out of stock is a definite rejection; a stale fence on a known key is refused outright.
    assert isinstance(
        await shop.inventory.apply(
            "reserve", key="k2", payload={"sku": "sku-1", "quantity": 1}, fence=1
        ),
        Rejected,
    )
    assert await shop.inventory.apply(
        "reserve", key="k1", payload={"sku": "sku-1", "quantity": 1}, fence=1
    ) == FencedOut(2)
    released = await shop.inventory.apply(
        "release", key="r1", payload={"reservation_id": first.remote_id}, fence=1
    )
    assert isinstance(released, Confirmed)
    again = await shop.inventory.apply(
        "release", key="r2", payload={"reservation_id": first.remote_id}, fence=1
    )
    assert again == Rejected("already_released")
    assert shop.stock("sku-1") == 1
    assert shop.counts()["inventory.reserve"] == 1
    assert shop.counts()["inventory.release"] == 1
    assert shop.duplicate_keys() == []


async def test_steady_workload_runs_every_saga_once(db_urls: DbUrls) -> None:
    # The fixed workload instructions are counted over (fault_injection/bench_steady.py): the
    # warm-up and the N sagas all take effect, once each, on either backend.
    urls = DatabasePair(db_urls.store, db_urls.provider, db_urls.backend)
    counts = await bench_steady.run(12, 4, urls, drain=True)
    expected = bench_steady.WARMUP + 12
    wanted = ("inventory.reserve", "payments.charge", "email.send", "payments.refund")
    assert {k: counts.get(k, 0) for k in wanted} == {
        "inventory.reserve": expected,
        "payments.charge": expected,
        "email.send": expected,
        "payments.refund": 0,
    }


@pytest.mark.skipif(not dbos_available(), reason="dbos is not installed (extra: bench)")
@pytest.mark.usefixtures("dbos_console")
def test_bench_cli_match_time_sizes_our_half_from_dboss_last(tmp_path: Path, backend: str) -> None:
    got, data = _compare_dbos(tmp_path, "--pairs", "2", "--match-time", backend=backend)
    # A pilot pair, not counted, sizes the first counted pair: every counted pair is matched.
    pilot = data["match_time_pilot"]
    assert pilot["sagas"] == pilot["dbos_sagas"] == 5 and pilot["check_ok"] is True
    assert "pilot (not counted; sizes the first pair)" in got.output
    assert len(data["pairs"]) == 2 and "pair 2/2" in got.output
    first, second = data["pairs"]
    expected_first = matched_sagas(5, pilot["dbos_elapsed_s"], pilot["sagas_per_s"])
    assert abs(first["sagas"] - expected_first) <= 1
    assert second["dbos_sagas"] == 5  # DBOS's half keeps --sagas
    # Our second half is sized to last as long as DBOS's first did, at our first half's rate
    # (within one saga: the JSON's rates are rounded through a division). Computed from the
    # run's own figures, not assumed: "ours is faster" is a speed, and it failed once under load.
    dbos_seconds = first["dbos_sagas"] / first["dbos_sagas_per_s"]
    expected = matched_sagas(5, dbos_seconds, first["sagas_per_s"])
    assert abs(second["sagas"] - expected) <= 1
    assert 5 <= second["sagas"] <= MATCH_CAP * 5
    assert f" sagas/s over {second['sagas']:,} sagas " in got.output


def _readings(monkeypatch: pytest.MonkeyPatch, *steal_ticks: int) -> list[CpuTimes]:
    """The machine's CPU counters the bench reads (``bench_cli.read_cpu_times``), stood in
    for: 1 000 ticks pass between two readings, ``steal_ticks[i]`` of them stolen. Returns
    the readings not yet taken."""
    left = [CpuTimes(total=0, steal=0)]
    for stolen in steal_ticks:
        last = left[-1]
        left.append(CpuTimes(total=last.total + 1000, steal=last.steal + stolen))
    monkeypatch.setattr(bench_cli, "read_cpu_times", lambda: left.pop(0))
    return left


@pytest.mark.parametrize(("stolen", "caution"), [(300, True), (49, False)])
def test_a_run_alone_reports_its_stolen_share_and_cautions_when_it_is_high(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stolen: int, caution: bool
) -> None:
    """A run on a virtual machine whose neighbours took a share of its CPU measures them too:
    the JSON has the share, and from 5 % the output says so under the figures."""
    left = _readings(monkeypatch, stolen)
    got, data = _bench_json(tmp_path)
    assert left == []  # read around the run, once each side
    assert data["steal_share"] == pytest.approx(stolen / 1000)
    text = " ".join(got.output.split())  # as rich wrapped it, unwrapped
    said = "the hypervisor took 30% of the machine's CPU in this run:" in text
    assert said is caution and ("hypervisor" in text) is caution, got.output


@pytest.mark.skipif(not dbos_available(), reason="dbos is not installed (extra: bench)")
def test_a_comparison_cautions_with_the_range_of_its_halves_stolen_shares(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each half's share is in its pair; the caution under the median names the high ones'
    range and how many halves reached 5 %; the top-level share is the median pair's."""
    _dbos_failing_on(monkeypatch, failing_call=0)  # DBOS stood in for, at 100 workflows/s
    # Each pair reads at its start, middle and end (the pauses between pairs are not read):
    # pair 1 ours 0 %, DBOS 20 %; pair 2 ours 7 %, DBOS 1 %; pair 3 none.
    left = _readings(monkeypatch, 0, 200, 0, 70, 10, 0, 0, 0)
    got, data = _compare_dbos(tmp_path, "--pairs", "3")
    assert left == []
    shares = [(p["steal_share"], p["dbos_steal_share"]) for p in data["pairs"]]
    assert shares == [(0.0, 0.2), (0.07, pytest.approx(0.01)), (0.0, 0.0)]
    text = " ".join(got.output.split())
    assert "the hypervisor took 7% to 20% of the machine's CPU in 2 of 6 halves" in text
    # Pair 2's halves lost 6 points apart; only pair 3's are alike.
    ratio = data["pairs"][2]["ratio_vs_dbos"]
    assert (
        "1 of 3 pairs lost alike shares in both halves (within 5% of each other): "
        f"their median ratio {ratio:.2f}x" in text
    )
    median = sorted(data["pairs"], key=lambda p: p["sagas_per_s"])[1]
    assert data["steal_share"] == median["steal_share"]


@pytest.mark.skipif(not dbos_available(), reason="dbos is not installed (extra: bench)")
def test_the_pilot_pair_says_what_was_stolen_from_its_halves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pilot sizes the first counted pair from its two halves: a slowed half sizes it
    wrong, so the pilot's line and JSON give each half's share, as a counted pair's do."""
    _dbos_failing_on(monkeypatch, failing_call=0)
    # The pilot: ours 0 %, DBOS 12 %; the gap before the pair; the pair: nothing.
    left = _readings(monkeypatch, 0, 120, 0, 0, 0)
    got, data = _compare_dbos(tmp_path, "--pairs", "1", "--match-time")
    assert left == []
    pilot = data["match_time_pilot"]
    assert (pilot["steal_share"], pilot["dbos_steal_share"]) == (0.0, pytest.approx(0.12))
    line = next(line for line in got.output.splitlines() if line.startswith("pilot "))
    assert " sagas, steal 0% · DBOS " in line and line.endswith(" s, steal 12%")


def test_the_alike_pairs_line_says_when_no_pair_was_alike_and_spans_several() -> None:
    def pair(ours_per_s: float, steal: float | None, dbos_steal: float | None) -> ComparePair:
        ours = SimpleNamespace(sagas_per_s=ours_per_s)
        theirs = dbos_result(concurrency=1, per_s=100.0)
        return ComparePair(ours, theirs, steal=steal, dbos_steal=dbos_steal)

    none_alike = [pair(1000.0, 0.3, 0.1), pair(1000.0, None, 0.1)]  # an unread half is not alike
    assert bench_cli._alike_steal_line(none_alike) == (
        "0 of 2 pairs lost alike shares in both halves (within 5% of each other)"
    )
    several = [pair(900.0, 0.3, 0.28), pair(1200.0, 0.1, 0.3), pair(1100.0, 0.0, 0.05)]
    assert bench_cli._alike_steal_line(several).endswith(
        ": their median ratio 10.00x (9.00x to 11.00x)"
    )


@pytest.mark.parametrize(
    ("option", "value"),
    [
        # Neither had an upper bound: a typo of a few digits ran for ever.
        ("--sagas", "99999999999999999999"),
        ("--sagas", str(bench_cli.MAX_SAGAS + 1)),
        ("--warmup", "99999999999999999999"),
        ("--warmup", str(bench_cli.MAX_WARMUP + 1)),
    ],
)
def test_bench_cli_refuses_a_run_without_end(option: str, value: str) -> None:
    got = CliRunner().invoke(app, [option, value])
    assert got.exit_code == 2, got.output
    assert f"Invalid value for '{option}'" in got.output
    assert "Traceback" not in got.output
