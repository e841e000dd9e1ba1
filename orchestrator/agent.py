"""The agent toolbox: prepare a plan, let the person confirm it, execute it exactly once.

::

    proposal = await orch.agent.prepare(caller, command_id, {"order_id": "42", ...})
    print(proposal["proposal"])                # for the person: what will happen, no ids
    ...                                        # a later turn: the person says "yes"
    result = await orch.agent.execute_staged_action(caller, proposal["confirmation_token"])
    result["status"], result["guidance"]       # "succeeded", "Done. ..."
    await orch.agent.mark_delivered(caller, result_execution_id)   # the reply reached the room

Guarantees (seed 000, "Agent 工具箱" and "Agent 派送調解視窗"):

* **Nothing is written without the person's confirmation of exactly the plan they saw.**
  ``prepare`` validates and stages the full plan (execution and transaction ``staged``) and pins the
  stored definition's digest in private confirmation state. The agent only ever holds an opaque
  32-hex token; the server forwards the pinned digest, so an edited command is refused
  (``command_contract_mismatch``) instead of running a plan nobody reviewed.
* **"Yes, do it" twice never charges twice.** Each confirmed execution is keyed
  ``agent-confirmed:<hash of command, room, inputs>`` and carries a pending delivery marker. While
  the marker is pending, the same request in that room — even re-prepared with a new token —
  replays the original execution instead of writing again. The marker is released when the
  runtime reports the reply crossed the room's visibility boundary (:meth:`mark_delivered`), or
  when its TTL (the definition's ``delivery_reconciliation_ttl_seconds``, resolved at execute time
  into an absolute ``expires_at``) passes. An execution still in flight keeps its key whatever
  its marker says, so the same request never runs next to one that may still charge.
* **Markers are a tenant's**: the window of a room holds this tenant's executions only.
* **Expiry is lazy**: each delivery lookup in a room scans its latest 65 agent-confirmed
  executions and flips expired markers in a separate best-effort transaction that only logs its
  errors. Markers without a parsable ``expires_at`` expire at ``created_at + 900 s``; an in-flight
  execution (``running``, or ``failed`` with no error yet) cannot expire before
  ``created_at + 3600 s``. More than 16 live pending markers — or a full 65-row window whose
  oldest row is still pending (more may hide behind it) — fails closed: the room's mutating agent
  calls answer ``room_write_protected`` until capacity frees.
* **Tool results are closed**: exactly ``{status, action, error, retryable, guidance}``, plus
  ``reason`` for ``assertion_failed`` only (the author's message, one line, ≤ 200 characters).
  ``guidance`` is a fixed string per code in the room's language; no provider or database text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import structlog

from ledger import commands, executions, principals, reservations, staged
from ledger.canonical import fingerprint
from ledger.errors import StorageError, StoreBusy
from ledger.executions import ExecutionRow
from ledger.store import Work
from orchestrator import audit, authz
from orchestrator.authz import Caller, Principal
from orchestrator.definitions import StoredCommand
from orchestrator.errors import (
    REGISTRY,
    AgentTxnError,
    CommandModeMismatch,
    CommandNotFound,
    ConfirmationInvalid,
    ContractMismatch,
    IdempotencyInProgress,
    LockConflict,
    PrincipalNotAuthorized,
    RoomWriteProtected,
    StoreUnavailableError,
)
from orchestrator.guidance import guidance_for, proposal_text

if TYPE_CHECKING:
    from orchestrator.commands import CommandService

log = structlog.get_logger(__name__)

TOKEN_PATTERN: Final = re.compile(r"^[0-9a-f]{32}$")
AGENT_KEY_PREFIX: Final = "agent-confirmed:"
MARKER: Final = "agent_response_delivery"
WINDOW_ROWS: Final = 65
MAX_LIVE_MARKERS: Final = 16
LEGACY_TTL_MS: Final = 900_000
IN_FLIGHT_FLOOR_MS: Final = 3_600_000
CONFIRMATION_TTL_MS: Final = 3_600_000
#: The operator resource: a principal managing it may list and acknowledge delivery markers.
OPS_RESOURCE: Final = "agent-txn.ops"


class _HandOverLost(Exception):
    """A compare-and-set on a staged plan lost a race: the token was confirmed or released by a
    concurrent call, or another confirmation of the same request holds its key. Rolls the
    transaction back whole."""


def agent_key(command_id: str, room_id: str | None, inputs: Any) -> str:
    """The server-generated idempotency key of an agent-confirmed execution: the same request in
    the same room maps to the same key, whatever token confirmed it."""
    digest = fingerprint({"command": command_id, "room": room_id or "", "inputs": inputs})
    return f"{AGENT_KEY_PREFIX}{digest[:48]}"


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("ascii")).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class Marker:
    """One execution's delivery marker as the window sees it."""

    execution: ExecutionRow
    state: str
    expires_at: int
    in_flight: bool

    def live(self, now_ms: int) -> bool:
        """Pending and not yet past its (floored) expiry."""
        return self.state == "pending" and self.expires_at > now_ms


