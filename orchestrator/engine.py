"""The ``Orchestrator`` facade: open a store, register providers and sagas, execute, recover.

::

    orch = await Orchestrator.open("sqlite+aiosqlite:///agent.db", providers=shop.providers())
    async with orch:
        result = await orch.execute(order_saga, {"order_id": "42", "sku": "sku-1", "amount": 1200})
        result.status  # TxState.COMMITTED

``execute`` validates everything before writing anything, persists the plan and the first
claim in one local commit, then drives the saga. An effect still in doubt is reconciled with
jittered backoff (tenacity) for at most ``execute_budget_seconds``; after that the result says
``in_doubt`` and a worker (``recover`` / ``drain`` / ``agent-txn worker``) finishes the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Self

import structlog
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_result,
    stop_after_delay,
    wait_random_exponential,
)

from ledger import definitions, effects, events, transactions
from ledger.canonical import NotCanonicalizable, fingerprint
from ledger.effects import Claim, EffectKind, NewEffect
from ledger.errors import (
    DuplicateKey,
    LeaseLost,
    SchemaOutdated,
    StorageError,
    StoreBusy,
    ValueNotStorable,
)
from ledger.events import LedgerEntry, LedgerProblem
from ledger.ids import time_ordered_id
from ledger.schema import BUSINESS_KEY_LENGTH, TX_ID_LENGTH
from ledger.states import TX_TERMINAL, TxState
from ledger.store import Chain, Store, Work
from orchestrator import audit, expressions, keys
from orchestrator.config import EngineSettings
from orchestrator.crashpoints import CrashPoints
from orchestrator.driver import SagaRun, Services, planned_effect, render_payload
from orchestrator.errors import (
    BusinessKeyConflict,
    DefinitionInvalid,
    IdempotencyPayloadMismatch,
    IdentifierInvalid,
    LockConflict,
    PayloadNotSerializable,
    SchemaOutdatedError,
    StoreUnavailableError,
    TransactionNotFound,
    UnknownActionError,
    UnknownProviderError,
    ValueNotStorableError,
)
from orchestrator.metrics import Metrics
from orchestrator.saga import Saga, SagaDefinition
from orchestrator.views import SagaResult, TransactionView, result_of, view_of
from providers.contract import Provider, UnknownAction
from providers.registry import ProviderRegistry, UnknownProvider

if TYPE_CHECKING:
    from orchestrator.agent import AgentToolbox
    from orchestrator.commands import CommandService

log = structlog.get_logger(__name__)

#: Writes of an upper layer that must commit with a transaction's plan (see ``execute``).
PrepareHook = Callable[[Work], Awaitable[None]]


@dataclass
class RecoveryReport:
    """What one recovery pass (or a drain) did."""

    passes: int = 0
    transactions: int = 0
    events: int = 0
    errors: int = 0
    lease_lost: int = 0
    tx_ids: list[str] = field(default_factory=list)

    def merge(self, other: RecoveryReport) -> None:
        """Add another pass's counts."""
        self.passes += other.passes
        self.transactions += other.transactions
        self.events += other.events
        self.errors += other.errors
        self.lease_lost += other.lease_lost
        self.tx_ids.extend(other.tx_ids)


@dataclass(frozen=True)
class _Plan:
    """A start's checked inputs and keyed plan, before anything is written."""

    definition: SagaDefinition
    inputs: dict[str, Any]
    business_key: str | None
    tx_id: str
    planned: list[NewEffect]


