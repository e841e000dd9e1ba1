"""``agent-txn bench`` and ``fault-inject`` options: what cannot be done as asked is one
``error:`` line on stderr and exit status 2, before anything runs or is written; a worker or
shop process that cannot start is one line that names it and quotes its stderr.

Found by an audit: a slow warm-up ended as "database unreachable" after two minutes, a worker
that died at start as a traceback saying ``b''``; refused runs left ``--json``/``--report``
folders behind; ``--recovery`` and ``--compare dbos`` silently ignored options; usage errors
went to stdout; numbers without bounds made false failures, tracebacks or endless runs; FIFOs
hung the output check and ``replay``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from fault_injection import bench_workers, cli
from fault_injection.bench import BenchConfig, serve_shop_process
from fault_injection.bench_cli import app as bench_app
from fault_injection.harness import DatabasePair
from orchestrator.cli import CliFailure
from tests.conftest import DbUrls


def _bench(*args: str) -> Result:
    return CliRunner().invoke(bench_app, list(args))


def _fault_inject(*args: str) -> Result:
    return CliRunner().invoke(cli.app, list(args))


def _refused(got: Result, message: str) -> None:
    """Exit 2, ``message`` on stderr (not stdout), no traceback."""
    assert got.exit_code == 2, (got.stdout, got.stderr)
    assert message in got.stderr, got.stderr
    assert "error" not in got.stdout, got.stdout
    assert not isinstance(got.exception, Exception) or isinstance(got.exception, SystemExit), (
        got.exception
    )


# -- 4: worker and shop processes that cannot start -----------------------------------------


async def test_a_worker_that_fails_at_start_is_one_error_with_its_stderr(
    db_urls: DbUrls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was ``RuntimeError: a bench worker did not start (said b'')``, a traceback, its
    cause lost (stderr went to /dev/null)."""
    start = bench_workers._start_worker

    async def broken(args: list[str], *rest: object) -> asyncio.subprocess.Process:
        return await start([*args, "--no-such-option"], *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(bench_workers, "_start_worker", broken)
    config = BenchConfig(sagas=2, warmup=0, workers=1, driver_seconds=0.1)
    urls = DatabasePair(db_urls.store, db_urls.provider, db_urls.backend)
    with pytest.raises(CliFailure) as failed:
        await bench_workers.run_workers_bench(config, urls, tmp_path)
    message = failed.value.message
    assert message.startswith("bench worker bench-w0"), message
    assert "did not start: it exited 2" in message
    assert "unrecognized arguments: --no-such-option" in message


async def test_a_worker_slower_than_its_ready_timeout_is_not_database_unreachable(
    db_urls: DbUrls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeout was a ``TimeoutError``, an ``OSError``, which the CLI reported as
    ``StoreUnavailable: database unreachable``."""
    monkeypatch.setattr(bench_workers, "ready_timeout", lambda _config: 0.0)
    config = BenchConfig(sagas=2, warmup=0, workers=1, driver_seconds=0.1)
    urls = DatabasePair(db_urls.store, db_urls.provider, db_urls.backend)
    with pytest.raises(CliFailure) as failed:
        await bench_workers.run_workers_bench(config, urls, tmp_path)
    assert "bench worker bench-w0" in failed.value.message
    assert "did not start: it said nothing within 0 s" in failed.value.message


def test_the_ready_timeout_makes_room_for_the_warm_up_at_its_latency() -> None:
    """``--warmup 9 --latency-ms 5000``: nine sagas of three 5 s calls each, past the fixed
    120 s the workers had to say ``ready`` in."""
    config = BenchConfig(sagas=1, warmup=9, latency_ms=5000, workers=1)
    warm_up_calls = 9 * 3 * 5.0
    assert bench_workers.ready_timeout(config) > bench_workers.READY_TIMEOUT_SECONDS + warm_up_calls


async def test_a_shop_server_that_fails_at_start_is_one_error_with_its_stderr(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/no-such-folder/shop.db"
    with pytest.raises(CliFailure) as failed:
        async with serve_shop_process(url):
            pass
    message = failed.value.message
    assert message.startswith("the fake shop's server process did not start: it exited 1")
    assert "unable to open database file" in message


# -- 6: no folders made for a run that is refused --------------------------------------------


def test_a_refused_bench_makes_no_json_folder(tmp_path: Path) -> None:
    target = tmp_path / "j1" / "sub" / "out.json"
    _refused(_bench("--json", str(target), "--provider", "smtp"), "--provider must be one of")
    assert not (tmp_path / "j1").exists()


@pytest.mark.usefixtures("nothing_runs")
def test_a_refused_fault_inject_run_makes_no_report_folder(tmp_path: Path) -> None:
    target = tmp_path / "r1" / "sub" / "rep"
    _refused(_fault_inject("run", "--report", str(target), "--suite", "bogus"), "--suite")
    assert not (tmp_path / "r1").exists()


def test_a_refused_replay_makes_no_report_folder(tmp_path: Path) -> None:
    target = tmp_path / "r2" / "sub" / "rep"
    got = _fault_inject("replay", str(tmp_path / "missing.json"), "--report", str(target))
    _refused(got, "cannot be read")
    assert not (tmp_path / "r2").exists()


def test_a_run_makes_its_report_folder_when_it_writes(
    tmp_path: Path, nothing_runs: list[str]
) -> None:
    target = tmp_path / "r3" / "sub" / "rep"
    got = _fault_inject("run", "--suite", "seed", "--report", str(target))
    assert got.exit_code == 0, (got.stdout, got.stderr)
    assert nothing_runs == ["seed"]
    assert (tmp_path / "r3" / "sub" / "rep.json").is_file()
    assert (tmp_path / "r3" / "sub" / "rep.md").is_file()


# -- 7: --report checks the two files it writes ------------------------------------------------


@pytest.mark.parametrize("ending", [".json", ".md"])
def test_a_report_whose_json_or_md_is_a_folder_is_refused_before_the_run(
    tmp_path: Path, nothing_runs: list[str], ending: str
) -> None:
    """A folder ``rep.json`` let the run happen and then fail; a folder ``rep.md`` failed after
    ``rep.json`` was written."""
    (tmp_path / f"rep{ending}").mkdir()
    got = _fault_inject("run", "--suite", "seed", "--report", str(tmp_path / "rep"))
    _refused(got, f"--report: {tmp_path / ('rep' + ending)} is a folder")
    assert nothing_runs == []
    assert not (tmp_path / "rep.json").is_file()


# -- 8 and 9: options a mode would ignore -----------------------------------------------------


@pytest.mark.parametrize(
    "option", [["--warmup", "5"], ["--sqlite-synchronous", "NORMAL"], ["--sqlite-writer", "inline"]]
)
def test_recovery_refuses_what_its_worker_processes_would_ignore(option: list[str]) -> None:
    got = _bench(
        "--recovery", "--provider", "fake", "--sagas", "1", "--driver-seconds", "0.1", *option
    )
    _refused(got, f"--recovery takes no {option[0]}")


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--latency-ms", "200"], "--compare dbos takes no --latency-ms"),
        (["--provider", "fake"], "--compare dbos takes --provider memory only"),
        (["--provider", "http"], "--compare dbos takes --provider memory only"),
    ],
)
def test_compare_refuses_what_applies_to_our_half_only(option: list[str], message: str) -> None:
    """DBOS's half always calls its in-memory dict provider, with no latency: the ratio was
    0.01x at --latency-ms 200."""
    got = _bench("--compare", "dbos", "--pairs", "1", "--sagas", "3", "--warmup", "0", *option)
    _refused(got, message)
    assert "DBOS's half" in got.stderr


# -- 10: usage errors on stderr ----------------------------------------------------------------


def test_bench_usage_errors_go_to_stderr() -> None:
    _refused(_bench("--provider", "smtp"), "error: --provider must be one of memory")


@pytest.mark.usefixtures("nothing_runs")
def test_an_unknown_suite_goes_to_stderr() -> None:
    _refused(_fault_inject("run", "--suite", "bogus"), "error: --suite must be one of seed")


# -- 11 and 12: fault-inject run's numbers and lists -------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--suite", "random", "--seed", "9" * 200],  # ids past the store's limit: false FAILs
        ["--suite", "random", "--seed", "-1"],
        ["--suite", "random", "--schedules", "99999999999999999999"],  # ran for ever
        ["--suite", "random", "--only", "9" * 5000],  # int() raised ValueError: a traceback
        ["--suite", "random", "--only", str(cli.MAX_SCHEDULES)],
        ["--suite", "random", "--schedules", "5", "--only", "7"],  # ran 7, ignored --schedules
        ["--suite", "matrix", "--modes", ""],  # was both modes, where " " and "," are refused
    ],
)
def test_fault_inject_run_refuses_numbers_and_lists_out_of_range(
    args: list[str], nothing_runs: list[str]
) -> None:
    got = _fault_inject("run", *args)
    assert got.exit_code == 2, (got.stdout, got.stderr)
    assert "Traceback" not in got.output and "error" in got.stderr.lower(), got.output
    assert nothing_runs == []


@pytest.mark.parametrize(
    "args",
    [
        ["--suite", "random", "--schedules", "5", "--only", "4"],
        ["--suite", "random", "--only", "207"],  # a reproduce line gives no --schedules
        ["--suite", "random", "--seed", str(2**63 - 1), "--schedules", "1"],
    ],
)
def test_fault_inject_run_takes_numbers_in_range(args: list[str], nothing_runs: list[str]) -> None:
    got = _fault_inject("run", *args)
    assert got.exit_code == 0, (got.stdout, got.stderr)
    assert nothing_runs == ["random"]


# -- 13: outputs and inputs that are not regular files -----------------------------------------


def test_bench_refuses_a_fifo_for_its_json(tmp_path: Path) -> None:
    """The check opened it to append, and hung until something read it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = _bench("--sagas", "1", "--warmup", "0", "--driver-seconds", "0.1", "--json", str(fifo))
    _refused(got, f"--json: {fifo} is not a regular file")


@pytest.mark.usefixtures("nothing_runs")
def test_fault_inject_refuses_a_fifo_for_its_report(tmp_path: Path) -> None:
    fifo = tmp_path / "rep.md"
    os.mkfifo(fifo)
    got = _fault_inject("run", "--suite", "seed", "--report", str(tmp_path / "rep"))
    _refused(got, f"--report: {fifo} is not a regular file")


def test_replay_refuses_a_schedule_that_is_not_a_regular_file() -> None:
    """A FIFO hung the read, ``/dev/zero`` read until a MemoryError traceback."""
    _refused(_fault_inject("replay", os.devnull), f"{os.devnull}: not a regular file")


def test_replay_refuses_a_schedule_file_too_large_to_be_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "MAX_SCHEDULE_FILE_BYTES", 1000)
    big = tmp_path / "big.json"
    big.write_text(" " * 1001)
    _refused(_fault_inject("replay", str(big)), "1,001 bytes, more than 1,000")