def marker_of(row: ExecutionRow) -> Marker | None:
    """The delivery marker of an agent-confirmed execution with the expiry rules applied."""
    snapshot = row.lifecycle_snapshot if isinstance(row.lifecycle_snapshot, Mapping) else {}
    raw = snapshot.get(MARKER)
    if not isinstance(raw, Mapping):
        return None
    state = str(raw.get("state") or "pending")
    expires = raw.get("expires_at")
    if not isinstance(expires, int) or isinstance(expires, bool):
        expires = row.created_at + LEGACY_TTL_MS  # written before TTLs, or unparsable
    in_flight = row.status == "running" or (row.status == "failed" and not row.error)
    if in_flight:
        # Expiring a record that may still commit would let the same call write again.
        expires = max(expires, row.created_at + IN_FLIGHT_FLOOR_MS)
    return Marker(row, state, int(expires), in_flight)


class AgentToolbox:
    """Staged actions for agent runtimes, over the command service."""

    def __init__(self, commands_service: CommandService) -> None:
        self.svc = commands_service

    @property
    def _store(self) -> Any:
        return self.svc.orch.store

    # -- prepare -------------------------------------------------------------------------------

    async def prepare(
        self,
        caller: Caller,
        command_id: str,
        inputs: Any,
        *,
        room_id: str | None = None,
        language: str | None = None,
    ) -> dict[str, Any]:
        """Validate and stage the plan as the invoking principal; return the proposal for the
        person and the confirmation token for the agent."""
        caller = _in_room(caller, room_id)
        authz.require_jwt(caller)
        async with self.svc._read() as conn:
            row = await self.svc._visible(conn, command_id)
            principal = await self.svc._principal(conn, caller, row)
            if row.mode != "execute":
                raise CommandModeMismatch(details={"mode": row.mode})  # no staged path
            stored = StoredCommand.from_stored(row.definition)
            await self.svc._check_dependencies(conn, stored)
            lang = language or await _room_language(conn, caller)
        await self._guard_room(caller.room_id)
        await self._release_expired(caller)
        prepared = await self.svc._prepare(row, stored, principal, caller, inputs, "agent")
        token = secrets.token_hex(16)
        token_hash = _token_hash(token)

        async def confirmation(execution_id: str, work: Work) -> None:
            await staged.insert_action(
                work,
                token_sha256=token_hash,
                execution_id=execution_id,
                command_id=row.command_id,
                digest=row.digest,
                room_id=caller.room_id,
                language=lang,
                invoker_kind=caller.kind,
                invoker_id=caller.principal_id,
                ttl_ms=CONFIRMATION_TTL_MS,
            )

        await self.svc.stage(
            prepared, caller, key=None, takeover=None, origin="agent", extra=confirmation
        )
        needs_approval = bool(await self.svc._approvals_needed(stored))
        return {
            "proposal": proposal_text(
                stored,
                prepared.inputs,
                lang,
                needs_approval=needs_approval,
                queries=prepared.queries,
            ),
            "confirmation_token": token,
            "action": stored.name,
            "expires_at": audit.iso(self._store.now_ms() + CONFIRMATION_TTL_MS),
        }

    # -- execute -------------------------------------------------------------------------------

    async def execute_staged_action(
        self, caller: Caller, token: str, *, budget_seconds: float | None = None
    ) -> dict[str, Any]:
        """Run the staged plan behind ``token`` once; the closed tool result, never a raise for
        outcomes (only for programming errors)."""
        lang = "en"
        action_name = ""
        try:
            authz.require_jwt(caller)
            action, record, row, stored = await self._confirmation(caller, token)
            lang, action_name = action.language, stored.name
            await self._release_expired(caller)
            return await self._execute(caller, action, record, row, stored, budget_seconds)
        except AgentTxnError as exc:
            return tool_error(exc, action_name, lang)
        except StoreBusy:
            return tool_error(LockConflict(), action_name, lang)
        except StorageError:
            return tool_error(StoreUnavailableError(), action_name, lang)

    async def _confirmation(
        self, caller: Caller, token: str
    ) -> tuple[staged.StagedActionRow, ExecutionRow, Any, StoredCommand]:
        if not isinstance(token, str) or not TOKEN_PATTERN.fullmatch(token):
            raise ConfirmationInvalid()
        async with self.svc._read() as conn:
            action = await staged.get_action(conn, _token_hash(token))
            if action is None or (action.invoker_kind, action.invoker_id) != (
                caller.kind,
                caller.principal_id,
            ):
                raise ConfirmationInvalid()  # unknown and not-yours look alike
            record = await executions.get(conn, action.execution_id)
            row = await commands.get(conn, action.command_id)
        if record is None:
            raise ConfirmationInvalid()
        if row is None:
            raise CommandNotFound()
        return action, record, row, StoredCommand.from_stored(row.definition)

    async def _execute(
        self,
        caller: Caller,
        action: staged.StagedActionRow,
        record: ExecutionRow,
        row: Any,
        stored: StoredCommand,
        budget_seconds: float | None,
    ) -> dict[str, Any]:
        caller = _in_room(caller, action.room_id)
        if action.state == "executed":
            # Redelivery of the same confirmed call: the original's result while its marker is
            # pending (or it is still settling); afterwards the token is used up.
            marker = marker_of(record)
            settling = record.status in ("running", "manual_review", "staged")
            if settling or (marker is not None and marker.live(self._store.now_ms())):
                return await self._status_of(record.execution_id, stored.name, action.language)
            raise ConfirmationInvalid()
        if action.state != "pending" or action.expires_at <= self._store.now_ms():
            raise ConfirmationInvalid()
        # The server forwards the pinned digest: an edited command never runs an unseen plan.
        if row.deleted_at is not None or row.digest != action.digest:
            await self._release(action, record, "command_contract_mismatch")
            raise ContractMismatch()
        async with self.svc._read() as conn:
            await self.svc._principal(conn, caller, row)
            await self.svc._check_dependencies(conn, stored)
            key = agent_key(row.command_id, action.room_id, record.input_snapshot)
            held = await reservations.get(conn, row.command_id, caller.bucket, key)
            previous = await executions.get(conn, held.execution_id) if held else None
        await self._guard_room(action.room_id)
        takeover: str | None = None
        if held is not None:
            marker = marker_of(previous) if previous is not None else None
            if previous is not None and marker is not None and marker.live(self._store.now_ms()):
                # "Yes" said twice: replay the original, never write again.
                await self._release(action, record, "staged_released")
                return await self._status_of(previous.execution_id, stored.name, action.language)
            if previous is not None and in_flight(previous):
                await self._release(action, record, "staged_released")
                return await self._status_of(previous.execution_id, stored.name, action.language)
            takeover = held.execution_id
        try:
            if await self.svc._approvals_needed(stored):
                return await self._to_approval(caller, action, record, row, stored, key, takeover)
            return await self._run_confirmed(
                caller, action, record, row, stored, key, takeover, budget_seconds
            )
        except _HandOverLost:
            return await self._winner(caller, action, record, row, stored, key)

    async def _run_confirmed(
        self,
        caller: Caller,
        action: staged.StagedActionRow,
        record: ExecutionRow,
        row: Any,
        stored: StoredCommand,
        key: str,
        takeover: str | None,
        budget_seconds: float | None,
    ) -> dict[str, Any]:
        """Hand the confirmed plan over (token used up, key reserved, marker pending) in the
        commit that starts it, then drive it."""
        ttl_ms = int(stored.ttl_seconds) * 1000

        async def confirm(work: Work) -> None:
            await self.svc._lock_command(work, row)
            await _hand_over(self.svc, work, action, row, caller, key, takeover, record)
            marker = {"state": "pending", "expires_at": work.now_ms + ttl_ms}
            await executions.finish(
                work,
                record.execution_id,
                status="running",
                idempotency_key=key,
                lifecycle_snapshot={MARKER: marker},
            )

        # Every staged action is written by ``stage`` with a record that names its transaction.
        assert record.tx_id is not None
        tx_id = record.tx_id
        await self.svc._with_lock_retries(
            lambda: self.svc.orch.execute_staged(
                tx_id, budget_seconds=budget_seconds, prepare_hook=confirm
            )
        )
        return await self._status_of(record.execution_id, stored.name, action.language)

    async def _to_approval(
        self,
        caller: Caller,
        action: staged.StagedActionRow,
        record: ExecutionRow,
        row: Any,
        stored: StoredCommand,
        key: str,
        takeover: str | None,
    ) -> dict[str, Any]:
        """A confirmed plan that needs an approver: it stays staged, now as a staged change.

        It holds the agent key and a pending marker like any confirmed call, so a repeated
        "yes" replays this staged answer instead of staging (and later charging) twice."""
        staged_change_id = secrets.token_hex(16)
        ttl_ms = int(stored.ttl_seconds) * 1000

        async def hand_over(work: Work) -> None:
            await self.svc._lock_command(work, row)
            await _hand_over(self.svc, work, action, row, caller, key, takeover, record)
            await staged.insert_change(
                work,
                staged_change_id=staged_change_id,
                execution_id=record.execution_id,
                command_id=record.command_id,
                digest=action.digest,
                requested_by=caller.principal_id,
            )
            await executions.finish(
                work,
                record.execution_id,
                status="staged",
                staged_change_id=staged_change_id,
                idempotency_key=key,
                lifecycle_snapshot={
                    MARKER: {"state": "pending", "expires_at": work.now_ms + ttl_ms}
                },
            )
            fresh = await executions.get(work.conn, record.execution_id)
            # ``finish`` just updated it in this transaction (it raises when the row is gone).
            assert fresh is not None
            await audit.enqueue_callbacks(work, fresh, "staged")

        await self.svc._with_lock_retries(lambda: self._in_transaction(hand_over))
        return tool_result("staged", stored.name, "approval_required", action.language)

    async def _winner(
        self,
        caller: Caller,
        action: staged.StagedActionRow,
        record: ExecutionRow,
        row: Any,
        stored: StoredCommand,
        key: str,
    ) -> dict[str, Any]:
        """The answer to a confirmation that lost its hand-over race: the status of the call
        that won, never a refusal that tells the person it was not done.

        The same token confirmed concurrently: the winner moved it to ``executed`` and runs this
        very execution. Another token of the same request: its execution holds the key; this
        plan is retired as a duplicate, as when the repeat comes after the winner."""
        # Read in a write transaction, not a plain read: on SQLite the losing hand-over can end
        # while the commit group holding the winner's is not committed yet. A write transaction
        # sees that group's rows (it joins the group, or begins after it) and ends only once
        # they are durable, so the status read after it is the winner's.
        async with self._store.transaction() as work:
            fresh = await staged.get_action(work.conn, action.token_sha256)
            held = await reservations.get(work.conn, row.command_id, caller.bucket, key)
        if fresh is not None and fresh.state == "executed":
            return await self._status_of(record.execution_id, stored.name, action.language)
        if fresh is not None and fresh.state == "pending" and held is not None:
            await self._release(action, record, "staged_released")
            return await self._status_of(held.execution_id, stored.name, action.language)
        raise ConfirmationInvalid()  # retired meanwhile (expired, or the command was edited)

    async def _release_expired(self, caller: Caller) -> None:
        """Retire this person's unconfirmed plans whose confirmation expired (lazily, a few at a
        time), so staged plans nobody confirmed do not pile up forever."""
        async with self.svc._read() as conn:
            expired = await staged.expired_actions(
                conn,
                invoker_kind=caller.kind,
                invoker_id=caller.principal_id,
                now_ms=self._store.now_ms(),
                limit=20,
            )
            records = [await executions.get(conn, a.execution_id) for a in expired]
        for action, record in zip(expired, records, strict=True):
            if record is not None and record.status == "staged":
                await self._release(action, record, "staged_released")

    async def _in_transaction(self, job: Any) -> None:
        try:
            async with self._store.transaction() as work:
                await job(work)
        except StoreBusy as exc:
            raise LockConflict() from exc
        except StorageError as exc:
            raise StoreUnavailableError() from exc

    async def release_expired_holder(self, tx_id: str) -> bool:
        """Retire the staged plan ``tx_id`` if it is an agent plan whose confirmation expired
        unconfirmed, whoever prepared it; ``True`` if it was one (retired now, by this call or
        a concurrent one), so the caller's write it blocked may be tried again.

        An unconfirmed plan holds its business key like any live transaction (the unique index
        cannot know about confirmation windows). Without this, one person's abandoned prepare
        blocked everybody else's write of the same business key until that person came back
        (:meth:`_release_expired` retires only the caller's own plans)."""
        async with self.svc._read() as conn:
            record = await executions.by_tx(conn, tx_id)
            action = await staged.action_of(conn, record.execution_id) if record else None
        if record is None or action is None or record.status != "staged":
            return False
        if action.state != "pending" or action.expires_at > self._store.now_ms():
            return False
        await self._release(action, record, "staged_released")
        return True

    async def _release(
        self, action: staged.StagedActionRow, record: ExecutionRow, code: str
    ) -> None:
        """Retire a staged plan that will not run (duplicate confirmation, edited command,
        expired confirmation); nothing if its token is no longer pending (a concurrent
        confirmation or release got there first: its outcome stands)."""

        async def retire(work: Work) -> None:
            if not await staged.move_action(
                work, action.token_sha256, from_state="pending", to_state="released"
            ):
                raise _HandOverLost()
            code_, text = audit.error_of({"code": code})
            await executions.finish(
                work, record.execution_id, status="failed", error_code=code_, error=text
            )

        if record.tx_id is not None:
            with contextlib.suppress(_HandOverLost):
                await self.svc.orch.release_staged(record.tx_id, code=code, hook=retire)

    # -- status and delivery -------------------------------------------------------------------

    async def execution_status(self, caller: Caller, token: str) -> dict[str, Any]:
        """The tool result of the execution behind ``token`` as it stands now (no write)."""
        try:
            authz.require_jwt(caller)
            action, record, _row, stored = await self._confirmation(caller, token)
        except AgentTxnError as exc:
            return tool_error(exc, "", "en")
        if action.state == "pending" and action.expires_at <= self._store.now_ms():
            # What confirming it now would answer: nothing waits for the person any more.
            return tool_error(ConfirmationInvalid(), stored.name, action.language)
        if action.state == "pending":
            return tool_result("staged", stored.name, None, action.language)
        try:
            return await self._status_of(record.execution_id, stored.name, action.language)
        except AgentTxnError as exc:
            return tool_error(exc, stored.name, action.language)

    async def _status_of(self, execution_id: str, action: str, lang: str) -> dict[str, Any]:
        """The tool result of an execution as stored now; :class:`ConfirmationInvalid` when its
        record is gone (pruned or deleted since it was read), as :meth:`_confirmation` says."""
        async with self.svc._read() as conn:
            record = await executions.get(conn, execution_id)
        if record is None:
            raise ConfirmationInvalid()
        if record.status == "succeeded":
            return tool_result("succeeded", action, None, lang)
        if record.status == "failed":
            code = record.error_code or "command_execution_failed"
            reason = record.error if code == "assertion_failed" else None
            return tool_result("failed", action, code, lang, reason=reason)
        if record.status == "staged":
            pending = "approval_required" if record.staged_change_id else None
            return tool_result("staged", action, pending, lang)
        code = "manual_review" if record.status == "manual_review" else "in_doubt"
        return tool_result("running", action, code, lang)

    async def mark_delivered(self, caller: Caller, execution_id: str) -> bool:
        """The reply crossed the room's visibility boundary: release the marker (and its key, so
        a later identical request is a new write). ``False`` if nothing was pending.

        The reply of an execution still in flight ("still in progress") is recorded as
        delivered too, but its key stays held until the execution ends (:func:`_settle`)."""
        authz.require_jwt(caller)
        async with self._store.transaction() as work:
            record = await executions.get_for_update(work, execution_id)
            if record is None or (record.invoker_kind, record.invoker_id) != (
                caller.kind,
                caller.principal_id,
            ):
                return False
            return await _settle(work, record, "delivered")

    async def mark_delivered_by_token(self, caller: Caller, token: str) -> bool:
        """:meth:`mark_delivered` for runtimes that only kept the confirmation token."""
        authz.require_jwt(caller)
        try:
            _action, record, _row, _stored = await self._confirmation(caller, token)
        except AgentTxnError:
            return False
        return await self.mark_delivered(caller, record.execution_id)

    async def _guard_room(self, room_id: str | None) -> None:
        """Lazy expiry, then fail closed when the room's window is over capacity."""
        if room_id is None:
            return
        markers = await self.window(room_id)
        now = self._store.now_ms()
        live = [m for m in markers if m.live(now)]
        oldest_live = bool(markers) and markers[-1].live(now)
        if len(live) > MAX_LIVE_MARKERS or (len(markers) >= WINDOW_ROWS and oldest_live):
            raise RoomWriteProtected()

    async def window(self, room_id: str) -> list[Marker]:
        """The room's markers of this tenant (newest first), expired ones flipped first (see
        :func:`window`)."""
        return await window(self._store, room_id, tenant=self.svc.tenant)

    async def deliveries(self, operator: Caller, room_id: str) -> list[dict[str, Any]]:
        """Markers of a room with their state, ``expires_at`` and ``in_window`` (operators of
        this tenant, its markers only)."""
        await self._require_operator(operator)
        return await deliveries(self._store, room_id, tenant=self.svc.tenant)

    async def acknowledge(
        self,
        operator: Caller,
        room_id: str,
        execution_ids: Sequence[str],
        *,
        execute: bool = False,
        force: bool = False,
    ) -> list[dict[str, Any]]:
        """Release selected markers (operators); see :func:`acknowledge`."""
        await self._require_operator(operator)
        return await acknowledge(
            self._store,
            room_id,
            execution_ids,
            tenant=self.svc.tenant,
            execute=execute,
            force=force,
        )

    async def _require_operator(self, operator: Caller) -> Principal:
        authz.require_jwt(operator)
        async with self.svc._read() as conn:
            principal = await authz.load_principal(
                conn,
                operator,
                tenant=self.svc.tenant,
                scope_kind="company",
                scope_id=self.svc.tenant,
            )
        if not authz.manages(principal, [OPS_RESOURCE]):
            raise PrincipalNotAuthorized()
        return principal


