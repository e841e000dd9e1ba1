"""The seven fault-injection assertions of seed 003 ("故障驗收"), as reusable scenarios.

Also the small kit every scenario module shares: :class:`ScenarioRun` (counter deltas read from
the provider's own database, fault rules scoped to one scenario, the verdict and the checker),
:class:`HoldingProvider` (a provider call frozen mid-flight, as in a long GC pause) and the keys
a transaction will use (:func:`order_keys`), so fault rules can target one scenario's calls
while every scenario shares one database pair.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fault_injection.harness import Harness
from fault_injection.holding import HoldingProvider
from fault_injection.results import ScenarioResult
from fault_injection.sagas import order, order_saga
from ledger.states import EffectState, TxState
from orchestrator import keys
from orchestrator.crashpoints import SimulatedCrash
from orchestrator.engine import Orchestrator
from orchestrator.saga import Saga
from orchestrator.views import TransactionView
from providers.fake.faults import FaultKind, FaultPlan, FaultRule
from providers.fake.shop import COUNTED_ACTIONS

Scenario = Callable[[Harness], Awaitable[ScenarioResult]]

#: Short counter names for the provider actions (``payments.charge`` -> ``charge``).
SHORT: Mapping[str, str] = {
    "inventory.reserve": "reserve",
    "inventory.release": "release",
    "payments.charge": "charge",
    "payments.refund": "refund",
    "email.send": "email",
}

# What the suite's engines put into every key (suite_settings leaves both at their defaults).
_TENANT = "default"
_ENVIRONMENT = "dev"


@dataclass(frozen=True)
class OrderKeys:
    """Every idempotency key one order saga will use, known before it runs."""

    reserve: str
    charge: str
    release: str
    refund: str
    receipt: str


def order_keys(tx_id: str, saga: Saga | None = None) -> OrderKeys:
    """The keys of ``tx_id`` (derived exactly as the engine derives them at prepare)."""
    version = (saga or order_saga()).version

    def op(provider: str, step: str) -> str:
        return keys.op_key(
            tenant=_TENANT,
            environment=_ENVIRONMENT,
            provider=provider,
            tx_id=tx_id,
            step=step,
            version=version,
        )

    reserve, charge = op("inventory", "reserve"), op("payments", "charge")
    return OrderKeys(
        reserve=reserve,
        charge=charge,
        release=keys.compensation_key(reserve),
        refund=keys.compensation_key(charge),
        receipt=keys.event_key(
            tenant=_TENANT,
            environment=_ENVIRONMENT,
            provider="email",
            tx_id=tx_id,
            event="receipt",
            version=version,
        ),
    )


def at(
    tx_id: str, name: str | None = None, kind: str = "operation"
) -> Callable[[Mapping[str, Any]], bool]:
    """A crash-point filter: this transaction, optionally this step / event of ``kind``."""

    def match(ctx: Mapping[str, Any]) -> bool:
        if ctx.get("tx_id") != tx_id:
            return False
        if name is None:
            return True
        return ctx.get("name") == name and ctx.get("kind") == kind

    return match


@dataclass
class ScenarioRun:
    """One scenario in progress: its ids, counter baseline, fault plans and verdict."""

    harness: Harness
    suite: str
    name: str
    started: float
    before: dict[str, int]
    plans: list[FaultPlan]
    reasons: list[str] = field(default_factory=list)
    tx_ids: list[str] = field(default_factory=list)
    crashes: int = 0
    sagas: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    async def start(cls, harness: Harness, suite: str, name: str) -> ScenarioRun:
        """Begin: no fault rule of an earlier scenario survives, counters are snapshotted."""
        harness.shop.faults.clear()
        before = await harness.shop.counts()
        return cls(harness, suite, name, time.monotonic(), before, [harness.shop.faults])

    def new_tx(self, prefix: str) -> tuple[str, dict[str, Any]]:
        """A fresh tx id and order inputs of its own (its own business key), counted as a saga.

        A random suffix keeps ids unique when scenarios share one database pair or run twice.
        """
        token = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.tx_ids.append(token)
        self.sagas += 1
        return token, order(token)

    def fault(self, rule: FaultRule) -> FaultRule:
        """Add ``rule`` to the harness shop's plan (cleared when the scenario ends)."""
        return self.harness.shop.faults.add(rule)

    def expect(self, condition: bool, reason: str) -> bool:
        """Record ``reason`` as a failure unless ``condition`` holds."""
        if not condition:
            self.reasons.append(reason)
        return condition

    async def delta(self) -> dict[str, int]:
        """Provider effects applied since the scenario began, by short action name."""
        now = await self.harness.shop.counts()
        return {SHORT[k]: now[k] - self.before.get(k, 0) for k in COUNTED_ACTIONS}

    async def crash(self, orch: Orchestrator) -> None:
        """The process behind ``orch`` dies: nothing released, nothing more written."""
        await self.harness.crash(orch)
        self.crashes += 1

    async def run_until_crash(self, orch: Orchestrator, job: Awaitable[Any], point: str) -> bool:
        """Await ``job`` (an ``execute``) expecting the armed ``point`` to kill ``orch``."""
        try:
            await job
        except SimulatedCrash:
            await self.crash(orch)
            return True
        self.reasons.append(f"crash point {point} was never hit")
        return False

    async def finish(
        self, label: str, summary: str, *, counts: Mapping[str, int] | None = None
    ) -> ScenarioResult:
        """Run the invariant checker on this scenario's transactions and build the result.

        ``passed`` needs both: every expectation met and the checker clean.
        """
        counts = dict(counts) if counts is not None else await self.delta()
        violations = []
        if self.tx_ids:
            report = await self.harness.check(tx_ids=self.tx_ids)
            violations = list(report.violations)
            for v in violations[:5]:
                self.reasons.append(f"invariant {v.invariant} {v.name} ({v.tx_id}): {v.message}")
            if len(violations) > 5:
                self.reasons.append(f"... and {len(violations) - 5} more violations")
        faults: Counter[str] = Counter()
        for plan in self.plans:
            faults.update({kind.value: n for kind, n in plan.fired.items()})
        self.harness.shop.faults.clear()
        passed = not self.reasons
        line = (
            f"PASS {label}: {summary}"
            if passed
            else f"FAIL {label}: {summary}; " + "; ".join(self.reasons)
        )
        return ScenarioResult(
            suite=self.suite,
            name=self.name,
            passed=passed,
            line=line,
            counts=counts,
            faults=faults,
            crashes=self.crashes,
            sagas=self.sagas,
            violations=violations,
            seconds=time.monotonic() - self.started,
            detail={**self.detail, "tx_ids": list(self.tx_ids)},
        )


