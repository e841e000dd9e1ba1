"""Running a worker as a process: which providers it serves, signals, and the run itself.

A worker process needs the same providers the sagas were written against. ``--app
module:attribute`` names them (an iterable of providers, an object with ``providers()``, or a
callable — sync or async — returning either), like Celery's ``-A``; ``--fake-shop URL`` is a
shortcut that serves the fake shop's three providers from its database.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import signal
from collections.abc import Iterable
from typing import Any

import structlog

from orchestrator.config import EngineSettings
from orchestrator.engine import Orchestrator
from orchestrator.errors import DefinitionInvalid
from orchestrator.worker import Worker, WorkerStats
from providers.contract import Provider

log = structlog.get_logger(__name__)


async def load_providers(app_ref: str) -> tuple[list[Provider], Any]:
    """Import ``module:attribute`` and turn it into providers; also returns what to close."""
    module_name, _, attr = app_ref.partition(":")
    if not module_name or not attr:
        raise DefinitionInvalid(details={"reason": "--app must look like module:attribute"})
    try:
        target: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise DefinitionInvalid(details={"reason": f"cannot load {app_ref}: {exc}"}) from None
    if callable(target) and not hasattr(target, "providers"):
        target = target()
        if inspect.isawaitable(target):
            target = await target
    if hasattr(target, "providers"):
        return list(target.providers()), target
    if isinstance(target, Iterable):
        return list(target), None
    raise DefinitionInvalid(details={"reason": f"{app_ref} gives no providers"})


#: Connections a worker needs beyond one per saga in hand: its claim pass and its callbacks.
WORKER_OWN_CONNECTIONS = 2


def sized_for(settings: EngineSettings, concurrency: int) -> EngineSettings:
    """``settings`` with a PostgreSQL pool large enough for ``concurrency`` sagas in hand: each
    holds a connection during its local transactions, and a transaction above the pool would
    open (and close) a connection of its own every time (README: pg_pool_size)."""
    needed = concurrency + WORKER_OWN_CONNECTIONS
    if settings.pg_pool_size >= needed:
        return settings
    return settings.model_copy(update={"pg_pool_size": needed})


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
    """Open the store, serve the providers, run until SIGTERM/SIGINT (or idle, with ``once``)."""
    closers: list[Any] = []
    providers: list[Provider] = []
    if fake_shop is not None:
        from providers.fake.shop import FakeShop

        shop = await FakeShop.open(fake_shop)
        providers.extend(shop.providers())
        closers.append(shop)
    if app_ref is not None:
        loaded, closer = await load_providers(app_ref)
        providers.extend(loaded)
        if closer is not None and hasattr(closer, "close"):
            closers.append(closer)
    # Every log line of this process names its worker, next to the tx_id / op_key the engine binds.
    structlog.contextvars.bind_contextvars(worker=settings.worker_id)
    orch = await Orchestrator.open(
        url, providers=providers, settings=sized_for(settings, concurrency)
    )
    if metrics_port is not None:
        orch.metrics.serve(metrics_port)
    worker = Worker(orch, concurrency=concurrency, poll_seconds=poll_seconds)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    try:
        return await worker.run(once=once)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await orch.close()
        for closer in closers:
            result = closer.close()
            if inspect.isawaitable(result):
                await result