async def window(store: Any, room_id: str, *, tenant: str) -> list[Marker]:
    """The room's markers of ``tenant`` (newest first), after flipping expired ones in a
    separate best-effort transaction that only logs its errors."""
    async with store.read() as conn:
        rows = await executions.agent_window(conn, room_id, tenant=tenant, limit=WINDOW_ROWS)
    markers = [m for m in (marker_of(r) for r in rows) if m is not None]
    now = store.now_ms()
    expired = [m for m in markers if m.state == "pending" and m.expires_at <= now]
    if expired:
        try:
            async with store.transaction() as work:
                for m in expired:
                    fresh = await executions.get_for_update(work, m.execution.execution_id)
                    if fresh is not None:
                        await _settle(work, fresh, "expired")
        except Exception as exc:  # best effort: never blocks the lookup
            log.warning("delivery marker expiry failed", room=room_id, error=type(exc).__name__)
        else:
            markers = [
                dataclasses.replace(m, state="expired") if m in expired else m for m in markers
            ]
    return markers


# -- operators (also used by `agent-txn ops deliveries`, which runs with database access) ------


async def deliveries(store: Any, room_id: str, *, tenant: str) -> list[dict[str, Any]]:
    """Markers of ``tenant`` in a room with their state, ``expires_at`` and ``in_window``."""
    now = store.now_ms()
    return [
        {
            "execution_id": m.execution.execution_id,
            "command_id": m.execution.command_id,
            "state": m.state,
            "expires_at": audit.iso(m.expires_at),
            "in_window": m.live(now),
            "created_at": audit.iso(m.execution.created_at),
        }
        for m in await window(store, room_id, tenant=tenant)
    ]


