"""Every SQLite- or PostgreSQL-specific line of the store lives here.

* engine construction: SQLite in WAL with ``busy_timeout``, ``foreign_keys=ON`` and ``BEGIN
  IMMEDIATE`` write transactions (aiosqlite recipe: the driver's own BEGIN is disabled so ours is
  the only one); PostgreSQL through asyncpg with pre-ping so connections killed by a server restart
  are replaced instead of failing the next claim;
* the database clock as a ``BIGINT`` of epoch milliseconds, so leases are never judged by a
  worker's clock;
* translation of driver exceptions into :mod:`ledger.errors`.
"""

from __future__ import annotations

import math
import os
import sqlite3
import time
from typing import Any, Literal

from sqlalchemy import BigInteger, Table, event, inspect, literal_column
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.sql import Select
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.elements import ColumnElement

from ledger import sqlite_inline
from ledger.canonical import plain_json
from ledger.errors import (
    DuplicateKey,
    StorageError,
    StoreBusy,
    StoreUnavailable,
    ValueNotStorable,
)

Dialect = Literal["sqlite", "postgresql"]

#: Execution option that marks a connection's transactions as read-only (SQLite: BEGIN DEFERRED).
READ_ONLY_OPTION = "agent_txn_read_only"

_PG_BUSY_CODES = frozenset({"40001", "40P01", "55P03"})  # serialization, deadlock, lock timeout
_PG_UNIQUE = "23505"
#: connection exception, invalid catalog (no such database), invalid authorization, and
#: insufficient resources: the server (or the role's or database's ``CONNECTION LIMIT``) has
#: no connection left for us, or no memory for one. asyncpg raises these while connecting,
#: unwrapped; each means "not now", and the store's callers retry a StoreUnavailable.
_PG_UNREACHABLE_CLASSES = frozenset({"08", "3D", "28", "53"})
#: What the operator reads for a shortage the sqlstate alone would not explain (class 53).
_PG_SHORTAGES = {"53100": "disk full", "53200": "out of memory", "53300": "too many connections"}
#: PostgreSQL's data exceptions (class 22) the operator reads by name; the rest of the class
#: is reported by its code alone.
_PG_DATA_EXCEPTIONS = {
    "22001": "string too long for its column",
    "22003": "number out of its column's range",
}


def dialect_of(url: str) -> Dialect:
    """``sqlite`` or ``postgresql`` for a SQLAlchemy URL; anything else is refused clearly."""
    backend = make_url(url).get_backend_name()
    if backend == "sqlite":
        return "sqlite"
    if backend == "postgresql":
        return "postgresql"
    raise ValueError(
        f"unsupported database {backend!r}: use sqlite+aiosqlite:///path.db or postgresql+asyncpg://…"
    )


#: The drivers the stores run on: the engine's hot path speaks to these two itself
#: (:mod:`ledger.hot`), and SQLAlchemy's async engine takes no other for these databases.
_DRIVERS: dict[str, str] = {"sqlite": "aiosqlite", "postgresql": "asyncpg"}


def normalize_url(url: str) -> str:
    """Pick the async driver when the URL names none (``sqlite:///x`` → ``sqlite+aiosqlite``),
    and refuse what would fail later at the first connection with a driver's own traceback:
    another driver (``postgresql+psycopg2``), a port out of range, a PostgreSQL option asyncpg
    does not take. libpq's ``sslmode`` (in the URLs hosting providers hand out) becomes
    asyncpg's ``ssl``, which takes the same modes."""
    parsed = make_url(url)
    backend, _, driver = parsed.drivername.partition("+")
    backend = "postgresql" if backend == "postgres" else backend
    wanted = _DRIVERS.get(backend)
    if wanted is None:
        return parsed.render_as_string(hide_password=False)  # dialect_of says what is wrong
    if driver and driver != wanted:
        raise ValueError(
            f"{backend}+{driver}: agent-txn reaches {backend} through {wanted} "
            f"(write {backend}:// or {backend}+{wanted}://)"
        )
    parsed = parsed.set(drivername=f"{backend}+{wanted}")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ValueError(f"port {parsed.port} is not a TCP port (1 to 65535)")
    if backend == "postgresql":
        parsed = _asyncpg_options(parsed)
    return parsed.render_as_string(hide_password=False)


