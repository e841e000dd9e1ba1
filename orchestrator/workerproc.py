"""Running a worker as a process: which providers it serves, signals, and the run itself.

A worker process needs the same providers the sagas were written against. ``--app
module:attribute`` names them (an iterable of providers, an object with ``providers()``, or a
callable — sync or async — returning either), like Celery's ``-A``; ``--fake-shop URL`` is a
shortcut that serves the fake shop's three providers from its database. The module is found
from the current folder too, as ``python -m`` and uvicorn's and Celery's app arguments find it
(the ``agent-txn`` console script does not put the folder on ``sys.path`` by itself).

A worker runs on a store that ``agent-txn db upgrade`` (or the application) made: it opens it
with ``auto_upgrade="never"`` and before its providers, so a mistyped ``--db`` (a new file, an
in-memory database, the shop's database given for ours) is refused before anything is written,
instead of getting a schema of its own and an idle worker reporting ``claimed 0``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import signal
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from ledger.pg_room import ConnectionRoom, read_room
from orchestrator.config import EngineSettings
from orchestrator.engine import Orchestrator
from orchestrator.errors import DefinitionInvalid
from orchestrator.worker import Worker, WorkerStats
from providers.contract import Provider

log = structlog.get_logger(__name__)


async def load_providers(app_ref: str) -> tuple[list[Provider], Any]:
    """Import ``module:attribute`` and turn it into providers; also returns what to close
    (the app, if it has a ``close``; else ``None``)."""
    module_name, _, attr = app_ref.partition(":")
    if not module_name or not attr:
        raise DefinitionInvalid(details={"reason": "--app must look like module:attribute"})
    _put_cwd_on_path()
    try:
        target: Any = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:
        # Whatever the import raised (a relative name's TypeError, the module's SyntaxError or
        # its own error at import) is the app's problem: one line naming it, no traceback.
        reason = f"cannot load {app_ref}: {type(exc).__name__}: {exc}"
        raise DefinitionInvalid(details={"reason": reason}) from None
    closer: Any = None
    try:
        if callable(target) and not hasattr(target, "providers"):
            target = target()
            if inspect.isawaitable(target):
                target = await target
        if hasattr(target, "providers"):
            closer = target if callable(getattr(target, "close", None)) else None
            found = list(target.providers())
        elif isinstance(target, Iterable) and not isinstance(target, (str, bytes, Mapping)):
            found = list(target)
        else:
            found = []
    except Exception as exc:
        # The caller's own code failed (a factory that wants arguments, a module attribute
        # that is something else): said in one line with its reason, as a bad name is.
        reason = f"loading providers from {app_ref} failed: {type(exc).__name__}: {exc}"
        await _close_refused(closer)
        raise DefinitionInvalid(details={"reason": reason}) from None
    strangers = [item for item in found if not isinstance(item, Provider)]
    if not found or strangers:
        await _close_refused(closer)
        what = f"{type(strangers[0]).__name__} {strangers[0]!r:.60}" if strangers else "nothing"
        raise DefinitionInvalid(
            details={"reason": f"{app_ref} gives no providers (it gave {what})"}
        )
    return found, closer


def _put_cwd_on_path() -> None:
    """The current folder first on ``sys.path``, as ``python -m`` puts it (``""``): run as the
    ``agent-txn`` console script, ``--app mymodule:build`` was not found beside the user."""
    cwd = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)


async def _close_refused(app: Any) -> None:
    """The caller never gets a refused app to close: one that opened a pool or a client for
    its providers is closed here, before the refusal."""
    if app is not None:
        with contextlib.suppress(Exception):  # the refusal is what the user needs to see
            await close_all([app])


async def open_providers(
    fake_shop: str | None, app_ref: str | None, closers: list[Any]
) -> list[Provider]:
    """The providers of ``--fake-shop`` and ``--app`` (``worker``, ``serve``, ``mcp``); what
    they opened is appended to ``closers``, for :func:`close_all` whatever fails later."""
    providers: list[Provider] = []
    origin: dict[str, str] = {}
    if fake_shop is not None:
        from providers.fake.shop import FakeShop

        shop = await FakeShop.open(fake_shop)
        closers.append(shop)
        _add_unique(providers, origin, shop.providers(), "--fake-shop")
    if app_ref is not None:
        loaded, closer = await load_providers(app_ref)
        if closer is not None:
            closers.append(closer)
        _add_unique(providers, origin, loaded, f"--app {app_ref}")
    return providers


def _add_unique(
    providers: list[Provider], origin: dict[str, str], new: Iterable[Provider], source: str
) -> None:
    """Add ``new`` to ``providers``, refusing a name already served: the engine keeps one
    provider per name, so the later one silently replaced the earlier (the fake shop's
    ``payments`` by the app's, or the other way round)."""
    for provider in new:
        first = origin.get(provider.name)
        if first is not None:
            where = source if first == source else f"{first} and {source}"
            raise DefinitionInvalid(
                details={
                    "reason": f"two providers are named {provider.name!r} ({where}); "
                    "a process serves one provider per name"
                }
            )
        origin[provider.name] = source
        providers.append(provider)


async def close_all(closers: list[Any]) -> None:
    """Close each, in reverse order of opening (the engine before its providers); a
    ``close()`` may be a coroutine function or a plain one."""
    for closer in reversed(closers):
        result = closer.close()
        if inspect.isawaitable(result):
            await result


#: Connections a worker needs beyond one per saga in hand: its claim pass and its callbacks.
WORKER_OWN_CONNECTIONS = 2


def worker_settings(settings: EngineSettings, concurrency: int) -> EngineSettings:
    """``settings`` for a worker process with ``concurrency`` sagas in hand.

    * A PostgreSQL pool large enough for them: each holds a connection during its local
      transactions, and a transaction above the pool would open (and close) a connection of
      its own every time (README: pg_pool_size).
    * Grouped commits in one cohort, unless the caller set ``pg_commit_cohorts``: a worker
      claims sagas when half its slots are free, so two half-size cohorts would halve every
      claim pass (about eight statements whatever it claims) and double their number —
      measured 5 to 20 % fewer sagas/s in worker processes (``docs/benchmarks-log.md``, item 39).
    * SQLite: commit groups on the event loop, unless the caller set ``sqlite_writer``. A
      worker's claim passes read, so each waits until the groups in flight in the writer
      process are committed, and the groups it ships stay small: with the writer process a
      worker with 8 in hand committed 1.8 times a saga against 0.75 inline, and drained
      790 to 830 sagas/s against 990 to 1 080 (``docs/benchmarks.md``, 2026-12-05). The writer
      process pays where sagas arrive as they come (``serve``, ``mcp``, a library caller)."""
    update: dict[str, object] = {}
    needed = concurrency + WORKER_OWN_CONNECTIONS
    if settings.pg_pool_size < needed:
        update["pg_pool_size"] = needed
    if "pg_commit_cohorts" not in settings.model_fields_set:
        update["pg_commit_cohorts"] = False
    if "sqlite_writer" not in settings.model_fields_set:
        update["sqlite_writer"] = "inline"
    return settings.model_copy(update=update) if update else settings


async def run_worker_process(
    url: str,
    *,
    settings: EngineSettings,
    concurrency: int,
    once: bool,
    poll_seconds: float,
    fake_shop: str | None = None,
    app_ref: str | None = None,
    metrics_port: int | None = None,
) -> WorkerStats:
    """Open the store, serve the providers, run until SIGTERM/SIGINT (or idle, with ``once``).

    The signal handlers come first: a SIGTERM while the process is still opening its databases
    (a rollout stopping a worker that just started) then ends it cleanly, exit 0, instead of
    killing it with the signal's default action half-way through its opening."""
    loop = asyncio.get_running_loop()
    stop = _StopRequest()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.request)
    try:
        return await _serve(
            url,
            stop,
            settings=settings,
            concurrency=concurrency,
            once=once,
            poll_seconds=poll_seconds,
            fake_shop=fake_shop,
            app_ref=app_ref,
            metrics_port=metrics_port,
        )
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def warn_if_short_of_connections(
    orch: Orchestrator, concurrency: int
) -> ConnectionRoom | None:
    """Log a warning when this worker's sagas in hand may need more connections than the
    PostgreSQL server admits now; the room read (``None`` on SQLite, or if it could not be
    read).

    Why only a warning: workers on other hosts share the server's connections and come and go,
    so a worker cannot know what will be free later, and it survives a refused connection (the
    pass is counted in ``WorkerStats.errors`` and tried again). But an operator who starts
    ``--concurrency 200`` against a server of 100 connections should learn it at start, not
    from a stream of failed passes."""
    if orch.store.dialect != "postgresql":
        return None
    pool = orch.store.engine.sync_engine.pool
    try:
        async with orch.store.read() as conn:
            room = await read_room(conn)
            # Connections this process opened already count in the room's ``in_use``, but are
            # its own to reuse (the one reading is left out of ``in_use`` already).
            held = max(0, pool.checkedin() + pool.checkedout() - 1)  # type: ignore[attr-defined]
    except Exception as exc:  # a check that only warns must never stop the worker's start
        log.info("could not read the server's connection room", error=type(exc).__name__)
        return None
    needed = concurrency + WORKER_OWN_CONNECTIONS
    if not room.admits(needed, held=held):
        log.warning(
            "the PostgreSQL server may refuse this worker's connections",
            needed=needed,
            admitted=room.free + held,
            max_connections=room.max_connections,
            in_use=room.in_use,
            hint="lower --concurrency, or raise the server's max_connections",
        )
    return room