async def acknowledge(
    store: Any,
    room_id: str,
    execution_ids: Sequence[str],
    *,
    tenant: str,
    execute: bool = False,
    force: bool = False,
) -> list[dict[str, Any]]:
    """Release selected markers of ``tenant`` (another tenant's are ``not_found``).
    ``execute=False`` previews per marker and writes nothing; in-window markers need ``force``
    (it re-opens the window for duplicates). Never undoes a committed write: only the marker
    and, once its execution has ended, its key are released (see :func:`_settle`)."""
    by_id = {m.execution.execution_id: m for m in await window(store, room_id, tenant=tenant)}
    now = store.now_ms()
    out: list[dict[str, Any]] = []
    for execution_id in execution_ids:
        m = by_id.get(execution_id)
        if m is None:
            out.append({"execution_id": execution_id, "result": "not_found"})
            continue
        entry: dict[str, Any] = {
            "execution_id": execution_id,
            "state": m.state,
            "in_window": m.live(now),
        }
        if m.state != "pending":
            entry["result"] = "not_pending"
        elif m.live(now) and not force:
            entry["result"] = "needs_force"
        elif not execute:
            entry["result"] = "would_acknowledge"
        else:
            async with store.transaction() as work:
                fresh = await executions.get_for_update(work, execution_id)
                done = fresh is not None and await _settle(work, fresh, "acknowledged")
            entry["result"] = "acknowledged" if done else "not_pending"
        out.append(entry)
    return out