#: The PostgreSQL options a URL's query may give. asyncpg takes them as keywords, and a URL
#: gives strings: these take strings (or are converted by asyncpg, or by SQLAlchemy's adapter:
#: ``command_timeout``, ``prepared_statement_cache_size``); those in :data:`_PG_NUMBERS` are
#: converted by :func:`pg_numbers`. asyncpg's other keywords take objects a URL cannot give
#: (``server_settings``, a boolean ``direct_tls``), and any other key failed at the first
#: connection with a ``TypeError``.
_PG_OPTIONS = frozenset(
    {
        "host", "port", "user", "password", "database", "passfile", "service", "servicefile",
        "ssl", "target_session_attrs", "krbsrvname", "gsslib", "command_timeout",
        "prepared_statement_cache_size",
    }
)  # fmt: skip
#: Numeric asyncpg options a URL may give, with their type: asyncpg compares them as numbers.
_PG_NUMBERS: dict[str, type[int] | type[float]] = {
    "timeout": float,
    "statement_cache_size": int,
    "max_cached_statement_lifetime": float,
    "max_cacheable_statement_size": int,
}


def _asyncpg_options(parsed: URL) -> URL:
    query = dict(parsed.query)
    mode = query.pop("sslmode", None)
    if mode is not None:
        query.setdefault("ssl", mode)  # asyncpg's own name wins where both are given
    taken = _PG_OPTIONS | set(_PG_NUMBERS)
    for key, value in query.items():
        if key not in taken:
            raise ValueError(
                f"unknown PostgreSQL connection option {key!r} in the URL (it takes: "
                f"sslmode, {', '.join(sorted(taken))})"
            )
        if key in _PG_NUMBERS and _pg_number(key, value) is None:
            raise ValueError(f"the URL's {key} must be a number >= 0, not {value!r}")
    return parsed.set(query=query)


def _pg_number(key: str, value: object) -> int | float | None:
    try:
        number = _PG_NUMBERS[key](str(value))
    except ValueError:
        return None
    return number if 0 <= number < math.inf else None


def pg_numbers(url: str) -> dict[str, Any]:
    """The numeric options of a normalised PostgreSQL URL, as numbers (connect arguments win
    over the URL's strings in SQLAlchemy). Every engine or bare asyncpg connection on a
    user's URL takes them so: asyncpg compares them as numbers, and a string failed the first
    connection with a ``TypeError``."""
    query = make_url(url).query
    return {key: _pg_number(key, query[key]) for key in _PG_NUMBERS if key in query}


#: PostgreSQL connections a store keeps open by default (EngineSettings.pg_pool_size).
PG_POOL_SIZE = 20


#: How long a SQLite connection waits for another process's write lock.
SQLITE_BUSY_TIMEOUT_MS = 10_000


def in_memory(url: str) -> bool:
    """Whether a SQLite URL names an in-memory database (``sqlite://``, ``:memory:``): one that
    each connection makes empty, and that is gone when it closes."""
    parsed = make_url(url)
    return parsed.get_backend_name() == "sqlite" and (parsed.database or "") in ("", ":memory:")


async def table_names(conn: AsyncConnection) -> set[str]:
    """The tables of the database ``conn`` is connected to (its default schema)."""
    return set(await conn.run_sync(lambda sync: inspect(sync).get_table_names()))


def sqlite_file(url: str) -> str | None:
    """The file a SQLite URL names, if it is a plain file (no ``:memory:``, no query string:
    the URLs whose statements run on the event loop, :mod:`ledger.sqlite_inline`), as an
    absolute path. Resolved now because it is opened later: the pool opens connections when
    it needs them and the writer process starts with the first group, maybe after the process
    changed its working directory, when a relative path would name another, new file."""
    if dialect_of(url) != "sqlite":
        return None
    parsed = make_url(normalize_url(url))
    database = parsed.database or ""
    if database and database != ":memory:" and not parsed.query:
        return os.path.abspath(database)
    return None


def create_engine(
    url: str,
    *,
    sqlite_synchronous: str = "FULL",
    sqlite_busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS,
    pg_pool_size: int = PG_POOL_SIZE,
    pg_lock_timeout_ms: int = 10_000,
) -> AsyncEngine:
    """An engine for ``url`` with the settings the protocol relies on."""
    url = normalize_url(url)
    if dialect_of(url) == "sqlite":
        return _sqlite_engine(url, sqlite_synchronous, sqlite_busy_timeout_ms)
    engine = create_async_engine(
        url,
        json_serializer=plain_json,  # what json.dumps gives, for less CPU (ledger.canonical)
        pool_size=pg_pool_size,
        max_overflow=pg_pool_size,
        pool_pre_ping=True,
        connect_args={
            **pg_numbers(url),
            "server_settings": {
                "application_name": "agent-txn",
                "lock_timeout": str(pg_lock_timeout_ms),
            },
        },
    )
    _ping_in_one_round_trip(engine)
    return engine


