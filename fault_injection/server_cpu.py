"""The local PostgreSQL server's CPU time during a run, read from ``/proc``.

Why: a sequential saga waits on two processes, ours and the server's backend, one after the
other. The bench has always reported the first (client CPU a saga); without the second, the
time a sequential PostgreSQL saga spends past its own CPU looked like round trips that a
faster engine could remove. Measured on 2026-12-05: the server spent 1.12 ms of CPU a saga,
nearly the engine's 1.27 ms, and ten times DBOS sequentially would have meant 1.35 ms for the
whole saga (``docs/benchmarks.md``, "Why the sequential targets are not met"). The same
reading of DBOS's half says what its workflows cost the server.

What is counted: user + system time of every process named ``postgres`` on this host
(backends, WAL writer, checkpointer, autovacuum), between two readings. Only where the bench
can see the server: a URL whose host is a loopback address or a Unix socket directory, on a
system with ``/proc`` (Linux). Anything else gives ``None``, and the report shows a dash.

It is a floor: a process that ends between the readings takes its time with it (the runs'
pooled connections live through the timed phase, so their backends do not). Other clients of
the same server during the run are counted too: the bench is meant to run on a quiet server.
The fake shop's database (``--provider fake|http``) is on the same server, so its work is in
the figure; with ``--provider memory`` (the default) nothing else of the bench's uses it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

PROC = Path("/proc")
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True, slots=True)
class ServerReading:
    """CPU clock ticks per server process, keyed by (pid, start time) so that a pid the kernel
    gave to a new process between two readings is not taken for the old one."""

    ticks: dict[tuple[int, int], int]
    ticks_per_second: int


def is_local_postgres(url: str) -> bool:
    """Whether ``url`` names a PostgreSQL server on this host (loopback, or a Unix socket:
    no host, or a host that is a directory path)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return False
    host = parsed.host or parsed.query.get("host")
    if isinstance(host, tuple):  # ``?host=`` given more than once
        host = host[0] if host else None
    return not host or host.startswith("/") or host in _LOOPBACK


def parse_stat(text: str) -> tuple[str, int, int] | None:
    """``(command name, start time, user + system ticks)`` from a ``/proc/<pid>/stat`` line;
    ``None`` if it is not one. The name sits in parentheses and may hold spaces or ``)``,
    so the fields are counted from the last ``)``."""
    open_at, close_at = text.find("("), text.rfind(")")
    if open_at < 0 or close_at < open_at:
        return None
    fields = text[close_at + 1 :].split()
    # After the name: state (field 3 of proc(5)), ..., utime (14), stime (15), starttime (22).
    if len(fields) < 20:
        return None
    try:
        return text[open_at + 1 : close_at], int(fields[19]), int(fields[11]) + int(fields[12])
    except ValueError:
        return None


def read_server(url: str, proc: Path = PROC) -> ServerReading | None:
    """The server's processes' CPU ticks now; ``None`` where they cannot be seen."""
    if not is_local_postgres(url) or not proc.is_dir():
        return None
    ticks: dict[tuple[int, int], int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parsed = parse_stat((entry / "stat").read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue  # ended while we looked
        if parsed is not None and parsed[0] == "postgres":
            ticks[(int(entry.name), parsed[1])] = parsed[2]
    if not ticks:
        return None  # no server process visible (another container, another user's view)
    return ServerReading(ticks, os.sysconf("SC_CLK_TCK"))


def server_cpu_seconds(before: ServerReading | None, after: ServerReading | None) -> float | None:
    """The server's CPU seconds between two readings (processes started in between count from
    zero); ``None`` if either reading is missing."""
    if before is None or after is None:
        return None
    spent = sum(t - before.ticks.get(key, 0) for key, t in after.ticks.items())
    return spent / after.ticks_per_second


def per_saga_ms(seconds: float | None, sagas: int) -> float | None:
    """``seconds`` as milliseconds a saga (``None`` stays ``None``)."""
    return None if seconds is None or sagas <= 0 else seconds * 1000 / sagas
