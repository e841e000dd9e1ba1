"""Execution records: what callers read back, and the hooks that keep them in step with sagas.

An execution row is written in the same local commit as its transaction's plan, and finished in
the same local commit as the transition that ends (or parks) the saga — by whoever drives it, the
caller's ``execute`` or a worker hours later. There is no second store to drift from the saga.

Payload rules of seed 000 applied here: null-valued keys are dropped, ``steps`` are capped at 40
and ``result_refs`` at 20, the safe error text at 4 096 characters, and a stored response snapshot
at 65 536 bytes (larger → a stand-in with ``truncated: true``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import structlog

from ledger import callbacks, commands, executions, reservations
from ledger.canonical import NotCanonicalizable, canonical_json
from ledger.executions import ExecutionRow
from ledger.states import EffectState, TxState
from ledger.store import Work
from orchestrator import authz, expressions
from orchestrator.errors import REGISTRY

if TYPE_CHECKING:
    from orchestrator.driver import SagaRun

log = structlog.get_logger(__name__)

MAX_STEPS: Final = 40
MAX_RESULT_REFS: Final = 20
MAX_ERROR_CHARS: Final = 4096
MAX_SNAPSHOT_BYTES: Final = 65_536

#: Codes that say "provably nothing was written" (seed 000: five codes).
NOTHING_WRITTEN: Final = frozenset(
    {
        "assertion_failed",
        "cap_exceeded",
        "cardinality_failed",
        "command_input_invalid",
        "command_rule_failed",
    }
)

_STATUS_OF: Final = {
    TxState.COMMITTED: "succeeded",
    TxState.FAILED: "failed",
    TxState.COMPENSATED: "failed",
    TxState.MANUAL_REVIEW: "manual_review",
}


def iso(ms: int | None) -> str | None:
    """Epoch milliseconds as an ISO-8601 UTC timestamp (seconds precision, like seed 000)."""
    if ms is None:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")


def drop_nulls(value: Any) -> Any:
    """Remove null-valued keys recursively: a missing key means null."""
    if isinstance(value, Mapping):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def compact(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`drop_nulls` of an object, typed as one."""
    out: dict[str, Any] = drop_nulls(mapping)
    return out


def safe_error(text: str | None) -> str | None:
    """Bounded error text (already safe: fixed registry messages or the author's own words)."""
    if text is None:
        return None
    return text[:MAX_ERROR_CHARS]


def snapshot(body: Mapping[str, Any]) -> dict[str, Any]:
    """The response as stored for replay: itself if small enough, else a truncated stand-in."""
    try:
        size = len(canonical_json(body).encode())
    except NotCanonicalizable:
        size = MAX_SNAPSHOT_BYTES + 1
    if size <= MAX_SNAPSHOT_BYTES:
        return dict(body)
    return compact(
        {
            "execution_id": body.get("execution_id"),
            "command_id": body.get("command_id"),
            "status": body.get("status"),
            "truncated": True,
        }
    )


def view(row: ExecutionRow) -> dict[str, Any]:
    """The execution as ``GET …/executions/{id}`` shows it (null keys dropped)."""
    body: dict[str, Any] = {
        "execution_id": row.execution_id,
        "command_id": row.command_id,
        "status": row.status,
        "invoker_id": row.invoker_id if row.invoker_kind == "user" else None,
        "invoker_client_id": row.invoker_id if row.invoker_kind == "client" else None,
        "idempotency_key": row.idempotency_key,
        "origin": row.origin,
        "duration_ms": row.duration_ms,
        "input_snapshot": row.input_snapshot,
        "authorization_snapshot": row.authorization_snapshot,
        "steps": row.steps,
        "result_refs": row.result_refs,
        "error": row.error,
        "error_code": row.error_code,
        "staged_change_id": row.staged_change_id,
        "created_at": iso(row.created_at),
    }
    return compact(body)