#: A connection returned to the pool this recently is not pinged at its next checkout
#: (HikariCP's ``aliveBypassWindowMs`` has the same default and reason).
PING_BYPASS_SECONDS = 0.5


_LAST_USE_KEY = "agent_txn_last_use"


def stamp_last_use(conn: AsyncConnection, used_at: float) -> None:
    """Say when ``conn`` (about to be returned to the pool) was last used, if not just now: a
    store that kept it checked out while idle (:meth:`ledger.store.Store._take_idle`) must not
    have the check-in's own time stand for its last use, or the next checkout would skip the
    ping for a connection that sat idle past :data:`PING_BYPASS_SECONDS`."""
    if conn.closed or conn.invalidated or conn.sync_connection is None:
        return
    conn.sync_connection.connection.info[_LAST_USE_KEY] = used_at


def _bare_ping(dbapi_connection: Any) -> None:
    dbapi_connection.run_async(lambda driver: driver.fetchrow(";"))


def _ping_in_one_round_trip(engine: AsyncEngine) -> None:
    """Pre-ping with one round trip instead of three, and none for a connection that was in use
    half a second ago.

    SQLAlchemy's asyncpg ping wraps ``;`` in ``BEGIN`` … ``ROLLBACK`` (for pgbouncer's
    transaction mode), three round trips on every checkout, i.e. on every local transaction:
    a quarter of a saga's round trips. We send the bare ``;`` through the documented
    ``AdaptedConnection.run_async``; if that fails for any reason the dialect's own ping runs,
    so a dead connection is still reported the way the pool expects (translated, then
    recycled).

    A connection checked in less than :data:`PING_BYPASS_SECONDS` ago is handed out unpinged:
    a busy engine checks connections out hundreds of times a second, and the ping then costs a
    sixth of a saga's round trips while proving only what the last transaction just proved.
    What this gives up: if the server dropped that connection within the window (a restart
    that completed in under half a second, or an administrator's ``pg_terminate_backend``),
    the next transaction on it fails as :class:`~ledger.errors.StoreUnavailable` instead of
    being rerouted by the ping. That transaction had written nothing, it is the same error a
    drop *during* a transaction gives (which no ping can prevent), and the pool discards the
    dead connection — together with every other connection it gave out before — so the one
    after it reconnects."""
    dialect = engine.sync_engine.dialect
    own_ping = dialect.do_ping
    # id(dbapi connection) -> when it was last checked in (the adapted asyncpg connection has
    # __slots__ and no __weakref__, so it cannot carry the stamp itself).
    returned_at: dict[int, float] = {}

    def do_ping(dbapi_connection: Any) -> bool:
        last = returned_at.pop(id(dbapi_connection), None)
        if last is not None and time.monotonic() - last < PING_BYPASS_SECONDS:
            return True
        try:
            _bare_ping(dbapi_connection)
        except Exception:
            return own_ping(dbapi_connection)
        return True

    def on_checkin(dbapi_connection: Any, record: Any) -> None:
        if dbapi_connection is not None:
            used_at = record.info.pop(_LAST_USE_KEY, None) if record is not None else None
            returned_at[id(dbapi_connection)] = time.monotonic() if used_at is None else used_at

    def on_gone(dbapi_connection: Any, *_args: Any) -> None:
        returned_at.pop(id(dbapi_connection), None)

    dialect.do_ping = do_ping  # type: ignore[method-assign]
    event.listen(engine.sync_engine.pool, "checkin", on_checkin)
    for name in ("invalidate", "soft_invalidate", "close", "close_detached"):
        event.listen(engine.sync_engine.pool, name, on_gone)


