"""The fake shop's database access: engines, serialized write transactions, records, reads.

Dialect-specific behaviour is confined here:

* SQLite — WAL, a busy timeout, and ``BEGIN IMMEDIATE`` for every transaction (the pysqlite
  driver's own deferred BEGIN would let two writers read the same state, then one fail on
  upgrade). Every write is therefore serialized on the file.
* PostgreSQL — READ COMMITTED plus ``pg_advisory_xact_lock(hashtext(provider:key))`` taken first
  in the transaction, so two applies of one key run one after the other and the second sees the
  first's entry. Business updates are single conditional ``UPDATE`` statements, which PostgreSQL
  re-checks after waiting on a row lock, so different keys racing for one row stay correct.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import bindparam, event, func, insert, select, text, update
from sqlalchemy.engine import URL, Connection, RowMapping, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from providers.fake import schema

T = TypeVar("T")

_SQLITE_BUSY_TIMEOUT_MS = 30_000
# Any fixed number: serializes concurrent create_all on one PostgreSQL database.
_PG_DDL_LOCK = 774_201_311


#: One encoder for every call: ``json.dumps`` with options builds a new one each time.
_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
)


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, ASCII only, no NaN: equal payloads give equal text."""
    return _ENCODER.encode(value)


def sha256_hex(text_value: str) -> str:
    """Hex SHA-256 of ``text_value`` as UTF-8."""
    return hashlib.sha256(text_value.encode("utf-8")).hexdigest()


class ShopDatabaseError(ValueError):
    """A URL the fake shop cannot keep its database at (in memory, an unsupported backend):
    the user's input, whose message is one line fit to show as it is (it holds no password).

    A type of its own so that a command can tell it from a bug and report it in one line; still
    a :class:`ValueError`, as it was, for callers that catch that.
    """


