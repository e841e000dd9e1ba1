"""Engine settings: frozen, validated, passed explicitly (only the CLI reads the environment)."""

from __future__ import annotations

import os
import socket
import uuid

from pydantic import BaseModel, ConfigDict, Field

from ledger import dialects
from ledger.schema import TENANT_LENGTH
from ledger.store import SqliteWriter


def default_worker_id() -> str:
    """host:pid:random — unique per process, readable in the ledger."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


#: The longest lease, in seconds (``EngineSettings.lease_seconds``).
MAX_LEASE_SECONDS = 3600.0
#: The longest idle poll interval a worker takes (``Worker``, ``agent-txn worker
#: --poll-seconds``): the longest lease. Its bound keeps out ``inf``, with which an idle worker
#: would never poll again.
MAX_POLL_SECONDS = MAX_LEASE_SECONDS


class EngineSettings(BaseModel):
    """How the engine runs sagas. Every duration is in seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Part of every idempotency key: two tenants or environments never share a key.
    tenant: str = Field(default="default", min_length=1, max_length=TENANT_LENGTH)
    environment: str = Field(default="dev", min_length=1, max_length=100)
    #: Appears as ``lease_owner`` and in the ledger.
    worker_id: str = Field(default_factory=default_worker_id, min_length=1, max_length=128)
    #: How long a claim stays ours without renewal; judged by the database clock.
    lease_seconds: float = Field(default=30.0, gt=0, le=MAX_LEASE_SECONDS)
    #: Budget of one provider call; past it the outcome is unknown, not failed.
    call_timeout_seconds: float = Field(default=10.0, gt=0, le=600)
    #: How long ``execute`` keeps reconciling an in-doubt effect before leaving it to workers.
    execute_budget_seconds: float = Field(default=5.0, ge=0, le=3600)
    #: Claims of one forward op or outbox event before it is parked in manual_review.
    reconcile_attempts: int = Field(default=8, ge=1, le=1000)
    #: Claims of one compensation step before it is parked in manual_review.
    compensation_attempts: int = Field(default=8, ge=1, le=1000)
    #: Jittered exponential backoff between reconcile attempts (tenacity).
    backoff_initial_seconds: float = Field(default=0.05, gt=0, le=60)
    backoff_max_seconds: float = Field(default=30.0, gt=0, le=3600)
    #: Largest result projection (canonical JSON bytes) a saga may commit with.
    max_output_bytes: int = Field(default=1_048_576, ge=1, le=64 * 1_048_576)
    #: SQLite ``synchronous`` pragma (FULL survives power loss; NORMAL only process crashes).
    sqlite_synchronous: str = Field(default="FULL", pattern="^(OFF|NORMAL|FULL|EXTRA)$")
    #: PostgreSQL connections kept open (and as many again in a burst). Size it to the local
    #: transactions this process runs at once (sagas in flight): a burst connection is closed
    #: when it is checked in, so running above the pool opens and closes a connection (and
    #: re-prepares its statements) every transaction.
    pg_pool_size: int = Field(default=dialects.PG_POOL_SIZE, ge=1, le=1000)
    #: PostgreSQL: concurrent transactions that end with the same statement share a commit; with
    #: this on, they leave in two cohorts of half the open transactions each, so that one runs
    #: on the server while this process works on the other (``ledger/grouped.py``): +14 to 26 %
    #: sagas/s at 16 in flight, for a process driving sagas as they come
    #: (``docs/benchmarks-log.md``, item 39). A worker process (``agent-txn worker``) turns it
    #: off unless set: it claims sagas in batches when half its slots are free, and half-size
    #: cohorts halve its batches.
    pg_commit_cohorts: bool = True
    #: SQLite (a plain file): where groups of concurrent transactions commit. ``process``: in
    #: a writer process of the store's own, started with the first group, on another core,
    #: while this process goes on with its other sagas (``ledger/sqlite_writer.py``); a
    #: transaction alone, and one that needs more than blind writes, still commits here.
    #: ``inline``: on the event loop, for a process that must not start another. ``None``: the
    #: store's default (:data:`ledger.store.DEFAULT_SQLITE_WRITER`, ``process``).
    sqlite_writer: SqliteWriter | None = None

    @property
    def lease_ms(self) -> int:
        """The lease in milliseconds."""
        return int(self.lease_seconds * 1000)