async def _hand_over(
    svc: CommandService,
    work: Work,
    action: staged.StagedActionRow,
    row: Any,
    caller: Caller,
    key: str,
    takeover: str | None,
    record: ExecutionRow,
) -> None:
    """Use the token up and reserve the request's key for this execution, both by
    compare-and-set; :class:`_HandOverLost` when a concurrent confirmation got there first."""
    if not await staged.move_action(
        work, action.token_sha256, from_state="pending", to_state="executed"
    ):
        raise _HandOverLost()
    try:
        await svc._reserve(work, row, caller, key, takeover, record.execution_id)
    except IdempotencyInProgress as exc:
        raise _HandOverLost() from exc


def in_flight(record: ExecutionRow) -> bool:
    """The execution has not ended: it may still write (``running``, or ``failed`` with no error
    yet), waits for an operator (``manual_review``) or for an approver (``staged``)."""
    if record.status == "failed":
        return not record.error
    return record.status != "succeeded"


async def _settle(work: Work, record: ExecutionRow, to_state: str) -> bool:
    """Move a pending marker to ``to_state`` and, once the execution has ended, free its key;
    ``False`` if not pending.

    An execution still in flight keeps its key whatever happens to its marker: freeing it would
    let the same request start a second run next to one that may still charge. The marker's
    state is recorded all the same; when the execution ends, the next identical request finds a
    held key whose marker is no longer live and takes it over, a new write as after any
    delivery."""
    marker = marker_of(record)
    if marker is None or marker.state != "pending":
        return False
    snapshot = dict(record.lifecycle_snapshot or {})
    snapshot[MARKER] = {**dict(snapshot.get(MARKER) or {}), "state": to_state}
    await executions.finish(
        work, record.execution_id, status=record.status, lifecycle_snapshot=snapshot
    )
    if record.idempotency_key is not None and not in_flight(record):
        await reservations.release(
            work,
            command_id=record.command_id,
            bucket=record.actor_bucket,
            key=record.idempotency_key,
            execution_id=record.execution_id,
        )
    return True


