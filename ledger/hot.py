"""Hot-path DML run straight on the driver connection, compiled by SQLAlchemy once.

Why: SQLAlchemy's Core execute path (cache-key lookup, execution context, parameter processing,
result set-up, events, the greenlet hop into the async adapter) costs about 25 µs of client CPU
per statement on SQLite and 35 µs on top of asyncpg's own work on PostgreSQL here, while the
statement itself (an ``UPDATE`` by primary key, or a row appended, on a SQLite file whose write
lock is held) costs 1 to 5 µs. A saga runs about a dozen such statements, so that layer was a
third of the engine's CPU per saga on SQLite (``docs/benchmarks-log.md``).

What stays exactly as through SQLAlchemy: the SQL text, the positional parameter order, the bind
processors of every typed column (JSON) and the constants bound inside the statement all come
from SQLAlchemy's own compilation of the same statement object, done once per statement and
parameter key set. A driver error is handed to SQLAlchemy's own error handler
(``Connection._handle_dbapi_exception``), so it is wrapped in the same exception classes (what
:func:`ledger.dialects.translate` reads) and a lost connection is invalidated as it would be.
The store's statement counter still counts each statement.

What is eligible (anything else goes through SQLAlchemy unchanged, decided once per compiled
form): a DML statement with no ``RETURNING``, no Python-side column defaults to pre-execute, and
no expanding (``IN``) or post-compile parameters, i.e. exactly the statements whose execution
SQLAlchemy does nothing with but pass the parameters and read the row count. Only two drivers
take this path: :mod:`ledger.sqlite_inline` connections, whose statements already run on the
event loop (the driver call is a plain function call), and asyncpg, through the connection
SQLAlchemy's adapter wraps (beginning the transaction the way the adapter does, lazily, before
the first statement). aiosqlite connections (in-memory and query-string URLs) keep SQLAlchemy's
path. The adapter attributes used (``_started``, ``_start_transaction``, ``_handle_exception``)
are private to SQLAlchemy 2.0's asyncpg dialect: ``pyproject.toml`` holds SQLAlchemy below 2.1,
and ``tests/integration/test_hot_path.py`` exercises every one of them on both backends.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import asyncpg
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import Executable
from sqlalchemy.sql.compiler import SQLCompiler

from ledger import batched
from ledger.errors import StoreUnavailable
from ledger.grouped import GroupSender
from ledger.sqlite_inline import InlineConnection
from ledger.sqlite_writer_child import split_rows


@dataclass(frozen=True, slots=True)
class Compiled:
    """One statement's SQL and how to turn a parameter mapping into its positional arguments."""

    sql: str
    compiled: SQLCompiler
    names: tuple[str, ...]
    processors: tuple[Callable[[Any], Any] | None, ...]
    #: The positional arguments of a parameter mapping, as one generated function (the slots
    #: :func:`_slots` resolved, through :func:`_builder`). ``None`` when a bound value is
    #: computed per execution (``bindparam(callable_=…)``): then SQLAlchemy builds them.
    build: Callable[[Mapping[str, Any]], tuple[Any, ...]] | None
    #: Whether it can be one CTE of a combined statement (:func:`ledger.batched.composable`):
    #: asked of every held-back write, a dozen a saga, so answered once here.
    composable: bool

    def arguments(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        if self.build is not None:
            return self.build(params)
        values = self.compiled.construct_params(params, _check=False)
        return tuple(
            values[name] if proc is None else proc(values[name])
            for name, proc in zip(self.names, self.processors, strict=True)
        )


def _builder(
    slots: tuple[tuple[str | None, Callable[[Any], Any] | None, Any], ...],
) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    """A function that turns a parameter mapping into the positional arguments ``slots``
    describe, written out as one tuple display.

    Why: a saga binds about twenty rows (ledger rows of 9 columns, effect rows of up to 25),
    and walking the slots in a Python loop per row (unpack, test, append, then ``tuple()``)
    cost 1.1 % of its client instructions on SQLite (``docs/benchmarks-log.md``, item 38). The
    generated expression does per position only what that position needs: a subscript, a
    processor call, or a constant. Keys are embedded with ``repr`` (a Python string literal,
    whatever the bind's name); processors and constants are passed in by name, never as
    text."""
    scope: dict[str, Any] = {}
    items = []
    for i, (key, proc, constant) in enumerate(slots):
        if key is None:
            scope[f"c{i}"] = constant
            items.append(f"c{i}")
        elif proc is None:
            items.append(f"p[{key!r}]")
        else:
            scope[f"f{i}"] = proc
            items.append(f"f{i}(p[{key!r}])")
    body = ", ".join(items) + ("," if len(items) == 1 else "")
    exec(f"def build(p):\n    return ({body})", scope)
    build: Callable[[Mapping[str, Any]], tuple[Any, ...]] = scope["build"]
    return build


def _slots(
    compiled: SQLCompiler,
    names: tuple[str, ...],
    processors: tuple[Callable[[Any], Any] | None, ...],
    keys: tuple[str, ...],
) -> tuple[tuple[str | None, Callable[[Any], Any] | None, Any], ...] | None:
    """Where each position's value comes from, resolved as :meth:`SQLCompiler.construct_params`
    resolves it for a parameter mapping with exactly ``keys``: the bind's key, else its name,
    else the value bound in the statement."""
    escaped = compiled.escaped_bind_names
    by_name = {escaped.get(name, name): (bind, name) for bind, name in compiled.bind_names.items()}
    given = set(keys)
    slots: list[tuple[str | None, Callable[[Any], Any] | None, Any]] = []
    for position, proc in zip(names, processors, strict=True):
        bind, name = by_name[position]
        if bind.key in given:
            slots.append((bind.key, proc, None))
        elif name in given:
            slots.append((name, proc, None))
        elif bind.callable is not None:
            return None
        else:
            slots.append((None, None, bind.value if proc is None else proc(bind.value)))
    return tuple(slots)


def _compile(stmt: Executable, dialect: Dialect, keys: tuple[str, ...]) -> Compiled | None:
    compiled = stmt.compile(dialect=dialect, column_keys=list(keys))  # type: ignore[attr-defined]
    assert isinstance(compiled, SQLCompiler)
    eligible = (compiled.isinsert or compiled.isupdate or compiled.isdelete) and not (
        compiled.effective_returning
        or compiled.insert_prefetch
        or compiled.update_prefetch
        or compiled.literal_execute_params
        or compiled.post_compile_params
        or any(b.expanding for b in compiled.binds.values())
        or compiled.positiontup is None
    )
    if not eligible:
        return None
    names = tuple(compiled.positiontup or ())
    processors = cast(Mapping[str, Callable[[Any], Any]], compiled._bind_processors)
    procs = tuple(processors.get(n) for n in names)
    slots = _slots(compiled, names, procs, keys)
    build = None if slots is None else _builder(slots)
    sql = compiled.string
    return Compiled(sql, compiled, names, procs, build, batched.composable(sql))


class HotPath:
    """The per-store cache of compiled hot statements, and their execution."""

    def __init__(
        self,
        dialect: Dialect,
        count: Callable[[], None],
        grouped: Callable[[int], None] = lambda _n: None,
        population: Callable[[], int] | None = None,
    ) -> None:
        self._dialect = dialect
        self._count = count
        self._composer = batched.Composer()
        #: PostgreSQL: blind transactions of one shape in flight together share a commit.
        self._groups = GroupSender(grouped, population, self._composer.batch)
        # (id of the statement object, parameter keys) -> compiled form, or None if ineligible.
        # The statement objects are the store's cached ones, alive as long as the store; the
        # entry holds the statement too, so an id is never reused while it is here.
        self._compiled: dict[tuple[int, tuple[str, ...]], tuple[Executable, Compiled | None]] = {}

    def _lookup(self, stmt: Executable, keys: tuple[str, ...]) -> Compiled | None:
        entry = self._compiled.get((id(stmt), keys))
        if entry is None:
            entry = self._compiled[(id(stmt), keys)] = (stmt, _compile(stmt, self._dialect, keys))
        return entry[1]

    def _target(
        self, conn: AsyncConnection, stmt: Executable, keys: tuple[str, ...]
    ) -> tuple[Any, Any, Compiled | None]:
        """The pooled connection under ``conn``, the driver's connection under that, and
        ``stmt``'s compiled form, or ``None`` when the statement or the driver does not take
        the hot path."""
        fairy, driver = _connections(conn)
        if not isinstance(driver, (InlineConnection, asyncpg.Connection)):
            return fairy, driver, None
        return fairy, driver, self._lookup(stmt, keys)

    def batchable(
        self, conn: AsyncConnection, stmt: Executable, keys: tuple[str, ...]
    ) -> Compiled | None:
        """The compiled form of ``stmt`` if it can be held back until the transaction's writes
        are sent (:mod:`ledger.batched`): on asyncpg, one it can compose into the combined
        statement; on a :mod:`ledger.sqlite_inline` connection, any hot statement (they run
        one by one when sent, so that a commit group's member hands over its writes as a
        list: :mod:`ledger.sqlite_writer`)."""
        _fairy, driver, compiled = self._target(conn, stmt, keys)
        if compiled is None:
            return None
        if isinstance(driver, InlineConnection):
            return compiled
        return compiled if compiled.composable else None

    async def send(
        self, conn: AsyncConnection, writes: Sequence[batched.PendingWrite], *, final: bool
    ) -> None:
        """Send held-back writes as one statement. ``final``: nothing follows it in this
        transaction, so if nothing began it yet it runs in an implicit transaction of its own
        (one round trip, no ``BEGIN``/``COMMIT``); otherwise the transaction is begun first, so
        that a later failure still undoes these writes."""
        fairy, driver = _connections(conn)
        if isinstance(driver, InlineConnection):
            await self._run_inline(conn, driver, writes)
            return
        sql, args = self._composer.statement(writes)
        self._count()
        try:
            if not final:
                await _begun(fairy)
            elif not fairy.dbapi_connection._started and await self._groups.send(driver, sql, args):
                return  # nothing began it: sent in an implicit transaction, alone or grouped
            await driver.execute(sql, *args)
        except StoreUnavailable:
            raise  # a group's outcome is unknown: this connection itself is sound
        except Exception as exc:
            lost = batched.lease_lost_in(exc, writes)
            if lost is not None:
                raise lost from None
            await _raise_as_sqlalchemy(conn, exc, sql, args)

    async def _run_inline(
        self,
        conn: AsyncConnection,
        driver: InlineConnection,
        writes: Sequence[batched.PendingWrite],
    ) -> None:
        """SQLite: run held-back writes one by one, in the order written (nothing to compose:
        a statement here is a function call). A fenced write that changed no row raises its
        :class:`LeaseLost`; the transaction's block then fails before its commit, as on
        PostgreSQL."""
        cursor = driver.statements
        for write in writes:
            self._count()
            sql = write.compiled.sql
            try:
                if write.rows == 1:
                    changed = cursor.execute(sql, write.args).rowcount
                else:
                    cursor.executemany(sql, split_rows(write.args, write.rows))
                    continue
            except Exception as exc:
                await _raise_as_sqlalchemy(conn, exc, sql, write.args)
            if write.lost is not None and changed != 1:
                raise write.lost

    async def execute(
        self, conn: AsyncConnection, stmt: Executable, params: Mapping[str, Any]
    ) -> int:
        """Run ``stmt`` once; the number of rows it changed."""
        fairy, driver, compiled = self._target(conn, stmt, tuple(params))
        if compiled is None:
            return (await conn.execute(stmt, dict(params))).rowcount
        args = compiled.arguments(params)
        self._count()
        try:
            if isinstance(driver, InlineConnection):
                return driver.statements.execute(compiled.sql, args).rowcount
            await _begun(fairy)
            return _rowcount(await driver.execute(compiled.sql, *args))
        except Exception as exc:
            await _raise_as_sqlalchemy(conn, exc, compiled.sql, args)

    async def execute_many(
        self, conn: AsyncConnection, stmt: Executable, rows: Sequence[Mapping[str, Any]]
    ) -> None:
        """Run ``stmt`` for each of ``rows`` (which share one key set), as one driver call."""
        if not rows:
            return
        fairy, driver, compiled = self._target(conn, stmt, tuple(rows[0]))
        if compiled is None:
            await conn.execute(stmt, [dict(r) for r in rows])
            return
        args = [compiled.arguments(r) for r in rows]
        self._count()
        try:
            if isinstance(driver, InlineConnection):
                driver.statements.executemany(compiled.sql, args)
                return
            await _begun(fairy)
            await driver.executemany(compiled.sql, args)
        except Exception as exc:
            await _raise_as_sqlalchemy(conn, exc, compiled.sql, args)

    async def begin_write(self, conn: AsyncConnection) -> bool:
        """``BEGIN IMMEDIATE`` written on a :mod:`ledger.sqlite_inline` connection itself
        (``False``: another driver, nothing done)."""
        return await self._control(conn, "BEGIN IMMEDIATE")

    async def commit_write(self, conn: AsyncConnection) -> bool:
        """``COMMIT`` on a :mod:`ledger.sqlite_inline` connection itself (``False``: another
        driver, nothing done)."""
        return await self._control(conn, "COMMIT")

    async def _control(self, conn: AsyncConnection, sql: str) -> bool:
        _fairy, driver = _connections(conn)
        if not isinstance(driver, InlineConnection):
            return False
        try:
            await (driver.commit() if sql == "COMMIT" else driver.begin_immediate())
        except Exception as exc:
            await _raise_as_sqlalchemy(conn, exc, sql, ())
        return True

    async def driver_sql(self, conn: AsyncConnection, sql: str) -> None:
        """A parameterless statement the store writes itself (SQLite savepoints)."""
        _fairy, driver = _connections(conn)
        if not isinstance(driver, InlineConnection):
            await conn.exec_driver_sql(sql)
            return
        self._count()
        try:
            driver.statements.execute(sql)
        except Exception as exc:
            await _raise_as_sqlalchemy(conn, exc, sql, ())


def _connections(conn: AsyncConnection) -> tuple[Any, Any]:
    """The pooled connection (SQLAlchemy's fairy) under ``conn`` and the driver's own
    connection under it (``None`` once the pool has let go of it: an invalidated connection).

    Why not ``fairy.driver_connection``: that walks two properties (the fairy's record, then
    the record's adapter) to the adapter the fairy holds as a plain attribute, and the hot path
    looks the driver up about twenty times a saga."""
    fairy: Any = conn.sync_connection.connection  # type: ignore[union-attr]
    return fairy, getattr(fairy.dbapi_connection, "driver_connection", None)


async def _begun(fairy: Any) -> None:
    # SQLAlchemy's asyncpg adapter sends BEGIN lazily, before its first statement; a statement
    # sent past it must do the same, or it would run outside the transaction.
    adapted = fairy.dbapi_connection
    if not adapted._started:
        await adapted._start_transaction()


def _rowcount(status: str) -> int:
    # asyncpg answers with the command tag: "UPDATE 1", "DELETE 0", "INSERT 0 1".
    tail = status.rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else -1


async def _raise_as_sqlalchemy(
    conn: AsyncConnection, exc: Exception, sql: str, args: Any
) -> NoReturn:
    """Hand a driver error to SQLAlchemy's own handler, as if it had run the statement: the
    error is wrapped in its exception classes (what :func:`ledger.dialects.translate` reads),
    and a lost connection is invalidated — the pool's other connections with it."""
    adapted: Any = conn.sync_connection.connection.dbapi_connection  # type: ignore[union-attr]
    error: BaseException = exc
    if hasattr(adapted, "_handle_exception") and not isinstance(exc, sqlite3.Error):
        try:
            adapted._handle_exception(exc)  # asyncpg's classes -> the adapter's DBAPI classes
        except Exception as translated:
            error = translated

    def handle(sync_conn: Any) -> None:
        sync_conn._handle_dbapi_exception(error, sql, args, None, None)

    await conn.run_sync(handle)
    raise error  # not reached: SQLAlchemy's handler always raises
