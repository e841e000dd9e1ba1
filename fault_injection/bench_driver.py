"""The database's own small-commit limits, measured in the bench's run on the bench's database.

Two loops of one-row ``INSERT`` + commit transactions on a scratch table, dropped after:

* :func:`driver_commit_rate` — through the engine's own settings and SQLAlchemy
  (:func:`ledger.dialects.create_engine`: SQLite's journal mode, ``synchronous`` and
  ``BEGIN IMMEDIATE``; PostgreSQL's asyncpg pool), the way the issue lists "SQLAlchemy +
  driver" rates. What ``efficiency`` divides by.
* :func:`raw_commit_rate` — the bare driver, the way the issue lists "raw" rates: stdlib
  :mod:`sqlite3` on the store's file with the same pragmas, ``BEGIN IMMEDIATE``, the insert and
  ``COMMIT`` on one connection; asyncpg with a prepared insert in autocommit, one round trip
  and one commit each, on as many connections as the other loop. Nothing a saga does can
  commit faster than this, so commits a saga ÷ this rate is the least time its commits take:
  the floor under the sequential ratio (``docs/benchmarks.md``, "Why the sequential targets
  are not met").

Why both: the SQLAlchemy loop pays a Python path per commit that the engine's own hot path
skips (``ledger/hot.py``), and on PostgreSQL three round trips (``BEGIN``, the insert,
``COMMIT``) where each of the engine's happy-path transactions takes one. Judged against it
alone, sequential PostgreSQL looked close to its limit (efficiency 0.83) while the wire
allowed two and a half times as many commits.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

import asyncpg
from rich.console import Console
from rich.markup import escape
from sqlalchemy import BigInteger, Column, MetaData, String, Table
from sqlalchemy.engine import make_url

from ledger import dialects

_scratch_meta = MetaData()
_scratch = Table(
    "bench_scratch",
    _scratch_meta,
    Column("id", BigInteger, primary_key=True, autoincrement=False),
    Column("v", String(16), nullable=False),
)
#: The raw loops' table, created and dropped in the driver's own SQL.
_RAW_TABLE = "bench_scratch_raw"


@dataclass(frozen=True, slots=True)
class DriverRates:
    """Small commits per second on the bench's database (:func:`measure_driver`)."""

    #: Through SQLAlchemy and the engine's settings (:func:`driver_commit_rate`).
    engine: float
    #: The bare driver (:func:`raw_commit_rate`); ``None`` where it cannot be measured (a
    #: SQLite URL that is not a plain file).
    raw: float | None


async def measure_driver(
    url: str, *, seconds: float, connections: int, sqlite_synchronous: str
) -> DriverRates:
    """Both loops, one after the other, ``seconds`` each."""
    engine = await driver_commit_rate(
        url, seconds=seconds, connections=connections, sqlite_synchronous=sqlite_synchronous
    )
    try:
        raw = await raw_commit_rate(
            url, seconds=seconds, connections=connections, sqlite_synchronous=sqlite_synchronous
        )
    except _RAW_FAILURES as exc:
        # The raw rate is an extra reading, taken after the run: its failure alone (the bare
        # driver refusing something SQLAlchemy's adapter took) must not lose the run's results.
        _note(f"the raw driver rate could not be measured ({_reason(exc)}); it is left out")
        raw = None
    return DriverRates(engine=engine, raw=raw)


#: What a failed raw measurement raises: the drivers' own errors and a connection's (a
#: ``TimeoutError`` is an ``OSError``). Anything else is a bug, and keeps its traceback.
_RAW_FAILURES: tuple[type[Exception], ...] = (
    OSError,
    sqlite3.Error,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)


def _reason(exc: Exception) -> str:
    if isinstance(exc, asyncpg.PostgresError):
        return f"PostgreSQL: {exc}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _note(message: str) -> None:
    Console(stderr=True, highlight=False, emoji=False).print(
        f"note: {escape(message)}", soft_wrap=True
    )


