"""``--sqlite-writer`` (``AGENT_TXN_SQLITE_WRITER``) on the commands that run sagas on a store.

SQLite stores commit groups of concurrent transactions in a writer process of their own by
default (``EngineSettings.sqlite_writer``); an operator who must not have a second process
turns it off here. What is checked: the value reaches the engine's settings, from the option
or the environment, left unset it leaves the engine's default, and anything else is one clean
error line (exit 2) before a store is opened. The engine's side of each mode is tested in
``tests/integration/test_sqlite_writer.py`` and by CI's two passes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from orchestrator import cli
from orchestrator.worker import WorkerStats

SECRET = "s" * 32


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What each command would have opened its engine with, instead of opening it."""
    seen: dict[str, Any] = {}

    async def worker(url: str, *, settings: Any, **_: Any) -> WorkerStats:
        seen["worker"] = settings.sqlite_writer
        return WorkerStats()

    async def server(url: str, **kwargs: Any) -> None:
        seen["serve"] = kwargs["sqlite_writer"]

    async def mcp(url: str, **kwargs: Any) -> None:
        seen["mcp"] = kwargs["sqlite_writer"]

    monkeypatch.setattr("orchestrator.workerproc.run_worker_process", worker)
    monkeypatch.setattr("orchestrator.serve.run_server", server)
    monkeypatch.setattr("orchestrator.mcp_server.run_mcp", mcp)
    return seen


def _args(command: str, db: Path) -> list[str]:
    url = f"sqlite+aiosqlite:///{db}"
    if command == "worker":
        return ["worker", "--db", url, "--once"]
    if command == "serve":
        return ["serve", "--db", url, "--jwt-secret", SECRET, "--port", "0"]
    return ["mcp", "--db", url, "--jwt-secret", SECRET, "--token", "t"]


def _invoke(args: list[str], env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli.app, args, env=env)


COMMANDS = ["worker", "serve", "mcp"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("mode", ["inline", "process"])
def test_the_option_reaches_the_engine(
    command: str, mode: str, opened: dict[str, Any], tmp_path: Path
) -> None:
    got = _invoke([*_args(command, tmp_path / "a.db"), "--sqlite-writer", mode])
    assert got.exit_code == 0, got.output
    assert opened == {command: mode}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_environment_sets_it_and_unset_leaves_the_default(
    command: str, opened: dict[str, Any], tmp_path: Path
) -> None:
    got = _invoke(_args(command, tmp_path / "a.db"), env={"AGENT_TXN_SQLITE_WRITER": "inline"})
    assert got.exit_code == 0, got.output
    assert opened == {command: "inline"}

    got = _invoke(_args(command, tmp_path / "a.db"), env={"AGENT_TXN_SQLITE_WRITER": ""})
    assert got.exit_code == 0, got.output
    assert opened == {command: None}  # EngineSettings' None: the store's default


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_mode_is_one_clean_line(
    command: str, opened: dict[str, Any], tmp_path: Path
) -> None:
    got = _invoke([*_args(command, tmp_path / "a.db"), "--sqlite-writer", "thread"])
    assert got.exit_code == 2
    assert "--sqlite-writer must be inline or process, not 'thread'" in got.output
    assert "Traceback" not in got.output
    assert opened == {}
    assert not (tmp_path / "a.db").exists()  # refused before any store was opened
