"""Per-test PostgreSQL databases for ``tests/conftest.py``: copied from migrated templates,
dropped in the background.

Why: every PostgreSQL test used to run ``CREATE DATABASE`` twice, then migrate ours (Alembic,
≈ 0.25 s) and create the fake provider's tables, and at teardown wait for two
``DROP DATABASE ... WITH (FORCE)`` (≈ 0.5 to 1 s together). Over ~800 tests that was a large part
of the suite's wall time. Here:

* **Templates.** Once per session we build two template databases, one migrated by
  :meth:`ledger.store.Store.open` and one holding the fake provider's tables
  (:meth:`providers.fake.shop.FakeShop.open`), and copy them with ``CREATE DATABASE x TEMPLATE
  tpl``. A copy holds the same schema and rows (``alembic_version`` at head, nothing else) as an
  empty database after its first ``Store.open`` / ``FakeShop.open``, so that first open in a test
  only checks the schema. Tests that must see a truly empty database (migration tests, "nothing
  was created" checks) ask for ``migrated=False``.
  PostgreSQL refuses to copy a database anybody is connected to, so once built the templates get
  ``ALLOW_CONNECTIONS false`` (nobody, superusers included, can connect to them afterwards) and
  any straggling backend is terminated before the first copy.
* **Copies made ahead.** A copy takes the server about 0.1 s (two databases of some 7.5 MB each,
  written through its WAL). After each ``create`` the worker thread makes the next copies of the
  same kind (:attr:`PgDatabases.stock` sets of them) while the test runs, so the next test takes
  a ready set instead of waiting for the server. A set made ahead is the same as one made on
  demand: the templates do not change once built.
* **Background drops.** Teardown only queues the names; a daemon thread with its own event loop
  and its own asyncpg connections runs the drops while the next test runs. The backlog is bounded
  (:attr:`PgDatabases.max_pending_drops`): a create waits while more drops than that are pending,
  so a slow server cannot make databases pile up on a small disk. :meth:`PgDatabases.close`
  (the session finalizer) waits for every drop, then drops the templates and anything else
  carrying this session's tag.

All server work happens on the worker thread's loop, so nothing here depends on the event loop of
the test that asks (pytest-asyncio gives every test its own), and the admin connections are kept
for the whole session instead of one connect per statement. A lost connection (the fault suite
restarts the server) is reopened and the statement retried for a while.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from sqlalchemy.engine import URL

T = TypeVar("T")

# How long a statement keeps being retried while the server is unreachable (a restart in the
# fault suite takes a few seconds; a server that is gone for good fails the test that waits).
RECONNECT_BUDGET_S = 30.0


def _is_connection_error(exc: BaseException) -> bool:
    """Errors after which the admin connection is useless and the statement may be retried.

    Socket errors and timeouts, asyncpg's interface / internal errors (a connection the server
    terminated while it sat idle fails its next query with one of those rather than a clean
    "connection closed"), and the server's connection-level SQLSTATEs. Any other error the
    server reports is the statement's own failure and is raised.
    """
    import asyncpg

    return isinstance(
        exc,
        (
            OSError,  # refused / reset while the server restarts
            TimeoutError,
            asyncpg.InterfaceError,
            asyncpg.exceptions.InternalClientError,
            asyncpg.exceptions.PostgresConnectionError,  # SQLSTATE class 08
            asyncpg.exceptions.OperatorInterventionError,  # 57: admin shutdown, cannot connect now
        ),
    )


class PgDatabases:
    """Creates and drops the per-test databases of one pytest session on one server."""

    def __init__(
        self,
        server: URL,
        *,
        tag: str | None = None,
        max_pending_drops: int = 20,
        stock: int = 2,
        template_builders: dict[str, Callable[[str], Awaitable[None]]] | None = None,
    ) -> None:
        """``server``: the admin URL (its database is the one we connect to for DDL).

        ``tag`` is part of every name (``agt_<tag>_...``) so one session's databases can be told
        from another's running on the same server. ``template_builders`` maps a template role
        (``"store"``, ``"provider"``) to a coroutine that builds the schema given the URL of a new
        empty database; a role without a builder always gets an empty database. ``stock``: how
        many sets of each kind asked for are made ahead (0: none, every create waits).
        """
        self.server = server
        self.tag = tag or uuid.uuid4().hex[:6]
        self.max_pending_drops = max_pending_drops
        self.stock = stock
        self._builders = dict(template_builders or {})
        self._templates: dict[str, str] = {}
        self._templates_lock: asyncio.Lock | None = None
        self._stock_lock: asyncio.Lock | None = None
        self._conns: dict[str, Any] = {}
        self._pending = 0  # queued or running drops; touched only on the worker loop
        self._drained: asyncio.Condition | None = None
        self._queue: asyncio.Queue[str] | None = None
        self._drop_errors: list[str] = []
        # Sets made ahead, by (roles, migrated), and the task topping each kind up; both are
        # touched only on the worker loop.
        self._ready_sets: dict[tuple[tuple[str, ...], bool], deque[list[str]]] = {}
        self._fillers: dict[tuple[tuple[str, ...], bool], asyncio.Task[None]] = {}
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"agt-pg-databases-{self.tag}", daemon=True
        )
        self._thread.start()
        self._ready.wait()

    # -- API for the fixtures (any thread) ------------------------------------------------------

    def url_for(self, name: str) -> str:
        """URL of ``name`` on the server."""
        return self.server.set(database=name).render_as_string(hide_password=False)

    def create(self, roles: Iterable[str], *, migrated: bool) -> list[str]:
        """Create one new database per role (``store``, ``provider``); returns their names.

        ``migrated``: copy the role's template (built on first use); otherwise an empty database.
        Waits first while more than :attr:`max_pending_drops` drops are pending.
        """
        return self._call(self._take((tuple(roles), migrated)))

    def ready_sets(self) -> int:
        """Sets made ahead and not yet taken, of every kind (diagnostics)."""
        return self._call(self._count_ready())

    def drop_later(self, names: Iterable[str]) -> None:
        """Queue ``names`` for dropping; returns at once."""
        if self._closed:
            raise RuntimeError("PgDatabases is closed")
        for name in names:
            self._loop.call_soon_threadsafe(self._enqueue, name)

    def pending_drops(self) -> int:
        """Drops queued or running (diagnostics)."""
        return self._call(self._get_pending())

    def close(self) -> None:
        """Wait for every queued drop, drop the templates and stop the worker.

        Raises when a drop failed: a database may have been left behind on the server.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=60)
        if self._drop_errors:
            raise RuntimeError("could not drop test database(s): " + "; ".join(self._drop_errors))

    # -- worker thread --------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._queue = asyncio.Queue()
        self._drained = asyncio.Condition()
        self._templates_lock = asyncio.Lock()
        self._stock_lock = asyncio.Lock()
        drain = self._loop.create_task(self._drain_drops())
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._stop_fillers())
            drain.cancel()
            self._loop.run_until_complete(asyncio.gather(drain, return_exceptions=True))
            self._loop.run_until_complete(self._close_connections())
            self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result()

    def _name(self, suffix: str, role: str) -> str:
        base = f"agt_{self.tag}_{suffix}"
        return base if role == "store" else f"{base}_{role}"

    def _enqueue(self, name: str) -> None:
        assert self._queue is not None
        self._pending += 1
        self._queue.put_nowait(name)

    def _enqueue_all(self, names: Iterable[str]) -> None:
        for name in names:
            self._enqueue(name)

    async def _get_pending(self) -> int:
        return self._pending

    async def _drain_drops(self) -> None:
        assert self._queue is not None and self._drained is not None
        while True:
            name = await self._queue.get()
            try:
                await self._execute("drop", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            except Exception as exc:  # reported by close(); the worker must keep draining
                self._drop_errors.append(f"{name}: {exc!r}")
            async with self._drained:
                self._pending -= 1
                self._drained.notify_all()

    async def _wait_for_backlog(self, limit: int) -> None:
        assert self._drained is not None
        async with self._drained:
            await self._drained.wait_for(lambda: self._pending <= limit)

    async def _count_ready(self) -> int:
        return sum(len(sets) for sets in self._ready_sets.values())

    async def _take(self, kind: tuple[tuple[str, ...], bool]) -> list[str]:
        """A set made ahead if one is ready, else a new one; then top the stock up."""
        await self._wait_for_backlog(self.max_pending_drops)
        ready = self._ready_sets.get(kind)
        names = ready.popleft() if ready else await self._create_set(kind, conn="create")
        filler = self._fillers.get(kind)
        if self.stock > 0 and not self._closed and (filler is None or filler.done()):
            self._fillers[kind] = asyncio.create_task(self._fill(kind))
        return names

    async def _fill(self, kind: tuple[tuple[str, ...], bool]) -> None:
        assert self._stock_lock is not None
        ready = self._ready_sets.setdefault(kind, deque())
        while not self._closed and len(ready) < self.stock:
            try:
                # The stock's own connections, as a create on demand may run at the same time,
                # and one kind's filler at a time on them: an asyncpg connection runs one
                # statement at a time, and two connects for one key would leak one of them.
                async with self._stock_lock:
                    names = await self._create_set(kind, conn="stock")
            except Exception:
                # The next create makes its set on demand (and meets the error itself, if it
                # lasts); _create_all queued whatever this one did create for dropping.
                return
            ready.append(names)

    async def _stop_fillers(self) -> None:
        # Awaited, not cancelled: each stops after the set in hand (``_closed`` is set), and a
        # cancelled CREATE DATABASE makes asyncpg send its cancel request on a socket of its
        # own, which the stopping loop would leave open.
        fillers, self._fillers = list(self._fillers.values()), {}
        await asyncio.gather(*fillers, return_exceptions=True)

    async def _create_set(self, kind: tuple[tuple[str, ...], bool], *, conn: str) -> list[str]:
        roles, migrated = kind
        suffix = uuid.uuid4().hex[:10]
        names = [self._name(suffix, role) for role in roles]
        wanted = list(zip(names, roles, strict=True))
        await self._create_all(wanted, migrated=migrated, conn=conn)
        return names

    async def _create_all(
        self, wanted: list[tuple[str, str]], *, migrated: bool, conn: str
    ) -> None:
        await self._wait_for_backlog(self.max_pending_drops)
        try:
            templates = [
                await self._template(role) if migrated and role in self._builders else None
                for _, role in wanted
            ]
            # One connection per database: PostgreSQL copies them in parallel.
            results = await asyncio.gather(
                *(
                    self._create(name, template, conn=f"{conn}-{i}")
                    for i, ((name, _), template) in enumerate(zip(wanted, templates, strict=True))
                ),
                return_exceptions=True,
            )
        except BaseException:
            self._enqueue_all(name for name, _ in wanted)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            # A half-finished fixture must not leak the database(s) that did get created.
            self._enqueue_all(name for name, _ in wanted)
            raise errors[0]

    async def _create(self, name: str, template: str | None, *, conn: str) -> None:
        sql = f'CREATE DATABASE "{name}"'
        if template is not None:
            sql += f' TEMPLATE "{template}"'
        await self._execute(conn, sql, idempotent=False)

    async def _template(self, role: str) -> str:
        """The template database for ``role``, built on first use."""
        assert self._templates_lock is not None
        async with self._templates_lock:
            if role in self._templates:
                return self._templates[role]
            name = self._name("tpl", role)
            await self._execute("template", f'CREATE DATABASE "{name}"', idempotent=False)
            try:
                await self._builders[role](self.url_for(name))
                # The builder closed its engine, but a backend can outlive its client by a moment
                # and a later accidental connect would make every copy fail: lock the template,
                # then end any straggler (CREATE ... TEMPLATE also waits a few seconds for them).
                await self._execute(
                    "template", f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false'
                )
                await self._execute(
                    "template",
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    f"WHERE datname = '{name}' AND pid <> pg_backend_pid()",
                )
            except BaseException:
                # Dropped now, not queued: the next test retries the build under the same name.
                with contextlib.suppress(Exception):
                    await self._execute(
                        "template", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
                    )
                raise
            self._templates[role] = name
            return name

    async def _shutdown(self) -> None:
        await self._stop_fillers()
        for sets in self._ready_sets.values():
            for names in sets:
                self._enqueue_all(names)
        self._ready_sets.clear()
        await self._wait_for_backlog(0)
        self._templates.clear()
        # The templates, and anything an interrupted create left behind (a create cancelled by a
        # test timeout or Ctrl-C may still commit after its name was queued and dropped): every
        # database carrying this session's tag is ours.
        prefix = f"agt_{self.tag}_"
        leftovers = await self._fetch_names(
            "SELECT datname FROM pg_database WHERE starts_with(datname, $1)", prefix
        )
        for name in leftovers:
            try:
                await self._execute("drop", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            except Exception as exc:
                self._drop_errors.append(f"{name}: {exc!r}")

    # -- connections ----------------------------------------------------------------------------

    async def _connection(self, key: str) -> Any:
        import asyncpg

        conn = self._conns.get(key)
        if conn is None or conn.is_closed():
            conn = await asyncpg.connect(
                host=self.server.host or "127.0.0.1",
                port=self.server.port or 5432,
                user=self.server.username or "postgres",
                password=self.server.password,
                database=self.server.database or "postgres",
                timeout=5,
                # Tells our admin sessions apart in pg_stat_activity (and from the tests' own).
                server_settings={"application_name": f"agt-test-databases-{self.tag}-{key}"},
            )
            self._conns[key] = conn
        return conn

    async def _execute(self, key: str, sql: str, *, idempotent: bool = True) -> None:
        """Run ``sql`` on connection ``key``, reconnecting and retrying while the server is away.

        ``idempotent=False`` (CREATE DATABASE): when a retried statement finds its database
        already there, the lost attempt did commit it (the names are unique to this session).
        """

        async def run(conn: Any) -> None:
            await conn.execute(sql)

        await self._retrying(key, run, idempotent=idempotent)

    async def _fetch_names(self, sql: str, *args: object) -> list[str]:
        names: list[str] = []

        async def run(conn: Any) -> None:
            names[:] = [str(row[0]) for row in await conn.fetch(sql, *args)]

        await self._retrying("drop", run, idempotent=True)
        return names

    async def _retrying(
        self, key: str, run: Callable[[Any], Awaitable[None]], *, idempotent: bool
    ) -> None:
        import asyncpg

        deadline = time.monotonic() + RECONNECT_BUDGET_S
        delay = 0.1
        retried = False
        while True:
            try:
                await run(await self._connection(key))
                return
            except asyncpg.exceptions.DuplicateDatabaseError:
                if idempotent or not retried:
                    raise
                return
            except Exception as exc:
                if not _is_connection_error(exc) or time.monotonic() + delay > deadline:
                    raise
                stale = self._conns.pop(key, None)
                if stale is not None:
                    stale.terminate()
                retried = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _close_connections(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            try:
                await asyncio.wait_for(conn.close(), timeout=5)
            except Exception:
                conn.terminate()