def step_summaries(run: SagaRun) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``steps`` (≤ 40) and ``result_refs`` (≤ 20) of a run: states and provider ids only."""
    steps: list[dict[str, Any]] = []
    refs: list[dict[str, Any]] = []
    for op in run.ops:
        steps.append(
            drop_nulls(
                {
                    "name": op.name,
                    "provider": op.provider,
                    "action": op.action,
                    "state": op.state.value,
                    "remote_id": op.remote_id,
                }
            )
        )
        if op.state is EffectState.CONFIRMED and op.remote_id:
            refs.append(
                {
                    "step": op.name,
                    "provider": op.provider,
                    "action": op.action,
                    "remote_id": op.remote_id,
                }
            )
    return steps[:MAX_STEPS], refs[:MAX_RESULT_REFS]


def error_of(stored: Mapping[str, Any] | None) -> tuple[str, str]:
    """(code, safe text) of a saga error: the author's message for a failed assert, else the
    registry's fixed message. Nothing from a provider is ever copied."""
    code = str((stored or {}).get("code") or "command_execution_failed")
    entry = REGISTRY.get(code) or REGISTRY["command_execution_failed"]
    if code == "assertion_failed" and (stored or {}).get("reason"):
        return code, str((stored or {})["reason"])
    return entry.code, entry.message


async def finish_execution(work: Work, run: SagaRun) -> None:
    """Terminal hook: finish the run's execution record in the saga's own commit."""
    assert run.execution_id is not None
    row = await executions.get_for_update(work, run.execution_id)
    if row is None:
        log.warning("execution record missing", execution_id=run.execution_id, tx_id=run.tx_id)
        return
    status = _STATUS_OF.get(run.txc.status)
    if status is None:
        return
    steps, refs = step_summaries(run)
    changes: dict[str, Any] = {
        "steps": steps,
        "result_refs": refs,
        "duration_ms": max(0, work.now_ms - row.created_at),
    }
    if status == "succeeded":
        try:
            output = run.output()
        except (expressions.ExpressionError, NotCanonicalizable):
            output = None  # refused in the validate phase already; never reached in practice
        body = view(row) | drop_nulls(
            {"status": status, "steps": steps, "result_refs": refs, "result": output}
        )
        body["duration_ms"] = changes["duration_ms"]
        changes |= {"response": snapshot(body), "error_code": None, "error": None}
    else:
        code, text = error_of(run.error)
        changes |= {"error_code": code, "error": safe_error(text)}
    await executions.finish(work, row.execution_id, status=status, **changes)
    if status == "failed" and row.idempotency_key is not None:
        # A failed execution never blocks a retry with the same key.
        await reservations.release(
            work,
            command_id=row.command_id,
            bucket=row.actor_bucket,
            key=row.idempotency_key,
            execution_id=row.execution_id,
        )
    if status in ("succeeded", "failed"):
        await enqueue_callbacks(work, row, status)


async def enqueue_callbacks(work: Work, row: ExecutionRow, event: str) -> None:
    """Lifecycle callbacks of the command for ``event``, queued durably with the outcome."""
    command = await commands.get(work.conn, row.command_id, include_deleted=True)
    if command is None:
        return
    targets = [
        str(cb["url"])
        for cb in command.definition.get("callbacks", []) or []
        if event in (cb.get("events") or [])
    ]
    if not targets:
        return
    payload = drop_nulls(
        {
            "event": event,
            "execution_id": row.execution_id,
            "command_id": row.command_id,
            "status": event,
        }
    )
    await callbacks.enqueue(
        work, execution_id=row.execution_id, event=event, targets=targets, payload=payload
    )


async def gate(work: Work, run: SagaRun, step: str, payload: Any) -> bool:
    """Step gate: the invoker may still perform ``step`` with ``payload`` (no definer rights)."""
    assert run.execution_id is not None
    row = await executions.get(work.conn, run.execution_id)
    if row is None:
        return False
    command = await commands.get(work.conn, row.command_id, include_deleted=True)
    if command is None:
        return False
    definition = run.definition.step(step)
    return await authz.recheck_step(
        work.conn,
        tenant=command.tenant,
        invoker_kind=row.invoker_kind,
        invoker_id=row.invoker_id,
        scope_kind=command.scope_kind,
        scope_id=command.scope_id,
        provider=str(definition["provider"]),
        action=str(definition["action"]),
        payload=payload if isinstance(payload, Mapping) else None,
    )