class _StopRequest:
    """A stop asked for by a signal, before or after the worker exists."""

    def __init__(self) -> None:
        self.requested = False
        self._worker: Worker | None = None

    def request(self) -> None:
        self.requested = True
        if self._worker is not None:
            self._worker.stop()

    def attach(self, worker: Worker) -> None:
        self._worker = worker
        if self.requested:
            worker.stop()


async def _serve(
    url: str,
    stop: _StopRequest,
    *,
    settings: EngineSettings,
    concurrency: int,
    once: bool,
    poll_seconds: float,
    fake_shop: str | None,
    app_ref: str | None,
    metrics_port: int | None,
) -> WorkerStats:
    from orchestrator.cli import _require_existing

    # The store first, checked and never created (module docs): a worker given the wrong
    # database is refused before its providers open theirs (the fake shop writes its tables).
    _require_existing(url)
    # Every log line of this process names its worker, next to the engine's tx_id / op_key.
    structlog.contextvars.bind_contextvars(worker=settings.worker_id)
    orch = await Orchestrator.open(
        url, settings=worker_settings(settings, concurrency), auto_upgrade="never"
    )
    # What the providers opened, closed after the engine whatever failed.
    closers: list[Any] = []
    try:
        try:
            for provider in await open_providers(fake_shop, app_ref, closers):
                orch.register_provider(provider)
            return await _work(orch, stop, concurrency, once, poll_seconds, metrics_port)
        finally:
            await orch.close()
    finally:
        await close_all(closers)


async def _work(
    orch: Orchestrator,
    stop: _StopRequest,
    concurrency: int,
    once: bool,
    poll_seconds: float,
    metrics_port: int | None,
) -> WorkerStats:
    await warn_if_short_of_connections(orch, concurrency)
    if metrics_port is not None:
        try:
            orch.metrics.serve(metrics_port)
        except OSError as exc:
            # Said as the port's problem: as an OSError it read "database unreachable".
            from orchestrator.cli import CliFailure

            reason = exc.strerror or str(exc)
            raise CliFailure(f"--metrics-port {metrics_port}: {reason}") from None
    worker = Worker(orch, concurrency=concurrency, poll_seconds=poll_seconds)
    stop.attach(worker)
    return await worker.run(once=once)
