"""``agent-txn fault-inject run``: an option the chosen suites do not use, or an ``--only`` that
names nothing, is one ``error:`` line and exit status 2 before anything runs.

Before, the first was ignored (``--suite seed --seed 3`` ran the seed suite as if no seed had
been given, ``--suite faults --only x`` the whole suite) and the second was a traceback.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fault_injection import cli


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The suites that would have started: every case below must be refused before any."""
    started: list[str] = []

    async def run_one(name: str, *_: object, **__: object) -> list[object]:
        started.append(name)
        return []

    monkeypatch.setattr(cli, "_run_one", run_one)
    return started


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
        (["--suite", "faults", "--only", "x"], "--only is for the matrix and random suites"),
        (["--suite", "all", "--only", "3"], "--only picks one matrix cell or one random index"),
        (["--suite", "random", "--only", "abc"], "--only: a random schedule's index is a number"),
        (["--suite", "random", "--only", "-1"], "--only: a random schedule's index is a number"),
        (["--suite", "matrix", "--only", "nonsense"], "--only: no matrix cell matches 'nonsense'"),
        (["--suite", "matrix", "--modes", "bogus"], "--modes: mode must be one of"),
        (["--suite", "matrix", "--modes", ","], "--modes: mode must be one of"),
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
        (["--suite", "concurrency", "--allow-server-restart", "--workers", "2"], ["concurrency"]),
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
