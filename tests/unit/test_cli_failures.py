"""How the CLI reports a job's failure (``orchestrator.cli._run``): one ``error:`` line and
exit code 2 for what a user can act on, the traceback for a bug, and the same for a failure
that reaches it inside an ExceptionGroup (a job whose tasks ran in a ``TaskGroup``, such as
the bench's sagas in flight)."""

from __future__ import annotations

import pytest
import typer

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