async def retire_engines(harness: Harness) -> None:
    """Close every engine a scenario opened (scenarios never share engines)."""
    for orch in list(harness.engines):
        await orch.close()
    harness.engines.clear()


async def calls_of(harness: Harness, key: str) -> list[str]:
    """The provider's request log for ``key``, as ``call:outcome`` strings."""
    return [f"{c.call}:{c.outcome}" for c in await harness.shop.calls(key=key)]


async def view(orch: Orchestrator, tx_id: str) -> TransactionView:
    """The stored transaction with all its effect rows."""
    return await orch.get(tx_id)


def op_state(v: TransactionView, name: str) -> EffectState | None:
    """State of the forward op ``name`` (``None`` if the saga has no such step)."""
    return next((o.state for o in v.operations if o.name == name), None)


def counts_text(counts: Mapping[str, int], *names: str) -> str:
    """``charge=1 email=1`` for ``names``, in order."""
    return " ".join(f"{n}={counts.get(n, 0)}" for n in names)


# -- the seven seed assertions ----------------------------------------------------------------

SUITE = "seed"


async def crash_before_call(harness: Harness) -> ScenarioResult:
    """Crash after the charge was claimed, before the call; recovery looks up before applying."""
    run = await ScenarioRun.start(harness, SUITE, "crash_before_call")
    tx, inputs = run.new_tx("seed-crash-before-call")
    k = order_keys(tx)
    orch = await harness.engine()
    orch.crashpoints.arm("effect.before_apply", when=at(tx, "charge"))
    if await run.run_until_crash(
        orch, orch.execute(order_saga(), inputs, tx_id=tx), "effect.before_apply"
    ):
        run.expect((await run.delta())["charge"] == 0, "the charge reached the provider anyway")
    await harness.recover(workers=1)
    counts = await run.delta()
    calls = [c.split(":")[0] for c in await calls_of(harness, k.charge)]
    run.expect(calls == ["lookup", "apply"], f"charge calls were {calls}, not lookup then apply")
    run.expect(counts["charge"] == 1 and counts["email"] == 1, "counts differ from 1/1")
    return await run.finish(
        "crash before call", "lookup-before-apply, " + counts_text(counts, "charge", "email")
    )