def shop_url(url: str | URL) -> URL:
    """Accept plain ``sqlite://`` / ``postgresql://`` URLs and pick the async driver; raises
    :class:`ShopDatabaseError` for a URL the shop cannot keep its database at. A command may
    call it first, to refuse such a URL before it makes anything else."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise ShopDatabaseError("the fake shop needs a SQLite file, not an in-memory database")
        return parsed.set(drivername="sqlite+aiosqlite")
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+asyncpg")
    raise ShopDatabaseError(f"unsupported database for the fake shop: {backend!r}")


#: asyncpg's numeric options a URL may give, with their type: asyncpg compares them as
#: numbers, and SQLAlchemy hands a URL's query to it as strings (``timeout=5`` failed the first
#: connection with a ``TypeError``). The same table as ``ledger.dialects._PG_NUMBERS``, which
#: this layer may not import (pyproject's import contract); a test keeps the two equal.
_PG_NUMBERS: dict[str, type[int] | type[float]] = {
    "timeout": float,
    "statement_cache_size": int,
    "max_cached_statement_lifetime": float,
    "max_cacheable_statement_size": int,
}


def _pg_numbers(url: URL) -> dict[str, int | float]:
    """The numeric options of a PostgreSQL URL as numbers, for ``connect_args`` (which win
    over the URL's strings); raises :class:`ShopDatabaseError` for one that is not a number."""
    numbers: dict[str, int | float] = {}
    for key, kind in _PG_NUMBERS.items():
        if key in url.query:
            value = url.query[key]
            try:
                numbers[key] = kind(str(value))
            except ValueError:
                raise ShopDatabaseError(
                    f"the URL's {key} must be a number >= 0, not {value!r}"
                ) from None
    return numbers


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Take transaction control away from the driver so "begin" below decides how BEGIN looks.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={_SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


def _sqlite_on_begin(connection: Connection) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")


# The statements every call runs, built once: building a statement and its cache key on each
# call cost more client CPU than executing it (py-spy over a recovering worker: the shop's
# calls were ~39 % of its samples). SQLAlchemy compiles each once either way.
_KEY_LOCK = text("SELECT pg_advisory_xact_lock(hashtext(:k))")
_LIVE_ENTRY = select(schema.effects).where(
    schema.effects.c.provider == bindparam("p_provider"),
    schema.effects.c.key == bindparam("p_key"),
    schema.effects.c.forgotten_at.is_(None),
)
_FORGET = (
    update(schema.effects)
    .where(schema.effects.c.seq == bindparam("p_seq"))
    .values(forgotten_at=bindparam("p_now"))
)
_INSERT_ENTRY = insert(schema.effects)
_FENCE_OF = select(schema.fences.c.highest).where(
    schema.fences.c.provider == bindparam("p_provider"), schema.fences.c.key == bindparam("p_key")
)
_INSERT_FENCE = insert(schema.fences)
_RAISE_FENCE = (
    update(schema.fences)
    .where(
        schema.fences.c.provider == bindparam("p_provider"),
        schema.fences.c.key == bindparam("p_key"),
    )
    .values(highest=bindparam("p_highest"))
)
_LOG_CALL = insert(schema.calls)


@dataclass(frozen=True, slots=True)
class EffectRecord:
    """One row of ``effects``: an applied effect, a void tombstone or a remembered rejection."""

    seq: int
    provider: str
    action: str
    key: str
    payload: dict[str, Any]
    payload_sha256: str
    remote_id: str | None
    result: dict[str, Any] | None
    status: str
    reason: str | None
    created_at: float
    forgotten_at: float | None

    @property
    def qualified_action(self) -> str:
        """``provider.action``, the form :meth:`FakeShop.counts` uses."""
        return f"{self.provider}.{self.action}"


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One row of the ``calls`` request log."""

    seq: int
    call: str
    provider: str
    action: str
    key: str
    fence: int | None
    outcome: str
    fault: str | None
    created_effect: bool
    at: float


def effect_from_row(row: RowMapping) -> EffectRecord:
    """Decode an ``effects`` row (JSON text columns become dicts)."""
    return EffectRecord(
        seq=int(row["seq"]),
        provider=row["provider"],
        action=row["action"],
        key=row["key"],
        payload=json.loads(row["payload"]),
        payload_sha256=row["payload_sha256"],
        remote_id=row["remote_id"],
        result=None if row["result"] is None else json.loads(row["result"]),
        status=row["status"],
        reason=row["reason"],
        created_at=float(row["created_at"]),
        forgotten_at=None if row["forgotten_at"] is None else float(row["forgotten_at"]),
    )


class Store:
    """An engine on the shop database plus the few queries the providers share."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.is_postgres = engine.dialect.name == "postgresql"
        #: Calls in progress, their callers waiting or not (see :meth:`call`).
        self._unfinished: set[asyncio.Task[Any]] = set()

    @classmethod
    async def open(cls, url: str | URL) -> Store:
        """Connect, configure the dialect and create the tables if missing."""
        parsed = shop_url(url)
        if parsed.get_backend_name() == "postgresql":
            engine = create_async_engine(parsed, connect_args=_pg_numbers(parsed))
        else:
            engine = create_async_engine(parsed)
        if parsed.get_backend_name() == "sqlite":
            event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
            event.listen(engine.sync_engine, "begin", _sqlite_on_begin)
        store = cls(engine)
        try:
            async with engine.begin() as conn:
                if store.is_postgres:
                    await conn.execute(
                        text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_DDL_LOCK}
                    )
                await conn.run_sync(schema.metadata.create_all)
        except BaseException:
            await engine.dispose()
            raise
        return store

    async def dispose(self) -> None:
        """Let every call in progress finish, then close every pooled connection."""
        await self.settle()
        await self.engine.dispose()

    async def settle(self) -> None:
        """Wait until no call is in progress, those whose callers stopped waiting included."""
        while self._unfinished:
            await asyncio.gather(*self._unfinished, return_exceptions=True)

    @asynccontextmanager
    async def write(self, provider: str | None, key: str | None) -> AsyncIterator[AsyncConnection]:
        """One serialized transaction; with ``key``, applies of that provider key queue up."""
        async with self.engine.begin() as conn:
            if self.is_postgres and provider is not None and key is not None:
                await conn.execute(_KEY_LOCK, {"k": f"{provider}:{key}"})
            yield conn

    async def call(
        self,
        provider: str | None,
        key: str | None,
        body: Callable[[AsyncConnection], Awaitable[T]],
    ) -> T:
        """``body`` in one :meth:`write` transaction that runs to its end even when the caller
        stops waiting (its call timeout, its process "crashing"): the caller sees its own
        cancellation, the shop commits or fails on its own, and :meth:`settle` waits for it.

        Why: the shop is another system. A client that gives up does not reach into a real
        provider's database and cut its transaction short; the request lands or not on the
        provider's side (the fake HTTP server behaves so too), which is what "unknown" means.
        Cutting it short also broke the SQLite file: a cancellation inside an aiosqlite
        statement makes SQLAlchemy close that connection with the statement still open, and
        SQLite keeps such a connection (a "zombie") and its write lock until the garbage
        collector frees the statement. Every other writer then waited out the 30 s busy
        timeout: CI's ``database is locked`` on ``285a65d`` (``docs/benchmarks-log.md``,
        item 72).
        """
        task = asyncio.get_running_loop().create_task(self._call(provider, key, body))
        self._unfinished.add(task)
        task.add_done_callback(self._finished)
        # A caller cancelled here leaves the task running, and the shield lets go of it.
        return await asyncio.shield(task)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._unfinished.discard(task)
        if not task.cancelled():
            # Retrieved: a failure whose caller had stopped waiting is nobody's to report (the
            # caller's side already saw its own timeout), and asyncio would log it as lost.
            task.exception()

    async def _call(
        self,
        provider: str | None,
        key: str | None,
        body: Callable[[AsyncConnection], Awaitable[T]],
    ) -> T:
        async with self.write(provider, key) as conn:
            return await body(conn)

    # -- protocol state -------------------------------------------------------------------------

    async def live_entry(
        self, conn: AsyncConnection, provider: str, key: str
    ) -> EffectRecord | None:
        """The entry the idempotency cache still remembers for ``provider`` + ``key``."""
        params = {"p_provider": provider, "p_key": key}
        row = (await conn.execute(_LIVE_ENTRY, params)).mappings().first()
        return None if row is None else effect_from_row(row)

    async def forget(self, conn: AsyncConnection, seq: int, now: float) -> None:
        """Drop an entry from the idempotency cache; the effect row itself stays."""
        await conn.execute(_FORGET, {"p_seq": seq, "p_now": now})

    async def insert_entry(self, conn: AsyncConnection, **values: Any) -> None:
        """Insert an ``effects`` row (``payload``/``result`` already JSON text)."""
        await conn.execute(_INSERT_ENTRY, values)

    async def check_fence(
        self, conn: AsyncConnection, provider: str, key: str, fence: int
    ) -> int | None:
        """Record ``fence`` if it is the highest seen; return the higher one if it is stale."""
        params: dict[str, Any] = {"p_provider": provider, "p_key": key}
        highest = (await conn.execute(_FENCE_OF, params)).scalar_one_or_none()
        if highest is None:
            await conn.execute(_INSERT_FENCE, {"provider": provider, "key": key, "highest": fence})
            return None
        if fence < highest:
            return int(highest)
        if fence > highest:
            await conn.execute(_RAISE_FENCE, {**params, "p_highest": fence})
        return None

    async def log_call(self, conn: AsyncConnection, **values: Any) -> None:
        """Append to the ``calls`` request log."""
        await conn.execute(_LOG_CALL, values)

    # -- reads ----------------------------------------------------------------------------------

    async def applied_counts(self) -> dict[tuple[str, str], int]:
        """Applied effects per (provider, action), forgotten entries included."""
        e = schema.effects
        query = (
            select(e.c.provider, e.c.action, func.count())
            .where(e.c.status == "applied")
            .group_by(e.c.provider, e.c.action)
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return {(row[0], row[1]): int(row[2]) for row in rows}

    async def effects(self, provider: str | None, action: str | None) -> list[EffectRecord]:
        """Every ``effects`` row, oldest first, optionally for one provider / action."""
        e = schema.effects
        query = select(e).order_by(e.c.seq)
        if provider is not None:
            query = query.where(e.c.provider == provider)
        if action is not None:
            query = query.where(e.c.action == action)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [effect_from_row(row) for row in rows]

    async def calls(self, key: str | None) -> list[CallRecord]:
        """The request log, oldest first, optionally for one key."""
        c = schema.calls
        query = select(c).order_by(c.c.seq)
        if key is not None:
            query = query.where(c.c.key == key)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [
            CallRecord(
                seq=int(r["seq"]),
                call=r["call"],
                provider=r["provider"],
                action=r["action"],
                key=r["key"],
                fence=None if r["fence"] is None else int(r["fence"]),
                outcome=r["outcome"],
                fault=r["fault"],
                created_effect=bool(r["created_effect"]),
                at=float(r["at"]),
            )
            for r in rows
        ]

    async def rows(self, table_name: str) -> list[dict[str, Any]]:
        """Every row of a business table, in primary-key order (for assertions)."""
        table = schema.metadata.tables[table_name]
        query = select(table).order_by(*table.primary_key.columns)
        async with self.engine.connect() as conn:
            return [dict(row) for row in (await conn.execute(query)).mappings().all()]


__all__ = [
    "CallRecord",
    "EffectRecord",
    "ShopDatabaseError",
    "Store",
    "canonical_json",
    "sha256_hex",
    "shop_url",
]