class Orchestrator:
    """The engine facade. One per process; safe for concurrent ``execute`` calls."""

    def __init__(
        self,
        store: Store,
        *,
        registry: ProviderRegistry | None = None,
        settings: EngineSettings | None = None,
        crashpoints: CrashPoints | None = None,
    ) -> None:
        self.store = store
        self.registry = registry or ProviderRegistry()
        self.settings = settings or EngineSettings()
        self.crashpoints = crashpoints or CrashPoints()
        self.metrics = Metrics()
        self._services = Services(
            store,
            self.registry,
            self.settings,
            self.crashpoints,
            self.metrics,
            # Command sagas: re-check the invoker before each effect, finish the audit record
            # in the saga's own commit. Plain sagas (no execution id) skip both.
            gate=audit.gate,
            on_terminal=audit.finish_execution,
        )
        self._by_name: dict[str, SagaDefinition] = {}
        self._by_digest: dict[str, SagaDefinition] = {}
        self._by_saga: dict[int, tuple[weakref.ref[Saga], SagaDefinition]] = {}
        self._stored: set[str] = set()
        self._commands: CommandService | None = None
        self._agent: AgentToolbox | None = None

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        providers: Iterable[Provider] = (),
        settings: EngineSettings | None = None,
        crashpoints: CrashPoints | None = None,
        auto_upgrade: Literal["empty", "always", "never"] = "empty",
        clock: Callable[[], float] = time.time,
    ) -> Orchestrator:
        """Connect to ``url`` (SQLite or PostgreSQL), check or create the schema."""
        settings = settings or EngineSettings()
        if not structlog.is_configured():
            # A library must not print info lines on the host's stdout: warnings to stderr,
            # unless the application configured structlog itself.
            from orchestrator.logging import configure_logging

            configure_logging()
        try:
            store = await Store.open(
                url,
                auto_upgrade=auto_upgrade,
                clock=clock,
                sqlite_synchronous=settings.sqlite_synchronous,
                pg_pool_size=settings.pg_pool_size,
                commit_cohorts=settings.pg_commit_cohorts,
                sqlite_writer=settings.sqlite_writer,
            )
        except SchemaOutdated as exc:
            raise SchemaOutdatedError(str(exc)) from exc
        except StorageError as exc:
            raise StoreUnavailableError(f"The database is unavailable: {exc}") from exc
        orch = cls(store, settings=settings, crashpoints=crashpoints)
        for p in providers:
            orch.register_provider(p)
        return orch

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the store's connections."""
        await self.store.close()

    async def abandon(self) -> None:
        """Drop everything as a crashed process would (no lease released)."""
        await self.store.abandon()

    @property
    def commands(self) -> CommandService:
        """The commands layer over this engine (authoring, execute, query, audit reads)."""
        if self._commands is None:
            from orchestrator.commands import CommandService

            self._commands = CommandService(self)
        return self._commands

    @property
    def agent(self) -> AgentToolbox:
        """Staged actions for agent runtimes (prepare → the person confirms → execute once)."""
        if self._agent is None:
            from orchestrator.agent import AgentToolbox

            self._agent = AgentToolbox(self.commands)
        return self._agent

    # -- registration ---------------------------------------------------------------------------

    def register_provider(self, provider: Provider) -> None:
        """Make ``provider`` available to sagas by its name."""
        self.registry.register(provider, replace=True)

    async def register(self, saga: Saga | Mapping[str, Any]) -> SagaDefinition:
        """Validate ``saga`` (shape, references, providers, contracts) and store its definition."""
        raw = saga.definition() if isinstance(saga, Saga) else saga
        definition = SagaDefinition.parse(raw)
        if definition.digest in self._by_digest:
            self._by_name[definition.name] = self._by_digest[definition.digest]
            return self._by_digest[definition.digest]
        self._check_against_providers(definition)
        await self._store_definition(definition)
        self._by_name[definition.name] = definition
        self._by_digest[definition.digest] = definition
        return definition

    def _contract(self, provider: str, action: str, where: str) -> Any:
        try:
            return self.registry.contract(provider, action)
        except UnknownProvider:
            raise UnknownProviderError(
                f"{where}: provider {provider!r} is not registered",
                details={"provider": provider},
            ) from None
        except UnknownAction:
            raise UnknownActionError(
                f"{where}: provider {provider!r} has no action {action!r}",
                details={"provider": provider, "action": action},
            ) from None

    def _check_against_providers(self, definition: SagaDefinition) -> None:
        shape: list[str] = []
        for step in definition.steps:
            where = f"step {step['name']!r}"
            contract = self._contract(step["provider"], step["action"], where)
            comp = step.get("compensation")
            if contract.compensation is not None and comp is None:
                raise DefinitionInvalid(
                    details={
                        "reason": f"{where}: the action is reversible; say how "
                        f"({contract.compensation!r} payload)",
                        "step": step["name"],
                    },
                    step=step["name"],
                )
            if comp is not None:
                if contract.compensation is None:
                    raise DefinitionInvalid(
                        details={
                            "reason": f"{where}: the action is irreversible",
                            "step": step["name"],
                        },
                        step=step["name"],
                    )
                if comp["action"] != contract.compensation:
                    raise DefinitionInvalid(
                        details={
                            "reason": f"{where}: compensate with {contract.compensation!r}",
                            "step": step["name"],
                        },
                        step=step["name"],
                    )
                self._contract(step["provider"], comp["action"], f"compensation of {where}")
            if step.get("retriable"):
                if not contract.dedups_by_key:
                    raise DefinitionInvalid(
                        details={
                            "reason": f"{where}: retriable steps need key dedup",
                            "step": step["name"],
                        },
                        step=step["name"],
                    )
                shape.append("R")
            else:
                shape.append("C" if comp is not None else "P")
        text = "".join(shape)
        # Compensatable steps first, then at most one pivot, then only retriable steps.
        stripped = text.lstrip("C")
        if stripped.startswith("P"):
            stripped = stripped[1:]
        if stripped.strip("R"):
            raise DefinitionInvalid(
                details={
                    "reason": "saga shape must be: compensatable steps, at most one "
                    "irreversible pivot, then only retriable steps"
                }
            )
        for ev in definition.outbox:
            self._contract(ev["provider"], ev["action"], f"outbox event {ev['name']!r}")

    async def _store_definition(self, definition: SagaDefinition) -> None:
        if definition.digest in self._stored:
            return
        async with self.store.transaction() as work:
            await definitions.put(
                work, digest=definition.digest, name=definition.name, definition=definition.data
            )
        self._stored.add(definition.digest)

    async def _definition(self, digest: str) -> SagaDefinition:
        known = self._by_digest.get(digest)
        if known is not None:
            return known
        async with self.store.read() as conn:
            data = await definitions.get(conn, digest)
        if data is None:
            raise TransactionNotFound(f"definition {digest} is missing")
        definition = SagaDefinition.parse(data)
        self._by_digest[digest] = definition
        self._stored.add(digest)
        return definition

    # -- execute --------------------------------------------------------------------------------

    async def execute(
        self,
        saga: Saga | str | SagaDefinition,
        inputs: Mapping[str, Any],
        *,
        tx_id: str | None = None,
        budget_seconds: float | None = None,
        execution_id: str | None = None,
        context: Mapping[str, Any] | None = None,
        prepare_hook: PrepareHook | None = None,
    ) -> SagaResult:
        """Run ``saga`` once for ``inputs``.

        ``tx_id`` (optional, caller-chosen) makes the call idempotent: the same id with the same
        inputs returns that transaction's outcome; with different inputs it is refused
        (``idempotency_payload_mismatch``) before any provider call.

        The commands layer passes ``execution_id`` (the audit record), ``context`` (query results
        frozen into the template scope) and ``prepare_hook``, which writes its own rows (the
        execution record, the idempotency reservation) in the same local commit as the plan.
        """
        plan = await self._prepared(saga, inputs, tx_id, context)
        chain = Chain(plan.tx_id)
        persisted = await self._persist(
            plan,
            chain,
            start="leased",
            execution_id=execution_id,
            context=context,
            prepare_hook=prepare_hook,
        )
        if isinstance(persisted, SagaResult):
            return persisted
        txc, first = persisted
        definition, clean, tx_id, planned = plan.definition, plan.inputs, plan.tx_id, plan.planned
        ops = [
            planned_effect(EffectKind.OPERATION, n, first if i == 0 else None)
            for i, n in enumerate(planned)
        ]
        run = SagaRun(
            self._services,
            definition,
            tx_id,
            clean,
            txc,
            chain,
            ops,
            hold_on_pause=True,
            context=context,
            execution_id=execution_id,
        )
        try:
            await self._drive_in_call(run, first, budget_seconds)
        except LeaseLost:
            log.info("lease lost during execute; another worker owns it", tx_id=tx_id)
            return await self.result(tx_id)
        return result_of(run)

    async def enqueue(
        self,
        saga: Saga | str | SagaDefinition,
        inputs: Mapping[str, Any],
        *,
        tx_id: str | None = None,
    ) -> SagaResult:
        """Persist ``saga`` for ``inputs`` and leave it to the workers; nothing is attempted here.

        One local commit writes the transaction (``executing``, no lease, due at once) and
        every step ``pending``: whichever worker claims it first applies the first step
        directly, because a pending step is known never to have been sent (a saga handed over
        by a process that died after claiming it is looked up first instead). Inputs, business
        key and ``tx_id`` are checked as :meth:`execute` checks them, with the same idempotency:
        the same ``tx_id`` and inputs return that transaction as it stands now.
        """
        plan = await self._prepared(saga, inputs, tx_id)
        persisted = await self._persist(plan, Chain(plan.tx_id), start="enqueued")
        if isinstance(persisted, SagaResult):
            return persisted
        return SagaResult(tx_id=plan.tx_id, status=TxState.EXECUTING)

    async def _prepared(
        self,
        saga: Saga | str | SagaDefinition,
        inputs: Mapping[str, Any],
        tx_id: str | None,
        context: Mapping[str, Any] | None = None,
    ) -> _Plan:
        """What every start checks before it writes: the definition, the inputs, the business
        key, the transaction id and the keyed plan (payloads of input-only steps rendered)."""
        definition = await self._resolve(saga)
        if tx_id is not None and not (keys.is_identifier(tx_id) and len(tx_id) <= TX_ID_LENGTH):
            raise IdentifierInvalid(
                f"tx_id must be a non-blank identifier of at most {TX_ID_LENGTH} characters",
                details={"field": "tx_id"},
            )
        clean = definition.validate_inputs(inputs)
        business_key = self._business_key(definition, clean)
        tx_id = tx_id or time_ordered_id()
        planned = self._plan(definition, tx_id, clean, context)
        return _Plan(definition, clean, business_key, tx_id, planned)

    async def _persist(
        self,
        plan: _Plan,
        chain: Chain,
        *,
        start: Literal["leased", "enqueued", "staged"],
        execution_id: str | None = None,
        context: Mapping[str, Any] | None = None,
        prepare_hook: PrepareHook | None = None,
    ) -> tuple[transactions.TxClaim, Claim | None] | SagaResult:
        """The one local commit that makes a plan durable, before anything is sent.

        ``leased``: this engine holds the transaction and its first step is claimed in the same
        commit (:meth:`execute`); ``enqueued``: no lease, every step pending, for the workers;
        ``staged``: waiting for a person's confirmation, never recovered. A transaction that
        already exists under this id (or business key) answers as it stands now."""
        owner = self.settings.worker_id if start == "leased" else None
        lease_ms = self.settings.lease_ms
        try:
            async with self.store.transaction() as work:
                if prepare_hook is not None:
                    # First, so its row locks (the command row) serialise concurrent executes
                    # before anything else is written.
                    await prepare_hook(work)
                txc = await transactions.insert(
                    work,
                    chain,
                    tx_id=plan.tx_id,
                    definition_digest=plan.definition.digest,
                    saga_name=plan.definition.name,
                    inputs=plan.inputs,
                    owner=owner,
                    lease_ms=lease_ms,
                    business_key=plan.business_key,
                    execution_id=execution_id,
                    context=context,
                    staged=start == "staged",
                )
                first = await effects.insert(
                    work,
                    chain,
                    EffectKind.OPERATION,
                    plan.planned,
                    claim_first=(owner, lease_ms) if owner is not None else None,
                )
                if start != "staged" and self.crashpoints.armed:
                    self.crashpoints.hit("prepare.before_commit", tx_id=plan.tx_id)
        except DuplicateKey:
            return await self._existing(plan.tx_id, plan.inputs, plan.business_key)
        except StoreBusy as exc:
            raise LockConflict() from exc
        except ValueNotStorable as exc:
            raise ValueNotStorableError() from exc
        except StorageError as exc:
            raise StoreUnavailableError() from exc
        if start != "staged" and self.crashpoints.armed:
            self.crashpoints.hit("prepare.after_commit", tx_id=plan.tx_id)
        return txc, first

    # -- staged plans (a person confirms before anything runs) --------------------------------

    async def stage(
        self,
        saga: Saga | str | SagaDefinition,
        inputs: Mapping[str, Any],
        *,
        tx_id: str | None = None,
        execution_id: str | None = None,
        context: Mapping[str, Any] | None = None,
        prepare_hook: PrepareHook | None = None,
    ) -> str:
        """Persist the full plan in ``staged`` (keys, payloads, no lease) and return its tx id.

        Nothing is sent and recovery never picks it up; :meth:`execute_staged` runs exactly this
        plan once, :meth:`release_staged` retires it."""
        plan = await self._prepared(saga, inputs, tx_id, context)
        persisted = await self._persist(
            plan,
            Chain(plan.tx_id),
            start="staged",
            execution_id=execution_id,
            context=context,
            prepare_hook=prepare_hook,
        )
        return persisted.tx_id if isinstance(persisted, SagaResult) else plan.tx_id

    async def execute_staged(
        self,
        tx_id: str,
        *,
        budget_seconds: float | None = None,
        prepare_hook: PrepareHook | None = None,
    ) -> SagaResult:
        """Run a staged plan: ``staged → executing`` and the first claim in one commit, then
        drive it like :meth:`execute`. A plan no longer staged answers its current outcome."""
        s = self.settings
        try:
            async with self.store.transaction() as work:
                if prepare_hook is not None:
                    await prepare_hook(work)
                chain = await events.chain_of(work.conn, tx_id)
                txc = await transactions.claim_staged(
                    work, chain, tx_id, owner=s.worker_id, lease_ms=s.lease_ms
                )
                if txc is None:
                    run = None
                else:
                    run = await self._load_run(work.conn, chain, txc)
                    run.hold_on_pause = True
                    first = await run._advance(work, eager=True)
        except StoreBusy as exc:
            raise LockConflict() from exc
        except ValueNotStorable as exc:
            raise ValueNotStorableError() from exc
        except StorageError as exc:
            raise StoreUnavailableError() from exc
        if run is None:
            return await self.result(tx_id)
        run._after_commit_milestones()
        try:
            await self._drive_in_call(run, first, budget_seconds)
        except LeaseLost:
            return await self.result(tx_id)
        return result_of(run)

    async def release_staged(
        self, tx_id: str, *, code: str = "staged_released", hook: PrepareHook | None = None
    ) -> bool:
        """Retire a staged plan (``staged → failed``); ``False`` if it is no longer staged."""
        async with self.store.transaction() as work:
            if hook is not None:
                await hook(work)
            return await self.release_staged_in(work, tx_id, code=code)

    async def release_staged_in(self, work: Work, tx_id: str, *, code: str) -> bool:
        """:meth:`release_staged` inside the caller's own transaction, for a caller that retires
        several plans in one commit (deleting a command retires every plan it staged)."""
        chain = await events.chain_of(work.conn, tx_id)
        return await transactions.release_staged(work, chain, tx_id, error={"code": code})

    async def _drive_in_call(self, run: SagaRun, first: Any, budget_seconds: float | None) -> None:
        budget = self.settings.execute_budget_seconds if budget_seconds is None else budget_seconds
        await run.drive(first)
        if run.paused_on is None or run.txc.status in TX_TERMINAL:
            return  # done, parked, or committed with an outbox event left to the workers

        async def again() -> bool:
            async with self.store.transaction() as work:
                await transactions.renew(work, run.txc, lease_ms=self.settings.lease_ms)
            await run.drive(None, eager=True)
            return run.paused_on is not None and run.txc.status not in TX_TERMINAL

        if budget > 0:
            retrying = AsyncRetrying(
                stop=stop_after_delay(budget),
                wait=wait_random_exponential(
                    multiplier=self.settings.backoff_initial_seconds,
                    max=self.settings.backoff_max_seconds,
                ),
                retry=retry_if_result(bool),
            )
            # RetryError: the budget ended with the effect still in doubt; workers take over.
            with contextlib.suppress(RetryError):
                await retrying(again)
        if run.paused_on is not None and run.txc.status not in TX_TERMINAL:
            async with self.store.transaction() as work:
                await run.release(work)

    async def _resolve(self, saga: Saga | str | SagaDefinition) -> SagaDefinition:
        if isinstance(saga, SagaDefinition):
            if self._by_digest.get(saga.digest) is saga:
                return saga  # parsed and registered by this engine: nothing to re-check
            return await self.register(saga.data)
        if isinstance(saga, Saga):
            # Normalizing and digesting a Saga costs more than the rest of ``execute`` before
            # its first commit (the bench's profile); a Saga is frozen, so it is done once per
            # object. The weak reference keeps the cache from outliving the caller's sagas.
            entry = self._by_saga.get(id(saga))
            if entry is not None and entry[0]() is saga:
                self._by_name[entry[1].name] = entry[1]  # as register() does
                return entry[1]
            definition = await self.register(saga)
            self._by_saga[id(saga)] = (weakref.ref(saga, self._forget_saga), definition)
            return definition
        if not isinstance(saga, str) or saga not in self._by_name:
            raise DefinitionInvalid(details={"reason": f"no saga named {saga!r} is registered"})
        return self._by_name[saga]

    def _forget_saga(self, ref: weakref.ref[Saga]) -> None:
        for key, (known, _definition) in list(self._by_saga.items()):
            if known is ref:
                del self._by_saga[key]

    def _business_key(self, definition: SagaDefinition, inputs: Mapping[str, Any]) -> str | None:
        template = definition.data.get("business_key")
        if template is None:
            return None
        try:
            # Validated when the definition was parsed (``SagaDefinition.parse``), so its
            # compiled form runs: walking and interpreting it was 2 % of a saga's CPU.
            value = expressions.render(template, {"inputs": inputs}, prevalidated=True)
        except expressions.ExpressionError as exc:
            raise IdentifierInvalid(
                "business key could not be rendered", details={"field": "business_key"}
            ) from exc
        if not isinstance(value, str) or not value.strip() or len(value) > BUSINESS_KEY_LENGTH:
            raise IdentifierInvalid(
                "business key must be a non-blank string of at most"
                f" {BUSINESS_KEY_LENGTH} characters",
                details={"field": "business_key"},
            )
        # Unique per tenant: another tenant's order with the same id (on a shared database) is
        # another business intent, and must neither block this one nor show it its tx id.
        return keys.tenant_business_key(self.settings.tenant, value)

    def _plan(
        self,
        definition: SagaDefinition,
        tx_id: str,
        inputs: dict[str, Any],
        context: Mapping[str, Any] | None = None,
    ) -> list[NewEffect]:
        """Keys for every step, payloads for every step that depends on inputs only."""
        s = self.settings
        scope: dict[str, Any] = {**(context or {}), "inputs": inputs, "tx": {"id": tx_id}}
        scope["steps"] = {}
        planned: list[NewEffect] = []
        for ordinal, step in enumerate(definition.steps):
            payload: Any = None
            sha: str | None = None
            needs_results = definition.payload_needs_results(ordinal)
            if not needs_results:
                try:
                    payload, sha = render_payload(step["payload"], scope)
                except expressions.ExpressionError as exc:
                    raise PayloadNotSerializable(
                        f"step {step['name']!r}: {exc.message}",
                        details={"step": step["name"]},
                        step=step["name"],
                    ) from exc
                except NotCanonicalizable as exc:
                    raise PayloadNotSerializable(details={"step": step["name"]}) from exc
            planned.append(
                NewEffect(
                    key=keys.op_key(
                        tenant=s.tenant,
                        environment=s.environment,
                        provider=step["provider"],
                        tx_id=tx_id,
                        step=step["name"],
                        version=definition.version,
                    ),
                    tx_id=tx_id,
                    name=step["name"],
                    provider=step["provider"],
                    action=step["action"],
                    ordinal=ordinal,
                    payload=payload,
                    payload_sha256=sha,
                )
            )
        if planned and planned[0].payload_sha256 is None:
            raise DefinitionInvalid(details={"reason": "the first step may depend on inputs only"})
        return planned

    async def _existing(
        self, tx_id: str, inputs: Mapping[str, Any], business_key: str | None
    ) -> SagaResult:
        async with self.store.read() as conn:
            existing = await transactions.get(conn, tx_id)
            holder = (
                await transactions.live_by_business_key(conn, business_key)
                if business_key is not None
                else None
            )
        if existing is not None:
            if fingerprint(existing.inputs) != fingerprint(dict(inputs)):
                raise IdempotencyPayloadMismatch(
                    "this tx_id was used with different inputs", details={"field": "inputs"}
                )
            return await self.result(tx_id)
        if holder is not None:
            if holder.status is TxState.COMMITTED:
                # The business action already ran: its outcome, never a second run. (The
                # commands layer, whose callers may not see it, answers business_key_committed.)
                return await self.result(holder.tx_id)
            # Still in flight: it may yet fail or be compensated and free the key (retryable).
            raise BusinessKeyConflict(
                details=audit.compact(
                    {
                        "business_key": keys.rendered_business_key(business_key),
                        "tx_id": holder.tx_id,
                        "execution_id": holder.execution_id,
                    }
                )
            )
        raise LockConflict()  # a concurrent writer won the race for a key we could not see

    # -- recovery -------------------------------------------------------------------------------

    async def recover(self, *, limit: int = 16) -> RecoveryReport:
        """One recovery pass: claim due transactions (one statement), drive each, then dispatch
        due outbox events of committed transactions."""
        report = RecoveryReport(passes=1)
        try:
            runs = await self.claim_due(limit=limit)
            due_events = await self.due_outbox(limit=limit)
        except StorageError as exc:
            report.errors += 1
            log.warning("recovery claim failed", error=type(exc).__name__)
            return report
        for run in runs:
            await self._guarded(report, self.drive_claimed(run), run.tx_id)
        for tx_id in due_events:
            await self._guarded(report, self.dispatch_outbox(tx_id), tx_id, outbox=True)
        return report

    async def due_outbox(self, *, limit: int) -> list[str]:
        """The transactions with outbox events due now (up to ``limit`` events), each once,
        oldest due first: what a recovery pass or a worker dispatches."""
        async with self.store.read() as conn:
            events = await effects.due(conn, EffectKind.OUTBOX, self.store, limit=limit)
        return list(dict.fromkeys(e.tx_id for e in events))

    async def _guarded(
        self, report: RecoveryReport, job: Any, tx_id: str, *, outbox: bool = False
    ) -> None:
        try:
            did = await job
        except LeaseLost:
            report.lease_lost += 1
            return
        except StorageError as exc:
            report.errors += 1
            log.warning("recovery step failed", tx_id=tx_id, error=type(exc).__name__)
            return
        if did:
            if outbox:
                report.events += 1
            else:
                report.transactions += 1
            report.tx_ids.append(tx_id)

    async def claim_due(self, *, limit: int) -> list[SagaRun]:
        """Claim up to ``limit`` due transactions and load their runs, in one local transaction:
        the claim, then four statements for the whole batch (the transactions and each effect
        table), so each drive's first local transaction only writes.

        A run loaded here is as good as one loaded when its drive starts: the holder of the
        transaction lease is the only writer of its rows, and every write the drive makes is
        fenced or pinned (a row that moved under it raises :class:`LeaseLost`)."""
        s = self.settings
        async with self.store.transaction() as work:
            claimed = await transactions.claim_due(
                work, owner=s.worker_id, lease_ms=s.lease_ms, limit=limit
            )
            return await self._load_runs(work.conn, [(c.txc, c.chain) for c in claimed])

    async def drive_claimed(
        self, run: SagaRun, *, should_stop: Callable[[], bool] | None = None
    ) -> TxState:
        """Drive a transaction this engine holds the lease of (its run from :meth:`claim_due`),
        until it is terminal, parked or waiting; ``should_stop`` ends the drive after the
        current write (lease released)."""
        run.should_stop = should_stop
        async with self.store.transaction() as work:
            claim = await run._advance(work, eager=False)
        run._after_commit_milestones()
        await run.drive(claim)
        return run.txc.status

    async def dispatch_outbox(self, tx_id: str) -> bool:
        """Send the due outbox events of a committed transaction; ``False`` if none was due."""
        async with self.store.transaction() as work:
            chain = await events.chain_of(work.conn, tx_id)
            tx = await transactions.get(work.conn, tx_id)
            if tx is None or tx.status is not TxState.COMMITTED:
                return False
            txc = transactions.TxClaim(tx_id, tx.fence, tx.status, self.settings.worker_id)
            run = await self._load_run(work.conn, chain, txc)
            claim = await run._advance(work, eager=False)
        if claim is None:
            return False
        await run.drive(claim)
        return True

    async def _load_run(self, conn: Any, chain: Chain, txc: transactions.TxClaim) -> SagaRun:
        return (await self._load_runs(conn, [(txc, chain)]))[0]

    async def _load_runs(
        self, conn: Any, held: Sequence[tuple[transactions.TxClaim, Chain]]
    ) -> list[SagaRun]:
        """The runs of transactions this engine holds, in the order given: four statements
        however many there are."""
        ids = [txc.tx_id for txc, _ in held]
        if not ids:
            return []
        records = await transactions.get_many(conn, ids)
        ops = await effects.for_txs(conn, EffectKind.OPERATION, ids)
        reversals = await effects.for_txs(conn, EffectKind.COMPENSATION, ids)
        outbox = await effects.for_txs(conn, EffectKind.OUTBOX, ids)
        runs = []
        for txc, chain in held:
            tx = records[txc.tx_id]
            runs.append(
                SagaRun(
                    self._services,
                    await self._definition(tx.definition_digest),
                    tx.tx_id,
                    dict(tx.inputs),
                    txc,
                    chain,
                    ops[tx.tx_id],
                    reversals[tx.tx_id],
                    outbox[tx.tx_id],
                    context=tx.context,
                    execution_id=tx.execution_id,
                )
            )
        return runs

    async def drain(self, *, timeout_seconds: float = 30.0, limit: int = 16) -> RecoveryReport:
        """Recover until nothing is in flight or ``timeout_seconds`` pass, waiting out backoffs."""
        total = RecoveryReport()
        deadline = time.monotonic() + timeout_seconds
        while True:
            report = await self.recover(limit=limit)
            total.merge(report)
            if report.transactions or report.events:
                continue
            try:
                busy = await self.in_flight()
            except StorageError as exc:
                # The database went away between passes (killed backend, restart): a worker
                # keeps draining until its deadline rather than dying with its work in hand.
                total.errors += 1
                log.warning("in-flight check failed", error=type(exc).__name__)
                busy = 1
            if not busy or time.monotonic() >= deadline:
                return total
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    async def in_flight(self) -> int:
        """Transactions not yet terminal or parked, plus outbox events not yet settled."""
        # In flight: prepared, executing, validating or compensating (not terminal, parked or
        # staged). Both counts read index entries of in-flight rows only.
        async with self.store.read() as conn:
            resumable = await transactions.count_resumable(conn)
            unsettled = await effects.count_unsettled(conn, EffectKind.OUTBOX)
        return resumable + unsettled

    # -- reading --------------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """Counts from the database: transactions by status, effects by state, outbox lag."""
        async with self.store.read() as conn:
            by_status = await transactions.count_by_status(conn)
            # Parked sagas and committed ones whose outbox event waits: what `review list` shows.
            parked = await transactions.count_parked(conn)
            kinds = {k.value: await effects.count_by_state(conn, k) for k in EffectKind}
            lag = await effects.oldest_unsettled_age_ms(
                conn, EffectKind.OUTBOX, self.store.db_now()
            )
        return {
            "transactions": by_status,
            "effects": kinds,
            "manual_review": parked,
            "outbox_lag_seconds": (lag or 0) / 1000,
        }

    async def get(self, tx_id: str) -> TransactionView:
        """The transaction with its operations, reversals and outbox events."""
        async with self.store.read() as conn:
            tx = await transactions.get(conn, tx_id)
            if tx is None:
                raise TransactionNotFound(details={"tx_id": tx_id})
            ops = await effects.for_tx(conn, EffectKind.OPERATION, tx_id)
            comps = await effects.for_tx(conn, EffectKind.COMPENSATION, tx_id)
            outbox = await effects.for_tx(conn, EffectKind.OUTBOX, tx_id)
        return view_of(tx, ops, comps, outbox)

    async def result(self, tx_id: str) -> SagaResult:
        """The typed result of a transaction as stored now."""
        return (await self.get(tx_id)).result()

    async def ledger(self, tx_id: str) -> list[LedgerEntry]:
        """A transaction's ledger, oldest first."""
        async with self.store.read() as conn:
            return await events.read(conn, tx_id)

    async def verify_ledger(self, tx_id: str | None = None) -> list[LedgerProblem]:
        """Hash-chain and replay problems (empty when the ledger is intact)."""
        async with self.store.read() as conn:
            return await events.verify(conn, tx_id)