async def response_lost(harness: Harness) -> ScenarioResult:
    """The charge commits at the provider, its response is lost; execute reconciles by lookup."""
    run = await ScenarioRun.start(harness, SUITE, "response_lost")
    tx, inputs = run.new_tx("seed-response-lost")
    k = order_keys(tx)
    run.fault(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge", key=k.charge)
    )
    orch = await harness.engine()
    result = await orch.execute(order_saga(), inputs, tx_id=tx)
    await orch.drain(timeout_seconds=10)
    run.expect(result.status is TxState.COMMITTED, f"execute ended {result.status}")
    v = await view(orch, tx)
    charge = next(o for o in v.operations if o.name == "charge")
    run.expect(
        charge.state is EffectState.CONFIRMED and charge.lookups == 1,
        f"charge {charge.state} after {charge.lookups} lookups (expected confirmed after 1)",
    )
    moves = [(e.from_state, e.to_state) for e in await orch.ledger(tx) if e.subject == k.charge]
    run.expect(("executing", "unknown") in moves, "the lost response was never recorded unknown")
    counts = await run.delta()
    run.expect(counts["charge"] == 1 and counts["email"] == 1, "counts differ from 1/1")
    return await run.finish(
        "effect committed/response lost", counts_text(counts, "charge", "email")
    )


async def response_before_local_commit(harness: Harness) -> ScenarioResult:
    """The provider answered, the process died before recording it; recovery finds the effect."""
    run = await ScenarioRun.start(harness, SUITE, "response_before_local_commit")
    tx, inputs = run.new_tx("seed-before-commit")
    k = order_keys(tx)
    orch = await harness.engine()
    orch.crashpoints.arm("effect.after_apply", when=at(tx, "charge"))
    if await run.run_until_crash(
        orch, orch.execute(order_saga(), inputs, tx_id=tx), "effect.after_apply"
    ):
        run.expect((await run.delta())["charge"] == 1, "the charge did not happen before the crash")
    await harness.recover(workers=1)
    counts = await run.delta()
    calls = [c.split(":")[0] for c in await calls_of(harness, k.charge)]
    run.expect(calls == ["apply", "lookup"], f"charge calls were {calls}, not apply then lookup")
    run.expect(counts["charge"] == 1 and counts["email"] == 1, "counts differ from 1/1")
    return await run.finish("response before local commit", counts_text(counts, "charge", "email"))


async def concurrent_workers(harness: Harness) -> ScenarioResult:
    """The intent is durable, the process dies; two workers race to recover the same order."""
    run = await ScenarioRun.start(harness, SUITE, "concurrent_workers")
    tx, inputs = run.new_tx("seed-concurrent")
    orch = await harness.engine()
    orch.crashpoints.arm("prepare.after_commit", when=at(tx))
    await run.run_until_crash(
        orch, orch.execute(order_saga(), inputs, tx_id=tx), "prepare.after_commit"
    )
    workers = await harness.recover(workers=2)
    status = (await workers[0].result(tx)).status
    run.expect(status is TxState.COMMITTED, f"the order ended {status}")
    counts = await run.delta()
    run.expect(
        (counts["reserve"], counts["charge"], counts["email"]) == (1, 1, 1),
        "counts differ from 1/1/1",
    )
    return await run.finish("concurrent workers", counts_text(counts, "reserve", "charge", "email"))


async def compensation_replay(harness: Harness) -> ScenarioResult:
    """A post-condition fails after both effects; refund and release lose their responses."""
    run = await ScenarioRun.start(harness, SUITE, "compensation_replay")
    tx, inputs = run.new_tx("seed-comp-replay")
    inputs["amount"] = 1500
    k = order_keys(tx)
    run.fault(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="refund", key=k.refund)
    )
    run.fault(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="inventory", action="release", key=k.release)
    )
    stock_before = await harness.shop.stock(inputs["sku"])
    orch = await harness.engine()
    await orch.execute(order_saga(max_amount=1000), inputs, tx_id=tx)
    await orch.drain(timeout_seconds=10)
    final = await orch.result(tx)
    run.expect(final.status is TxState.COMPENSATED, f"the order ended {final.status}")
    run.expect(
        final.error is not None and final.error.code == "validation_failed",
        f"error was {final.error}",
    )
    # The provider's own state is back where it was, not merely "answered success".
    run.expect(await harness.shop.stock(inputs["sku"]) == stock_before, "stock not restored")
    refunded = [c["refunded"] for c in await harness.shop.charges() if c["key"] == k.charge]
    run.expect(refunded == [1500], f"charge refunded {refunded}, expected [1500]")
    counts = await run.delta()
    run.expect(
        (counts["refund"], counts["release"], counts["email"]) == (1, 1, 0),
        "counts differ from 1/1/0",
    )
    return await run.finish(
        "compensation replay", counts_text(counts, "refund", "release", "email")
    )


