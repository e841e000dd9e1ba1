"""The durable store: engine, local transactions ("work"), the database clock and cost counters.

The caller owns the transaction. Repositories take the :class:`Work` of one local transaction, so
a state change, its ledger row and any outbox rows commit together::

    async with store.transaction() as work:
        await effects.record(work, chain, claim, EffectState.CONFIRMED, remote_id=rid)
        # the ledger row for that change is written by effects.record into the same commit

Ledger rows are buffered in the :class:`Work` and written as one multi-row INSERT just before the
commit (fewer statements per transition); the in-memory head of each hash chain advances only
after the commit succeeded, so a rolled-back transaction never leaves a dangling head.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import os
import sqlite3
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast, get_args

import structlog
from sqlalchemy import event, insert, literal, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql import Executable
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.util import await_only

from ledger import dialects
from ledger.batched import PendingWrite
from ledger.canonical import canonical_json, sha256_hex
from ledger.errors import DuplicateKey, LeaseLost, StoreUnavailable
from ledger.hot import Compiled, HotPath
from ledger.riders import Rider, Riders
from ledger.schema import ledger as ledger_table
from ledger.sqlite_inline import others_ready
from ledger.sqlite_writer import Answer, WriterProcess, error_of

log = structlog.get_logger(__name__)

GENESIS_HASH = "0" * 64
#: Where a transaction's Work is found from its connection (``Connection.info``).
_WORK_KEY = "agent_txn_work"

S = TypeVar("S", bound=Executable)

#: Where a SQLite store commits groups of its transactions: ``inline`` on the event loop, or
#: ``process`` in a writer process of its own (:mod:`ledger.sqlite_writer`).
SqliteWriter = Literal["inline", "process"]
#: Its values, for the commands that take one as text.
SQLITE_WRITERS: tuple[SqliteWriter, ...] = get_args(SqliteWriter)
#: What :meth:`Store.open` uses when not told (the test suite runs once with each). ``process``
#: since 2026-12-05: with sagas in flight together it gave +11 to +43 % sagas/s on every machine
#: measured, for the same CPU per saga (``docs/benchmarks.md``), and the whole SQLite suite
#: passes in both modes. A sequential caller never starts the child (a transaction alone
#: commits here), a URL that is not a plain file or a host that is not POSIX commits inline,
#: and a child that cannot run makes the store commit inline with a warning, so the default
#: costs nothing where it cannot help.
DEFAULT_SQLITE_WRITER: SqliteWriter = "process"

#: Set while the current task is inside one of the store's write transactions: a read there must
#: not wait for riders (landing them takes the write lock this task may hold).
_WRITING: contextvars.ContextVar[bool] = contextvars.ContextVar("agent_txn_writing", default=False)


def _is_ledger_chain(constraint: str) -> bool:
    # PostgreSQL names the constraint; SQLite names its first column ("ledger.tx_id,").
    return constraint == "uq_ledger_tx_id_prev_hash" or constraint.startswith("ledger.")


@dataclass
class StoreStats:
    """Counted, not estimated: physical commits and SQL statements since the store opened (a
    commit shared by a group of local transactions counts once)."""

    commits: int = 0
    statements: int = 0
    rollbacks: int = 0
    #: CPU seconds of the SQLite writer process (:mod:`ledger.sqlite_writer`): the engine's
    #: work, done outside this process.
    writer_cpu_s: float = 0.0

    def snapshot(self) -> StoreStats:
        """A copy, to subtract later."""
        return StoreStats(self.commits, self.statements, self.rollbacks, self.writer_cpu_s)


@dataclass
class Chain:
    """The hash chain of one transaction's ledger, as far as this process has seen it."""

    tx_id: str
    head: str = GENESIS_HASH


def _ledger_insert(_now: ColumnElement[int]) -> Executable:
    # inline(): no implicit RETURNING of the generated ``seq`` (nothing reads it back), which
    # keeps the statement on the hot path (ledger/hot.py) on PostgreSQL too.
    return insert(ledger_table).inline()


def ledger_hash(
    prev_hash: str,
    tx_id: str,
    subject: str | None,
    action: str,
    from_state: str | None,
    to_state: str | None,
    detail: str,
    created_at: int,
) -> str:
    """The chain link: SHA-256 over the previous hash and this row's content."""
    body = [prev_hash, tx_id, subject, action, from_state, to_state, detail, created_at]
    return sha256_hex(canonical_json(body))