def _sqlite_engine(url: str, synchronous: str, busy_timeout_ms: int) -> AsyncEngine:
    if synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
        raise ValueError(
            f"sqlite synchronous must be OFF, NORMAL, FULL or EXTRA, not {synchronous!r}"
        )
    database = sqlite_file(url)
    if database is not None:
        # A plain file: statements run on the event loop, only BEGIN/COMMIT on a thread
        # (ledger/sqlite_inline.py says why). Anything else keeps aiosqlite as it comes.
        engine = create_async_engine(
            url,
            json_serializer=plain_json,  # what json.dumps gives, for less CPU (ledger.canonical)
            async_creator=sqlite_inline.connector(
                database, busy_timeout_ms=busy_timeout_ms, synchronous=synchronous
            ),
        )
    else:
        engine = create_async_engine(
            url, json_serializer=plain_json, connect_args={"timeout": busy_timeout_ms / 1000}
        )

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the driver: it would issue a DEFERRED BEGIN lazily,
        # and a deferred reader that later writes can deadlock on SQLite's single writer lock.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        _enable_wal(cursor, busy_timeout_ms)
        # FULL by default: with NORMAL a power loss may undo a commit whose intent a provider
        # already acted on, orphaning the effect. NORMAL is still safe against process crashes.
        cursor.execute(f"PRAGMA synchronous={synchronous.upper()}")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        # The journals of savepoints and statements in memory: SQLite spills them to a file
        # past 64 KiB, and a commit group's members (one SAVEPOINT each) went past it, so a
        # saga wrote ~84 KB to temporary files it then threw away (docs/benchmarks-log.md item 41).
        cursor.execute("PRAGMA temp_store=MEMORY")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Connection) -> None:
        read_only = conn.get_execution_options().get(READ_ONLY_OPTION, False)
        conn.connection.info[_BEGIN_KEY] = "BEGIN DEFERRED" if read_only else "BEGIN IMMEDIATE"

    def do_begin(dbapi_connection: Any) -> None:
        # The dialect's own begin is a no-op for the driver (isolation_level None): SQLite's
        # BEGIN is ours to write. Written here on the driver's cursor rather than by
        # ``exec_driver_sql`` in the event (a whole SQLAlchemy execute per transaction); an
        # error here is wrapped and translated like any statement's (StoreBusy on a lock).
        statement = dbapi_connection.info.pop(_BEGIN_KEY, "BEGIN IMMEDIATE")
        if _begun_by_the_store(dbapi_connection):
            return  # Store._begin_writer wrote it on the driver: this begin is bookkeeping
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(statement)
        finally:
            cursor.close()

    own_commit = engine.sync_engine.dialect.do_commit

    def do_commit(dbapi_connection: Any) -> None:
        if _begun_by_the_store(dbapi_connection, committed=True):
            return  # Store._commit_writer committed it on the driver: nothing left to send
        own_commit(dbapi_connection)

    engine.sync_engine.dialect.do_begin = do_begin  # type: ignore[method-assign]
    engine.sync_engine.dialect.do_commit = do_commit  # type: ignore[method-assign]
    return engine


def _begun_by_the_store(dbapi_connection: Any, *, committed: bool = False) -> bool:
    """Whether the store wrote this transaction's ``BEGIN`` (still open) or ``COMMIT``
    (``committed``: none is open any more) on a :mod:`ledger.sqlite_inline` connection itself,
    so SQLAlchemy's own begin or commit has nothing to send (``Store._begin_writer``)."""
    driver = getattr(dbapi_connection, "driver_connection", None)
    if not isinstance(driver, sqlite_inline.InlineConnection):
        return False
    return driver.in_transaction is not committed


#: Where the begin event leaves the BEGIN statement for ``do_begin`` (the pooled connection's
#: ``info``; the event sees the execution options, ``do_begin`` only the connection).
_BEGIN_KEY = "agent_txn_begin"


def _enable_wal(cursor: Any, busy_timeout_ms: int) -> None:
    """Switch the file to WAL. Changing the journal mode does not wait on the busy handler, so
    processes opening a brand-new file together retry here instead of failing."""
    cursor.execute("PRAGMA journal_mode")
    if str(cursor.fetchone()[0]).lower() == "wal":
        return
    deadline = time.monotonic() + busy_timeout_ms / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def db_now_ms(dialect: Dialect) -> ColumnElement[int]:
    """The database's own clock in epoch milliseconds, evaluated per statement."""
    if dialect == "postgresql":
        # clock_timestamp(), not now(): now() is frozen at transaction start.
        sql = "CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)"
    else:
        sql = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"
    return literal_column(sql, type_=BigInteger())


