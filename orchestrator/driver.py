"""The saga driver: moves one leased transaction through execute → validate → commit, or back
through compensation, one local commit per provider answer.

The same driver runs a fresh ``execute`` and a recovering worker: it looks only at the stored
state (operations, compensation steps, outbox), never at what the caller remembers. Commit
economy: recording an effect's outcome and claiming the next effect share one local
transaction (:meth:`SagaRun._advance` runs inside the record's transaction), so a happy saga of
N steps and one outbox event costs N + 2 commits: prepare+claim, N-1 x record+claim,
record+commit+outbox claim, outbox record. The last one rides on the store's next transaction
(:mod:`ledger.riders`, :meth:`SagaRun._may_ride` says when), so a sequential caller pays N + 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import structlog

from compensation.planner import ReversalSpec, plan_reversal
from compensation.policy import (
    REASON_IRREVERSIBLE,
    REASON_PAYLOAD,
    REASON_RETRIABLE_REJECTED,
    REASON_REVERSAL_REJECTED,
    RetryBudget,
)
from ledger import effects, transactions
from ledger.canonical import NotCanonicalizable, canonical_json, fingerprint
from ledger.effects import Claim, Effect, EffectKind
from ledger.errors import LeaseLost, StorageError
from ledger.states import CLAIMABLE, TX_TERMINAL, EffectState, TxState
from ledger.store import Chain, Store, Work
from ledger.transactions import TxClaim
from orchestrator import expressions, keys
from orchestrator.config import EngineSettings
from orchestrator.crashpoints import CrashPoints
from orchestrator.metrics import Metrics
from orchestrator.protocol import Decision, decide, echo_mismatches
from orchestrator.saga import SagaDefinition
from providers.contract import FULL_REMOTE_ID_FIELD, bounded_remote_id, full_remote_id
from providers.registry import ProviderRegistry

log = structlog.get_logger(__name__)


def storable_remote_id(decision: Decision) -> Decision:
    """``decision`` with a remote id the store can hold on every backend.

    Every provider answer passes here before it is recorded (:meth:`SagaRun._decidable`), so
    this is the one boundary where a provider's id meets the ``remote_id`` column. An id longer
    than the column (PostgreSQL refused it with ``ValueNotStorable`` on every retry, while the
    effect had happened; SQLite kept it whole) is recorded as its stand-in
    (:func:`~providers.contract.bounded_remote_id`: a prefix plus a SHA-256 of the whole id)
    and the whole id goes into the result, so the effect is still recorded confirmed, lookups
    and views find one stable id, and templates (``forward.remote_id``: a refund naming the
    charge) render the whole id (:func:`~providers.contract.full_remote_id`)."""
    remote_id = decision.remote_id
    if remote_id is None or len(remote_id) <= effects.REMOTE_ID_MAX:
        return decision
    stored = bounded_remote_id(remote_id, effects.REMOTE_ID_MAX)
    result = {**(decision.result or {}), FULL_REMOTE_ID_FIELD: remote_id}
    detail = {**decision.detail, "remote_id_length": len(remote_id)}
    return replace(decision, remote_id=stored, result=result, detail=detail)


class StepGate(Protocol):
    """Asked before a never-sent effect of a command's saga is claimed: may the invoker still
    do this, with this payload? (Authorization as the caller, checked again before the effect.)"""

    async def __call__(self, work: Work, run: SagaRun, step: str, payload: Any) -> bool: ...


class TerminalHook(Protocol):
    """Called inside the local transaction that moves a saga to a terminal or parked state,
    so what depends on the outcome (the command's execution record) commits with it."""

    async def __call__(self, work: Work, run: SagaRun) -> None: ...


@dataclass
class Services:
    """What every run needs from the engine."""

    store: Store
    registry: ProviderRegistry
    settings: EngineSettings
    crashpoints: CrashPoints
    metrics: Metrics | None = None
    gate: StepGate | None = None
    on_terminal: TerminalHook | None = None


def render_payload(template: Any, scope: Mapping[str, Any]) -> tuple[Any, str]:
    """Render a payload template of a parsed definition (validated when it was parsed);
    returns the payload and its fingerprint."""
    payload = expressions.render(template, scope, prevalidated=True)
    return payload, fingerprint(payload)


@dataclass
class SagaRun:
    """One holder's view of one transaction while it holds the lease."""

    services: Services
    definition: SagaDefinition
    tx_id: str
    inputs: dict[str, Any]
    txc: TxClaim
    chain: Chain
    ops: list[Effect]
    reversals: list[Effect] = field(default_factory=list)
    events: list[Effect] = field(default_factory=list)
    #: Keep the transaction lease while an effect is in doubt (``execute`` reconciles in-call).
    hold_on_pause: bool = False
    error: dict[str, Any] | None = None
    paused_on: Effect | None = None
    retry_hint_ms: int | None = None
    #: Asked after every commit; true ends the drive and hands the leases back (worker stop).
    should_stop: Callable[[], bool] | None = None
    #: Extra scope frozen at prepare (a command's query results), ``None`` for plain sagas.
    context: Mapping[str, Any] | None = None
    #: The command execution this saga belongs to (its audit record), if any.
    execution_id: str | None = None
    _milestones: list[str] = field(default_factory=list)
    _lease_renewed_at: float = field(default_factory=time.monotonic)

    # -- the loop ------------------------------------------------------------------------------

    async def drive(self, claim: Claim | None, *, eager: bool = False) -> None:
        """Run until the saga is terminal, parked, or waiting on an in-doubt effect."""
        store = self.services.store
        crash = self.services.crashpoints
        self.paused_on = None
        while True:
            if claim is None:
                async with store.transaction() as work:
                    claim = await self._advance(work, eager=eager)
                    if crash.armed:
                        crash.hit("record.before_commit", tx_id=self.tx_id, kind="advance")
            else:
                try:
                    decision = self._decidable(claim, await self._decide(claim))
                except LeaseLost:
                    if self.services.metrics is not None:
                        self.services.metrics.fence_refusals.inc()
                        self.services.metrics.lease_losses.inc()
                    raise
                self._count(claim, decision)
                if self._may_ride(claim, decision):
                    # Nothing is sent after this record: it rides on the store's next
                    # transaction instead of committing one of its own (ledger/riders.py).
                    self._remember(claim, decision)
                    store.ride(_Delivered(self, claim, decision))
                    return
                async with store.transaction() as work:
                    await self._keep_lease(work)
                    await self._record(work, claim, decision)
                    if decision.in_doubt:
                        # Never re-claim in the same breath: the backoff is the point.
                        await self._pause(work, self._cached(claim.kind, claim.key))
                        claim = None
                    else:
                        claim = await self._advance(work, eager=eager)
                    if crash.armed:
                        crash.hit("record.before_commit", **self._ctx_of(claim, decision))
                if crash.armed:
                    crash.hit("record.after_commit", tx_id=self.tx_id, kind="record")
            self._after_commit_milestones()
            if claim is None:
                return
            if self.should_stop is not None and self.should_stop():
                await self._hand_back(claim)
                return

    async def _hand_back(self, claim: Claim) -> None:
        """Stopping: give back the effect just claimed and the transaction lease, so another
        worker resumes at once (the effect was never sent: its claim is undone by expiry-free
        release of the lease; the next claimer still looks up first, as for any reclaim)."""
        async with self.services.store.transaction() as work:
            await effects.release(work, self.chain, claim)
            if self.txc.status not in TX_TERMINAL:
                await transactions.release(work, self.txc, retry_in_ms=None)
        log.info("handed back on stop", tx_id=self.tx_id, op_key=claim.key)

    async def _keep_lease(self, work: Work) -> None:
        """Renew the transaction lease in passing once half of it is gone (long sagas only)."""
        if self.txc.status in TX_TERMINAL:
            return
        now = time.monotonic()
        if now - self._lease_renewed_at < self.services.settings.lease_seconds / 2:
            return
        await transactions.renew(work, self.txc, lease_ms=self.services.settings.lease_ms)
        self._lease_renewed_at = now

    def _ctx_of(self, claim: Claim | None, decision: Decision) -> dict[str, Any]:
        return {
            "tx_id": self.tx_id,
            "kind": "record",
            "state": decision.state._value_,
            "next": claim.name if claim else None,
        }

    def _after_commit_milestones(self) -> None:
        crash = self.services.crashpoints
        for point in self._milestones:
            crash.hit(point, tx_id=self.tx_id)
        self._milestones.clear()

    async def _decide(self, claim: Claim) -> Decision:
        settings = self.services.settings
        provider = self.services.registry.get(claim.provider)
        contract = provider.contract(claim.action)
        attempts = (
            settings.compensation_attempts
            if claim.kind is EffectKind.COMPENSATION
            else settings.reconcile_attempts
        )
        budget = RetryBudget(
            attempts, settings.backoff_initial_seconds, settings.backoff_max_seconds
        )
        call = decide(
            provider,
            contract,
            claim,
            payload=claim.payload,
            budget=budget,
            call_timeout=settings.call_timeout_seconds,
            claimed_at_ms=claim.claimed_at_ms,
            crashpoints=self.services.crashpoints,
        )
        if settings.call_timeout_seconds * 2 < settings.lease_seconds:
            return await call  # the call always ends well inside the lease: no heartbeat needed
        heartbeat = asyncio.create_task(self._heartbeat(claim))
        try:
            return await call
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat

    async def _heartbeat(self, claim: Claim) -> None:
        """Renew the effect's and the transaction's leases while a slow call is in flight."""
        settings = self.services.settings
        while True:
            await asyncio.sleep(settings.lease_seconds / 3)
            try:
                async with self.services.store.transaction() as work:
                    await effects.renew(work, claim, lease_ms=settings.lease_ms)
                    if self.txc.status not in TX_TERMINAL:
                        await transactions.renew(work, self.txc, lease_ms=settings.lease_ms)
            except LeaseLost:
                log.warning(
                    "lease lost while a call was in flight", tx_id=self.tx_id, op_key=claim.key
                )
                return  # the record will be refused by its fence; nothing else to do
            except StorageError as exc:
                log.warning("heartbeat failed", tx_id=self.tx_id, error=type(exc).__name__)

    def _count(self, claim: Claim, decision: Decision) -> None:
        m = self.services.metrics
        if m is None:
            return
        m.effect_recorded(claim.kind._value_, decision.state._value_)
        if decision.lookups:
            m.reconciles.inc(decision.lookups)

    def _may_ride(self, claim: Claim, decision: Decision) -> bool:
        """Whether the record of ``decision`` can ride on a later transaction: the saga's last
        unsettled outbox event was delivered, so nothing else is claimed, sent or written for
        it, and losing the record costs a lookup at most (the event stays ``executing`` under
        this worker's lease)."""
        if claim.kind is not EffectKind.OUTBOX or decision.state is not EffectState.CONFIRMED:
            return False
        for ev in self.events:
            if ev.key != claim.key and ev.state in CLAIMABLE:
                return False
        return self.services.store.riding_pays()

    def _decidable(self, claim: Claim, decision: Decision) -> Decision:
        """A refusal the saga cannot go back from parks the *effect*, not only the saga.

        A rejected reversal cannot be compensated in turn, and a rejected step after the pivot
        may not turn the saga back (:class:`~orchestrator.saga.Step`): nothing automatic may
        follow. Recorded ``failed``, the effect would be final and leave the operator nothing to
        decide (``review resolve`` acts on ``manual_review`` effects only), so the saga would be
        parked for good; recorded ``manual_review`` (the provider's refusal kept as its last
        answer), it waits for a person like any undecidable effect."""
        decision = storable_remote_id(decision)
        if decision.state is not EffectState.FAILED or not self._cannot_turn_back(claim):
            return decision
        return replace(decision, state=EffectState.MANUAL_REVIEW)

    def _cannot_turn_back(self, claim: Claim) -> bool:
        if claim.kind is EffectKind.COMPENSATION:
            return True
        if claim.kind is EffectKind.OPERATION:
            return bool(self.definition.step(claim.name).get("retriable"))
        return False  # an outbox event rejected is final: the saga is committed already

    def _park_reason(self, e: Effect) -> str:
        """Why a saga parks on ``e`` (in ``manual_review``): a refusal says whose it was."""
        if e.last_error == "rejected":
            if e.kind is EffectKind.COMPENSATION:
                return REASON_REVERSAL_REJECTED
            return REASON_RETRIABLE_REJECTED
        return e.last_error or "undecidable"

    async def _record(self, work: Work, claim: Claim, decision: Decision) -> None:
        decision = self._decidable(claim, decision)
        await self._write_record(work, claim, decision)
        self._remember(claim, decision)

    async def _write_record(
        self, work: Work, claim: Claim, decision: Decision, *, may_be_taken: bool = False
    ) -> None:
        retry_in: int | None = None
        if decision.in_doubt:
            s = self.services.settings
            budget = RetryBudget(0, s.backoff_initial_seconds, s.backoff_max_seconds)
            retry_in = int(budget.delay_seconds(claim.attempts) * 1000)
            self.retry_hint_ms = retry_in
        detail = dict(decision.detail)
        await effects.record(
            work,
            self.chain,
            claim,
            decision.state,
            action=decision.action,
            remote_id=decision.remote_id,
            result=dict(decision.result) if decision.result is not None else None,
            error=decision.error,
            retry_in_ms=retry_in,
            lookups=decision.lookups,
            detail=detail,
            may_be_taken=may_be_taken,
        )

    def _remember(self, claim: Claim, decision: Decision) -> None:
        self._replace(
            claim.kind,
            claim.key,
            state=decision.state,
            remote_id=decision.remote_id,
            result=dict(decision.result) if decision.result is not None else None,
            last_error=decision.error,
            fence=claim.fence,
            attempts=claim.attempts,
            payload=claim.payload,
            payload_sha256=claim.payload_sha256,
        )

    # -- deciding what comes next, inside the current local transaction -------------------------

    async def _advance(self, work: Work, *, eager: bool) -> Claim | None:
        """Make every transition that needs no provider call; return the next effect to call
        (already claimed in ``work``), or ``None`` when nothing can be done now."""
        while True:
            status = self.txc.status
            if status is TxState.PREPARED:
                self.txc = await transactions.transition(
                    work, self.chain, self.txc, TxState.EXECUTING, action="start"
                )
                continue
            if status is TxState.EXECUTING:
                op = next((o for o in self.ops if o.state is not EffectState.CONFIRMED), None)
                if op is None:
                    return await self._validate_and_commit(work)
                if op.state is EffectState.FAILED:
                    step = self.definition.step(op.name)
                    if step.get("retriable"):
                        await self._park(work, op.name, REASON_RETRIABLE_REJECTED)
                        return None
                    claim = await self._turn_back(
                        work, {"code": "provider_rejected", "step": op.name}
                    )
                    if claim is not None or self.txc.status is not TxState.COMPENSATING:
                        return claim
                    continue
                if op.state is EffectState.MANUAL_REVIEW:
                    await self._park(work, op.name, self._park_reason(op))
                    return None
                if op.state is EffectState.PENDING:
                    refusal = await self._preflight(work, op)
                    if refusal is not None:
                        claim = await self._turn_back(work, refusal)
                        if claim is not None or self.txc.status is not TxState.COMPENSATING:
                            return claim
                        continue
                claim = await self._claim_op(work, op, eager=eager)
                if claim is None:
                    if self.ops_state(op.key) in (EffectState.MANUAL_REVIEW, EffectState.FAILED):
                        continue
                    await self._pause(work, op)
                    return None
                return claim
            if status is TxState.VALIDATING:
                return await self._validate_and_commit(work)
            if status is TxState.COMPENSATING:
                step_ = next(
                    (r for r in self.reversals if r.state is not EffectState.CONFIRMED), None
                )
                if step_ is None:
                    self.txc = await transactions.transition(
                        work, self.chain, self.txc, TxState.COMPENSATED, action="compensated"
                    )
                    await self._finished(work)
                    return None
                if step_.state is EffectState.FAILED:
                    await self._park(work, step_.name, REASON_REVERSAL_REJECTED)
                    return None
                if step_.state is EffectState.MANUAL_REVIEW:
                    await self._park(work, step_.name, self._park_reason(step_))
                    return None
                claim = await self._claim_effect(work, step_, eager=eager)
                if claim is None:
                    if self._cached(step_.kind, step_.key).state is EffectState.MANUAL_REVIEW:
                        continue
                    await self._pause(work, step_)
                return claim
            if status is TxState.COMMITTED:
                for ev in self.events:
                    if ev.state in (
                        EffectState.PENDING,
                        EffectState.UNKNOWN,
                        EffectState.EXECUTING,
                    ):
                        claim = await self._claim_effect(work, ev, eager=eager)
                        if claim is not None:
                            return claim
                        self.paused_on = ev
                return None
            return None  # compensated, failed, manual_review, staged: nothing to drive

    def ops_state(self, key: str) -> EffectState:
        """Current cached state of a forward op."""
        return next(o.state for o in self.ops if o.key == key)

    def scope(self, forward: Effect | None = None) -> dict[str, Any]:
        """Template scope: inputs, tx id, confirmed steps, and the op being reversed."""
        steps = {
            o.name: {
                "payload": o.payload,
                "result": o.result,
                "remote_id": full_remote_id(o.remote_id, o.result),
            }
            for o in self.ops
            if o.state is EffectState.CONFIRMED
        }
        scope: dict[str, Any] = {"inputs": self.inputs, "tx": {"id": self.tx_id}, "steps": steps}
        if self.context:
            for root, value in self.context.items():
                scope.setdefault(root, value)
        if forward is not None:
            scope["forward"] = {
                "payload": forward.payload,
                "result": forward.result,
                "remote_id": full_remote_id(forward.remote_id, forward.result),
            }
        return scope

    def _failed_assert(self, step: str | None) -> dict[str, Any] | None:
        """The first author assert guarding ``step`` that does not hold, as a saga error."""
        scope = self.scope()
        for a in self.definition.asserts_before(step):
            try:
                ok = expressions.evaluate_condition(a["expr"], scope, prevalidated=True)
            except expressions.ExpressionError:
                ok = False
            if not ok:
                return {"code": "assertion_failed", "step": a["name"], "reason": a["message"]}
        return None

    async def _preflight(self, work: Work, op: Effect) -> dict[str, Any] | None:
        """Before an effect is first sent: its asserts hold and the invoker may still do it.

        Only never-sent effects are gated: one that may have been sent is reconciled first,
        whatever the invoker may do now."""
        failed = self._failed_assert(op.name)
        if failed is not None:
            return failed
        gate = self.services.gate
        if gate is None or self.execution_id is None:
            return None
        payload: Any = op.payload
        if payload is None:
            with contextlib.suppress(expressions.ExpressionError, NotCanonicalizable):
                payload = render_payload(self.definition.step(op.name)["payload"], self.scope())[0]
        if await gate(work, self, op.name, payload):
            return None
        return {"code": "principal_not_authorized", "step": op.name}

    def output(self) -> Any:
        """The result projection of the saga's definition over its confirmed steps."""
        template = self.definition.result_template
        if template is None:
            return None
        return expressions.render(template, self.scope(), prevalidated=True)

    async def _finished(self, work: Work) -> None:
        """The saga reached a terminal or parked state in ``work``: tell the hook, same commit."""
        hook = self.services.on_terminal
        if hook is not None and self.execution_id is not None:
            await hook(work, self)

    async def _claim_op(self, work: Work, op: Effect, *, eager: bool) -> Claim | None:
        template = self.definition.step(op.name)["payload"]
        try:
            payload, sha = render_payload(template, self.scope())
        except (expressions.ExpressionError, NotCanonicalizable) as exc:
            if op.payload_sha256 is not None:
                payload, sha = op.payload, op.payload_sha256  # stored at prepare; checked below
            else:
                # Deterministic: it will never render. Nothing was sent, so the op failed.
                claim = await self._claim_effect(work, op, eager=True)
                if claim is not None:
                    await self._record(
                        work,
                        claim,
                        Decision(
                            EffectState.FAILED,
                            "render",
                            error="payload_render_failed",
                            detail={"code": getattr(exc, "code", "not_json")},
                        ),
                    )
                return None
        return await self._claim_effect(work, op, eager=eager, payload=(payload, sha))

    async def _claim_effect(
        self,
        work: Work,
        e: Effect,
        *,
        eager: bool,
        payload: tuple[Any, str] | None = None,
    ) -> Claim | None:
        """Claim ``e``; refuse to call if its stored payload is not the intended one.

        The stored payload must hash to its stored fingerprint, and a re-rendered forward payload
        (``payload``) must have that same fingerprint: the same key never carries another payload.
        """
        fresh = effects.is_fresh(e)
        if fresh:
            # Never attempted: the claim's outcome is known, so it is a blind write that
            # PostgreSQL sends with this transaction's other writes (one round trip, no read).
            claim: Claim | None = await effects.claim_fresh(
                work,
                self.chain,
                e,
                owner=self.txc.owner,
                lease_ms=self.services.settings.lease_ms,
                tx_fence=self.txc.fence,
                payload=payload[0] if payload else None,
                payload_sha256=payload[1] if payload else None,
            )
        else:
            claim = await effects.claim(
                work,
                self.chain,
                e.kind,
                e.key,
                owner=self.txc.owner,
                lease_ms=self.services.settings.lease_ms,
                payload=payload[0] if payload else None,
                payload_sha256=payload[1] if payload else None,
                due_only=not eager,
                tx_fence=self.txc.fence,
            )
        if claim is None:
            return None
        self._replace(
            e.kind,
            e.key,
            state=EffectState.EXECUTING,
            fence=claim.fence,
            attempts=claim.attempts,
            payload=claim.payload,
            payload_sha256=claim.payload_sha256,
        )
        # A payload this claim just stored was fingerprinted by render_payload a moment ago.
        just_stored = fresh and payload is not None and e.payload_sha256 is None
        stored_ok = just_stored or _fingerprint_or_none(claim.payload) == claim.payload_sha256
        if not stored_ok or (payload is not None and claim.payload_sha256 != payload[1]):
            # Same key, different payload: never guessed, never sent. A person decides.
            await self._record(
                work,
                claim,
                Decision(
                    EffectState.MANUAL_REVIEW,
                    "park",
                    error="idempotency_payload_mismatch",
                    detail={"reason": REASON_PAYLOAD},
                ),
            )
            return None
        return claim

    async def _pause(self, work: Work, e: Effect) -> None:
        self.paused_on = e
        if self.hold_on_pause or self.txc.status in TX_TERMINAL:
            return  # held for an in-call retry, or a committed saga's outbox (no tx lease)
        await self.release(work)

    async def release(self, work: Work) -> None:
        """Give the transaction lease back; recovery resumes it when its effect is due."""
        await transactions.release(work, self.txc, retry_in_ms=self.retry_hint_ms)

    async def _park(
        self, work: Work, step: str, reason: str, *, via: Sequence[TxState] = ()
    ) -> None:
        self.error = {"code": "manual_review", "step": step, "reason": reason[:200]}
        self.txc = await transactions.transition(
            work,
            self.chain,
            self.txc,
            TxState.MANUAL_REVIEW,
            action="park",
            via=via,
            error=self.error,
            release=True,
        )
        await self._finished(work)

    async def _validate_and_commit(self, work: Work) -> Claim | None:
        failures: list[dict[str, Any]] = []
        for op in self.ops:
            if op.result is None:
                continue  # confirmed by an operator, not by a provider answer: nothing to echo
            contract = self.services.registry.contract(op.provider, op.action)
            mismatched = echo_mismatches(contract, op.payload, op.result)
            if mismatched:
                failures.append({"check": f"{op.name}.echo", "fields": mismatched})
        failed_assert = self._failed_assert(None)
        if failed_assert is not None:
            via = [TxState.VALIDATING] if self.txc.status is TxState.EXECUTING else []
            return await self._turn_back(work, failed_assert, via=via)
        output_error = self._output_problem()
        if output_error is not None:
            via = [TxState.VALIDATING] if self.txc.status is TxState.EXECUTING else []
            return await self._turn_back(work, output_error, via=via)
        scope = self.scope()
        for check in self.definition.checks:
            try:
                ok = expressions.evaluate_condition(check["expr"], scope, prevalidated=True)
            except expressions.ExpressionError as exc:
                ok, detail = False, exc.code
            else:
                detail = "false"
            if not ok:
                failures.append({"check": check["name"], "result": detail})
        planned: list[effects.NewEffect] = []
        if not failures:
            for ordinal, ev in enumerate(self.definition.outbox):
                try:
                    payload, sha = render_payload(ev["payload"], scope)
                except (expressions.ExpressionError, NotCanonicalizable):
                    failures.append({"check": f"outbox.{ev['name']}", "result": "render"})
                    break
                s = self.services.settings
                planned.append(
                    effects.NewEffect(
                        key=keys.event_key(
                            tenant=s.tenant,
                            environment=s.environment,
                            provider=ev["provider"],
                            tx_id=self.tx_id,
                            event=ev["name"],
                            version=self.definition.version,
                        ),
                        tx_id=self.tx_id,
                        name=ev["name"],
                        provider=ev["provider"],
                        action=ev["action"],
                        ordinal=ordinal,
                        payload=payload,
                        payload_sha256=sha,
                    )
                )
        via = [TxState.VALIDATING] if self.txc.status is TxState.EXECUTING else []
        if failures:
            first = failures[0]
            return await self._turn_back(
                work,
                {"code": "validation_failed", "check": str(first["check"])},
                via=via,
                detail={"failures": failures[:10]},
            )
        self.txc = await transactions.transition(
            work, self.chain, self.txc, TxState.COMMITTED, action="commit", via=via
        )
        await self._finished(work)
        claim = await effects.insert(
            work,
            self.chain,
            EffectKind.OUTBOX,
            planned,
            claim_first=(self.txc.owner, self.services.settings.lease_ms),
        )
        self.events = [
            planned_effect(EffectKind.OUTBOX, n, claim if i == 0 else None)
            for i, n in enumerate(planned)
        ]
        if self.services.crashpoints.armed:
            self.services.crashpoints.hit("commit.before_commit", tx_id=self.tx_id)
        self._milestones.append("commit.after_commit")
        return claim

    def _output_problem(self) -> dict[str, Any] | None:
        """The result projection must render and fit the output budget before we commit."""
        if self.definition.result_template is None:
            return None
        limit = self.services.settings.max_output_bytes
        try:
            size = len(canonical_json(self.output()))
        except (expressions.ExpressionError, NotCanonicalizable):
            return {"code": "validation_failed", "check": "result"}
        if size > limit:
            return {"code": "output_limit_exceeded", "limit": limit, "actual": size}
        return None

    async def _turn_back(
        self,
        work: Work,
        error: dict[str, Any],
        *,
        via: list[TxState] | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> Claim | None:
        """A definite failure: skip what never ran, persist the reverse plan, start it."""
        self.error = error
        pending = [o.key for o in self.ops if o.state is EffectState.PENDING]
        await effects.skip_pending(work, self.chain, EffectKind.OPERATION, pending)
        for key in pending:
            self._replace(EffectKind.OPERATION, key, state=EffectState.SKIPPED)
        specs: dict[str, ReversalSpec | None] = {}
        for step in self.definition.steps:
            comp = step.get("compensation")
            specs[step["name"]] = ReversalSpec(comp["action"], comp["payload"]) if comp else None

        def render(op: Effect, template: Any) -> tuple[Any, str]:
            return render_payload(template, self.scope(forward=op))

        try:
            plan = plan_reversal(
                self.ops, specs, key_for=lambda op: keys.compensation_key(op.key), render=render
            )
        except (expressions.ExpressionError, NotCanonicalizable):
            await self._park(
                work,
                error.get("step", "compensation"),
                "a compensation payload cannot be rendered",
                via=via or [],
            )
            return None
        if not plan.complete:
            await self._park(work, plan.irreversible[0].name, REASON_IRREVERSIBLE, via=via or [])
            return None
        if not plan.steps:
            self.txc = await transactions.transition(
                work,
                self.chain,
                self.txc,
                TxState.FAILED,
                action="fail",
                via=via or [],
                error=error,
                detail=detail,
            )
            await self._finished(work)
            return None
        self.txc = await transactions.transition(
            work,
            self.chain,
            self.txc,
            TxState.COMPENSATING,
            action="turn_back",
            via=via or [],
            error=error,
            detail=detail,
        )
        claim = await effects.insert(
            work,
            self.chain,
            EffectKind.COMPENSATION,
            plan.steps,
            claim_first=(self.txc.owner, self.services.settings.lease_ms),
        )
        self.reversals = [
            planned_effect(EffectKind.COMPENSATION, n, claim if i == 0 else None)
            for i, n in enumerate(plan.steps)
        ]
        self._milestones.append("compensation.after_plan")
        return claim

    def _items(self, kind: EffectKind) -> list[Effect]:
        return {
            EffectKind.OPERATION: self.ops,
            EffectKind.COMPENSATION: self.reversals,
            EffectKind.OUTBOX: self.events,
        }[kind]

    def _cached(self, kind: EffectKind, key: str) -> Effect:
        return next(e for e in self._items(kind) if e.key == key)

    def _replace(self, kind: EffectKind, key: str, **changes: Any) -> None:
        items = self._items(kind)
        for index, e in enumerate(items):
            if e.key == key:
                items[index] = effects.replace_effect(e, **changes)
                return


def planned_effect(kind: EffectKind, new: effects.NewEffect, claim: Claim | None) -> Effect:
    """The cached row of an effect just inserted (claimed or pending)."""
    return Effect(
        kind=kind,
        key=new.key,
        tx_id=new.tx_id,
        name=new.name,
        provider=new.provider,
        action=new.action,
        ordinal=new.ordinal,
        payload=new.payload,
        payload_sha256=new.payload_sha256,
        state=EffectState.EXECUTING if claim else EffectState.PENDING,
        claimed_from=EffectState.PENDING if claim else None,
        lease_owner=claim.owner if claim else None,
        lease_until=None,
        fence=claim.fence if claim else 0,
        attempts=claim.attempts if claim else 0,
        lookups=0,
        first_attempt_at=None,
        next_attempt_at=None,
        remote_id=None,
        result=None,
        last_error=None,
        forward_op_key=new.forward_op_key,
    )


def _fingerprint_or_none(payload: Any) -> str | None:
    try:
        return fingerprint(payload)
    except NotCanonicalizable:
        return None


@dataclass(slots=True)
class _Delivered:
    """The record of a saga's last outbox event, delivered: a :class:`ledger.riders.Rider`.

    Its crash points are the ones the record would have hit in a transaction of its own, in
    the same places: written and not committed, then committed."""

    run: SagaRun
    claim: Claim
    decision: Decision

    async def write(self, work: Work) -> None:
        run = self.run
        await run._write_record(work, self.claim, self.decision, may_be_taken=True)
        crash = run.services.crashpoints
        if crash.armed:
            crash.hit("record.before_commit", **run._ctx_of(None, self.decision))

    def landed(self) -> None:
        run = self.run
        if run.services.crashpoints.armed:
            run.services.crashpoints.hit("record.after_commit", tx_id=run.tx_id, kind="record")
