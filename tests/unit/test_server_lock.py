"""The test server's reader-writer lock (tests/support/server_lock.py), across processes.

Each holder runs in its own process and signals when it got the lock, and when it is about to let
go (``leaving``, set while it still holds the lock), so the tests check the order
of events, not how long anything took."""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from tests.support.server_lock import ServerLock

URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
HOLD_S = 3.0
CTX = multiprocessing.get_context("spawn")


def _hold(directory: str, mode: str, arrived: Any, got: Any, leaving: Any) -> None:
    lock = ServerLock(URL, Path(directory))
    arrived.set()
    with lock.shared() if mode == "shared" else lock.exclusive():
        got.set()
        time.sleep(HOLD_S)
        leaving.set()


@dataclass
class Holder:
    process: BaseProcess
    arrived: Any
    got: Any
    leaving: Any


def _holder(directory: Path, mode: str, *, wait: bool = True) -> Holder:
    arrived, got, leaving = CTX.Event(), CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_hold, args=(str(directory), mode, arrived, got, leaving))
    proc.start()
    if wait:
        assert got.wait(30), f"the {mode} holder never got the lock"
    return Holder(proc, arrived, got, leaving)


def test_readers_share_and_a_writer_waits_for_them(tmp_path: Path) -> None:
    reader = _holder(tmp_path, "shared")
    lock = ServerLock(URL, tmp_path)
    with lock.shared():
        assert not reader.leaving.is_set()  # let in beside the first reader
    with lock.exclusive():
        assert reader.leaving.is_set()  # only once the reader was done
    reader.process.join()


def test_a_writer_keeps_readers_out(tmp_path: Path) -> None:
    writer = _holder(tmp_path, "exclusive")
    with ServerLock(URL, tmp_path).shared():
        assert writer.leaving.is_set()
    writer.process.join()


def test_a_queued_writer_goes_before_later_readers(tmp_path: Path) -> None:
    # A reader holds the server and a writer queues behind it. A reader arriving now must wait
    # for the writer too (the turnstile) instead of slipping in beside the first reader.
    first = _holder(tmp_path, "shared")
    writer = _holder(tmp_path, "exclusive", wait=False)
    # Started processes take a while to import; wait until the writer is about to lock, then
    # give it a moment to block in the turnstile (1 s: a loaded machine may not run it at once).
    assert writer.arrived.wait(30)
    time.sleep(1.0)
    assert not writer.got.is_set()
    with ServerLock(URL, tmp_path).shared():
        assert first.leaving.is_set() and writer.leaving.is_set()
    first.process.join()
    writer.process.join()


def test_locks_are_named_after_the_server(tmp_path: Path) -> None:
    other = _holder(tmp_path, "exclusive")
    with ServerLock(URL.replace("5432", "5433"), tmp_path).exclusive():
        assert not other.leaving.is_set()  # another server's lock is free
    other.process.join()
