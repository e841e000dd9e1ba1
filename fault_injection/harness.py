"""The suite's test bench: our database, the fake provider's own database, and engines on them.

An engine here stands for one process. ``crash`` abandons it without cleanup (its leases stay
held until they expire, exactly as after a real death); ``recover`` starts fresh engines whose
clocks run past the dead holder's leases and drains them concurrently.

:func:`fresh_databases` makes the pair of databases a run works on: two SQLite files in a work
folder, or two new databases on the PostgreSQL server a ``--db`` URL names (dropped after).
:func:`scratch_folder` makes that work folder: where a SQLite ``--db`` URL's file would be, or
a temporary folder when there is none. A run needs fresh files, so a SQLite URL cannot name
them; it names the disk they are on instead, which is what a SQLite figure under ``FULL``
measures (a ``/tmp`` on tmpfs has no fsync to wait for).
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections.abc import AsyncIterator, Collection, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from fault_injection._evidence import EvidenceReader
from fault_injection.invariants import CheckReport, check_snapshot
from fault_injection.sagas import STOCK
from ledger.dialects import dialect_of, in_memory, normalize_url, pg_numbers
from orchestrator.config import EngineSettings
from orchestrator.engine import Orchestrator
from providers.fake.faults import FaultPlan
from providers.fake.shop import FakeShop

#: Fast settings: tiny backoffs so a schedule settles in milliseconds, small budgets so the
#: manual-review paths are reached.
SUITE_SETTINGS: Mapping[str, Any] = {
    "backoff_initial_seconds": 0.002,
    "backoff_max_seconds": 0.02,
    "execute_budget_seconds": 0.5,
    "call_timeout_seconds": 1.0,
    "lease_seconds": 30.0,
    "reconcile_attempts": 6,
    "compensation_attempts": 4,
}


def suite_settings(**overrides: Any) -> EngineSettings:
    """Engine settings for one suite "process" (a unique worker id each)."""
    values = {**SUITE_SETTINGS, "worker_id": f"fi-{uuid.uuid4().hex[:8]}", **overrides}
    return EngineSettings.model_validate(values)


def sqlite_folder(db: str | None) -> Path | None:
    """The folder of the file a SQLite URL names, where a run's fresh SQLite files go; ``None``
    with no URL (a temporary folder) or a PostgreSQL one. Raises :class:`ValueError` for an
    in-memory database, which the engine's writer process and the shop could not share."""
    if db is None:
        return None
    url = make_url(normalize_url(db))
    if url.get_backend_name() != "sqlite":
        return None
    if in_memory(db) or url.database is None:
        raise ValueError(
            "an in-memory SQLite database cannot be shared by the engine, its writer process "
            "and the shop; give a file URL (fresh files are made in its folder)"
        )
    return Path(url.database).expanduser().absolute().parent


def scratch_folder(db: str | None, prefix: str) -> tempfile.TemporaryDirectory[str]:
    """A new folder for one run's files, removed after: in :func:`sqlite_folder` of ``db``, or
    the system's temporary folder."""
    return tempfile.TemporaryDirectory(prefix=prefix, dir=sqlite_folder(db))


@dataclass(frozen=True)
class DatabasePair:
    """Our database and the provider's."""

    store: str
    provider: str
    backend: str


#: How long a first connection to a ``--db`` server may take before the command gives up on
#: it, when the URL gives no ``timeout`` of its own. asyncpg waits 60 s by default, and a
#: server that accepts the connection but never answers (a wrong port behind a proxy, a hung
#: server) kept the bench waiting that long at each of its connections; docs/fault-injection.md
#: promises that an unreachable database ends the run at once.
PROBE_CONNECT_SECONDS = 10.0


def probe_url(db: str) -> str:
    """``db`` normalised, with :data:`PROBE_CONNECT_SECONDS` as its connect ``timeout`` when it
    gives none (PostgreSQL; a SQLite URL is returned normalised). For the short connections a
    command opens before its run (the server's room, its version, the fresh databases), never
    for the run's own URLs: the URL's options are the user's."""
    url = make_url(normalize_url(db))
    if url.get_backend_name() != "postgresql" or "timeout" in url.query:
        return url.render_as_string(hide_password=False)
    return url.update_query_dict({"timeout": str(PROBE_CONNECT_SECONDS)}).render_as_string(
        hide_password=False
    )


#: PostgreSQL's ``insufficient_privilege``: here, a role without ``CREATEDB``.
_PG_INSUFFICIENT_PRIVILEGE = "42501"


def admin_engine(server: str) -> AsyncEngine:
    """An engine for the CREATE and DROP of a run's databases, and for a command's own
    statements on a ``--db`` server: autocommit (neither runs in a transaction), the URL's
    numeric options as numbers (:func:`ledger.dialects.pg_numbers`), and the short connect
    timeout of :func:`probe_url`. NullPool: a fresh connection each time, so a server restart
    during the run (the opt-in concurrency scenario) cannot leave a dead pooled connection
    behind."""
    url = probe_url(server)
    return create_async_engine(
        url,
        isolation_level="AUTOCOMMIT",
        poolclass=NullPool,
        connect_args=pg_numbers(url),
    )


