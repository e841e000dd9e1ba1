"""The event loop's side of the SQLite writer process (:mod:`ledger.sqlite_writer_child`).

:class:`WriterProcess` starts the child, hands it commit groups and resolves one future per
group with the child's answer. Submitting is synchronous (the message is written to the pipe,
or queued behind what the pipe has not taken yet), so groups reach the child, and are
committed, in the order they were submitted; answers come back in that order.

What the parent learns, and what it concludes (:class:`Answer`):

* an answer: the group committed (each member's own outcome in it), or nothing of it did
  (``failure``);
* no answer, because the child died or its pipe broke: the group's outcome is unknown. Its
  future fails with :class:`~ledger.errors.StoreUnavailable`, as a PostgreSQL transaction's
  does when its connection drops during the commit; what was committed is durable, and
  recovery reads it back. The next group starts a fresh child.
* a child that exits on its own (not killed by a signal) before its first answer,
  :data:`SILENT_DEATHS` times in a row: a writer cannot run here (the host's ``sys.executable``
  is not a plain Python, say). The groups it was given failed as above;
  :attr:`WriterProcess.unusable` is set, with a warning, and the store commits in-process from
  then on, as if it had been configured so;
* a child that cannot be started at all (:meth:`WriterProcess.ready`): given up at once, the
  same way, before any group was handed to it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import pickle
import sqlite3
import struct
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from ledger import sqlite_writer_child
from ledger.batched import PendingWrite
from ledger.errors import StoreUnavailable

_LENGTH = struct.Struct(">I")
#: How long :meth:`WriterProcess.close` waits for the child to end after its input closed.
CLOSE_WAIT_S = 5.0
#: How long a child whose pipe closed is given to be reaped before it is killed.
REAP_WAIT_S = 0.05
#: Children in a row that exit on their own before their first answer, after which the store
#: stops trying.
SILENT_DEATHS = 2

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Answer:
    """The child's answer for one group (see :mod:`ledger.sqlite_writer_child`)."""

    outcomes: list[Any]
    failure: sqlite_writer_child.Error | None
    statements: int
    #: The child's CPU time so far.
    cpu_s: float


def error_of(described: sqlite_writer_child.Error) -> sqlite3.Error:
    """The :mod:`sqlite3` exception the child described, as the statement raised it there."""
    name, message, code, code_name = described
    kind = getattr(sqlite3, name, None)
    if not (isinstance(kind, type) and issubclass(kind, sqlite3.Error)):
        kind = sqlite3.DatabaseError
    error = kind(message)
    error.sqlite_errorcode = code
    error.sqlite_errorname = code_name
    return error