def _in_room(caller: Caller, room_id: str | None) -> Caller:
    if room_id is None or caller.room_id == room_id:
        return caller
    if caller.room_id is not None:
        raise PrincipalNotAuthorized()  # a token bound to one room cannot act in another
    return dataclasses.replace(caller, room_id=room_id)


async def _room_language(conn: Any, caller: Caller) -> str:
    if caller.room_id is None:
        return "en"
    membership = await principals.membership(conn, caller.room_id, caller.principal_id)
    language = getattr(membership, "language", None)
    return language if language in ("en", "zh-TW") else "en"


def tool_result(
    status: str,
    action: str,
    code: str | None,
    language: str,
    *,
    reason: str | None = None,
) -> dict[str, Any]:
    """The closed tool result: ``{status, action, error, retryable, guidance}`` (+ ``reason``
    for ``assertion_failed`` only)."""
    entry = REGISTRY.get(code) if code else None
    out: dict[str, Any] = {
        "status": status,
        "action": action,
        "error": code,
        "retryable": bool(entry.retryable) if entry is not None else False,
        "guidance": guidance_for(code or status, language),
    }
    if code == "assertion_failed" and reason:
        out["reason"] = " ".join(reason.split())[:200]
    return out


def tool_error(exc: AgentTxnError, action: str, language: str) -> dict[str, Any]:
    """A refusal as a tool result: the code and a fixed guidance, never the message text."""
    code = exc.code if exc.code in REGISTRY else "command_execution_failed"
    reason = exc.message if code == "assertion_failed" else None
    return tool_result("failed", action, code, language, reason=reason)
