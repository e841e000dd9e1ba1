"""Victims forked from one process that has imported the engine already.

Why: a kill cell's victim was a fresh interpreter, and its start-up (the interpreter, then the
engine's imports: SQLAlchemy, asyncpg, structlog, pydantic, the ledger) cost about 0.6 s of CPU
on a fast machine of this kind and 0.9 s on a slow one, for each of the 47 kill cells of a
backend. That was most of the kill half's CPU, and CI runs it three times (both backends, then
SQLite again with the inline writer). Start-up overlapped the cell before it (``LOOKAHEAD``),
but on two cores its CPU still came out of everything else the suite ran.

How: :class:`ForkServer` starts ``python -m fault_injection.forkserver`` once. That process
imports the victim (:data:`PRELOAD`) and waits on a Unix socket. For each request, the argv of
a victim, it makes three pipes and forks; the child makes them its stdin, stdout and stderr,
re-seeds :mod:`random` (a fork copies the generator), runs :func:`fault_injection.victim.main`
and leaves with its exit status. The server sends the child's pid and the parent's ends of the
pipes back over the socket, and later the child's exit status, as :func:`os.waitpid` gave it:
a victim that SIGKILLs itself reads ``-9``, exactly as a direct child would.

A forked victim is a real process: its own pid, its own event loop, its own connections, and a
SIGKILL that leaves no ``finally``. What it shares with the server is memory copied on write,
set up by imports alone (the server runs nothing else: no event loop, no thread, no
connection). The server ends when its socket closes, the parent's end included when the parent
dies; a victim still waiting for its "go" then reads end-of-file on stdin and goes home.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import select
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from typing import Any, Final

#: What the server imports before its first fork: the victim and the drivers it opens lazily.
PRELOAD: Final = (
    "fault_injection.victim",
    "fault_injection.harness",
    "sqlalchemy.dialects.sqlite.aiosqlite",
    "sqlalchemy.dialects.postgresql.asyncpg",
    "aiosqlite",
    "asyncpg",
)
#: Largest message either side sends (one victim's argv, or one answer).
_MESSAGE_BYTES: Final = 1 << 16
#: Whether this platform can fork victims and pass their pipes (POSIX with ``SCM_RIGHTS``).
AVAILABLE: Final = hasattr(os, "fork") and hasattr(socket, "send_fds")


class ForkServerGone(RuntimeError):
    """The fork server ended while a victim was being forked or was still running."""


class ForkedProcess:
    """One victim forked by the server: the part of :class:`asyncio.subprocess.Process` the
    crash matrix uses (``pid``, ``stdin``, ``returncode``, ``communicate``, ``kill``)."""

    def __init__(self, pid: int, stdin: int | None, stdout: int, stderr: int) -> None:
        self.pid = pid
        #: Our end of its stdin, or ``None`` once closed (``None`` from the start: no input).
        self.stdin = stdin
        self._stdout = stdout
        self._stderr = stderr
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def returncode(self) -> int | None:
        """Its exit status once it ended (``-N`` when signal N killed it), else ``None``."""
        if self._exit.done() and not self._exit.cancelled() and self._exit.exception() is None:
            return self._exit.result()
        return None

    def _ended(self, code: int) -> None:
        if not self._exit.done():
            self._exit.set_result(code)

    def _lost(self, error: BaseException) -> None:
        if not self._exit.done():
            self._exit.set_exception(error)

    async def communicate(self, input: bytes | None = None) -> tuple[bytes, bytes]:
        """Write ``input`` to its stdin and close it, read stdout and stderr to their end, and
        wait for it to exit: what :meth:`asyncio.subprocess.Process.communicate` does."""
        if self.stdin is not None:
            fd, self.stdin = self.stdin, None
            try:
                if input:
                    # A go line is far below a pipe's buffer: the write never blocks.
                    os.write(fd, input)
            except BrokenPipeError:
                pass  # it has gone already; its exit status says how
            finally:
                os.close(fd)
        out, err = await asyncio.gather(_read_all(self._stdout), _read_all(self._stderr))
        await self._exit
        return out, err

    def kill(self) -> None:
        """SIGKILL it, unless it has ended (its pid may then belong to someone else)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


