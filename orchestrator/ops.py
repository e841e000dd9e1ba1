"""Operator jobs: retention pruning and the requeue of lost callback deliveries (seed 000, 保留期).

Both are operator-triggered only — ``agent-txn ops …`` or the operator HTTP routes — and never a
background job: deleting audit records is a decision somebody takes, on a day they choose.

* :func:`prune` deletes ``succeeded`` and ``failed`` execution records created more than 180 days
  ago, with their dependents (idempotency reservations, callback runs, staged actions and staged
  changes). ``staged`` records are never pruned, whatever their age (they wait for a decision);
  neither are ``running`` or ``manual_review`` ones. The ledger is never touched: an execution is
  an audit view, the ledger is the append-only history of its transaction and keeps its hash chain.
* :func:`requeue_callbacks` republishes stale ``pending`` runs, retries ``failed`` runs that have
  an attempt left and reclaims ``running`` runs whose lease expired
  (:func:`ledger.callbacks.requeue`), bounded by ``limit``.

Who may call them is decided by :func:`is_operator`: a principal holding ``manage`` on
``agent-txn.ops`` (see :data:`OPS_PROVIDER`, :data:`OPS_ACTION`). The CLI is trusted (whoever can
reach the database is an operator already); the HTTP layer checks it.

Tenants may share one database, and an operator is a principal of one tenant: both jobs take a
``tenant`` and then touch only the executions of that tenant's commands (and their callback
runs). The HTTP routes always pass the tenant the server serves; the CLI acts on every tenant
unless given ``--tenant``.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any, Final

from ledger import callbacks, executions
from ledger.store import Store
from orchestrator.authz import Principal
from orchestrator.errors import RequestInvalid

RETENTION_DAYS: Final = 180
DAY_MS: Final = 86_400_000

#: The grant that makes a principal an operator: ``manage`` on ``agent-txn.ops``. A pseudo
#: provider, so operators are granted like everything else (``agent-txn principals grant``) and a
#: provider-wide ``agent-txn.*`` manage grant counts too, as it does for any provider.
OPS_PROVIDER: Final = "agent-txn"
OPS_ACTION: Final = "ops"
OPS_PERMISSION: Final = "manage"

REQUEUE_DEFAULT_OLDER_THAN_SECONDS: Final = 300
REQUEUE_DEFAULT_LIMIT: Final = 500
REQUEUE_MAX_LIMIT: Final = 2000


def is_operator(principal: Principal) -> bool:
    """Whether ``principal`` may run operator jobs: it holds ``manage`` on ``agent-txn.ops``.

    The principal was already checked alive, verified and enabled when it was loaded
    (:func:`orchestrator.authz.load_principal`); this only looks at its grants.
    """
    return bool(principal.grant_for(OPS_PROVIDER, OPS_ACTION, frozenset({OPS_PERMISSION})))


def utc_iso(epoch_ms: int) -> str:
    """``2026-01-31T12:00:00.123Z`` for an epoch-millisecond timestamp."""
    stamp = datetime.fromtimestamp(epoch_ms / 1000, tz=UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _invalid(field: str, problem: str) -> RequestInvalid:
    return RequestInvalid(details={"errors": [{"field": field, "problem": problem}]})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def prune(
    store: Store,
    *,
    now_ms: int | None = None,
    retention_days: int = RETENTION_DAYS,
    tenant: str | None = None,
) -> dict[str, Any]:
    """Delete finished execution records older than ``retention_days`` (by ``created_at``), of
    ``tenant``'s commands only (``None``: of every tenant's).

    Returns exactly ``{"pruned": n, "retention_days": days, "cutoff": "<ISO-8601 UTC>"}``.
    ``now_ms`` defaults to the store's clock — the clock ``created_at`` was written with — and is
    a parameter so tests and dry reasoning can pin the cutoff. One transaction: a failure
    deletes nothing.
    """
    if not _is_int(retention_days) or retention_days < 1:
        raise _invalid("retention_days", "must be an integer >= 1")
    now = store.now_ms() if now_ms is None else now_ms
    cutoff = now - retention_days * DAY_MS
    async with store.transaction() as work:
        pruned = await executions.prune(work, cutoff_ms=cutoff, tenant=tenant)
    return {"pruned": pruned, "retention_days": retention_days, "cutoff": utc_iso(cutoff)}


async def requeue_callbacks(
    store: Store,
    *,
    older_than_seconds: float = REQUEUE_DEFAULT_OLDER_THAN_SECONDS,
    limit: int = REQUEUE_DEFAULT_LIMIT,
    tenant: str | None = None,
) -> dict[str, int]:
    """Recover lost callback deliveries; ``{"republished": n, "retried": n, "reclaimed": n}``.
    Only the runs of ``tenant``'s executions (``None``: every tenant's).

    ``older_than_seconds`` (>= 0) is how long a pending or running run must have been left alone
    to count as stale; ``limit`` (1..2000) bounds the runs changed in all, oldest first. Invalid
    values raise :class:`~orchestrator.errors.RequestInvalid` before anything is read.
    """
    problems: list[dict[str, str]] = []
    if (
        not isinstance(older_than_seconds, int | float)
        or isinstance(older_than_seconds, bool)
        or not math.isfinite(older_than_seconds)
        or older_than_seconds < 0
    ):
        problems.append({"field": "older_than_seconds", "problem": "must be a number >= 0"})
    if not _is_int(limit) or not 1 <= limit <= REQUEUE_MAX_LIMIT:
        problems.append({"field": "limit", "problem": f"must be 1..{REQUEUE_MAX_LIMIT}"})
    if problems:
        raise RequestInvalid(details={"errors": problems})
    async with store.transaction() as work:
        return await callbacks.requeue(
            work,
            older_than_ms=int(min(older_than_seconds, 1e12) * 1000),
            limit=limit,
            tenant=tenant,
        )


__all__ = [
    "OPS_ACTION",
    "OPS_PERMISSION",
    "OPS_PROVIDER",
    "RETENTION_DAYS",
    "is_operator",
    "prune",
    "requeue_callbacks",
]