class WriterProcess:
    """One child per store; see the module doc."""

    def __init__(self, path: str, *, synchronous: str, busy_timeout_ms: int) -> None:
        self._argv = [
            sys.executable,
            "-I",
            "-S",
            sqlite_writer_child.__file__,
            path,  # absolute (dialects.sqlite_file): the child may start after a chdir
            synchronous,
            str(int(busy_timeout_ms)),
        ]
        self._proc: subprocess.Popen[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: collections.deque[asyncio.Future[Answer]] = collections.deque()
        self._inbox = bytearray()
        self._outbox = bytearray()
        #: SQL text -> its number in the running child (a fresh child starts from none).
        self._numbers: dict[str, int] = {}
        #: Children started so far (a restart after a death adds one).
        self.started = 0
        #: Whether the running child has answered yet, and how many children in a row exited
        #: on their own before their first answer.
        self._answered = False
        self._silent_deaths = 0
        #: Set once :data:`SILENT_DEATHS` children in a row exited before their first answer: a
        #: writer cannot run here (``sys.executable`` is not a plain Python, say), and the
        #: store commits in-process from then on (:meth:`ledger.store.Store.transaction`).
        self.unusable = False
        #: CPU time of the children that ended, and of the running one as of its last answer.
        self._ended_cpu_s = 0.0
        self._child_cpu_s = 0.0

    @property
    def cpu_s(self) -> float:
        """The writer processes' CPU time so far, as their answers reported it (a child's time
        after its last answer is not seen)."""
        return self._ended_cpu_s + self._child_cpu_s

    @property
    def in_flight(self) -> int:
        """Groups submitted whose answer has not come."""
        return len(self._waiting)

    def submit(
        self, members: Sequence[Sequence[PendingWrite]], future: asyncio.Future[Answer]
    ) -> None:
        """Hand a group (one list of writes per member) to the child. ``future`` resolves with
        its :class:`Answer`, or fails with :class:`StoreUnavailable` if none comes."""
        try:
            self._ensure_running(asyncio.get_running_loop())
        except OSError as exc:
            self._give_up(f"it could not be started: {exc}")
            future.set_exception(StoreUnavailable(f"the SQLite writer did not start: {exc}"))
            return
        numbers = self._numbers
        new_sql: list[str] = []
        message = []
        for writes in members:
            shipped = []
            for write in writes:
                sql = write.compiled.sql
                number = numbers.get(sql)
                if number is None:
                    number = numbers[sql] = len(numbers)
                    new_sql.append(sql)
                shipped.append((number, write.args, write.lost is not None, write.rows))
            message.append(shipped)
        try:
            body = pickle.dumps((new_sql, message), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # nothing was sent: the members learn why instead of waiting
            future.set_exception(exc)
            return
        self._waiting.append(future)
        self._send(_LENGTH.pack(len(body)) + body)

    def ready(self) -> bool:
        """Whether a group may be handed over now: the child runs, or has just been started.

        A child that cannot even be started (an :class:`OSError`: no such executable, no
        process left to fork, a sandbox that forbids them) gives the writer up at once, with a
        warning, so that the store commits in-process from then on. The store asks before it
        builds a group, so no group is failed for it. (A start that fails later, to replace a
        child that died, fails that group as unknown, as the death did.)"""
        if self.unusable:
            return False
        try:
            self._ensure_running(asyncio.get_running_loop())
        except OSError as exc:
            self._give_up(f"it could not be started: {exc}")
            return False
        return True

    def _give_up(self, why: str) -> None:
        if not self.unusable:
            self.unusable = True
            log.warning(
                "the SQLite writer process cannot run here: committing in-process",
                argv=self._argv[:4],
                why=why,
            )

    def _ensure_running(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._proc is not None:
            return
        if self.unusable:
            raise OSError("it ended before answering, every time it was started")
        proc = subprocess.Popen(
            self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True
        )
        assert proc.stdin is not None and proc.stdout is not None
        os.set_blocking(proc.stdin.fileno(), False)
        os.set_blocking(proc.stdout.fileno(), False)
        self._proc, self._loop = proc, loop
        self._answered = False
        self._numbers = {}
        self._ended_cpu_s += self._child_cpu_s
        self._child_cpu_s = 0.0
        self._inbox.clear()
        self._outbox.clear()
        self.started += 1
        loop.add_reader(proc.stdout.fileno(), self._on_readable)

    def _send(self, data: bytes) -> None:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and self._loop is not None
        if self._outbox:
            self._outbox += data  # behind what the pipe has not taken yet, in order
            return
        try:
            sent = os.write(proc.stdin.fileno(), data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._died("the SQLite writer's pipe broke")
            return
        if sent < len(data):
            self._outbox += data[sent:]
            self._loop.add_writer(proc.stdin.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        try:
            sent = os.write(proc.stdin.fileno(), self._outbox)
        except BlockingIOError:
            return
        except OSError:
            self._died("the SQLite writer's pipe broke")
            return
        del self._outbox[:sent]
        if not self._outbox and self._loop is not None:
            self._loop.remove_writer(proc.stdin.fileno())

    def _on_readable(self) -> None:
        proc = self._proc
        if proc is None or proc.stdout is None:
            return
        try:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._died("the SQLite writer ended")
            return
        inbox = self._inbox
        inbox += chunk
        while len(inbox) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(inbox)
            if len(inbox) < _LENGTH.size + size:
                break
            try:
                answer = Answer(*pickle.loads(bytes(inbox[_LENGTH.size : _LENGTH.size + size])))
            except Exception:
                # Not an answer this side can read (a child of another version of the engine,
                # say): no group in flight can be told its outcome, so none is.
                self._died("the SQLite writer's answer could not be read")
                return
            del inbox[: _LENGTH.size + size]
            self._child_cpu_s = answer.cpu_s
            self._answered, self._silent_deaths = True, 0
            future = self._waiting.popleft()
            if not future.done():
                future.set_result(answer)

    def _died(self, why: str) -> None:
        """No answer will come for the groups in flight: their outcome is unknown. The child,
        if it still runs, is ended (a writer whose pipe broke cannot be trusted with more)."""
        proc = self._detach()
        # Ended on its own (an exit status, not a signal: a crash or a kill is no sign that a
        # writer cannot run here) before it ever answered. Its pipes close before the kernel
        # lets it be reaped, so it is given a moment to be (a rare path: a writer's end).
        exited = None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                exited = proc.wait(timeout=REAP_WAIT_S)
        if exited is not None and exited >= 0 and not self._answered:
            self._silent_deaths += 1
            if self._silent_deaths >= SILENT_DEATHS:
                self._give_up(why)
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        waiting, self._waiting = self._waiting, collections.deque()
        for future in waiting:
            if not future.done():
                future.set_exception(StoreUnavailable(f"{why}: the commit's outcome is unknown"))
                future.exception()  # retrieved: each member re-raises it on its own

    def _detach(self) -> subprocess.Popen[bytes] | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        loop = self._loop
        if loop is not None and not loop.is_closed():
            assert proc.stdout is not None and proc.stdin is not None
            loop.remove_reader(proc.stdout.fileno())
            loop.remove_writer(proc.stdin.fileno())
        self._outbox.clear()
        return proc

    async def drained(self) -> None:
        """Wait until every group submitted so far has its answer (or is known lost)."""
        while self._waiting:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._waiting[-1])

    async def close(self) -> None:
        """Let the child finish what it was given, then end it (its input closes)."""
        await self.drained()
        proc = self._detach()
        if proc is None:
            return
        assert proc.stdin is not None and proc.stdout is not None
        with contextlib.suppress(OSError):
            proc.stdin.close()
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(None, proc.wait), CLOSE_WAIT_S)
        except (TimeoutError, OSError):
            proc.kill()
        proc.stdout.close()

    def kill(self) -> None:
        """End the child at once, as a crash would (the groups in flight: outcome unknown)."""
        self._died("the SQLite writer was stopped")