@dataclass
class Work:
    """One local database transaction plus the ledger rows it will append."""

    conn: AsyncConnection
    store: Store
    now_ms: int
    #: Ledger rows about to be written, as the insert's parameters (the hash covers every
    #: column but ``seq``).
    _rows: list[dict[str, Any]] = field(default_factory=list)
    _heads: dict[str, tuple[Chain, str]] = field(default_factory=dict)
    #: Blind writes held back until they are sent together (ledger/batched.py).
    _pending: list[PendingWrite] = field(default_factory=list)
    _pending_rows: set[Hashable] = field(default_factory=set)
    #: Riders this transaction took on (:mod:`ledger.riders`), written by :meth:`flush`.
    _riders: list[Rider] | None = None
    #: SQLite with the writer process: nothing has begun a physical transaction for this one
    #: yet. Its blind writes may still be shipped to the writer with a commit group's; anything
    #: else (a read, a ``RETURNING``, a row count) begins it here first (:meth:`Store._begin`).
    _deferred: bool = False

    @property
    def db_now(self) -> ColumnElement[int]:
        """The database clock expression (plus the test offset) for lease arithmetic."""
        return self.store.db_now()

    def statement(self, key: Hashable, build: Callable[[ColumnElement[int]], S]) -> S:
        """The store's cached statement for ``key`` (see :meth:`Store.statement`)."""
        return self.store.statement(key, build)

    async def execute(self, stmt: Executable, params: Mapping[str, Any]) -> int:
        """Run a DML statement without ``RETURNING`` (a cached one: :meth:`statement`) now; the
        number of rows it changed. It skips SQLAlchemy's execute path (:mod:`ledger.hot`)."""
        await self.send_writes()
        return await self.store.hot.execute(self.conn, stmt, params)

    async def execute_many(self, stmt: Executable, rows: Sequence[Mapping[str, Any]]) -> None:
        """Run a DML statement once per row of ``rows`` (one key set), as one driver call."""
        await self.send_writes()
        await self.store.hot.execute_many(self.conn, stmt, rows)

    async def write(
        self,
        stmt: Executable,
        params: Mapping[str, Any],
        *,
        lost: LeaseLost | None = None,
        row: Hashable | None = None,
    ) -> None:
        """A blind write: its outcome is success, a storage error, or — with ``lost`` — ``lost``
        raised because it changed no row (a fenced update whose lease is gone). ``row`` names
        the row it writes, e.g. ``("transactions", tx_id)``.

        On PostgreSQL it may be held back and sent with the transaction's other writes and
        ledger rows as one statement (:mod:`ledger.batched`): before the next statement on the
        connection, or when the block ends. Its error is then raised there, still before the
        commit. A caller that must catch it inside the block calls :meth:`send_writes`."""
        compiled = self._batchable(stmt, tuple(params))
        if compiled is None:
            changed = await self.execute(stmt, params)
            if lost is not None and changed != 1:
                raise lost
            return
        if row is not None and row in self._pending_rows:
            await self.send_writes()  # one snapshot for all CTEs: the second must see the first
        self._pending.append(PendingWrite(compiled, compiled.arguments(params), lost, row))
        if row is not None:
            self._pending_rows.add(row)

    async def write_many(
        self, stmt: Executable, rows: Sequence[Mapping[str, Any]], ids: Sequence[Hashable]
    ) -> None:
        """Blind inserts of ``rows`` (one key set; ``ids`` name the rows, as in :meth:`write`):
        one driver call on SQLite, held back with the transaction's other writes on
        PostgreSQL."""
        if not rows:
            return
        compiled = self._batchable(stmt, tuple(rows[0]))
        if compiled is None:
            await self.execute_many(stmt, rows)
            return
        if any(i in self._pending_rows for i in ids):
            await self.send_writes()
        for values, row in zip(rows, ids, strict=True):
            self._pending.append(PendingWrite(compiled, compiled.arguments(values), None, row))
            self._pending_rows.add(row)

    def _batchable(self, stmt: Executable, keys: tuple[str, ...]) -> Compiled | None:
        if self.store._write_lock is not None and not self._deferred:
            # SQLite, in a physical transaction already: the write runs at once. Holding it
            # back only serves a transaction that may still be shipped to the writer process
            # (:meth:`Store._shipped`); elsewhere it cost 4 to 5 % of a saga's instructions
            # (PendingWrite records, the send loop) for nothing.
            return None
        return self.store.hot.batchable(self.conn, stmt, keys)

    async def send_writes(self, *, final: bool = False) -> None:
        """Send the held-back writes now."""
        if self._deferred:
            await self.store._begin(self)
        if not self._pending:
            return
        writes, self._pending = self._pending, []
        self._pending_rows.clear()
        await self.store.hot.send(self.conn, writes, final=final)

    def log(
        self,
        chain: Chain,
        *,
        action: str,
        subject: str | None = None,
        from_state: str | None = None,
        to_state: str | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> None:
        """Append a ledger row to this transaction's chain (written at commit)."""
        row = self._link(chain, action, subject, from_state, to_state, detail)
        self._rows.append(row)
        self._heads[chain.tx_id] = (chain, row["hash"])

    async def log_unless_taken(self, chain: Chain, link: Mapping[str, Any]) -> None:
        """Append a ledger row to ``chain`` unless another holder appended to it first (it
        holds the transaction's effect now), without failing this transaction either way: for
        a write that must not fail its host (:mod:`ledger.riders`). Sent like :meth:`write`;
        ``chain``'s head in memory is left alone (a rider's chain has no further use here).
        ``link``: :meth:`log`'s keyword arguments."""
        row = self._link(chain, **link)
        dialect = self.store.dialect
        stmt = self.statement(
            "ledger.insert_unless_taken",
            lambda _now: dialects.insert_ignore_statement(dialect, ledger_table),
        )
        await self.write(stmt, row)

    def _link(
        self,
        chain: Chain,
        action: str,
        subject: str | None,
        from_state: str | None,
        to_state: str | None,
        detail: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        prev = self._heads[chain.tx_id][1] if chain.tx_id in self._heads else chain.head
        text = canonical_json(dict(detail)) if detail else "{}"
        digest = ledger_hash(
            prev, chain.tx_id, subject, action, from_state, to_state, text, self.now_ms
        )
        return {
            "tx_id": chain.tx_id,
            "subject": subject,
            "action": action,
            "from_state": from_state,
            "to_state": to_state,
            "detail": text,
            "created_at": self.now_ms,
            "prev_hash": prev,
            "hash": digest,
        }

    async def flush(self, *, send: bool = True) -> None:
        """Write the buffered ledger rows (and, on PostgreSQL, the held-back writes with them)
        in one statement, just before the commit. Riders waiting on the store board here.
        ``send=False``: only queue them with the held-back writes (the SQLite writer process
        takes them from there)."""
        riders = self.store.riders
        if riders.queued:
            boarded = self._riders = riders.board()
            for rider in boarded:
                await rider.write(self)
        rows, self._rows = self._rows, []
        insert_row = self.statement("ledger.insert", _ledger_insert)
        if rows:
            compiled = self._batchable(insert_row, tuple(rows[0]))
            if compiled is not None:
                args = tuple(itertools.chain.from_iterable(map(compiled.arguments, rows)))
                self._pending.append(PendingWrite(compiled, args, None, None, rows=len(rows)))
                rows = []
        if rows:
            await self.execute_many(insert_row, rows)
        if send:
            await self.send_writes(final=True)

    def _advance_chains(self) -> None:
        for chain, head in self._heads.values():
            chain.head = head
        self._heads.clear()


@dataclass(eq=False)
class Shipment:
    """The writers of this process whose writes go to the SQLite writer process as one group
    (:meth:`Store._shipped`): built while it is open, then shipped."""

    done: asyncio.Future[Answer]
    #: Each member transaction's writes, in the order they joined.
    writes: list[list[PendingWrite]] = field(default_factory=list)


@dataclass(eq=False)
class CommitGroup:
    """The writers of this process sharing one physical SQLite transaction (see
    :meth:`Store.transaction`)."""

    conn: AsyncConnection
    done: asyncio.Future[None]
    members: int = 0
    poisoned: bool = False
    committer: asyncio.Future[None] | None = None


def _translation(exc: Exception) -> Exception | None:
    """The :mod:`ledger.errors` exception a driver exception stands for (``None``: raise it as
    it is)."""
    translated = dialects.translate(exc)
    if isinstance(translated, DuplicateKey) and _is_ledger_chain(translated.what):
        # Our in-memory chain head is stale: another holder appended to this
        # transaction's ledger since we last saw it, i.e. it holds the transaction now.
        return LeaseLost("ledger chain (another holder wrote this transaction)", 0)
    if translated is not None and translated is not exc:
        return translated
    return None


class _Translated:
    """:meth:`Store.transaction`'s block: the store's transaction (``inner``), counted in
    :attr:`Store.open_writes` while it is open, with storage errors translated on the way out.

    Why a class and not a generator: ``@asynccontextmanager`` runs a generator per block,
    and this wrapper around the generator that does the work made it two per local
    transaction, about four a saga; a class's ``__aenter__``/``__aexit__`` are two plain
    calls."""

    __slots__ = ("_inner", "_store", "_token", "_work")

    _work: Work  # set by __aenter__; __aexit__ only runs after it succeeded

    def __init__(self, store: Store, inner: contextlib.AbstractAsyncContextManager[Work]) -> None:
        self._store = store
        self._inner = inner

    async def __aenter__(self) -> Work:
        self._store._open_writes += 1
        self._token = _WRITING.set(True)
        try:
            work = self._work = await self._inner.__aenter__()
        except BaseException as exc:
            self._store._open_writes -= 1
            _WRITING.reset(self._token)
            _raise_translated(exc)
            raise
        return work

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> bool:
        try:
            suppressed = await self._inner.__aexit__(kind, exc, tb)
        except BaseException as raised:
            self._hand_on_riders(raised)
            _raise_translated(raised)
            raise
        finally:
            self._store._open_writes -= 1
            _WRITING.reset(self._token)
        if exc is not None and not suppressed:
            _raise_translated(exc)
        riders = self._work._riders
        if riders:
            self._store.riders.landed(riders)
        return bool(suppressed)

    def _hand_on_riders(self, exc: BaseException) -> None:
        riders = self._work._riders
        if riders:
            self._store.riders.failed(riders, exc)


def _as_statement_error(sql: str, described: Any) -> Exception:
    error = DBAPIError.instance(sql, None, error_of(described), sqlite3.Error, hide_parameters=True)
    return cast(Exception, error)


def _raise_translated(exc: BaseException) -> None:
    """Raise the :mod:`ledger.errors` exception ``exc`` stands for, if it stands for one."""
    if isinstance(exc, Exception):
        translated = _translation(exc)
        if translated is not None:
            raise translated from exc


@contextlib.contextmanager
def _seen_by_statements(conn: AsyncConnection, work: Work) -> Iterator[None]:
    """While the block runs, a statement through SQLAlchemy on ``conn`` sends ``work``'s
    held-back writes first (the ``before_execute`` hook of :meth:`Store._install_counters`)."""
    sync = conn.sync_connection
    assert sync is not None
    info = sync.info
    info[_WORK_KEY] = work
    try:
        yield
    finally:
        info.pop(_WORK_KEY, None)


async def _quietly(step: Awaitable[Any]) -> None:
    # Clean-up after a failure must not hide the failure itself.
    with contextlib.suppress(Exception):
        await step


class Store:
    """agent-txn's own database on SQLite or PostgreSQL."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        url: str,
        clock: Callable[[], float] = time.time,
        commit_cohorts: bool = True,
        writer_process: WriterProcess | None = None,
    ) -> None:
        self.engine = engine
        self.url = url
        self.dialect: dialects.Dialect = dialects.dialect_of(url)
        self.stats = StoreStats()
        self._clock = clock
        self._clock_offset_ms = 0
        # SQLite has one writer: queueing our own writers here is cheaper than letting them spin
        # in the driver's busy handler. Other processes still meet busy_timeout.
        self._write_lock = asyncio.Lock() if self.dialect == "sqlite" else None
        #: Writers waiting for ``_write_lock``: they would join the next commit group.
        self._queued_writers = 0
        self._statements: dict[tuple[Hashable, int], Executable] = {}
        self._group: CommitGroup | None = None
        # SQLite: the writer connection, kept between commit groups. Checking a connection out
        # of the pool and back in (with its reset) for every local transaction cost more client
        # CPU than the transaction's SQL (the bench's profile); SQLite has one writer anyway.
        self._writer: AsyncConnection | None = None
        # PostgreSQL: connections committed on moments ago, most recent last (_take_idle).
        self._idle: list[tuple[AsyncConnection, float]] = []
        #: Write transactions open now (:attr:`open_writes`).
        self._open_writes = 0
        #: Records riding on the next transaction (:mod:`ledger.riders`).
        self.riders = Riders(self._flush_riders)
        self.hot = HotPath(
            engine.sync_engine.dialect,
            self._count_statement,
            self._count_grouped,
            # PostgreSQL: grouped commits leave in two cohorts (ledger/grouped.py), or in one.
            population=(lambda: self._open_writes) if commit_cohorts else None,
        )
        #: SQLite: the process that commits groups of this store's transactions
        #: (:mod:`ledger.sqlite_writer`; ``None``: they commit on the event loop).
        self.writer_process = writer_process
        #: The group being built for the writer process (:meth:`_shipped`).
        self._building: Shipment | None = None
        self._install_counters()

    def _count_statement(self) -> None:
        self.stats.statements += 1

    def _count_grouped(self, members: int) -> None:
        # ``commits`` counts physical commits, as SQLite's commit groups do: a transaction whose
        # statement rode in another's batch (ledger/grouped.py) still sees SQLAlchemy's commit
        # event, which sends nothing, so the batch takes those back here.
        self.stats.commits -= members

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        auto_upgrade: Literal["empty", "always", "never"] = "empty",
        clock: Callable[[], float] = time.time,
        sqlite_synchronous: str = "FULL",
        pg_pool_size: int = dialects.PG_POOL_SIZE,
        commit_cohorts: bool = True,
        sqlite_writer: SqliteWriter | None = None,
    ) -> Store:
        """Connect, check (or create) the schema, and return a ready store.
        ``commit_cohorts``: see :attr:`orchestrator.config.EngineSettings.pg_commit_cohorts`;
        ``sqlite_writer``: :attr:`orchestrator.config.EngineSettings.sqlite_writer` (``None``:
        :data:`DEFAULT_SQLITE_WRITER`)."""
        from ledger import migrate  # local: migrations import the schema, not the store

        url = dialects.normalize_url(url)
        engine = dialects.create_engine(
            url, sqlite_synchronous=sqlite_synchronous, pg_pool_size=pg_pool_size
        )
        try:
            await migrate.ensure_schema(engine, auto_upgrade=auto_upgrade)
        except BaseException as exc:
            await engine.dispose()
            translated = dialects.translate(exc)
            if translated is not None and translated is not exc:
                raise translated from exc
            raise
        writer = None
        path = dialects.sqlite_file(url)
        # A plain file only (its statements run on the loop: ledger/sqlite_inline.py), and POSIX
        # only (the loop watches the writer's pipes, which Windows' event loop cannot).
        wanted = (sqlite_writer or DEFAULT_SQLITE_WRITER) == "process"
        if wanted and path is not None and os.name == "posix":
            writer = WriterProcess(
                path,
                synchronous=sqlite_synchronous,
                busy_timeout_ms=dialects.SQLITE_BUSY_TIMEOUT_MS,
            )
        return cls(
            engine, url=url, clock=clock, commit_cohorts=commit_cohorts, writer_process=writer
        )

    def _install_counters(self) -> None:
        sync_engine = self.engine.sync_engine

        def on_commit(_conn: Any) -> None:
            self.stats.commits += 1

        def on_rollback(_conn: Any) -> None:
            self.stats.rollbacks += 1

        def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            if not statement.startswith(("BEGIN", "PRAGMA")):
                self.stats.statements += 1

        def before_execute(conn: Any, *_args: Any) -> None:
            # Any other statement sees the held-back writes of its transaction, as if they had
            # run at once (ledger/batched.py), and with the SQLite writer process it begins the
            # transaction here first (Store._begin). This runs inside SQLAlchemy's greenlet.
            work = conn.info.get(_WORK_KEY)
            if work is not None and (work._pending or work._deferred):
                await_only(work.send_writes())

        event.listen(sync_engine, "before_execute", before_execute)
        event.listen(sync_engine, "commit", on_commit)
        event.listen(sync_engine, "rollback", on_rollback)
        event.listen(sync_engine, "before_cursor_execute", on_execute)

    # -- clocks --------------------------------------------------------------------------------

    def now_ms(self) -> int:
        """The client clock in epoch ms (ledger timestamps; never used to judge a lease)."""
        return int(self._clock() * 1000) + self._clock_offset_ms

    def db_now(self) -> ColumnElement[int]:
        """The database clock, shifted by the test offset, as a SQL expression."""
        base = dialects.db_now_ms(self.dialect)
        if self._clock_offset_ms:
            return base + literal(self._clock_offset_ms)
        return base

    def advance_clock(self, seconds: float) -> None:
        """Shift the clocks this store sees by ``seconds`` (tests expire leases this way)."""
        self._clock_offset_ms += int(seconds * 1000)

    def statement(self, key: Hashable, build: Callable[[ColumnElement[int]], S]) -> S:
        """A hot-path statement built once by ``build(db_now)`` and reused.

        Hot paths bind their values as parameters of a statement built once: building a fresh
        ``update(...).where(...).values(...)`` per call, and generating its cache key, cost more
        client CPU than executing it (the bench's profile). The clock offset is part of the key,
        because ``db_now`` embeds it."""
        full = (key, self._clock_offset_ms)
        stmt = self._statements.get(full)
        if stmt is None:
            stmt = self._statements[full] = build(self.db_now())
        return cast(S, stmt)

    async def db_time_ms(self) -> int:
        """Read the (shifted) database clock."""
        async with self.read() as conn:
            return int((await conn.execute(select(self.db_now()))).scalar_one())

    # -- transactions ---------------------------------------------------------------------------

    def transaction(self) -> contextlib.AbstractAsyncContextManager[Work]:
        """One local write transaction; storage errors translated.

        It is durable when the block exits: nothing written in it may be acted on before.
        On SQLite it may share its physical commit with the transactions of other tasks of
        this process (:class:`CommitGroup`); on PostgreSQL it is its own."""
        if self._write_lock is None:
            inner = self._transaction()
        elif self.writer_process is not None and not self.writer_process.unusable:
            inner = self._shipped()
        else:
            inner = self._grouped()
        return _Translated(self, inner)

    def riding_pays(self) -> bool:
        """Whether a record that may ride (:mod:`ledger.riders`) should, rather than commit in a
        transaction of its own now. On SQLite always: it joins whatever commit group comes
        next. On PostgreSQL only when no other write transaction is open: with others open its
        own transaction is batched with theirs (:mod:`ledger.grouped`), while as a rider it
        would change its host's statement and keep the host out of its batch."""
        return self._write_lock is not None or self._open_writes == 0

    def ride(self, rider: Rider) -> None:
        """Write ``rider`` in the next transaction that ends on this store (see
        :mod:`ledger.riders`)."""
        self.riders.add(rider)

    async def _flush_riders(self) -> None:
        if self.riders.queued:
            async with self.transaction():
                pass  # the transaction boards the queued riders as it ends (Work.flush)

    @property
    def sqlite_writer(self) -> SqliteWriter:
        """Where this store commits groups of transactions now (``inline`` on PostgreSQL, and
        once a writer process turned out unable to run: :attr:`WriterProcess.unusable`)."""
        writer = self.writer_process
        return "process" if writer is not None and not writer.unusable else "inline"

    @property
    def open_writes(self) -> int:
        """Local write transactions entered on this store and not yet ended (committed,
        refused or abandoned; on SQLite, those queued for the writer included). On PostgreSQL
        the group sender splits its queue by it (:mod:`ledger.grouped`)."""
        return self._open_writes

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Work]:
        """PostgreSQL: one transaction on a connection this store used moments ago, or on one
        checked out of the pool (:meth:`_take_idle` says why)."""
        conn = await self._take_idle()
        if conn is None:
            conn = await self.engine.connect()
        try:
            sync = conn.sync_connection
            assert sync is not None
            # SQLAlchemy's transaction, begun and ended on the loop where nothing is sent: the
            # asyncpg adapter sends BEGIN lazily, before its first statement, and a transaction
            # whose writes all went in one implicit statement (ledger/batched.py) has no
            # COMMIT to send. Only a begun one commits through the greenlet bridge (its COMMIT
            # is a round trip). ``AsyncConnection.begin()`` and its exit took two greenlet
            # hops per transaction for what is, in the usual case, bookkeeping.
            outer = sync.begin()
            work = Work(conn=conn, store=self, now_ms=self.now_ms())
            with _seen_by_statements(conn, work):
                yield work
                await work.flush()
            if sync.connection.dbapi_connection._started:  # type: ignore[union-attr]
                await conn.commit()
            else:
                outer.commit()  # the commit event still counts it: the implicit one committed
        except BaseException:
            # Back to the pool (rolled back on the way), which pings or replaces it before it
            # is used again. A lost connection sends the idle ones there too: if the server
            # went away, so did they.
            lost = conn.invalidated
            await asyncio.shield(conn.close())
            if lost:
                await self._close_idle()
            raise
        await self._keep_idle(conn)
        work._advance_chains()

    async def _take_idle(self) -> AsyncConnection | None:
        """The connection this store committed on last, if that was within
        :data:`~ledger.dialects.PING_BYPASS_SECONDS`.

        Checking a connection out of SQLAlchemy's pool and back in (fairy, events, reset,
        greenlet hops) cost about a sixth of a sequential saga's client CPU on PostgreSQL (the
        bench's profile), for a connection that had just proved itself by committing. So the
        store keeps the connections it committed on, most recent last, and hands one out again
        within the window in which the pool would have handed it out unpinged anyway
        (`ledger.dialects._ping_in_one_round_trip` says what that window gives up). Older ones go
        back to the pool stamped with when they were last used, so the pool pings them at their
        next checkout exactly as if they had never been held."""
        idle = self._idle
        while idle:
            conn, used_at = idle.pop()
            if conn.closed or conn.invalidated:
                continue
            if time.monotonic() - used_at < dialects.PING_BYPASS_SECONDS:
                return conn
            idle.append((conn, used_at))  # the most recent is stale, so is every older one
            await self._close_idle()
        return None

    async def _keep_idle(self, conn: AsyncConnection) -> None:
        if conn.invalidated or conn.closed:
            return
        pool: Any = self.engine.sync_engine.pool
        if len(self._idle) + pool.checkedin() >= pool.size():
            # Above the pool's size (a burst): closed, as the pool closes a burst connection it
            # has no room for. The pool would not see it as one, as the idle connections it
            # does not hold leave room in its queue; the record goes back empty, reconnected
            # at its next checkout.
            await _quietly(conn.invalidate())
            await _quietly(conn.close())
            return
        self._idle.append((conn, time.monotonic()))

    async def _close_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn, used_at in idle:
            dialects.stamp_last_use(conn, used_at)
            await _quietly(conn.close())

    @asynccontextmanager
    async def _grouped(self) -> AsyncIterator[Work]:
        """Group commit on SQLite (DESIGN "Commit economy").

        Writers of this process queue on the store's lock (SQLite has one writer). The first
        writer opens the physical transaction (``BEGIN IMMEDIATE``) and, when its block ends,
        schedules the commit one loop turn later; every writer that gets the lock before that
        joins the same transaction inside a ``SAVEPOINT`` of its own, so its failure undoes
        only its own rows. Each writer then *waits for the physical commit* before its block
        exits — the rule that nothing is acted on before it is durable is unchanged; only the
        fsync-class wait is shared. A sequential caller pays no savepoint: the first writer of
        a group is alone in it until it has finished. When that writer finishes with no other
        writer waiting for the lock and nothing else ready to run on the loop, nobody could
        join within the loop turn, so it commits at once instead of scheduling the commit."""
        assert self._write_lock is not None
        await self._take_write_lock()
        try:
            group = self._group
            if group is None:
                conn, self._writer = self._writer, None
                if conn is None or conn.closed or conn.invalidated:
                    conn = await self.engine.connect()
                try:
                    await self._begin_writer(conn)
                except BaseException:
                    await _quietly(conn.close())
                    raise
                group = CommitGroup(conn, asyncio.get_running_loop().create_future())
                work = Work(conn=conn, store=self, now_ms=self.now_ms())
                try:
                    yield work
                    await work.flush()
                except BaseException:
                    # Alone in the group: the whole physical transaction is this writer's.
                    await _quietly(conn.rollback())
                    await _quietly(conn.close())
                    raise
                if self._nobody_could_join():
                    # Nobody is waiting for the lock and nothing else can run before the
                    # commit, so nobody could join a group within a loop turn: commit now, with
                    # no committer task, no future and no second turn of the lock.
                    await self._commit_physical(conn)
                    work._advance_chains()
                    return
                self._open_group(group)
            else:
                async with self._member_of(group) as work:
                    yield work
        finally:
            self._write_lock.release()
        await asyncio.shield(group.done)
        work._advance_chains()

    async def _take_write_lock(self) -> None:
        """Queue for the store's lock, counted in ``_queued_writers`` while waiting (a writer
        that ends sees whether anyone could join its group)."""
        assert self._write_lock is not None
        self._queued_writers += 1
        try:
            await self._write_lock.acquire()
        finally:
            self._queued_writers -= 1

    @asynccontextmanager
    async def _member_of(self, group: CommitGroup) -> AsyncIterator[Work]:
        """A writer joining ``group`` (lock held): its own savepoint in the group's physical
        transaction, so that its failure undoes only its own rows."""
        work = Work(conn=group.conn, store=self, now_ms=self.now_ms())
        # One name serves every member: each releases its savepoint before the next member
        # gets the lock. Written by the store itself rather than through ``begin_nested()``,
        # which compiles both statements again on every call.
        await self.hot.driver_sql(group.conn, "SAVEPOINT agent_txn_member")
        try:
            yield work
            await work.flush()
            await self.hot.driver_sql(group.conn, "RELEASE SAVEPOINT agent_txn_member")
        except BaseException:
            try:
                await self.hot.driver_sql(group.conn, "ROLLBACK TO SAVEPOINT agent_txn_member")
                await self.hot.driver_sql(group.conn, "RELEASE SAVEPOINT agent_txn_member")
            except BaseException:
                group.poisoned = True  # the outer transaction is gone with it
            raise
        group.members += 1

    @asynccontextmanager
    async def _shipped(self) -> AsyncIterator[Work]:
        """Group commit on SQLite through the writer process (:mod:`ledger.sqlite_writer`).

        As in :meth:`_grouped`, writers of this process queue on the store's lock, and a
        writer's block exits only once its transaction is durable. What differs is where a
        group's writes run. A writer's blind writes are held back (:mod:`ledger.batched`) and,
        when its block ends, handed to the group being built instead of run here; the group
        is shipped to the writer process, which runs each member inside a savepoint of its own
        and commits the group, while this loop goes on with other sagas. Each member then
        learns its own outcome: its writes committed, its lease lost, or its own error.

        A group is shipped one loop turn after its first member joined (every task ready now
        may still join), or at once when it holds half of the store's open write transactions:
        two cohorts, so that the writer commits one while the loop runs the other.

        Two kinds of writer run here, as in :meth:`_grouped`, on this process's connection:

        * one alone (no group being built or in flight, nobody waiting for the lock, nothing
          else ready to run): a round trip to the writer process would only add to its wait
          (``docs/benchmarks-log.md``);
        * one that needs more than blind writes (a read, a ``RETURNING``, a row count): it
          begins its physical transaction here (:meth:`_begin`) once the groups before it are
          committed, so that it sees them.

        Such a writer opens an in-process commit group when its block ends, exactly as
        :meth:`_grouped`'s first writer does, and the writers that get the lock while that
        group is open join it (:meth:`_member_of`), so transactions that cannot be shipped
        still share commits. Shipping resumes once it has committed."""
        assert self._write_lock is not None and self.writer_process is not None
        await self._take_write_lock()
        shipment: Shipment | None = None
        index = 0
        try:
            group = self._group
            if group is not None:
                async with self._member_of(group) as work:
                    yield work
            else:
                conn, self._writer = self._writer, None
                if conn is None or conn.closed or conn.invalidated:
                    conn = await self.engine.connect()
                work = Work(conn=conn, store=self, now_ms=self.now_ms(), _deferred=True)
                try:
                    with _seen_by_statements(conn, work):
                        yield work
                        await work.flush(send=False)
                    if work._deferred and not work._pending:
                        self._writer = conn  # nothing to write, nothing begun
                        return
                    # Whether it could still be shipped, and whether anyone could join it.
                    shippable, alone = work._deferred, self._nobody_could_join()
                    if (
                        shippable
                        and (
                            self._building is not None or self.writer_process.in_flight or not alone
                        )
                        # Starts the child if none runs; one that cannot start is given up
                        # and this writer commits here (WriterProcess.ready).
                        and self.writer_process.ready()
                    ):
                        self._writer = conn
                        shipment, index = self._join_shipment(work)
                    else:
                        await work.send_writes(final=True)  # begins it here if still deferred
                except BaseException:
                    if work._deferred:
                        self._writer = conn  # nothing was begun on it
                    else:  # its own physical transaction: undone with it
                        await _quietly(conn.rollback())
                        await _quietly(conn.close())
                    raise
                if shipment is None:
                    if alone if shippable else self._nobody_could_join():
                        await self._commit_physical(conn)
                        work._advance_chains()
                        return
                    group = CommitGroup(conn, asyncio.get_running_loop().create_future())
                    self._open_group(group)
        finally:
            self._write_lock.release()
        if shipment is not None:
            answer = await asyncio.shield(shipment.done)
            self._settle_member(answer, shipment.writes[index], index)
        else:
            assert group is not None
            await asyncio.shield(group.done)
        work._advance_chains()

    def _join_shipment(self, work: Work) -> tuple[Shipment, int]:
        """Hand ``work``'s held-back writes to the group being built (lock held); the group
        and ``work``'s place in it."""
        shipment = self._building
        if shipment is None:
            shipment = self._building = self._new_shipment()
        index = len(shipment.writes)
        shipment.writes.append(work._pending)
        if 2 * len(shipment.writes) >= self._open_writes:
            self._ship()  # half of the open transactions: they leave as one cohort
        return shipment, index

    def _settle_member(self, answer: Answer, writes: Sequence[PendingWrite], index: int) -> None:
        """Raise what the writer process says of member ``index`` (``writes``: its writes;
        nothing if they were committed): the error that kept the group from committing, or the
        member's own lost lease or error. Errors are raised as SQLAlchemy raises a statement's,
        so they are translated as in-process ones are (:func:`_raise_translated`). A refused
        member counts as a rollback, as its own transaction would have."""
        if answer.failure is not None:
            self.stats.rollbacks += 1
            raise _as_statement_error("COMMIT", answer.failure)
        outcome = answer.outcomes[index]
        if outcome is None:
            return
        self.stats.rollbacks += 1
        if outcome[0] == "lost":
            lost = writes[outcome[1]].lost
            assert lost is not None
            raise lost
        raise _as_statement_error(writes[outcome[1]].compiled.sql, outcome[2])

    def _new_shipment(self) -> Shipment:
        loop = asyncio.get_running_loop()
        shipment = Shipment(loop.create_future())
        shipment.done.add_done_callback(self._count_shipment)
        # One loop turn: every task that is ready now may still join with its transition.
        loop.call_soon(self._ship, shipment)
        return shipment

    def _ship(self, shipment: Shipment | None = None) -> None:
        """Hand the group being built to the writer process (``shipment``: only if it is
        still the one being built)."""
        building = self._building
        if building is None or (shipment is not None and shipment is not building):
            return
        self._building = None
        assert self.writer_process is not None
        self.writer_process.submit(building.writes, building.done)

    def _count_shipment(self, done: asyncio.Future[Answer]) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        answer = done.result()
        assert self.writer_process is not None
        self.stats.writer_cpu_s = self.writer_process.cpu_s
        self.stats.statements += answer.statements
        if answer.failure is None:
            self.stats.commits += 1

    async def _begin(self, work: Work) -> None:
        """Begin ``work``'s physical transaction here, on the writer connection it holds (see
        :meth:`_shipped`): after the group being built and every group in flight have been
        committed by the writer process, so that it sees their writes and the SQLite lock is
        free."""
        writer = self.writer_process
        assert writer is not None
        if self._building is not None:
            self._ship()
        if writer.in_flight:
            await writer.drained()
        await self._begin_writer(work.conn)
        work._deferred = False

    def _nobody_could_join(self) -> bool:
        """Whether no writer could join a group within this loop turn: nobody waits for the
        lock and nothing else is ready to run."""
        return not self._queued_writers and not others_ready()

    def _open_group(self, group: CommitGroup) -> None:
        """Its first writer's block has ended: open ``group`` to the writers that get the lock
        within this loop turn, and schedule its commit."""
        self._group = group
        group.members = 1
        group.committer = asyncio.ensure_future(self._commit_group(group))

    async def _begin_writer(self, conn: AsyncConnection) -> None:
        """``BEGIN IMMEDIATE`` on the writer connection.

        On a :mod:`ledger.sqlite_inline` connection the store writes it on the driver itself
        and then begins SQLAlchemy's transaction as bookkeeping only (the dialect's
        ``do_begin`` finds it begun and sends nothing): ``AsyncConnection.begin()`` took a
        greenlet hop and SQLAlchemy's cursor wrapping for one statement of a few microseconds,
        and its commit the same, ~10 greenlet switches per local transaction (cProfile of a
        sequential saga). Errors are SQLAlchemy's, as for any statement (``HotPath``)."""
        sync = conn.sync_connection
        assert sync is not None
        if await self.hot.begin_write(conn):
            sync.begin()
        else:
            await conn.begin()

    async def _commit_writer(self, conn: AsyncConnection) -> None:
        """Commit the writer's physical transaction (see :meth:`_begin_writer`). The commit
        event still fires, so the counters see it."""
        sync = conn.sync_connection
        assert sync is not None
        if await self.hot.commit_write(conn):
            sync.commit()  # bookkeeping: the dialect's do_commit finds nothing left to commit
        else:
            await conn.commit()

    async def _commit_physical(self, conn: AsyncConnection, *, abandon: bool = False) -> None:
        """Commit a physical transaction (one writer's, or a group's; lock held) and keep its
        connection as the writer; ``abandon``: roll it back and fail instead."""
        try:
            if abandon:
                raise StoreUnavailable("the commit group was abandoned")
            await self._commit_writer(conn)
        except BaseException:
            await _quietly(conn.rollback())
            await _quietly(conn.close())  # a failed commit: start afresh next time
            raise
        await self._keep_writer(conn)

    async def _commit_group(self, group: CommitGroup) -> None:
        # One loop turn: every task that is ready now may still join with its transition.
        await asyncio.sleep(0)
        assert self._write_lock is not None
        async with self._write_lock:
            if self._group is group:
                self._group = None
            try:
                await self._commit_physical(group.conn, abandon=group.poisoned)
            except BaseException as exc:
                group.done.set_exception(exc)
                group.done.exception()  # retrieved: every member re-raises it on its own
            else:
                group.done.set_result(None)

    async def _keep_writer(self, conn: AsyncConnection) -> None:
        if self._writer is None and not conn.invalidated:
            self._writer = conn
        else:
            await _quietly(conn.close())

    async def _close_writer(self) -> None:
        conn, self._writer = self._writer, None
        if conn is not None:
            await _quietly(conn.close())

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A read-only transaction (DEFERRED on SQLite, so it never takes the writer lock).

        Riders queued on this store land first, so a process reads its own writes (unless the
        read is made inside one of this task's write transactions)."""
        if self.riders.waiting and not _WRITING.get():
            await self.riders.settle()
        try:
            async with self.engine.connect() as raw:
                conn = await raw.execution_options(**{dialects.READ_ONLY_OPTION: True})
                async with conn.begin():
                    yield conn
        except Exception as exc:
            translated = dialects.translate(exc)
            if translated is not None and translated is not exc:
                raise translated from exc
            raise

    async def _settle_group(self, *, abandon: bool) -> None:
        group = self._group
        if group is None or group.committer is None:
            return
        group.poisoned = group.poisoned or abandon
        with contextlib.suppress(Exception):
            await asyncio.shield(group.committer)

    async def close(self) -> None:
        """Commit what is pending (riders included), then release every pooled connection."""
        try:
            await self.riders.settle()
        except Exception as exc:
            # Their effects stay leased to this worker; recovery settles them by lookup.
            log.warning("riders not landed at close", error=type(exc).__name__)
        await self._settle_group(abandon=False)
        if self.writer_process is not None:
            self._ship()
            await self.writer_process.close()
        await self._close_writer()
        await self._close_idle()
        await self.engine.dispose()

    async def abandon(self) -> None:
        """Drop every connection as a crashed process would: no lease is released, nothing else
        is written; uncommitted work was already rolled back by the database (a commit group
        still waiting for its commit is rolled back: its writers were waiting, none acted).
        Riders are dropped, as a crash drops them."""
        self.riders.drop()
        await self._settle_group(abandon=True)
        if self.writer_process is not None:
            building, self._building = self._building, None
            if building is not None and not building.done.done():
                building.done.set_exception(StoreUnavailable("the commit group was abandoned"))
                building.done.exception()  # retrieved: every member re-raises it on its own
            self.writer_process.kill()
        await self._close_writer()
        await self._close_idle()
        await self.engine.dispose()
