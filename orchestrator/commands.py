"""Commands: stored saga definitions executed exactly once, as the caller (seed 000).

::

    svc = orch.commands                       # one service per Orchestrator
    info = await svc.create(author, ship_order_json)
    outcome = await svc.execute(
        Caller.user("u-1"), info["command_id"], {"order_id": "42"}, idempotency_key="fe-9f2c"
    )
    outcome.status_code, outcome.body["status"]     # 200, "succeeded"

The order of checks is the contract, because each one promises what has *not* happened yet:

1. the caller authenticated with a JWT (API keys are refused on command routes);
2. ``expected_contract_digest`` (when given) is compared with the visible command's stored digest
   — before input validation, reservation, audit row, lock or write;
3. the principal is alive, verified, enabled and (room scope) a member — one uniform 403;
4. no referenced action is locked for an operation; the dependency contract still holds
   (version 2: the whole contract; version 1: actions and fields still exist);
5. an idempotency key replays a succeeded/staged execution, or blocks while one is running or
   parked (even past the 24 h reservation);
6. inputs validate; runtime budgets; readable result fields; every step's grant;
7. query steps run (reads, bounded by the time budget), then rules, caps and the asserts that
   precede the first effect. A failure here leaves a ``failed`` audit row and nothing else;
8. one local commit: the command row re-read under lock (changed → ``source_authority_changed``),
   the reservation, the execution row (``running``), the transaction and its first claim;
9. the saga runs; the execution is finished in the same commit as the saga's last transition.

Lock contention in step 8 is retried a bounded number of times, then ``command_lock_conflict``
(409, retryable): that commit rolled back whole, reservation included, so the same key retries.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import enum
import random
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import text

from ledger import (
    action_settings,
    commands,
    executions,
    principals,
    reservations,
    staged,
    transactions,
)
from ledger import callbacks as callback_runs
from ledger.canonical import NotCanonicalizable, canonical_json, fingerprint, jsonb_stable
from ledger.commands import CommandRow
from ledger.errors import StorageError, StoreBusy, ValueNotStorable
from ledger.executions import ExecutionRow
from ledger.ids import time_ordered_id
from ledger.schema import IDEMPOTENCY_KEY_LENGTH
from ledger.states import TxState
from ledger.store import Work
from orchestrator import audit, authz, budgets, definitions, expressions, keys
from orchestrator.authz import Caller, Principal
from orchestrator.definitions import StoredCommand
from orchestrator.errors import (
    ActionLocked,
    AgentTxnError,
    ApprovalRequired,
    AssertionFailed,
    BusinessKeyCommitted,
    BusinessKeyConflict,
    CapExceeded,
    CardinalityFailed,
    CommandModeMismatch,
    CommandNotFound,
    CommandTimeout,
    ContractDigestInvalid,
    ContractMismatch,
    ExecutionNotFound,
    IdempotencyInProgress,
    IdempotencyKeyInvalid,
    IdempotencyPayloadMismatch,
    LimitExceeded,
    LockConflict,
    OutcomeError,
    PrincipalNotAuthorized,
    ProviderUnavailable,
    RequestInvalid,
    RuleFailed,
    SourceAuthorityChanged,
    StagedChangeDecided,
    StagedChangeNotFound,
    StoreUnavailableError,
    ValueNotStorableError,
)
from orchestrator.saga import SagaDefinition
from orchestrator.views import SagaResult
from providers.contract import Confirmed

if TYPE_CHECKING:
    from orchestrator.engine import Orchestrator

DIGEST_PATTERN: Final = re.compile(r"^[0-9a-f]{64}$")
IDEMPOTENCY_TTL_MS: Final = 24 * 3600 * 1000
#: Largest page offset (``skip``) a listing takes: more records than a tenant keeps, and far
#: inside the 64-bit integer both databases bind an OFFSET as (a larger one was a 500: SQLite's
#: driver raised OverflowError, PostgreSQL "value out of int64 range").
MAX_SKIP: Final = 1_000_000_000
#: Most records one page returns.
MAX_LIMIT: Final = 200


class Unchanged(enum.Enum):
    """The type of :data:`UNCHANGED`."""

    UNCHANGED = "unchanged"


#: An edit's "leave this field as stored" (where ``None`` means "clear it").
UNCHANGED: Final = Unchanged.UNCHANGED


class CommandLimits(BaseModel):
    """Runtime budgets of one execution (seed 000 "執行期資源預算") and the lock-retry policy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Effect steps plus outbox events (``mutation_limit_exceeded``).
    max_mutations: int = Field(default=32, ge=1, le=10_000)
    #: Query steps (``query_limit_exceeded``).
    max_queries: int = Field(default=16, ge=0, le=10_000)
    #: Distinct providers touched (``relation_limit_exceeded``).
    max_relations: int = Field(default=8, ge=1, le=1_000)
    #: Result projection size in canonical JSON bytes (``output_limit_exceeded``).
    max_output_bytes: int = Field(default=1_048_576, ge=1)
    #: Time budget of the read phase, before anything is written (``command_timeout``).
    timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    #: Lock-contention retries inside the server before ``command_lock_conflict``.
    lock_retries: int = Field(default=3, ge=0, le=20)
    #: PostgreSQL ``lock_timeout`` of the apply commit, per attempt.
    lock_timeout_ms: int = Field(default=500, ge=1, le=60_000)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an execute call answers: HTTP status, body, and whether it was a replay."""

    status_code: int
    body: dict[str, Any]
    execution_id: str | None = None
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class _Prepared:
    """Everything checked before the apply commit (step 1-7)."""

    row: CommandRow
    stored: StoredCommand
    principal: Principal
    inputs: dict[str, Any]
    queries: dict[str, Any]
    snapshot: dict[str, Any]


def command_view(row: CommandRow) -> dict[str, Any]:
    """A command as the authoring routes show it. ``definition`` is the exact stored object
    (nulls kept): it is what ``expected_contract_digest`` hashes."""
    view = audit.compact(
        {
            "command_id": row.command_id,
            "name": row.name,
            "scope": {"kind": row.scope_kind, "id": row.scope_id},
            "tag_id": row.tag_id,
            "version": row.version,
            "mode": row.mode,
            "digest": row.digest,
            "definition": row.definition,
            "created_by": row.created_by,
            "created_at": audit.iso(row.created_at),
            "updated_at": audit.iso(row.updated_at),
            "deleted": row.deleted_at is not None or None,
        }
    )
    view["definition"] = row.definition
    return view


class CommandService:
    """Authoring, execute, query and audit reads over one :class:`Orchestrator`."""

    def __init__(self, orch: Orchestrator, *, limits: CommandLimits | None = None) -> None:
        self.orch = orch
        self.limits = limits or CommandLimits()
        #: Test seam: awaited between validation (step 1-7) and the apply commit (step 8), so a
        #: test can edit the command in that gap and see ``source_authority_changed``.
        self.between_validation_and_apply: Callable[[], Awaitable[None]] | None = None

    @contextlib.asynccontextmanager
    async def _read(self) -> AsyncIterator[Any]:
        """A read transaction whose storage failures reach callers as registered errors."""
        try:
            async with self.orch.store.read() as conn:
                yield conn
        except StoreBusy as exc:
            raise LockConflict() from exc
        except ValueNotStorable as exc:
            raise ValueNotStorableError() from exc
        except StorageError as exc:
            raise StoreUnavailableError() from exc

    @property
    def tenant(self) -> str:
        """The tenant this engine serves (from its settings)."""
        return self.orch.settings.tenant

    # -- authoring -----------------------------------------------------------------------------

    async def _settings_map(self, conn: Any) -> dict[tuple[str, str], dict[str, Any]]:
        rows = await action_settings.all_(conn)
        return {
            (r.provider, r.action): {
                "requires_approval": r.requires_approval,
                "approval_policy": r.approval_policy,
            }
            for r in rows
        }

    async def create(
        self,
        caller: Caller,
        definition: Mapping[str, Any] | definitions.Command,
        *,
        scope_kind: str = "company",
        scope_id: str | None = None,
        tag_id: str | None = None,
    ) -> dict[str, Any]:
        """Normalize, check and store a command; the author must manage every action it uses."""
        authz.require_jwt(caller)
        raw = definition.definition() if isinstance(definition, definitions.Command) else definition
        if scope_kind not in ("company", "room"):
            raise RequestInvalid(details={"errors": [{"field": "scope.kind", "problem": "enum"}]})
        if scope_kind == "company" and scope_id not in (None, self.tenant):
            # The company is this tenant: another id would be a scope nobody can mount.
            raise RequestInvalid(details={"errors": [{"field": "scope.id", "problem": "tenant"}]})
        scope_id = scope_id or self.tenant
        async with self._read() as conn:
            principal = await authz.load_principal(
                conn, caller, tenant=self.tenant, scope_kind=scope_kind, scope_id=scope_id
            )
            settings = await self._settings_map(conn)
        stored = definitions.normalize(raw, registry=self.orch.registry, settings=settings)
        self._require_manager(principal, stored)
        saga_digest = await self._register_saga(stored)
        command_id = uuid.uuid4().hex
        async with self.orch.store.transaction() as work:
            row = await commands.insert(
                work,
                command_id=command_id,
                tenant=self.tenant,
                name=stored.name,
                scope_kind=scope_kind,
                scope_id=scope_id,
                tag_id=tag_id,
                version=stored.version,
                mode=stored.mode,
                definition=stored.data,
                digest=stored.digest,
                saga_digest=saga_digest,
                created_by=caller.principal_id,
            )
        return command_view(row)

    async def update(
        self,
        caller: Caller,
        command_id: str,
        definition: Mapping[str, Any] | definitions.Command,
        *,
        expected_digest: str | None = None,
        tag_id: str | Literal[Unchanged.UNCHANGED] | None = UNCHANGED,
    ) -> dict[str, Any]:
        """Replace a command's definition (compare-and-set on its digest); ``tag_id`` is kept
        unless given, and ``None`` clears it."""
        authz.require_jwt(caller)
        raw = definition.definition() if isinstance(definition, definitions.Command) else definition
        async with self._read() as conn:
            row = await self._visible(conn, command_id)
            principal = await self._principal(conn, caller, row)
            settings = await self._settings_map(conn)
        # Replacing is deleting what is stored and authoring the new: the caller must manage the
        # actions of both (else a manager of one action could cut another's steps out).
        self._require_manager(principal, StoredCommand.from_stored(row.definition))
        stored = definitions.normalize(raw, registry=self.orch.registry, settings=settings)
        self._require_manager(principal, stored)
        saga_digest = await self._register_saga(stored)
        changes: dict[str, Any] = {
            "name": stored.name,
            "version": stored.version,
            "mode": stored.mode,
            "definition": stored.data,
            "digest": stored.digest,
            "saga_digest": saga_digest,
        }
        if tag_id is not UNCHANGED:
            changes["tag_id"] = tag_id
        async with self.orch.store.transaction() as work:
            updated = await commands.update(
                work, command_id, expected_digest=expected_digest or row.digest, **changes
            )
        if updated is None:
            raise SourceAuthorityChanged()
        return command_view(updated)

    async def get(self, caller: Caller, command_id: str) -> dict[str, Any]:
        """One visible command."""
        authz.require_jwt(caller)
        async with self._read() as conn:
            row = await self._visible(conn, command_id)
            await self._principal(conn, caller, row)
        return command_view(row)

    async def list(
        self, caller: Caller, *, skip: int = 0, limit: int = 50
    ) -> builtins.list[dict[str, Any]]:
        """Commands of this tenant the caller can act in, newest first; the scopes are judged
        first, then the database filters and pages (``skip``/``limit``). A caller who may not
        act in this tenant at all (unknown, another tenant's, deleted, unverified, disabled) is
        the uniform refusal, as on every other call, not an empty list that looks like one."""
        authz.require_jwt(caller)
        _check_page(skip, limit)
        async with self._read() as conn:
            await authz.require_known_principal(conn, caller, tenant=self.tenant)
            company, rooms = await self._actable_scopes(conn, caller)
            if not company and not rooms:
                return []
            rows = await commands.list_(
                conn, tenant=self.tenant, skip=skip, limit=limit, company=company, rooms=rooms
            )
        return [command_view(row) for row in rows]

    async def _actable_scopes(self, conn: Any, caller: Caller) -> tuple[bool, builtins.list[str]]:
        """(company commands visible, rooms whose commands are visible), each scope judged by
        the principal check a single command gets (:meth:`_principal`)."""
        # Only rooms the caller is in can pass that check, and a room-bound caller acts in its
        # own room alone; of those, only rooms with commands are worth a check.
        if caller.room_id is not None:
            candidates = [caller.room_id]
        else:
            memberships = await principals.memberships_of(conn, caller.principal_id)
            candidates = [m.room_id for m in memberships if m.current]
        in_use = await commands.rooms_in_use(conn, tenant=self.tenant, among=candidates)

        async def may_act(kind: str, scope_id: str) -> bool:
            try:
                await authz.load_principal(
                    conn, caller, tenant=self.tenant, scope_kind=kind, scope_id=scope_id
                )
            except PrincipalNotAuthorized:
                return False
            return True

        # The company check ignores the scope id (company commands are this tenant's).
        company = await may_act("company", self.tenant)
        rooms = [room for room in sorted(in_use) if await may_act("room", room)]
        return company, rooms

    async def delete(self, caller: Caller, command_id: str) -> None:
        """Soft-delete a command (its executions stay readable) and, in the same commit, release
        every plan it staged that nobody decided yet.

        A deleted command's plan can never run (approve and confirm re-read the command under
        its lock and refuse), so a plan left ``staged`` would hold its idempotency key and its
        business key forever. Each one is retired as a rejection is: its staged change
        ``rejected`` by the deleter (an agent's unconfirmed action ``released``), its record
        ``failed`` with ``staged_released``, its key freed, its transaction ``staged → failed``
        in the ledger, its ``failed`` callbacks queued."""
        authz.require_jwt(caller)
        async with self._read() as conn:
            row = await self._visible(conn, command_id)
            principal = await self._principal(conn, caller, row)
        self._require_manager(principal, StoredCommand.from_stored(row.definition))
        async with self.orch.store.transaction() as work:
            # First: the update locks the command row, so a plan staged concurrently either
            # committed before (and is read below) or sees the command deleted and aborts.
            if not await commands.soft_delete(work, command_id):
                raise CommandNotFound()
            for record in await executions.staged_of(work.conn, command_id):
                retired = await self._retire_staged(
                    work,
                    record,
                    staged_change_id=record.staged_change_id,
                    decided_by=caller.principal_id,
                    reason="command deleted",
                    code="staged_released",
                )
                # A staged record always names its transaction (see approve()).
                if retired is not None and record.tx_id is not None:
                    await self.orch.release_staged_in(work, record.tx_id, code="staged_released")

    def _require_manager(self, principal: Principal, stored: StoredCommand) -> None:
        resources = sorted(stored.data["dependency_contract"]["actions"])
        if not authz.manages(principal, resources):
            raise PrincipalNotAuthorized()

    async def _register_saga(self, stored: StoredCommand) -> str | None:
        if stored.mode != "execute":
            return None
        definition = await self.orch.register(stored.saga_part())
        return definition.digest

    async def _principal(self, conn: Any, caller: Caller, row: CommandRow) -> Principal:
        """The caller as a principal in the command's scope (one uniform 403 otherwise)."""
        return await authz.load_principal(
            conn, caller, tenant=self.tenant, scope_kind=row.scope_kind, scope_id=row.scope_id
        )

    async def _visible(self, conn: Any, command_id: str) -> CommandRow:
        row = await commands.get(conn, command_id)
        if row is None or row.tenant != self.tenant:
            raise CommandNotFound()
        return row

    # -- execute -------------------------------------------------------------------------------

    async def execute(
        self,
        caller: Caller,
        command_id: str,
        inputs: Any,
        *,
        idempotency_key: str | None = None,
        expected_contract_digest: str | None = None,
        origin: str = "manual",
        budget_seconds: float | None = None,
    ) -> Outcome:
        """Run a command's saga once, as ``caller``; see the module docs for the order."""
        authz.require_jwt(caller)
        if expected_contract_digest is not None and (
            not isinstance(expected_contract_digest, str)
            or not DIGEST_PATTERN.fullmatch(expected_contract_digest)
        ):
            raise ContractDigestInvalid(details={"field": "expected_contract_digest"})
        if idempotency_key is not None and (
            not isinstance(idempotency_key, str)
            or not 1 <= len(idempotency_key) <= IDEMPOTENCY_KEY_LENGTH
        ):
            raise IdempotencyKeyInvalid(details={"field": "idempotency_key"})
        async with self._read() as conn:
            row = await self._visible(conn, command_id)
            # Frozen: everything below judges this exact row.
            if expected_contract_digest is not None and expected_contract_digest != row.digest:
                raise ContractMismatch()
            principal = await self._principal(conn, caller, row)
            if row.mode != "execute":
                raise CommandModeMismatch(details={"mode": row.mode})
            stored = StoredCommand.from_stored(row.definition)
            await self._check_dependencies(conn, stored)
            takeover: str | None = None
            if idempotency_key is not None:
                replay, takeover = await self._idempotency(conn, row, caller, idempotency_key)
                if replay is not None:
                    _same_inputs(replay, inputs)
                    return _replay(replay)
        prepared = await self._prepare(row, stored, principal, caller, inputs, origin)
        if await self._approvals_needed(stored):
            await self._stage_for_approval(prepared, caller, idempotency_key, takeover, origin)
        return await self._apply(
            prepared, caller, idempotency_key, takeover, origin, budget_seconds
        )

    async def _check_dependencies(self, conn: Any, stored: StoredCommand) -> None:
        settings_rows = {(r.provider, r.action): r for r in await action_settings.all_(conn)}
        for entry in stored.data["dependency_contract"]["actions"].values():
            setting = settings_rows.get((entry["provider"], entry["action"]))
            if setting is not None and setting.locked_for:
                raise ActionLocked(
                    f"Action is currently locked for operation: {setting.locked_for}",
                    details={
                        "provider": entry["provider"],
                        "action": entry["action"],
                        "operation": setting.locked_for,
                    },
                )
        settings = {
            key: {"requires_approval": r.requires_approval, "approval_policy": r.approval_policy}
            for key, r in settings_rows.items()
        }
        definitions.check_drift(stored, self.orch.registry, settings)

    async def _idempotency(
        self, conn: Any, row: CommandRow, caller: Caller, key: str
    ) -> tuple[ExecutionRow | None, str | None]:
        """(execution to replay, reservation to take over)."""
        held = await reservations.get(conn, row.command_id, caller.bucket, key)
        if held is None:
            return None, None
        previous = await executions.get(conn, held.execution_id)
        if previous is None:
            return None, held.execution_id
        if previous.status in ("running", "manual_review"):
            # In doubt: a new attempt could double the effect. Blocks even past the TTL.
            raise IdempotencyInProgress(details={"execution_id": previous.execution_id})
        expired = held.expires_at <= self.orch.store.now_ms()
        if previous.status in ("succeeded", "staged") and not expired:
            return previous, None
        return None, held.execution_id

    async def _prepare(
        self,
        row: CommandRow,
        stored: StoredCommand,
        principal: Principal,
        caller: Caller,
        inputs: Any,
        origin: str,
    ) -> _Prepared:
        budgets.check_inputs_size(inputs)
        saga = SagaDefinition.parse(stored.saga_part())
        clean = saga.validate_inputs(inputs)
        self._check_runtime_budgets(stored)
        authz.check_readable(principal, definitions.field_refs(stored))
        scope: dict[str, Any] = {"inputs": clean, "queries": {}}
        for step in stored.effect_steps:
            payload = _render_or_none(step["payload"], scope)
            authz.authorize_step(
                principal, provider=step["provider"], action=step["action"], payload=payload
            )
        for event in stored.data.get("outbox", []):
            authz.authorize_step(
                principal, provider=event["provider"], action=event["action"], payload=None
            )
        snapshot = self._authorization_snapshot(row, stored, caller, origin)
        try:
            queries = await self._run_queries(stored, principal, scope)
            _check_preconditions(stored, scope)
        except (AssertionFailed, CapExceeded, CardinalityFailed, RuleFailed) as exc:
            await self._record_failed(row, caller, clean, snapshot, origin, exc)
            raise
        return _Prepared(row, stored, principal, clean, queries, snapshot)

    def _check_runtime_budgets(self, stored: StoredCommand) -> None:
        lim = self.limits
        mutations = len(stored.effect_steps) + len(stored.data.get("outbox", []))
        if mutations > lim.max_mutations:
            raise LimitExceeded("mutation", limit=lim.max_mutations, actual=mutations)
        queries = len(stored.queries)
        if queries > lim.max_queries:
            raise LimitExceeded("query", limit=lim.max_queries, actual=queries)
        providers = {s["provider"] for s in stored.data["steps"] if s.get("provider")}
        providers |= {e["provider"] for e in stored.data.get("outbox", [])}
        if len(providers) > lim.max_relations:
            raise LimitExceeded("relation", limit=lim.max_relations, actual=len(providers))

    def _authorization_snapshot(
        self, row: CommandRow, stored: StoredCommand, caller: Caller, origin: str
    ) -> dict[str, Any]:
        """Frozen at execute: visibility of the record is judged by this, never the live row."""
        return audit.compact(
            {
                "version": 1,
                "scope": {"kind": row.scope_kind, "id": row.scope_id},
                "tag_id": row.tag_id,
                "resource_ids": sorted(stored.data["dependency_contract"]["actions"]),
                "command_updated_at": audit.iso(row.updated_at),
                "audience": "internal" if caller.kind == "user" else "external",
                "origin": origin,
                "ai": caller.ai,
            }
        )

    async def _run_queries(
        self, stored: StoredCommand, principal: Principal, scope: dict[str, Any]
    ) -> dict[str, Any]:
        """Run the query steps (reads) in order within the time budget; fill ``scope``."""
        limit = self.limits.timeout_seconds
        try:
            async with asyncio.timeout(limit):
                for step in stored.queries:
                    scope["queries"][step["name"]] = await self._query_step(step, principal, scope)
        except TimeoutError:
            raise CommandTimeout(details={"limit": limit}) from None
        return dict(scope["queries"])

    async def _query_step(
        self, step: Mapping[str, Any], principal: Principal, scope: Mapping[str, Any]
    ) -> dict[str, Any]:
        name = str(step["name"])
        try:
            payload = expressions.render(step["payload"], scope)
        except expressions.ExpressionError as exc:
            raise RuleFailed(
                f"query {name!r}: its payload cannot be rendered ({exc.code})",
                details={"rule": name},
            ) from None
        if not isinstance(payload, Mapping):
            raise RuleFailed(f"query {name!r}: payload must be an object", details={"rule": name})
        _authorize_read(principal, step["provider"], step["action"], payload)
        provider = self.orch.registry.get(step["provider"])
        try:
            answer = await provider.apply(
                step["action"], key=f"query:{uuid.uuid4().hex}", payload=payload, fence=0
            )
        except Exception:  # a read that raised: nothing written, say so without its text
            raise ProviderUnavailable(details={"step": name}, step=name) from None
        if not isinstance(answer, Confirmed):
            raise ProviderUnavailable(details={"step": name}, step=name)
        result = {"remote_id": answer.remote_id, "result": dict(answer.result)}
        cardinality = step.get("cardinality") or {}
        if cardinality:
            items = answer.result.get("items")
            actual = len(items) if isinstance(items, list) else 0
            low, high = cardinality.get("min"), cardinality.get("max")
            if (low is not None and actual < low) or (high is not None and actual > high):
                raise CardinalityFailed(
                    details=audit.compact(
                        {"step": name, "min": low, "max": high, "actual": actual}
                    ),
                    step=name,
                )
        return result

    async def _record_failed(
        self,
        row: CommandRow,
        caller: Caller,
        inputs: dict[str, Any],
        snapshot: dict[str, Any],
        origin: str,
        exc: AgentTxnError,
    ) -> None:
        """A definite failure before any write: one audit row (and failed callbacks), no tx."""
        execution_id = time_ordered_id()
        async with self.orch.store.transaction() as work:
            await executions.insert(
                work,
                **_new_record(
                    row,
                    caller,
                    execution_id=execution_id,
                    tx_id=None,
                    status="failed",
                    key=None,
                    origin=origin,
                    inputs=inputs,
                    snapshot=snapshot,
                    error_code=exc.code,
                    error=audit.safe_error(exc.message),
                    duration_ms=0,
                ),
            )
            failed = await executions.get(work.conn, execution_id)
            # Inserted just above in this same transaction: it cannot be gone yet (prune and
            # every other writer wait for this commit).
            assert failed is not None
            await audit.enqueue_callbacks(work, failed, "failed")
        exc.execution_id = execution_id  # type: ignore[attr-defined]

    def _records_writer(
        self,
        prepared: _Prepared,
        caller: Caller,
        *,
        key: str | None,
        takeover: str | None,
        origin: str,
        execution_id: str,
        tx_id: str,
        status: str,
        staged_change_id: str | None = None,
        lifecycle: Mapping[str, Any] | None = None,
        extra: Callable[[Work], Awaitable[None]] | None = None,
    ) -> Callable[[Work], Awaitable[None]]:
        """The rows that commit with the plan (step 8): authority re-check under the command
        row's lock, the reservation, the execution record, and ``extra`` rows of the caller."""
        row = prepared.row

        async def write_records(work: Work) -> None:
            await self._lock_command(work, row)
            if key is not None:
                await self._reserve(work, row, caller, key, takeover, execution_id)
            await executions.insert(
                work,
                **_new_record(
                    row,
                    caller,
                    execution_id=execution_id,
                    tx_id=tx_id,
                    status=status,
                    key=key,
                    origin=origin,
                    inputs=prepared.inputs,
                    snapshot=prepared.snapshot,
                    lifecycle=lifecycle,
                    staged_change_id=staged_change_id,
                ),
            )
            if extra is not None:
                await extra(work)

        return write_records

    async def _lock_command(self, work: Work, row: CommandRow) -> None:
        """Re-read the command under its row lock: what was validated is what is applied."""
        if work.store.dialect == "postgresql":
            # Bounded wait on the command row; past it the attempt is retried.
            ms = int(self.limits.lock_timeout_ms)
            await work.conn.execute(text(f"SET LOCAL lock_timeout = '{ms}ms'"))
        current = await commands.lock_for_apply(work, row.command_id)
        if (
            current is None
            or current.deleted_at is not None
            or current.digest != row.digest
            or (current.scope_kind, current.scope_id) != (row.scope_kind, row.scope_id)
            or current.tag_id != row.tag_id
        ):
            raise SourceAuthorityChanged()

    async def _reserve(
        self,
        work: Work,
        row: CommandRow,
        caller: Caller,
        key: str,
        takeover: str | None,
        execution_id: str,
    ) -> None:
        if takeover is not None:
            ok = await reservations.replace(
                work,
                command_id=row.command_id,
                bucket=caller.bucket,
                key=key,
                old_execution_id=takeover,
                execution_id=execution_id,
                ttl_ms=IDEMPOTENCY_TTL_MS,
            )
        else:
            ok = await reservations.reserve(
                work,
                command_id=row.command_id,
                bucket=caller.bucket,
                key=key,
                execution_id=execution_id,
                ttl_ms=IDEMPOTENCY_TTL_MS,
            )
        if not ok:
            # Another request with this key won the race (it committed its reservation with its
            # execution): name that execution, not this attempt's, which is never written.
            held = await reservations.get(work.conn, row.command_id, caller.bucket, key)
            if held is None:
                raise LockConflict()  # released since: the retry reserves it afresh
            raise IdempotencyInProgress(details={"execution_id": held.execution_id})

    async def _with_lock_retries(self, attempt_once: Callable[[], Awaitable[Any]]) -> Any:
        """Lock contention is retried a bounded number of times, then ``command_lock_conflict``;
        each attempt rolled back whole, so a retry starts clean."""
        attempts = self.limits.lock_retries + 1
        for attempt in range(attempts):
            try:
                return await attempt_once()
            except LockConflict:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(random.uniform(0.01, 0.05) * (2**attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _apply(
        self,
        prepared: _Prepared,
        caller: Caller,
        key: str | None,
        takeover: str | None,
        origin: str,
        budget_seconds: float | None,
    ) -> Outcome:
        if self.between_validation_and_apply is not None:
            await self.between_validation_and_apply()
        execution_id = time_ordered_id()
        tx_id = time_ordered_id()
        saga = SagaDefinition.parse(prepared.stored.saga_part())
        writer = self._records_writer(
            prepared,
            caller,
            key=key,
            takeover=takeover,
            origin=origin,
            execution_id=execution_id,
            tx_id=tx_id,
            status="running",
        )
        result = await self._past_expired_plans(
            lambda: self._with_lock_retries(
                lambda: self.orch.execute(
                    saga,
                    prepared.inputs,
                    tx_id=tx_id,
                    budget_seconds=budget_seconds,
                    execution_id=execution_id,
                    context=_context(prepared),
                    prepare_hook=writer,
                )
            )
        )
        if result.tx_id != tx_id:
            raise await self._business_key_held(result.tx_id)
        return await self._respond(execution_id, result)

    async def _past_expired_plans(self, attempt_once: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``attempt_once``; when its business key is held by an agent plan whose
        confirmation expired unconfirmed, retire that plan and try once more.

        Released where the key is checked, whoever prepared the plan, and by compare-and-set
        (the plan's token ``pending → released``): of racing writers only one retires it, and
        a confirmation that won first keeps its plan (the retry then meets a live holder and
        answers ``business_key_conflict`` as before). The failed attempt rolled back whole."""
        try:
            return await attempt_once()
        except BusinessKeyConflict as exc:
            holder = exc.details.get("tx_id")
            if not isinstance(holder, str) or not await self.orch.agent.release_expired_holder(
                holder
            ):
                raise
        return await attempt_once()

    async def _business_key_held(self, holder_tx_id: str) -> AgentTxnError:
        """Why a plan answered with another transaction: that one holds the business key, and
        the plan's commit (with this call's records and ``extra`` rows) was rolled back.

        A committed holder keeps the key for good: the business action already ran, and a
        retry can never succeed (``business_key_committed``). Any other holder may still fail
        and free it (``business_key_conflict``, retryable). Both name the holder's transaction
        and execution; the execution is readable only by those who may see it."""
        async with self._read() as conn:
            holder = await transactions.get(conn, holder_tx_id)
        if holder is None:
            # Pruned since it answered: its key is free again, so a retry can run.
            return BusinessKeyConflict(details={"tx_id": holder_tx_id})
        details = audit.compact(
            {
                "business_key": keys.rendered_business_key(holder.business_key),
                "tx_id": holder.tx_id,
                "execution_id": holder.execution_id,
            }
        )
        if holder.status is TxState.COMMITTED:
            return BusinessKeyCommitted(details=details)
        return BusinessKeyConflict(details=details)

    async def _respond(self, execution_id: str, result: SagaResult) -> Outcome:
        """Map a driven execution (whose plan landed) to what the caller receives."""
        async with self._read() as conn:
            record = await executions.get(conn, execution_id)
        if record is None:
            # It was written with the plan: pruned or deleted since, so a retry would not help.
            raise ExecutionNotFound()
        body = audit.view(record)
        if record.status == "succeeded":
            if result.output is not None:
                body["result"] = result.output
            return Outcome(200, body, execution_id)
        if record.status == "failed":
            stored_error = _tx_error(result)
            raise OutcomeError(
                record.error_code or "command_execution_failed",
                message=record.error,
                details=stored_error,
                step=stored_error.get("step"),
                execution_id=execution_id,
            )
        return Outcome(202, body, execution_id)

    # -- staging and approvals -----------------------------------------------------------------

    async def stage(
        self,
        prepared: _Prepared,
        caller: Caller,
        *,
        key: str | None,
        takeover: str | None,
        origin: str,
        staged_change_id: str | None = None,
        extra: Callable[[str, Work], Awaitable[None]] | None = None,
        response: Mapping[str, Any] | None = None,
    ) -> str:
        """Persist the validated plan without running it: execution ``staged``, transaction
        ``staged``, plus the caller's ``extra`` rows, in one commit. Returns the execution id."""
        if self.between_validation_and_apply is not None:
            await self.between_validation_and_apply()
        execution_id = time_ordered_id()
        tx_id = time_ordered_id()
        saga = SagaDefinition.parse(prepared.stored.saga_part())

        async def extras(work: Work) -> None:
            if response is not None:
                await executions.finish(
                    work, execution_id, status="staged", response=audit.snapshot(response)
                )
            if extra is not None:
                await extra(execution_id, work)

        writer = self._records_writer(
            prepared,
            caller,
            key=key,
            takeover=takeover,
            origin=origin,
            execution_id=execution_id,
            tx_id=tx_id,
            status="staged",
            staged_change_id=staged_change_id,
            extra=extras,
        )
        landed = await self._past_expired_plans(
            lambda: self._with_lock_retries(
                lambda: self.orch.stage(
                    saga,
                    prepared.inputs,
                    tx_id=tx_id,
                    execution_id=execution_id,
                    context=_context(prepared),
                    prepare_hook=writer,
                )
            )
        )
        if landed != tx_id:
            # Another transaction holds the business key: nothing of this call was written, so
            # no proposal, token or staged change may be answered from it.
            raise await self._business_key_held(landed)
        return execution_id

    async def _approvals_needed(self, stored: StoredCommand) -> builtins.list[tuple[str, str]]:
        async with self._read() as conn:
            rows = {(r.provider, r.action): r for r in await action_settings.all_(conn)}
        needed = []
        for step in stored.effect_steps:
            setting = rows.get((step["provider"], step["action"]))
            if setting is not None and setting.requires_approval:
                needed.append((str(step["provider"]), str(step["action"])))
        return needed

    async def _stage_for_approval(
        self,
        prepared: _Prepared,
        caller: Caller,
        key: str | None,
        takeover: str | None,
        origin: str,
    ) -> None:
        staged_change_id = uuid.uuid4().hex
        refusal = ApprovalRequired(details={"staged_change_id": staged_change_id})

        async def change(execution_id: str, work: Work) -> None:
            await staged.insert_change(
                work,
                staged_change_id=staged_change_id,
                execution_id=execution_id,
                command_id=prepared.row.command_id,
                digest=prepared.row.digest,
                requested_by=caller.principal_id,
            )
            # The "staged" callbacks commit with the staged record (as the agent's hand-over
            # does), not in a later transaction where the record could already be decided,
            # pruned or deleted, and a crash in between could lose them.
            record = await executions.get(work.conn, execution_id)
            assert record is not None  # inserted earlier in this same transaction
            await audit.enqueue_callbacks(work, record, "staged")

        execution_id = await self.stage(
            prepared,
            caller,
            key=key,
            takeover=takeover,
            origin=origin,
            staged_change_id=staged_change_id,
            extra=change,
            response=refusal.envelope(),
        )
        refusal.execution_id = execution_id  # type: ignore[attr-defined]
        raise refusal

    async def approve(
        self,
        approver: Caller,
        staged_change_id: str,
        *,
        reason: str | None = None,
        budget_seconds: float | None = None,
    ) -> Outcome:
        """An approver runs the frozen plan exactly as staged (its digest checked again)."""
        change, record, row = await self._decidable(approver, staged_change_id)

        async def decide(work: Work) -> None:
            await self._lock_command(work, row)
            if row.digest != change.digest:
                raise SourceAuthorityChanged()
            if not await staged.decide_change(
                work,
                staged_change_id,
                to_state="approved",
                decided_by=approver.principal_id,
                reason=_bounded(reason),
            ):
                raise StagedChangeDecided()
            await executions.finish(work, record.execution_id, status="running", response=None)

        # A staged change is only ever written with a record from :meth:`stage`, which always
        # carries its transaction; only ``_record_failed`` rows lack one, and they stage nothing.
        assert record.tx_id is not None
        tx_id = record.tx_id
        result = await self._with_lock_retries(
            lambda: self.orch.execute_staged(
                tx_id, budget_seconds=budget_seconds, prepare_hook=decide
            )
        )
        return await self._respond(record.execution_id, result)

    async def reject(
        self, approver: Caller, staged_change_id: str, *, reason: str | None = None
    ) -> dict[str, Any]:
        """An approver releases the plan: nothing runs, the key is freed, the record says so."""
        _change, record, _row = await self._decidable(approver, staged_change_id)
        decided: list[ExecutionRow] = []

        async def decide(work: Work) -> None:
            failed = await self._retire_staged(
                work,
                record,
                staged_change_id=staged_change_id,
                decided_by=approver.principal_id,
                reason=_bounded(reason),
                code="approval_rejected",
            )
            if failed is None:
                raise StagedChangeDecided()
            decided.append(failed)

        # See approve(): a staged change's record always names its transaction.
        assert record.tx_id is not None
        await self.orch.release_staged(record.tx_id, code="approval_rejected", hook=decide)
        # The record as this rejection committed it, not a re-read afterwards: once ``failed``
        # it may be pruned at any moment, and the rejection happened either way.
        return audit.view(decided[-1])

    async def _retire_staged(
        self,
        work: Work,
        record: ExecutionRow,
        *,
        staged_change_id: str | None,
        decided_by: str,
        reason: str | None,
        code: str,
    ) -> ExecutionRow | None:
        """Close ``record``'s staged plan without running it, in ``work``: its staged change
        ``rejected`` (or, with none, the agent's unconfirmed action ``released``) by
        compare-and-set, the record ``failed`` with ``code``, its idempotency key released, and
        a staged change's ``failed`` callbacks queued. ``None`` when somebody decided it first.
        The transaction is the caller's to release (its ledger row commits with this)."""
        if staged_change_id is not None:
            moved = await staged.decide_change(
                work, staged_change_id, to_state="rejected", decided_by=decided_by, reason=reason
            )
        else:
            action = await staged.action_of(work.conn, record.execution_id)
            moved = action is not None and await staged.move_action(
                work, action.token_sha256, from_state="pending", to_state="released"
            )
        if not moved:
            return None
        error_code, error_text = audit.error_of({"code": code})
        await executions.finish(
            work,
            record.execution_id,
            status="failed",
            error_code=error_code,
            error=error_text,
            response=None,
            duration_ms=max(0, work.now_ms - record.created_at),
        )
        if record.idempotency_key is not None:
            await reservations.release(
                work,
                command_id=record.command_id,
                bucket=record.actor_bucket,
                key=record.idempotency_key,
                execution_id=record.execution_id,
            )
        failed = await executions.get(work.conn, record.execution_id)
        # ``finish`` just updated it in this transaction (it raises when the row is gone), and
        # on PostgreSQL holds its row lock: it cannot vanish before the read.
        assert failed is not None
        if staged_change_id is not None:
            # Its "staged" callbacks went out; an agent's unconfirmed proposal queued none.
            await audit.enqueue_callbacks(work, failed, "failed")
        return failed

    async def _decidable(
        self, approver: Caller, staged_change_id: str
    ) -> tuple[staged.StagedChangeRow, ExecutionRow, CommandRow]:
        """The pending change, its execution and command, and proof the approver may decide.

        A deleted command's change is found too: delete releases its pending changes, so it
        answers ``staged_change_decided``; one stranded by an older version can still be
        rejected (approve refuses it: the command is re-read under its lock)."""
        authz.require_jwt(approver)
        async with self._read() as conn:
            change = await staged.get_change(conn, staged_change_id)
            if change is None:
                raise StagedChangeNotFound()
            row = await commands.get(conn, change.command_id, include_deleted=True)
            record = await executions.get(conn, change.execution_id)
            if row is None or record is None or row.tenant != self.tenant:
                raise StagedChangeNotFound()
            principal = await self._principal(conn, approver, row)
            settings_rows = {(r.provider, r.action): r for r in await action_settings.all_(conn)}
        if change.state != "pending":
            raise StagedChangeDecided()
        stored = StoredCommand.from_stored(row.definition)
        for step in stored.effect_steps:
            setting = settings_rows.get((step["provider"], step["action"]))
            if setting is None or not setting.requires_approval:
                continue
            authz.authorize_step(
                principal,
                provider=step["provider"],
                action=step["action"],
                payload=None,
                permission="approve",
            )
            policy = setting.approval_policy or {}
            separate = policy.get("separate_approver", True) if isinstance(policy, dict) else True
            if separate and approver.principal_id == change.requested_by:
                raise PrincipalNotAuthorized()  # never the invoker alone when the policy says so
        return change, record, row

    # -- query ---------------------------------------------------------------------------------

    async def query(self, caller: Caller, command_id: str, inputs: Any) -> dict[str, Any]:
        """Run a query-mode command: reads and expressions only; no lock, no audit row."""
        authz.require_jwt(caller)
        async with self._read() as conn:
            row = await self._visible(conn, command_id)
            principal = await self._principal(conn, caller, row)
            if row.mode != "query":
                raise CommandModeMismatch(details={"mode": row.mode})
            stored = StoredCommand.from_stored(row.definition)
            await self._check_dependencies(conn, stored)
        budgets.check_inputs_size(inputs)
        clean = _validate_query_inputs(stored, inputs)
        self._check_runtime_budgets(stored)
        authz.check_readable(principal, definitions.field_refs(stored))
        scope: dict[str, Any] = {"inputs": clean, "queries": {}}
        await self._run_queries(stored, principal, scope)
        _check_preconditions(stored, scope)
        output: Any = None
        if stored.result is not None:
            try:
                output = expressions.render(stored.result, scope)
            except expressions.ExpressionError:
                raise RuleFailed(
                    "the result cannot be rendered", details={"rule": "result"}
                ) from None
            size = len(canonical_json(output))
            if size > self.limits.max_output_bytes:
                raise LimitExceeded("output", limit=self.limits.max_output_bytes, actual=size)
        return audit.compact({"command_id": row.command_id, "result": output})

    # -- audit reads ---------------------------------------------------------------------------

    async def executions(
        self, caller: Caller, command_id: str, *, skip: int = 0, limit: int = 50
    ) -> builtins.list[dict[str, Any]]:
        """Executions of a command the caller may see, newest first."""
        authz.require_jwt(caller)
        _check_page(skip, limit)
        out: list[dict[str, Any]] = []
        async with self._read() as conn:
            row, principal = await self._audit_context(conn, caller, command_id)
            offset = 0
            while len(out) < skip + limit:
                page = await executions.list_(conn, command_id=command_id, skip=offset, limit=200)
                if not page:
                    break
                offset += len(page)
                out.extend(audit.view(r) for r in page if _visible_to(principal, r, row))
        return out[skip : skip + limit]

    async def execution(self, caller: Caller, command_id: str, execution_id: str) -> dict[str, Any]:
        """One execution, if the caller may see it; else 404 (never 403: no probing)."""
        authz.require_jwt(caller)
        async with self._read() as conn:
            row, principal = await self._audit_context(conn, caller, command_id)
            record = await executions.get(conn, execution_id)
        if record is None or record.command_id != command_id:
            raise ExecutionNotFound()
        if not _visible_to(principal, record, row):
            raise ExecutionNotFound()
        return audit.view(record)

    async def _audit_context(
        self, conn: Any, caller: Caller, command_id: str
    ) -> tuple[CommandRow, Principal]:
        row = await commands.get(conn, command_id, include_deleted=True)
        if row is None or row.tenant != self.tenant:
            raise ExecutionNotFound()
        try:
            principal = await self._principal(conn, caller, row)
        except PrincipalNotAuthorized:
            raise ExecutionNotFound() from None
        return row, principal

    async def pending_callbacks(self, execution_id: str) -> builtins.list[Any]:
        """Callback runs queued for an execution (delivery is the workers' job)."""
        async with self._read() as conn:
            return list(await callback_runs.for_execution(conn, execution_id))


# -- helpers -------------------------------------------------------------------------------------


def _new_record(
    row: CommandRow,
    caller: Caller,
    *,
    execution_id: str,
    tx_id: str | None,
    status: str,
    key: str | None,
    origin: str,
    inputs: Mapping[str, Any],
    snapshot: Mapping[str, Any],
    error_code: str | None = None,
    error: str | None = None,
    lifecycle: Mapping[str, Any] | None = None,
    staged_change_id: str | None = None,
    duration_ms: int | None = None,
) -> dict[str, Any]:
    """The columns of a new execution record of ``row`` run by ``caller``: the one place that
    maps a run onto ``executions.insert`` (a failure before any write, or a plan's record)."""
    return {
        "execution_id": execution_id,
        "command_id": row.command_id,
        "command_digest": row.digest,
        "tx_id": tx_id,
        "status": status,
        "invoker_kind": caller.kind,
        "invoker_id": caller.principal_id,
        "actor_bucket": caller.bucket,
        "idempotency_key": key,
        "origin": origin,
        "input_snapshot": inputs,
        "authorization_snapshot": snapshot,
        "steps": [],
        "result_refs": [],
        "error_code": error_code,
        "error": error,
        "response": None,
        "lifecycle_snapshot": dict(lifecycle) if lifecycle is not None else None,
        "staged_change_id": staged_change_id,
        "room_id": caller.room_id,
        "duration_ms": duration_ms,
    }


def _context(prepared: _Prepared) -> dict[str, Any] | None:
    return {"queries": prepared.queries} if prepared.queries else None


def _bounded(reason: str | None) -> str | None:
    return None if reason is None else " ".join(reason.split())[:500]


def _replay(previous: ExecutionRow) -> Outcome:
    """The stored answer of an earlier execution with the same key (never a second write)."""
    if previous.status == "staged":
        refusal = ApprovalRequired(details={"staged_change_id": previous.staged_change_id})
        refusal.execution_id = previous.execution_id  # type: ignore[attr-defined]
        raise refusal
    return Outcome(200, dict(previous.response or {}), previous.execution_id, True)


def _check_page(skip: int, limit: int) -> None:
    problems = []
    if not isinstance(skip, int) or not 0 <= skip <= MAX_SKIP:
        problems.append({"field": "skip", "problem": f"must be 0..{MAX_SKIP}"})
    if not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        problems.append({"field": "limit", "problem": f"must be 1..{MAX_LIMIT}"})
    if problems:
        raise RequestInvalid(details={"errors": problems})


def _render_or_none(template: Any, scope: Mapping[str, Any]) -> Mapping[str, Any] | None:
    try:
        value = expressions.render(template, scope)
    except expressions.ExpressionError:
        return None  # depends on a later step's result: checked again before the effect
    return value if isinstance(value, Mapping) else None


def _authorize_read(principal: Principal, provider: str, action: str, payload: Any) -> None:
    try:
        authz.authorize_step(
            principal, provider=provider, action=action, payload=payload, permission="read"
        )
    except PrincipalNotAuthorized:
        authz.authorize_step(principal, provider=provider, action=action, payload=payload)


def _check_preconditions(stored: StoredCommand, scope: Mapping[str, Any]) -> None:
    """Rules, caps and the asserts before the first effect: all over inputs and queries."""
    for rule in stored.rules:
        try:
            ok = expressions.evaluate_condition(rule["when"], scope)
        except expressions.ExpressionError:
            ok = False
        if not ok:
            raise RuleFailed(rule.get("message") or None, details={"rule": rule["name"]})
    for cap in stored.caps:
        try:
            value = expressions.evaluate(cap["value"], scope)
        except expressions.ExpressionError:
            value = None
        if not isinstance(value, int | float) or isinstance(value, bool) or value > cap["max"]:
            actual = value if isinstance(value, int | float) else None
            raise CapExceeded(
                details=audit.compact({"cap": cap["name"], "limit": cap["max"], "actual": actual})
            )
    for check in stored.asserts_pre:
        try:
            ok = expressions.evaluate_condition(check["expr"], scope)
        except expressions.ExpressionError:
            ok = False
        if not ok:
            message = " ".join(str(check.get("message") or "").split())
            raise AssertionFailed(
                message or None, details={"step": check["name"]}, step=check["name"]
            )


def _validate_query_inputs(stored: StoredCommand, inputs: Any) -> dict[str, Any]:
    shape = {
        "format": "agent-txn/saga@1",
        "name": stored.name,
        "version": stored.version,
        "inputs": stored.data["inputs"],
        "steps": [{"name": "noop", "provider": "none", "action": "none", "payload": {}}],
    }
    return SagaDefinition.parse(shape).validate_inputs(inputs)


def _same_inputs(previous: ExecutionRow, inputs: Any) -> None:
    """A replay is for the same request: the same key with other inputs is refused."""
    try:
        # Both as JSONB keeps numbers: the snapshot was read back from it (on PostgreSQL a float
        # of 1e16 or more comes back as an integer), the request still holds what was sent.
        same = fingerprint(jsonb_stable(previous.input_snapshot)) == fingerprint(
            jsonb_stable(inputs)
        )
    except NotCanonicalizable:
        same = False
    if not same:
        raise IdempotencyPayloadMismatch(details={"field": "inputs"})


def _tx_error(result: Any) -> dict[str, Any]:
    error = getattr(result, "error", None)
    if error is None:
        return {}
    return audit.compact({"step": error.step})


def _visible_to(principal: Principal, record: ExecutionRow, command: CommandRow) -> bool:
    return authz.can_see_execution(
        principal,
        invoker_kind=record.invoker_kind,
        invoker_id=record.invoker_id,
        snapshot=record.authorization_snapshot,
        mounted_scope=(command.scope_kind, command.scope_id),
    )


__all__: Sequence[str] = (
    "UNCHANGED",
    "CommandLimits",
    "CommandService",
    "Outcome",
    "Unchanged",
    "command_view",
)
