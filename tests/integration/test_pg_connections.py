"""A PostgreSQL server out of connections: the engine says ``store_unavailable`` and writes
nothing, and the bench refuses a run that cannot fit before it starts.

PostgreSQL only. What could break: the server's refusal (``53300``, raised by asyncpg while
connecting, unwrapped) reached callers as a raw driver error, and ``agent-txn bench
--concurrency 128`` on a default server (``max_connections`` 100) ended in a traceback.

A role with a ``CONNECTION LIMIT`` makes the refusal without taking the shared server's slots
from the tests running beside this one (superusers are exempt from it, so the role is not one:
it is a member of the test role, which owns the tables).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url
from structlog.testing import capture_logs
from typer.testing import CliRunner

from fault_injection.bench_cli import app
from fault_injection.sagas import order, order_saga
from ledger import dialects
from ledger.errors import StoreUnavailable
from ledger.pg_room import ConnectionRoom, connection_room
from orchestrator.engine import Orchestrator
from orchestrator.errors import StoreUnavailableError
from orchestrator.worker import Worker
from orchestrator.workerproc import WORKER_OWN_CONNECTIONS, warn_if_short_of_connections
from providers.memory import MemoryShop
from tests.conftest import DbUrls, pg_admin_url, pg_connect
from tests.support.postgres_only import postgres_backend  # noqa: F401  (the fixture)


@pytest.fixture
async def limited_role(db_urls: DbUrls) -> AsyncIterator[str]:
    """A login role that may do what the test role does, not a superuser; dropped after."""
    name = f"agent_txn_limited_{uuid.uuid4().hex[:10]}"
    admin = await pg_connect(pg_admin_url())
    owner = make_url(pg_admin_url()).username or "postgres"
    try:
        await admin.execute(f'CREATE ROLE "{name}" LOGIN NOSUPERUSER')
        await admin.execute(f'GRANT "{owner}" TO "{name}"')
        yield name
    finally:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", name
        )
        await admin.execute(f'DROP ROLE IF EXISTS "{name}"')
        await admin.close()


def _as(url: str, role: str) -> str:
    return make_url(url).set(username=role, password=None).render_as_string(hide_password=False)


async def _limit(role: str, connections: int) -> None:
    admin = await pg_connect(pg_admin_url())
    try:
        await admin.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT {connections}')
    finally:
        await admin.close()


async def _transactions(url: str) -> int:
    conn = await pg_connect(url)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM transactions"))
    finally:
        await conn.close()


async def test_a_refused_connection_is_store_unavailable_and_nothing_is_written(
    db_urls: DbUrls, limited_role: str
) -> None:
    url = _as(db_urls.store, limited_role)
    shop = MemoryShop()
    orch = await Orchestrator.open(url, providers=shop.providers())
    try:
        await orch.register(order_saga())
        await _limit(limited_role, 0)
        # The connections the store already holds stay open; the next transaction must open
        # one, and the server refuses it.
        await orch.store._close_idle()  # back to the pool first, which dispose() then closes
        await orch.store.engine.dispose()
        with pytest.raises(StoreUnavailableError) as caught:
            await orch.execute(order_saga(), order("refused-1"))
        cause = caught.value.__cause__
        assert isinstance(cause, StoreUnavailable), repr(cause)
        assert "53300: too many connections" in str(cause)
    finally:
        await _limit(limited_role, -1)
        await orch.close()
    assert await _transactions(db_urls.store) == 0  # the intent was never made durable
    assert not any(shop.counts().values())  # and nothing crossed to the shop


async def test_the_refusal_while_connecting_translates_to_store_unavailable(
    db_urls: DbUrls, limited_role: str
) -> None:
    await _limit(limited_role, 0)
    try:
        await pg_connect(_as(db_urls.store, limited_role))
    except Exception as exc:  # asyncpg's TooManyConnectionsError, unwrapped
        translated = dialects.translate(exc)
    else:
        pytest.fail("the server admitted a role whose limit is 0")
    assert isinstance(translated, StoreUnavailable)
    assert str(translated) == "database refused the connection (53300: too many connections)"


async def test_the_room_counts_the_connections_open(db_urls: DbUrls) -> None:
    held = [await pg_connect(db_urls.store) for _ in range(3)]
    try:
        room = await connection_room(db_urls.store)
        conn = held[0]
        max_connections = int(await conn.fetchval("SHOW max_connections"))
        superuser = bool(
            await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        )
    finally:
        for conn in held:
            await conn.close()
    assert room.max_connections == max_connections
    assert room.superuser is superuser
    assert room.in_use >= 3
    assert room.free <= max_connections - 3


def test_the_bench_refuses_a_run_the_server_cannot_hold(db_urls: DbUrls) -> None:
    # Not a coroutine: the command runs its own event loop, as it does from a shell.
    room = asyncio.run(connection_room(db_urls.store))
    concurrency = 1024  # the most the option takes
    if room.free >= concurrency + 4:
        pytest.skip(f"this server admits {room.free} connections: 1024 in flight would fit")
    got = CliRunner().invoke(
        app, ["--db", db_urls.store, "--sagas", "1", "--concurrency", str(concurrency)]
    )
    assert got.exit_code == 2, got.output
    assert "Traceback" not in got.output
    assert "--concurrency 1024 keeps up to 1028 PostgreSQL connections open at once" in got.output
    assert "raise the server's max_connections" in got.output


async def test_a_role_that_is_not_a_superuser_reads_the_reserved_slots(
    db_urls: DbUrls, limited_role: str
) -> None:
    room = await connection_room(_as(db_urls.store, limited_role))
    conn = await pg_connect(db_urls.store)
    try:
        reserved = int(await conn.fetchval("SHOW superuser_reserved_connections"))
    finally:
        await conn.close()
    assert room.superuser is False
    assert room.reserved == reserved


async def test_a_worker_outlives_a_refused_connection_and_claims_once_admitted(
    db_urls: DbUrls, limited_role: str
) -> None:
    """Before class 53 was translated, the raw driver error escaped the worker's claim pass
    (it catches storage errors only) and ended its loop."""
    url = _as(db_urls.store, limited_role)
    shop = MemoryShop()
    orch = await Orchestrator.open(url, providers=shop.providers())
    try:
        shop.seed_stock({"sku-1": 10})
        await orch.register(order_saga())
        await orch.enqueue(order_saga(), order("queued-1"))
        await _limit(limited_role, 0)
        await orch.store._close_idle()  # back to the pool first, which dispose() then closes
        await orch.store.engine.dispose()
        worker = Worker(orch, concurrency=2, poll_seconds=0.01)
        assert await worker.run_pass() == 0
        assert worker.stats.errors == 1 and worker.stats.claimed == 0
        await _limit(limited_role, -1)
        stats = await worker.run(once=True)
    finally:
        await _limit(limited_role, -1)
        await orch.close()
    assert stats.claimed == 1 and stats.by_status == {"committed": 1}
    assert shop.counts() == {
        "inventory.reserve": 1,
        "inventory.release": 0,
        "payments.charge": 1,
        "payments.refund": 0,
        "email.send": 1,
    }


async def test_a_worker_warns_at_start_when_its_sagas_may_not_fit(
    db_urls: DbUrls, monkeypatch: pytest.MonkeyPatch
) -> None:
    orch = await Orchestrator.open(db_urls.store)
    try:
        # A server of 100 with 99 in use: whatever this process holds, 64 in hand cannot fit.
        async def full_server(conn: object) -> ConnectionRoom:
            return ConnectionRoom(100, 3, 99, superuser=True)

        monkeypatch.setattr("orchestrator.workerproc.read_room", full_server)
        with capture_logs() as logs:
            room = await warn_if_short_of_connections(orch, 64)
    finally:
        await orch.close()
    assert room is not None and room.free == 1
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1, logs
    assert warnings[0]["event"] == "the PostgreSQL server may refuse this worker's connections"
    assert warnings[0]["needed"] == 64 + WORKER_OWN_CONNECTIONS
    assert warnings[0]["max_connections"] == 100 and warnings[0]["in_use"] == 99


async def test_a_worker_that_fits_reads_the_real_room_and_says_nothing(db_urls: DbUrls) -> None:
    orch = await Orchestrator.open(db_urls.store)
    try:
        with capture_logs() as logs:
            room = await warn_if_short_of_connections(orch, 2)
    finally:
        await orch.close()
    assert room is not None and room.max_connections > room.in_use >= 0
    assert not [e for e in logs if e["log_level"] == "warning"], logs


async def test_a_sqlite_worker_has_no_room_to_read(tmp_path: Path) -> None:
    orch = await Orchestrator.open(f"sqlite+aiosqlite:///{tmp_path / 'agent.db'}")
    try:
        assert await warn_if_short_of_connections(orch, 1024) is None
    finally:
        await orch.close()


async def test_a_room_that_cannot_be_read_does_not_stop_a_worker(
    db_urls: DbUrls, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unreadable(conn: object) -> ConnectionRoom:
        raise RuntimeError("permission denied for view pg_stat_activity")

    monkeypatch.setattr("orchestrator.workerproc.read_room", unreadable)
    orch = await Orchestrator.open(db_urls.store)
    try:
        assert await warn_if_short_of_connections(orch, 1024) is None
    finally:
        await orch.close()