async def driver_commit_rate(
    url: str, *, seconds: float, connections: int, sqlite_synchronous: str = "FULL"
) -> float:
    """Small commits per second (one-row ``INSERT`` + commit each) through the engine settings
    the store uses, on ``connections`` connections at once; the scratch table is dropped after."""
    engine = dialects.create_engine(
        url,
        sqlite_synchronous=sqlite_synchronous,
        pg_pool_size=max(dialects.PG_POOL_SIZE, connections),
    )
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_scratch_meta.drop_all)
            await conn.run_sync(_scratch_meta.create_all)
        done = [0]
        deadline = time.perf_counter() + seconds

        async def loop(lane: int) -> None:
            async with engine.connect() as conn:
                i = 0
                while time.perf_counter() < deadline:
                    async with conn.begin():
                        await conn.execute(_scratch.insert(), {"id": lane * 10**9 + i, "v": "x"})
                    i += 1
                    done[0] += 1

        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for lane in range(connections):
                group.create_task(loop(lane))
        elapsed = time.perf_counter() - started
        async with engine.begin() as conn:
            await conn.run_sync(_scratch_meta.drop_all)
        return done[0] / elapsed
    finally:
        await engine.dispose()


async def raw_commit_rate(
    url: str, *, seconds: float, connections: int, sqlite_synchronous: str = "FULL"
) -> float | None:
    """Small commits per second through the bare driver (see the module doc); ``None`` for a
    SQLite URL that is not a plain file. SQLite uses one connection whatever ``connections``
    says: it has one writer."""
    if dialects.dialect_of(url) == "sqlite":
        path = dialects.sqlite_file(url)
        if path is None:
            return None
        return await asyncio.to_thread(_sqlite_raw_rate, path, seconds, sqlite_synchronous)
    return await _postgres_raw_rate(url, seconds, connections)


def _sqlite_raw_rate(path: str, seconds: float, synchronous: str) -> float:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute(f"DROP TABLE IF EXISTS {_RAW_TABLE}")
        conn.execute(f"CREATE TABLE {_RAW_TABLE} (id INTEGER PRIMARY KEY, v TEXT NOT NULL)")
        insert = f"INSERT INTO {_RAW_TABLE} (id, v) VALUES (?, ?)"
        done = 0
        started = time.perf_counter()
        deadline = started + seconds
        while time.perf_counter() < deadline:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(insert, (done, "x"))
            conn.execute("COMMIT")
            done += 1
        elapsed = time.perf_counter() - started
        conn.execute(f"DROP TABLE {_RAW_TABLE}")
        return done / elapsed
    finally:
        conn.close()


#: URL options of SQLAlchemy's asyncpg adapter, not of asyncpg's ``connect``.
_ADAPTER_ONLY_OPTIONS = frozenset({"prepared_statement_cache_size"})


def asyncpg_arguments(url: str) -> dict[str, Any]:
    """Keyword arguments of ``asyncpg.connect`` for a PostgreSQL URL, as SQLAlchemy's adapter
    gives them: host, port, user, password and database, and the query's options as keywords,
    the numeric ones as numbers (:func:`ledger.dialects.pg_numbers`). Not a DSN: asyncpg takes
    a DSN's unknown query keys (``command_timeout``; ``ssl``, which ``normalize_url`` writes
    for libpq's ``sslmode``) as server settings, which the server then refuses."""
    normalized = dialects.normalize_url(url)
    parsed = make_url(normalized)
    arguments: dict[str, Any] = parsed.translate_connect_args(username="user")
    arguments.update(
        (key, value) for key, value in parsed.query.items() if key not in _ADAPTER_ONLY_OPTIONS
    )
    arguments.update(dialects.pg_numbers(normalized))
    return arguments


async def _postgres_raw_rate(url: str, seconds: float, connections: int) -> float:
    arguments = asyncpg_arguments(url)
    admin = await asyncpg.connect(**arguments)
    try:
        await admin.execute(
            f"DROP TABLE IF EXISTS {_RAW_TABLE}; "
            f"CREATE TABLE {_RAW_TABLE} (id bigint PRIMARY KEY, v text NOT NULL)"
        )
        done = [0]
        deadline = time.perf_counter() + seconds

        async def loop(lane: int) -> None:
            conn = await asyncpg.connect(**arguments)
            try:
                insert = await conn.prepare(f"INSERT INTO {_RAW_TABLE} (id, v) VALUES ($1, $2)")
                i = 0
                while time.perf_counter() < deadline:
                    await insert.fetch(lane * 10**9 + i, "x")  # autocommit: one round trip
                    i += 1
                    done[0] += 1
            finally:
                await conn.close()

        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for lane in range(connections):
                group.create_task(loop(lane))
        elapsed = time.perf_counter() - started
        await admin.execute(f"DROP TABLE {_RAW_TABLE}")
        return done[0] / elapsed
    finally:
        await admin.close()


__all__ = [
    "DriverRates",
    "asyncpg_arguments",
    "driver_commit_rate",
    "measure_driver",
    "raw_commit_rate",
]
