"""How many more connections a PostgreSQL server admits now.

Why: every saga in flight holds a connection during its local transactions (the store's pool is
sized to them, ``EngineSettings.pg_pool_size``), and past the server's ``max_connections`` the
server refuses the next one (sqlstate ``53300``): the transaction that needed it fails as
:class:`~ledger.errors.StoreUnavailable`. So a process about to hold many connections asks
first: ``agent-txn worker`` warns when its sagas in hand may not fit
(:mod:`orchestrator.workerproc`), and ``agent-txn bench`` refuses a run that cannot
(:mod:`fault_injection.pg_connections`).

The room is read, never configured: ``max_connections``, less the slots reserved for superusers
when the role is not one, less the client connections open now (other than the one asking).
It is a reading of a moment: other clients take and give back slots all the time.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import dialects

_ROOM_SQL = text(
    "SELECT current_setting('max_connections')::int,"
    " current_setting('superuser_reserved_connections')::int,"
    " (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int,"
    " (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"
)


@dataclass(frozen=True, slots=True)
class ConnectionRoom:
    """What the server admits, read at one moment (:func:`read_room`)."""

    max_connections: int
    #: Slots only superusers may take (``superuser_reserved_connections``).
    reserved: int
    #: Client connections open, not counting the one that read this.
    in_use: int
    superuser: bool

    @property
    def free(self) -> int:
        """Connections this role could still open."""
        limit = self.max_connections - (0 if self.superuser else self.reserved)
        return max(0, limit - self.in_use)

    def admits(self, needed: int, *, held: int = 0) -> bool:
        """Whether a process holding ``held`` of the connections counted in :attr:`in_use`
        could hold ``needed`` in all."""
        return needed <= self.free + held


async def read_room(conn: AsyncConnection) -> ConnectionRoom:
    """The room on the server ``conn`` is connected to."""
    row = (await conn.execute(_ROOM_SQL)).one()
    max_connections, reserved, open_now, superuser = row
    return ConnectionRoom(int(max_connections), int(reserved), int(open_now) - 1, bool(superuser))


async def connection_room(url: str) -> ConnectionRoom:
    """The room on the PostgreSQL server ``url`` names (one short connection of its own)."""
    engine = dialects.create_engine(dialects.normalize_url(url))
    try:
        async with engine.connect() as conn:
            return await read_room(conn)
    finally:
        await engine.dispose()


__all__ = ["ConnectionRoom", "connection_room", "read_room"]
