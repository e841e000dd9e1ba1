"""A reader-writer lock on the test PostgreSQL server, shared by every pytest process on this
machine.

Why: the suite runs in several processes (pytest-xdist), and a few tests restart the server
(marked ``restarts_postgres``). A restart fails whatever another process is doing on the server
at that moment, so those tests must have it to themselves. Every other test holds the lock
*shared* for its whole run (setup and teardown included); a restarting test holds it
*exclusive*. Two separate pytest sessions against the same server (a developer's run beside
CI) are serialized the same way, because the lock is a file named after the server.

It is built on ``flock``: the kernel drops a dead process's locks, so a killed pytest can't
leave the server locked. ``flock`` by itself gives a waiting writer no priority (readers that
keep coming could starve it), so a *turnstile* comes first: a writer holds it while it waits
for the readers in the room to leave, and a reader passes through it before taking its shared
lock, so no new reader gets in while a writer waits. A writer thus waits for at most one test
per other process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


class ServerLock:
    """Shared for tests that use the server, exclusive for tests that restart it."""

    def __init__(self, server_url: str, directory: Path | None = None) -> None:
        digest = hashlib.sha256(server_url.encode()).hexdigest()[:16]
        base = directory if directory is not None else Path(tempfile.gettempdir())
        self.room = base / f"agent-txn-test-pg-{digest}.lock"
        self.turnstile = base / f"agent-txn-test-pg-{digest}.turnstile"

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the server together with other tests (no restart can happen meanwhile)."""
        with self._open(self.room) as room:
            with self._open(self.turnstile) as turnstile:
                fcntl.flock(turnstile, fcntl.LOCK_EX)  # wait behind any writer already queued
                fcntl.flock(room, fcntl.LOCK_SH)
                # Leaving the turnstile closes it: the next reader or writer may go on.
            yield

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the server alone: every other test that uses it has finished, none starts."""
        with self._open(self.turnstile) as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            with self._open(self.room) as room:
                fcntl.flock(room, fcntl.LOCK_EX)
                yield

    @staticmethod
    @contextlib.contextmanager
    def _open(path: Path) -> Iterator[int]:
        # Each acquisition opens its own file description: flock locks belong to it, so two
        # holders in one process exclude each other as two processes would, and closing the
        # descriptor releases the lock even on an error.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            yield fd
        finally:
            os.close(fd)
