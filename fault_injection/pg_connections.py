"""Whether a bench run's connections fit in what the PostgreSQL server still admits.

Why: every saga in flight holds a connection during its local transactions (the store's pool
is sized to them, ``EngineSettings.pg_pool_size``), and so does each worker process's and the
fake shop's. Past the server's ``max_connections`` the server refuses the next connection
(``53300``, "too many clients"), the sagas that needed it fail with ``store_unavailable``,
and a run of ``agent-txn bench --concurrency 128`` on a default server (100) ended in a
traceback instead of a measurement. So the bench asks the server first, and refuses what
cannot fit with one line that says what to change.

The room itself is read by :mod:`ledger.pg_room`. It is a reading of a moment: other
clients may take slots during the run, so the estimate of what the run needs
(:func:`connections_needed`) keeps a margin of its own.
"""

from __future__ import annotations

from ledger.pg_room import ConnectionRoom
from orchestrator.workerproc import WORKER_OWN_CONNECTIONS

#: Connections the bench itself holds beside the engines: the environment's and the server
#: CPU reader's short ones, the workers' bench's progress poller.
BENCH_OWN_CONNECTIONS = 2
#: Beside its sagas in flight, a process of ours keeps one for its outbox dispatch and one
#: kept idle by the store, as a worker's pool allows for (measured: at C = 32 and 64 the
#: run's peak was C + 1 client connections).
PROCESS_OWN_CONNECTIONS = WORKER_OWN_CONNECTIONS


def connections_needed(*, concurrency: int, workers: int, provider: str) -> int:
    """The most connections a run holds at once: each process of ours (the bench's own, or
    each of ``workers``) its sagas in flight and its own two, the fake shop's pool as many
    again (its calls run inside the sagas' steps; the memory provider keeps none), and the
    bench's."""
    processes = max(1, workers)
    engines = processes * (concurrency + PROCESS_OWN_CONNECTIONS)
    shop = 0 if provider == "memory" else processes * concurrency
    return engines + shop + BENCH_OWN_CONNECTIONS


def too_many(needed: int, room: ConnectionRoom, *, what: str) -> str | None:
    """The line that refuses a run needing ``needed`` connections, or ``None`` if it fits."""
    if room.admits(needed):
        return None
    reserved = "" if room.superuser else f", {room.reserved} reserved for superusers"
    return (
        f"{what} keeps up to {needed} PostgreSQL connections open at once; the server"
        f" admits {room.free} more now"
        f" (max_connections {room.max_connections}, {room.in_use} in use{reserved}). Lower"
        " --concurrency, or raise the server's max_connections."
    )


__all__ = [
    "BENCH_OWN_CONNECTIONS",
    "PROCESS_OWN_CONNECTIONS",
    "connections_needed",
    "too_many",
]