def translate(exc: BaseException) -> StorageError | None:
    """Map a driver/SQLAlchemy exception to a storage error, or ``None`` if it is not one."""
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, PoolTimeout):
        return StoreBusy("no free database connection")
    if isinstance(exc, IntegrityError):
        code = _pg_code(exc)
        text = str(exc.orig)
        if code == _PG_UNIQUE or "UNIQUE constraint failed" in text:
            return DuplicateKey(_constraint_hint(text))
        return StorageError(f"integrity error: {type(exc.orig).__name__}")
    if isinstance(exc, DBAPIError):
        code = _pg_code(exc)
        text = str(exc.orig).lower()
        if code in _PG_BUSY_CODES or "database is locked" in text or "database is busy" in text:
            return StoreBusy("lock contention")
        if exc.connection_invalidated or isinstance(exc, InterfaceError) or _is_disconnect(exc):
            return StoreUnavailable("database connection lost")
        if _not_a_database(text):
            return StoreUnavailable(_NOT_A_DATABASE)
        if (code or "")[:2] == "22":
            # A data exception: the value has no place in its column (a string wider than a
            # VARCHAR(n), an integer past BIGINT). The statement wrote nothing, and the same
            # value fails again, so it is neither a lost database nor contention; its text
            # (which may quote the value) stays out of the message.
            reason = _PG_DATA_EXCEPTIONS.get(code or "", "data exception")
            return ValueNotStorable(f"database refused a value ({code}: {reason})")
        if (code or "")[:2] == "53":
            # Insufficient resources (disk full, out of memory) during a statement: the
            # statement failed, so the transaction wrote nothing; SQLAlchemy's asyncpg adapter
            # wraps it as its generic Error, not as an OperationalError.
            reason = _PG_SHORTAGES.get(code or "", "insufficient resources")
            return StoreUnavailable(f"database out of resources ({code}: {reason})")
        if isinstance(exc, OperationalError):
            return StoreUnavailable("database operational error")
        return None
    if isinstance(exc, OverflowError) and "sqlite" in str(exc).lower():
        # sqlite3 refuses to bind an integer past 64 bits before SQLite sees it.
        return ValueNotStorable("database refused a value (integer wider than 64 bits)")
    if isinstance(exc, sqlite3.DatabaseError) and _not_a_database(str(exc).lower()):
        return StoreUnavailable(_NOT_A_DATABASE)  # raised by the inline driver, unwrapped
    if isinstance(exc, (ConnectionError, OSError)):
        return StoreUnavailable("database unreachable")
    # asyncpg raises some server errors while connecting without SQLAlchemy wrapping them.
    sqlstate = str(getattr(exc, "sqlstate", "") or "")
    if sqlstate[:2] in _PG_UNREACHABLE_CLASSES or sqlstate.startswith("57P"):
        shortage = _PG_SHORTAGES.get(sqlstate)
        detail = f"{sqlstate}: {shortage}" if shortage else sqlstate
        return StoreUnavailable(f"database refused the connection ({detail})")
    return None


#: What a SQLite URL that names some other file (a typo, a log, a key) is reported as. SQLite
#: opens any file and only finds out at its first read, with an error SQLAlchemy wraps as the
#: generic ``DatabaseError``; ``database disk image is malformed`` is a damaged one.
_NOT_A_DATABASE = "not a SQLite database file, or a damaged one"


def _not_a_database(text: str) -> bool:
    return "file is not a database" in text or "database disk image is malformed" in text


def _pg_code(exc: DBAPIError) -> str | None:
    orig = exc.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return str(code) if code else None


def _is_disconnect(exc: DBAPIError) -> bool:
    text = str(exc.orig).lower()
    needles = ("connection is closed", "connection was closed", "terminating connection")
    return any(n in text for n in needles) or (_pg_code(exc) or "").startswith("08")


def _constraint_hint(text: str) -> str:
    # Keep only the constraint/column name: never echo values from the row.
    if "UNIQUE constraint failed:" in text:
        return text.split("UNIQUE constraint failed:", 1)[1].strip().split()[0]
    if 'constraint "' in text:
        return text.split('constraint "', 1)[1].split('"', 1)[0]
    return "key"


def insert_ignore(dialect: Dialect, table: Table, values: dict[str, Any]) -> Insert:
    """``INSERT … ON CONFLICT DO NOTHING`` for content-addressed rows written by many writers."""
    stmt: Insert = upsert_insert(dialect, table).values(values).on_conflict_do_nothing()
    return stmt


def insert_ignore_statement(dialect: Dialect, table: Table) -> Insert:
    """:func:`insert_ignore` whose values come with each execution's parameters (no implicit
    ``RETURNING``, so it can ride in a batch: :mod:`ledger.batched`)."""
    stmt: Insert = upsert_insert(dialect, table).on_conflict_do_nothing().inline()
    return stmt


def upsert_insert(dialect: Dialect, table: Table) -> Any:
    """The dialect's ``INSERT`` construct, for ``… ON CONFLICT DO UPDATE`` upserts (both
    backends spell it the same way: ``.on_conflict_do_update(index_elements=…, set_=…)``)."""
    return postgresql_insert(table) if dialect == "postgresql" else sqlite_insert(table)


def skip_locked(stmt: Select[Any], dialect: Dialect) -> Select[Any]:
    """Let concurrent claimers pass over rows another worker is claiming (PostgreSQL).

    SQLite has a single writer: the write transaction itself serialises claimers.
    """
    if dialect == "postgresql":
        return stmt.with_for_update(skip_locked=True)
    return stmt