async def manual_review(harness: Harness) -> ScenarioResult:
    """The refund stays unknown (lost, lookups unavailable) past its budget: a person decides."""
    run = await ScenarioRun.start(harness, SUITE, "manual_review")
    tx, inputs = run.new_tx("seed-manual-review")
    inputs["amount"] = 1500
    k = order_keys(tx)
    for kind in (FaultKind.LOSE_RESPONSE, FaultKind.LOOKUP_UNAVAILABLE):
        run.fault(FaultRule(kind, provider="payments", action="refund", key=k.refund, times=None))
    orch = await harness.engine()
    await orch.execute(order_saga(max_amount=1000), inputs, tx_id=tx)
    await orch.drain(timeout_seconds=10)
    v = await view(orch, tx)
    refund = next((c for c in v.compensations if c.action == "refund"), None)
    run.expect(
        refund is not None and refund.state is EffectState.MANUAL_REVIEW,
        f"refund ended {refund.state if refund else 'unplanned'}",
    )
    if refund is not None:
        budget = orch.settings.compensation_attempts
        run.expect(refund.attempts <= budget, f"refund claimed {refund.attempts} times > {budget}")
    ledger = await orch.ledger(tx)
    last = ledger[-1] if ledger else None
    run.expect(
        last is not None and last.to_state == "manual_review" and bool(last.detail.get("error")),
        "the ledger does not end with the parking and its reason",
    )
    counts = await run.delta()
    run.expect(counts["refund"] == 1, f"refund={counts['refund']}: deduplication failed")
    run.detail["evidence"] = {
        "reason": v.tx.error,
        "refund_last_error": refund and refund.last_error,
    }
    return await run.finish("manual review", f"compensation_unknown -> {v.tx.status.value}")


async def post_commit_outbox(harness: Harness) -> ScenarioResult:
    """Crash inside the saga's commit: both effects confirmed, no email may exist yet."""
    run = await ScenarioRun.start(harness, SUITE, "post_commit_outbox")
    tx, inputs = run.new_tx("seed-outbox")
    k = order_keys(tx)
    orch = await harness.engine()
    orch.crashpoints.arm("commit.before_commit", when=at(tx))
    early = 0
    if await run.run_until_crash(
        orch, orch.execute(order_saga(), inputs, tx_id=tx), "commit.before_commit"
    ):
        mid = await run.delta()
        early = mid["email"]
        run.expect(mid["charge"] == 1, f"charge={mid['charge']} before the commit")
        run.expect(early == 0, f"email={early} observed before the local commit")
    await harness.recover(workers=1)
    counts = await run.delta()
    run.expect(counts["charge"] == 1 and counts["email"] == 1, "counts differ from 1/1")
    emails = await harness.shop.effects("email.send")
    charges = await harness.shop.effects("payments.charge")
    email = next((e for e in emails if e.key == k.receipt), None)
    charge = next((e for e in charges if e.key == k.charge), None)
    run.expect(
        email is not None and charge is not None and email.created_at >= charge.created_at,
        "the email is not after the charge",
    )
    summary = (
        "no email observed before local commit"
        if early == 0
        else f"email observed before local commit (email={early})"
    )
    return await run.finish("post-commit outbox", summary, counts=counts)


#: The seed's seven assertions, in the seed's order; each line is the seed's own when passing.
SEED_SCENARIOS: list[tuple[str, Scenario]] = [
    ("crash_before_call", crash_before_call),
    ("response_lost", response_lost),
    ("response_before_local_commit", response_before_local_commit),
    ("concurrent_workers", concurrent_workers),
    ("compensation_replay", compensation_replay),
    ("manual_review", manual_review),
    ("post_commit_outbox", post_commit_outbox),
]

__all__ = [
    "SEED_SCENARIOS",
    "HoldingProvider",
    "OrderKeys",
    "Scenario",
    "ScenarioRun",
    "at",
    "calls_of",
    "order_keys",
    "retire_engines",
]
