"""How the CLI reports a job's failure (``orchestrator.cli._run``): one ``error:`` line and
exit code 2 for what a user can act on, the traceback for a bug, and the same for a failure
that reaches it inside an ExceptionGroup (a job whose tasks ran in a ``TaskGroup``, such as
the bench's sagas in flight)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from fault_injection.cli import written_report
from fault_injection.results import RunSummary
from ledger.errors import StoreUnavailable
from orchestrator import cli
from orchestrator.errors import StoreUnavailableError


async def _raises(exc: BaseException) -> None:
    raise exc


@pytest.mark.parametrize(
    "raised",
    [
        StoreUnavailableError(),
        ExceptionGroup("tasks", [StoreUnavailableError(), StoreUnavailableError()]),
        ExceptionGroup("outer", [ExceptionGroup("inner", [StoreUnavailableError()])]),
    ],
    ids=["alone", "in a group", "in a nested group"],
)
def test_an_expected_failure_is_one_line_alone_or_in_a_group(
    raised: BaseException, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(typer.Exit) as caught:
        cli._run(_raises(raised))
    assert caught.value.exit_code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: store_unavailable: ")
    assert len(err.strip().splitlines()) == 1


def test_a_storage_error_in_a_group_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    refused = StoreUnavailable("database refused the connection (53300: too many connections)")
    with pytest.raises(typer.Exit):
        cli._run(_raises(ExceptionGroup("tasks", [refused])))
    assert capsys.readouterr().err.strip() == (
        "error: StoreUnavailable: database refused the connection (53300: too many connections)"
    )


def test_a_group_whose_first_failure_is_a_bug_keeps_its_traceback() -> None:
    group = ExceptionGroup("tasks", [ZeroDivisionError("bug"), StoreUnavailableError()])
    with pytest.raises(ExceptionGroup) as caught:
        cli._run(_raises(group))
    assert caught.value is group


def test_a_report_that_cannot_be_written_after_the_run_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fault-inject run --report`` checks its path before the run; a write that still fails
    after it (the disk filled, the folder went away) is one line and exit code 2."""
    gone = tmp_path / "gone"
    gone.mkdir()
    report = gone / "run.json"
    gone.rmdir()  # the folder write_report expects is no longer there, and a file stands in it
    gone.write_text("")
    with pytest.raises(typer.Exit) as caught:
        written_report(RunSummary(), report)
    assert caught.value.exit_code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --report: cannot write "), err
    assert len(err.strip().splitlines()) == 1