async def _read_all(fd: int) -> bytes:
    """Everything from ``fd`` up to end-of-file, then close it."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(fd, "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        return await reader.read()
    finally:
        transport.close()


class ForkServer:
    """One fork server process and the victims it forked for this process.

    Open with :meth:`start`, fork with :meth:`spawn`, end with :meth:`close`. Spawns are
    answered in the order they are asked; exits arrive whenever they happen.
    """

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self._proc = proc
        self._sock = sock
        self._waiting: list[asyncio.Future[ForkedProcess]] = []
        self._children: dict[int, ForkedProcess] = {}
        self._gone: BaseException | None = None
        asyncio.get_running_loop().add_reader(sock.fileno(), self._on_message)

    @classmethod
    async def start(cls, env: dict[str, str]) -> ForkServer:
        """Start the server with ``env`` (the victims' environment) and wait until it has
        imported everything."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "fault_injection.forkserver",
                str(theirs.fileno()),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        ready = await asyncio.get_running_loop().sock_recv(ours, _MESSAGE_BYTES)
        if json.loads(ready or b"{}").get("ready") is not True:
            ours.close()
            await proc.wait()
            raise ForkServerGone(f"the fork server did not start (exit status {proc.returncode})")
        return cls(proc, ours)

    async def spawn(self, argv: Sequence[str], *, stdin: bool) -> ForkedProcess:
        """Fork a victim running ``fault_injection.victim.main(argv)``; without ``stdin`` its
        stdin is closed at once (it reads end-of-file, as from ``/dev/null``)."""
        if self._gone is not None:
            raise ForkServerGone("the fork server has ended") from self._gone
        answer: asyncio.Future[ForkedProcess] = asyncio.get_running_loop().create_future()
        # Sent and queued with no await between: answers come in the order of the requests,
        # so a caller cancelled here must still leave its place in the queue (see
        # _on_message). A request is a few hundred bytes: the send never waits.
        self._sock.send(json.dumps({"argv": list(argv)}).encode())
        self._waiting.append(answer)
        child = await answer
        if not stdin and child.stdin is not None:
            os.close(child.stdin)
            child.stdin = None
        return child

    def _on_message(self) -> None:
        try:
            data, fds, _flags, _addr = socket.recv_fds(self._sock, _MESSAGE_BYTES, 3)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._end(exc)
            return
        if not data:
            self._end(ForkServerGone("the fork server ended"))
            return
        message: dict[str, Any] = json.loads(data)
        if "spawned" in message:
            stdin, stdout, stderr = fds
            child = ForkedProcess(int(message["spawned"]), stdin, stdout, stderr)
            self._children[child.pid] = child
            answer = self._waiting.pop(0)
            if not answer.done():
                answer.set_result(child)
            else:  # its asker was cancelled: nobody will run it, so end it
                child.kill()
                for fd in (stdin, stdout, stderr):
                    os.close(fd)
                child.stdin = None
        elif "exited" in message:
            # Never before its "spawned": the server sends that right after the fork and reaps
            # only later, and the socket keeps the order of its messages.
            known = self._children.pop(int(message["exited"]), None)
            if known is not None:
                known._ended(int(message["code"]))

    def _end(self, error: BaseException) -> None:
        if self._gone is not None:
            return
        self._gone = error
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        for answer in self._waiting:
            if not answer.done():
                answer.set_exception(ForkServerGone("the fork server ended"))
        self._waiting.clear()
        for child in self._children.values():
            child._lost(ForkServerGone(f"the fork server ended while victim {child.pid} ran"))
        self._children.clear()

    async def close(self) -> None:
        """Close the socket (the server then exits) and wait for the server to end. Victims
        still running are the caller's to finish first."""
        self._end(ForkServerGone("closed"))
        self._sock.close()
        await self._proc.wait()


# -- the server's side ------------------------------------------------------------------------


def _child(argv: list[str], stdin: int, stdout: int, stderr: int) -> None:
    """In the forked child: become the victim. Never returns."""
    code = 1
    try:
        for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
            os.dup2(fd, target)
            os.close(fd)
        random.seed()  # the fork copied the server's generator: every victim would draw alike
        from fault_injection import victim

        code = victim.main(argv)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


#: The server's SIGINT disposition as it started, before it ignored the signal: its victims
#: get it back (a victim of a run in the background ignores Ctrl-C, as a direct child would).
_inherited_sigint: Any = signal.SIG_DFL


def _fork(argv: list[str], closing: Sequence[int]) -> tuple[int, list[int]]:
    """Fork one victim; return its pid and the parent's ends (stdin, stdout, stderr)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in (*closing, in_w, out_r, err_r):
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, _inherited_sigint)
        _child(argv, in_r, out_w, err_w)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    return pid, [in_w, out_r, err_r]


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        # A parent gone already (its end closed) hears nothing; serve() sees it next.
        with contextlib.suppress(OSError):
            sock.sendall(json.dumps({"exited": pid, "code": code}).encode())


def serve(sock: socket.socket) -> None:
    """Answer fork requests on ``sock`` until it closes."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    # A handler of our own (not the default, which ignores the signal without waking us).
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # Ctrl-C reaches the whole process group: the parent decides what it means, and when it
    # ends, its end of the socket closes and this loop ends. Victims get back what it had.
    global _inherited_sigint
    _inherited_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock.sendall(json.dumps({"ready": True}).encode())
    listening = sock.fileno()
    while True:
        ready, _, _ = select.select([listening, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock)
        if listening in ready:
            data = sock.recv(_MESSAGE_BYTES)
            if not data:
                return  # the parent closed its end (or died): victims carry on alone
            argv = [str(a) for a in json.loads(data)["argv"]]
            pid, ends = _fork(argv, (sock.fileno(), wake_r, wake_w))
            try:
                socket.send_fds(sock, [json.dumps({"spawned": pid}).encode()], ends)
            except OSError:
                return  # the parent is gone; the victim reads end-of-file and goes home
            finally:
                for fd in ends:
                    os.close(fd)
            _reap(sock)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