async def _create_database(conn: AsyncConnection, name: str) -> None:
    try:
        await conn.execute(text(f'CREATE DATABASE "{name}"'))
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) != _PG_INSUFFICIENT_PRIVILEGE:
            raise
        from orchestrator.cli import CliFailure  # the command's own one-line failure

        raise CliFailure(
            "--db: this role cannot create databases (the run makes fresh ones on the "
            "server, dropped after)"
        ) from None


@asynccontextmanager
async def fresh_databases(db: str | None, workdir: Path) -> AsyncIterator[DatabasePair]:
    """A new, empty pair of databases for one run (SQLite files, or PostgreSQL databases).

    On PostgreSQL, a server that cannot be reached fails at the first connection, within
    :data:`PROBE_CONNECT_SECONDS`; only the databases that were made are dropped after (a
    DROP after a failed CREATE waited for the unreachable server once more, and its error
    replaced the first)."""
    if db is None or dialect_of(normalize_url(db)) == "sqlite":
        base = workdir / uuid.uuid4().hex[:8]
        base.mkdir(parents=True, exist_ok=True)
        yield DatabasePair(
            f"sqlite+aiosqlite:///{base / 'agent.db'}",
            f"sqlite+aiosqlite:///{base / 'provider.db'}",
            "sqlite",
        )
        return
    server = make_url(normalize_url(db))
    names = [f"agt_fi_{uuid.uuid4().hex[:10]}", ""]
    names[1] = names[0] + "_provider"
    created: list[str] = []
    admin = admin_engine(server.render_as_string(hide_password=False))
    try:
        async with admin.connect() as conn:
            for name in names:
                await _create_database(conn, name)
                created.append(name)
        yield DatabasePair(
            server.set(database=names[0]).render_as_string(hide_password=False),
            server.set(database=names[1]).render_as_string(hide_password=False),
            "postgres",
        )
    finally:
        try:
            if created:
                async with admin.connect() as conn:
                    for name in created:
                        await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            await admin.dispose()


@dataclass
class Harness:
    """One run's world: the shop, the engines, and the invariant checker over both databases."""

    dbs: DatabasePair
    shop: FakeShop
    engines: list[Orchestrator] = field(default_factory=list)
    #: The checker's connections, opened at the first check and kept until :meth:`close`.
    _evidence: EvidenceReader | None = field(default=None, repr=False)

    @classmethod
    async def open(cls, dbs: DatabasePair, *, faults: FaultPlan | None = None) -> Harness:
        """Open the shop (stocked) on the provider database."""
        shop = await FakeShop.open(dbs.provider, faults=faults)
        await shop.seed_stock(STOCK)
        return cls(dbs, shop)

    async def engine(self, **overrides: Any) -> Orchestrator:
        """A fresh engine ("process") on our database."""
        orch = await Orchestrator.open(
            self.dbs.store, providers=self.shop.providers(), settings=suite_settings(**overrides)
        )
        self.engines.append(orch)
        return orch

    async def crash(self, orch: Orchestrator) -> None:
        """Abandon ``orch`` as a dead process: no lease is released, nothing more is written."""
        await orch.abandon()
        if orch in self.engines:
            self.engines.remove(orch)

    async def recover(
        self, *, workers: int = 1, timeout_seconds: float = 30.0, advance_seconds: float = 31.0
    ) -> list[Orchestrator]:
        """Fresh engines, clocks past every dead lease, draining concurrently until idle."""
        fresh = [await self.engine() for _ in range(workers)]
        for orch in fresh:
            orch.store.advance_clock(advance_seconds)
        await asyncio.gather(*(o.drain(timeout_seconds=timeout_seconds) for o in fresh))
        return fresh

    async def check(
        self, tx_ids: Collection[str] | None = None, *, require_settled: bool = True
    ) -> CheckReport:
        """Every invariant, read from both databases (through connections of the checker's
        own, never an engine's: ``fault_injection.invariants.check_invariants``)."""
        # A call an engine gave up on (its timeout, its crash) may still be landing at the
        # shop: the snapshot must hold everything that will ever land, or it could pass a
        # state that is about to change.
        await self.shop.settle()
        if self._evidence is None:
            self._evidence = await EvidenceReader.open(self.dbs.store, self.dbs.provider)
        snap = await self._evidence.load(tx_ids)
        return check_snapshot(snap, require_settled=require_settled)

    async def close(self) -> None:
        """Close every engine, the checker's connections and the shop."""
        for orch in self.engines:
            await orch.close()
        self.engines.clear()
        if self._evidence is not None:
            evidence, self._evidence = self._evidence, None
            await evidence.close()
        await self.shop.close()


def tx_ids_of(*results: Any) -> list[str]:
    """The tx ids of saga results (for scoping a check)."""
    return [r.tx_id for r in results]
