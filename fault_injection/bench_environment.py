"""What a benchmark ran on: the machine, the interpreter and the versions of what it measured.

Why: two machines of one description (2 cores, 24 GiB) do not give one ratio. On 2026-12-04
the same engine's SQLite verdict against DBOS at C = 16 was 9.80x on one machine and 10.55x on
another a few hours later, an Intel Xeon (``docs/benchmarks-log.md``; the first one's processor was
not recorded): the two engines' CPU per saga does not scale alike across processors. A result
is comparable with another only when both say where they were measured, so every run of
``agent-txn bench`` prints this and ``--json`` keeps it under ``environment``.

Read from the running process and the database server, never configured: the processor's model
name (``/proc/cpuinfo``; ``platform.processor()`` where there is none), the CPUs the process
may use, the operating system and architecture, Python, the SQLite library the engine (and DBOS)
link, the PostgreSQL server's version when the run is on PostgreSQL, and the versions of
agent-txn and, with ``--compare dbos``, of DBOS. On SQLite also where the run's files are and
the file system there (``/proc/mounts``): a commit under ``FULL`` waits for that disk, and a
``/tmp`` on tmpfs has no disk to wait for, so the same run reads several times faster there.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from fault_injection.harness import probe_url, sqlite_folder
from ledger import dialects
from ledger.pg_room import ConnectionRoom, read_room

CPUINFO = Path("/proc/cpuinfo")
MOUNTS = Path("/proc/mounts")


def processor_model(cpuinfo: Path = CPUINFO) -> str | None:
    """The processor's model name as the kernel reports it, or the platform's own guess; ``None``
    when neither says anything."""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def usable_cpus() -> int | None:
    """CPUs this process may run on (its affinity where the OS has one, else all of them)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count()


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``, ``None`` if it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _unescaped(field: str) -> str:
    # /proc/mounts writes a space, tab, newline or backslash in a path as a 3-digit octal escape.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_of(path: Path, mounts: Path = MOUNTS) -> str | None:
    """The type of the file system ``path`` is on (``ext4``, ``tmpfs`` …): that of the longest
    mount point above it, the last one mounted there winning; ``None`` where the mounts cannot
    be read (not Linux)."""
    try:
        lines = mounts.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    target = path.resolve()
    found, depth = None, -1
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(_unescaped(fields[1]))
        if (point == target or point in target.parents) and len(point.parts) >= depth:
            found, depth = fields[2], len(point.parts)
    return found


def sqlite_files(db: str | None) -> dict[str, str | None] | None:
    """Where a run on ``db`` keeps its SQLite files and on what file system; ``None`` on
    PostgreSQL (:func:`fault_injection.harness.scratch_folder` makes the folder)."""
    if db is not None and dialects.dialect_of(dialects.normalize_url(db)) != "sqlite":
        return None
    folder = sqlite_folder(db) or Path(tempfile.gettempdir())
    return {"folder": str(folder), "filesystem": filesystem_of(folder)}


async def postgres_server_version(url: str) -> str:
    """``server_version`` of the PostgreSQL server ``url`` names (one short connection, with
    :func:`fault_injection.harness.probe_url`'s connect timeout)."""
    engine = dialects.create_engine(probe_url(url))
    try:
        async with engine.connect() as conn:
            return str((await conn.execute(text("SHOW server_version"))).scalar_one())
    finally:
        await engine.dispose()


async def connection_room(url: str) -> ConnectionRoom | None:
    """The PostgreSQL server's room for connections now (:mod:`ledger.pg_room`), read on one
    short connection with :func:`fault_injection.harness.probe_url`'s connect timeout.

    A failure to connect is raised: it is the bench's first connection, and a server it cannot
    reach ends the command there, at once, rather than after every later connection has
    waited for it too. ``None`` when the server answered but the room could not be read."""
    engine = dialects.create_engine(probe_url(url))
    try:
        async with engine.connect() as conn:
            try:
                return await read_room(conn)
            except DBAPIError:
                return None
    finally:
        await engine.dispose()


async def _server_version_or_none(url: str) -> str | None:
    # A server the bench cannot reach fails the run itself a moment later, with the error the
    # bench gives for it; the description only says it could not read the version.
    try:
        return await postgres_server_version(url)
    except Exception:
        return None


async def describe(db: str | None, *, compare: str | None = None) -> dict[str, Any]:
    """The environment of a run on ``db`` (``None``: SQLite files), under stable keys."""
    postgresql = None
    if db is not None and dialects.dialect_of(dialects.normalize_url(db)) == "postgresql":
        postgresql = await _server_version_or_none(db)
    return {
        "processor": processor_model(),
        "cpus": usable_cpus(),
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "sqlite": sqlite3.sqlite_version,
        "sqlite_files": sqlite_files(db),
        "postgresql": postgresql,
        "agent_txn": package_version("agent-txn"),
        "dbos": package_version("dbos") if compare == "dbos" else None,
    }


#: File systems that keep files in memory: a commit there waits for no disk.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def memory_files_note(environment: dict[str, Any]) -> str | None:
    """A line for a run whose SQLite files are in memory (a ``/tmp`` on tmpfs, as several
    distributions mount it), which no durable deployment is; ``None`` otherwise."""
    files = environment.get("sqlite_files")
    if not files or files["filesystem"] not in MEMORY_FILESYSTEMS:
        return None
    return (
        f"note: the SQLite files are in {files['folder']}, on {files['filesystem']} (memory): "
        "commits wait for no disk. To measure a disk, name a file on it: "
        "--db sqlite+aiosqlite:///DIR/bench.db (fresh files are made in DIR)"
    )


def one_line(environment: dict[str, Any]) -> str:
    """The environment as the line the bench prints before its results."""
    parts = [
        f"{environment['processor'] or 'unknown processor'}, {environment['cpus']} CPUs",
        f"{environment['os']} {environment['arch']}",
        environment["python"],
        f"SQLite {environment['sqlite']}",
    ]
    files = environment.get("sqlite_files")
    if files:
        parts[-1] += (
            f" (files in {files['folder']}, {files['filesystem'] or 'file system unknown'})"
        )
    if environment["postgresql"]:
        parts.append(f"PostgreSQL {environment['postgresql']}")
    parts.append(f"agent-txn {environment['agent_txn'] or '(not installed)'}")
    if environment["dbos"]:
        parts.append(f"dbos {environment['dbos']}")
    return "on: " + " · ".join(parts)


__all__ = [
    "connection_room",
    "describe",
    "filesystem_of",
    "memory_files_note",
    "one_line",
    "package_version",
    "postgres_server_version",
    "processor_model",
    "sqlite_files",
    "usable_cpus",
]
