"""``agent-txn fault-inject run`` and ``fleet``: options that cannot do what they say are one
``error:`` line and exit status 2 before anything runs.

Before, ``run`` ignored an option the chosen suites do not use (``--suite seed --seed 3`` ran
the seed suite as if no seed had been given, ``--suite faults --only x`` the whole suite), an
``--only`` that names nothing was a traceback, and ``fleet`` with a bad fault list or its only
worker killed waited an hour for sagas nobody could settle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fault_injection import cli
from fault_injection.faulty_shop import parse_faults
from fault_injection.schedules import generate


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--suite", "seed", "--seed", "3"], "--seed is for the random suite (or --suite all)"),
        (["--suite", "faults", "--schedules", "5"], "--schedules is for the random suite"),
        (["--suite", "seed", "--modes", "kill"], "--modes is for the matrix suite"),
        (
            ["--suite", "matrix", "--workers", "3"],
            "--workers is for the seed, faults, concurrency and random suites",
        ),
        (
            ["--suite", "seed", "--allow-server-restart"],
            "--allow-server-restart is for the concurrency suite",
        ),
        # SQLite has no server to restart: it was ignored.
        (
            ["--suite", "concurrency", "--allow-server-restart"],
            "--allow-server-restart restarts the local PostgreSQL server: give a PostgreSQL --db",
        ),
        (
            [
                "--suite",
                "concurrency",
                "--allow-server-restart",
                "--db",
                "postgresql://db.example/x",
            ],
            "--allow-server-restart: this process cannot restart the server --db names",
        ),
        (["--suite", "faults", "--only", "x"], "--only is for the matrix and random suites"),
        (["--suite", "all", "--only", "3"], "--only picks one matrix cell or one random index"),
        (["--suite", "random", "--only", "abc"], "--only: a random schedule's index is a number"),
        (["--suite", "random", "--only", "-1"], "--only: a random schedule's index is a number"),
        (["--suite", "matrix", "--only", "nonsense"], "--only: no matrix cell matches 'nonsense'"),
        (["--suite", "matrix", "--modes", "bogus"], "--modes: mode must be one of"),
        (["--suite", "matrix", "--modes", ","], "--modes: name at least one of inprocess, kill"),
    ],
)
def test_an_option_no_chosen_suite_uses_is_refused_before_anything_runs(
    args: list[str], message: str, nothing_runs: list[str]
) -> None:
    got = CliRunner().invoke(cli.app, ["run", *args])
    assert got.exit_code == 2, got.output
    assert got.output.startswith(f"error: {message}"), got.output
    assert "Traceback" not in got.output
    assert nothing_runs == []


@pytest.mark.parametrize(
    ("args", "suites"),
    [
        (["--suite", "random", "--seed", "3", "--schedules", "2", "--workers", "2"], ["random"]),
        (["--suite", "random", "--only", "17"], ["random"]),
        (
            ["--suite", "matrix", "--only", "effect.after_apply@charge/*", "--modes", "kill"],
            ["matrix"],
        ),
        (["--suite", "matrix", "--modes", "kill,"], ["matrix"]),
        (["--suite", "concurrency", "--workers", "2"], ["concurrency"]),
        (
            ["--suite", "all", "--seed", "3", "--modes", "inprocess", "--workers", "2"],
            ["seed", "faults", "concurrency", "matrix", "random"],
        ),
    ],
)
def test_options_a_chosen_suite_uses_are_accepted(
    args: list[str], suites: list[str], nothing_runs: list[str]
) -> None:
    got = CliRunner().invoke(cli.app, ["run", *args])
    assert got.exit_code == 0, got.output
    assert nothing_runs == suites


PG = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # The workers would each die of it at start, unseen, and the fleet wait an hour.
        (["--db", PG, "--faults", "bogus"], "--faults: 'bogus' is not kind:provider.action"),
        (
            ["--db", PG, "--faults", "lose_response:payments.charge:0:5,gremlins:email.send:0:1"],
            "--faults: 'gremlins:email.send:0:1': unknown fault kind 'gremlins'",
        ),
        (["--db", PG, "--faults", "reject:payments:0:1"], "--faults: 'reject:payments:0:1': "),
        (["--db", PG, "--faults", "reject:email.send:-1:1"], "--faults: 'reject:email.send:-1"),
        # An action the shop has not: the rule never fired, and the fleet ran without faults.
        (
            ["--db", PG, "--faults", "lose_response:payments.chrage:0:1"],
            "--faults: 'lose_response:payments.chrage:0:1': the fake shop has no action "
            "'payments.chrage' (inventory.reserve, ",
        ),
        # Its only worker killed, nobody would recover what it held.
        (["--db", PG, "--workers", "1", "--kill-one-after", "2"], "--kill-one-after needs"),
        # A restart this process cannot make failed mid-run with a traceback.
        (
            ["--db", "sqlite+aiosqlite:///fleet.db", "--restart-after", "2"],
            "--restart-after restarts the local PostgreSQL server",
        ),
        # Without --db the fleet runs on SQLite files in a temporary folder: nothing to restart.
        (["--restart-after", "2"], "--restart-after restarts the local PostgreSQL server"),
        (
            ["--db", "postgresql+asyncpg://postgres@db.example:5432/x", "--restart-after", "2"],
            "--restart-after: this process cannot restart the server",
        ),
    ],
)
def test_fleet_refuses_what_would_leave_it_waiting_or_failing_midway(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[object] = []

    async def run_fleet(*args: object, **kwargs: object) -> None:
        started.append(kwargs)

    monkeypatch.setattr("fault_injection.fleet.run_fleet", run_fleet)
    got = CliRunner().invoke(cli.app, ["fleet", "--sagas", "1", *args])
    assert got.exit_code == 2, got.output
    assert got.output.startswith(f"error: {message}"), got.output
    assert started == []


def test_a_fault_list_parses_into_its_rules() -> None:
    rules = parse_faults(" lose_response:payments.charge:5:25, timeout:inventory.reserve:0:1 ,")
    assert [(r.kind.value, r.provider, r.action, r.skip, r.times) for r in rules] == [
        ("lose_response", "payments", "charge", 5, 25),
        ("timeout", "inventory", "reserve", 0, 1),
    ]
    assert parse_faults("") == []


def test_a_server_this_process_can_restart_is_accepted(
    nothing_runs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def restartable(url: str) -> object:
        return object()  # what local_cluster finds for a local server it may restart

    monkeypatch.setattr("fault_injection.scenarios_concurrency.local_cluster", restartable)
    got = CliRunner().invoke(
        cli.app, ["run", "--suite", "concurrency", "--allow-server-restart", "--db", PG]
    )
    assert got.exit_code == 0, got.output
    assert nothing_runs == ["concurrency"]


@pytest.mark.parametrize("only", ["²", "١٢", "3²"])
def test_only_takes_ascii_digits_alone(only: str, nothing_runs: list[str]) -> None:
    """str.isdigit() admits superscripts and other scripts' digits, which int() then refused
    with a traceback; they are refused as any other index that is not a number."""
    got = CliRunner().invoke(cli.app, ["run", "--suite", "random", "--only", only])
    assert got.exit_code == 2, got.output
    assert got.output.startswith("error: --only: a random schedule's index is a number")
    assert nothing_runs == []


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc and /sys")
@pytest.mark.parametrize("folder", ["/proc", "/sys"])
@pytest.mark.parametrize("command", [["run", "--suite", "random", "--only", "0"], ["replay"]])
def test_a_folder_that_refuses_new_folders_is_refused_for_the_runs_files(
    command: list[str], folder: str, nothing_runs: list[str], tmp_path: Path
) -> None:
    """/proc and /sys say they are writable (to root) and refuse new folders: ``run`` and
    ``replay`` failed making their work folder there, with a traceback (FileNotFoundError,
    PermissionError)."""
    if command == ["replay"]:
        saved = tmp_path / "schedule.json"
        saved.write_text(json.dumps(generate(1, 0).to_json()))
        command = ["replay", str(saved)]
    got = CliRunner().invoke(cli.app, [*command, "--db", f"sqlite+aiosqlite:///{folder}/x.db"])
    assert got.exit_code == 2, got.output
    assert got.output.startswith(f"error: --db: cannot make the run's SQLite files in {folder}")
    assert "Traceback" not in got.output and nothing_runs == []


@pytest.mark.parametrize(
    ("option", "value"),
    [
        # No bound: a typo of a few digits ran for ever (fleet.py prepares them all first).
        ("--sagas", "99999999999999999999"),
        ("--sagas", str(cli.MAX_SAGAS + 1)),
        # Past the fleet's deadline the kill or the restart never came; inf was accepted.
        ("--kill-one-after", "inf"),
        ("--kill-one-after", "3601"),
        ("--kill-one-after", "nan"),
        ("--restart-after", "inf"),
        ("--restart-after", "nan"),
    ],
)
def test_fleet_refuses_a_size_or_a_time_without_end(
    option: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[object] = []

    async def run_fleet(*args: object, **kwargs: object) -> None:
        started.append(kwargs)

    monkeypatch.setattr("fault_injection.fleet.run_fleet", run_fleet)
    got = CliRunner().invoke(cli.app, ["fleet", "--workers", "2", option, value])
    assert got.exit_code == 2, got.output
    assert f"Invalid value for '{option}'" in got.output
    assert "Traceback" not in got.output and started == []


@pytest.mark.parametrize(
    ("field", "text", "message"),
    [
        ("call_timeout_s", "Infinity", "call_timeout_s must be above 0 and at most 60 s, not inf"),
        ("call_timeout_s", "NaN", "call_timeout_s must be above 0 and at most 60 s, not nan"),
        ("call_timeout_s", "0", "call_timeout_s must be above 0"),
        ("budget_s", "Infinity", "budget_s must be from 0 to 60 s, not inf"),
        ("budget_s", "NaN", "budget_s must be from 0 to 60 s, not nan"),
        ("budget_s", '"0.1"', "schedule field 'budget_s' must be a number"),
        ("rounds", "100000000000000000000", "rounds must be in 1..10"),
        ("rounds", "1e20", "schedule field 'rounds' must be an integer"),
        ("max_workers", "100000000000000000000", "max_workers must be in 1..64"),
        ("workers", "100000000000000000000", "workers must be in 1..4"),
    ],
)
def test_replay_refuses_a_schedule_out_of_range_naming_the_field(
    field: str, text: str, message: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Infinity and NaN (which JSON's loader takes) were a pydantic traceback or accepted, and
    a huge ``rounds`` ran into the schedule's time limit, and as many ``workers`` never ended."""
    started: list[object] = []

    async def run_fresh(*args: object, **kwargs: object) -> None:
        started.append(args)

    monkeypatch.setattr("fault_injection.schedules.run_fresh", run_fresh)
    saved = tmp_path / "schedule.json"
    schedule = {**generate(1, 0).to_json(), field: "PLACEHOLDER"}
    saved.write_text(json.dumps(schedule).replace('"PLACEHOLDER"', text))
    got = CliRunner().invoke(cli.app, ["replay", str(saved)])
    assert got.exit_code == 2, got.output
    assert got.output.startswith(f"error: {saved}: not a schedule: {message}"), got.output
    assert started == []
