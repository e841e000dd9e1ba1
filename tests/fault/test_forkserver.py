"""The crash matrix's fork server: victims forked from one pre-imported process behave as
processes started afresh (exit statuses, stderr, a SIGKILL, a waiting victim sent home).

The kill cells themselves run through it in ``test_crash_matrix.py`` (``run_cells``), on both
backends; these tests pin down the process side on its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fault_injection import forkserver
from fault_injection.forkserver import ForkServer, ForkServerGone
from fault_injection.matrix import _victim_env
from fault_injection.victim import CANCELLED, USAGE

pytestmark = pytest.mark.skipif(not forkserver.AVAILABLE, reason="needs fork and SCM_RIGHTS")


@pytest.fixture
async def forks() -> AsyncIterator[ForkServer]:
    server = await ForkServer.start(_victim_env())
    try:
        yield server
    finally:
        await server.close()


def _waiting_argv(tmp_path: Path) -> list[str]:
    # A waiting victim reads stdin before it opens anything, so these files are never made.
    return [
        "--store",
        f"sqlite+aiosqlite:///{tmp_path / 'agent.db'}",
        "--provider",
        f"sqlite+aiosqlite:///{tmp_path / 'provider.db'}",
        "--point",
        "effect.after_apply",
        "--position",
        "charge",
        "--tx-id",
        "mx-forked",
        "--wait",
    ]


async def test_a_bad_command_line_exits_2_with_its_usage_on_stderr(forks: ForkServer) -> None:
    child = await forks.spawn(["--no-such-option"], stdin=False)
    out, err = await child.communicate()
    assert child.returncode == USAGE
    assert b"usage:" in err and b"the following arguments are required" in err
    assert out == b""


async def test_a_sigkill_reads_minus_9_and_a_victim_sent_home_0(
    forks: ForkServer, tmp_path: Path
) -> None:
    killed = await forks.spawn(_waiting_argv(tmp_path), stdin=True)
    home = await forks.spawn(_waiting_argv(tmp_path), stdin=True)
    assert killed.pid != home.pid and os.getpid() not in (killed.pid, home.pid)
    killed.kill()
    await killed.communicate()
    assert killed.returncode == -signal.SIGKILL
    await home.communicate(b"")  # stdin closed before a go: it goes home untouched
    assert home.returncode == CANCELLED
    assert os.listdir(tmp_path) == []
    killed.kill()  # ended: a no-op, never a signal to whoever has its pid now


async def test_a_closed_server_forks_nothing_more(tmp_path: Path) -> None:
    server = await ForkServer.start(_victim_env())
    first = await server.spawn(["--no-such-option"], stdin=False)
    await first.communicate()
    await server.close()
    with pytest.raises(ForkServerGone):
        await server.spawn(_waiting_argv(tmp_path), stdin=True)


async def test_a_spawn_whose_caller_gave_up_keeps_the_answers_in_order(
    forks: ForkServer, tmp_path: Path
) -> None:
    given_up = asyncio.create_task(forks.spawn(_waiting_argv(tmp_path), stdin=True))
    await asyncio.sleep(0)  # it has asked, and waits for its answer
    given_up.cancel()
    # The next spawn gets its own victim, not the one forked for the cancelled request (that
    # one is killed): a bad command line, so exit status 2, not a waiting victim's 0.
    child = await forks.spawn(["--no-such-option"], stdin=False)
    await child.communicate()
    assert child.returncode == USAGE
    with pytest.raises(asyncio.CancelledError):
        await given_up
