"""Provider faults, one scenario each: what the fake shop can do wrong, and what must follow.

Every scenario targets its faults at its own idempotency keys (:func:`order_keys`), reads the
provider's counters as deltas, and passes only if its expectation holds and the invariant
checker is clean for its transactions.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from compensation.policy import REASON_REVERSAL_REJECTED
from fault_injection.harness import Harness
from fault_injection.results import ScenarioResult
from fault_injection.sagas import order_saga
from fault_injection.scenarios_seed import (
    HoldingProvider,
    Scenario,
    ScenarioRun,
    at,
    calls_of,
    counts_text,
    op_state,
    order_keys,
    view,
)
from ledger.states import EffectState, TxState
from providers.fake.faults import FaultKind, FaultPlan, FaultRule
from providers.fake.shop import FakeShop

SUITE = "faults"


async def response_lost_to_workers(harness: Harness) -> ScenarioResult:
    """The charge commits, its response is lost, execute has no budget: a worker reconciles."""
    run = await ScenarioRun.start(harness, SUITE, "response_lost_to_workers")
    tx, inputs = run.new_tx("f-lost")
    k = order_keys(tx)
    run.fault(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge", key=k.charge)
    )
    orch = await harness.engine()
    first = await orch.execute(order_saga(), inputs, tx_id=tx, budget_seconds=0)
    run.expect(first.in_doubt, f"execute without budget ended {first.status}, not in doubt")
    await orch.drain(timeout_seconds=10)
    status = (await orch.result(tx)).status
    run.expect(status is TxState.COMMITTED, f"the order ended {status}")
    calls = await calls_of(harness, k.charge)
    run.expect(calls == ["apply:lost_response", "lookup:found"], f"charge calls {calls}")
    counts = await run.delta()
    run.expect(counts["charge"] == 1 and counts["email"] == 1, "counts differ from 1/1")
    return await run.finish(
        "response lost after the effect",
        f"unknown -> lookup found, {counts_text(counts, 'charge', 'email')}",
    )


async def fail_before_effect(harness: Harness) -> ScenarioResult:
    """The provider refuses before acting: unknown, lookup not_found, re-apply once."""
    run = await ScenarioRun.start(harness, SUITE, "fail_before_effect")
    tx, inputs = run.new_tx("f-before")
    k = order_keys(tx)
    run.fault(FaultRule(FaultKind.FAIL_BEFORE, provider="payments", action="charge", key=k.charge))
    orch = await harness.engine()
    await orch.execute(order_saga(), inputs, tx_id=tx)
    await orch.drain(timeout_seconds=10)
    status = (await orch.result(tx)).status
    run.expect(status is TxState.COMMITTED, f"the order ended {status}")
    calls = await calls_of(harness, k.charge)
    expected = ["apply:unavailable", "lookup:not_found", "apply:confirmed"]
    run.expect(calls == expected, f"charge calls {calls}, expected {expected}")
    resend = [
        e for e in await orch.ledger(tx) if e.subject == k.charge and e.detail.get("resend") is True
    ]
    run.expect(len(resend) == 1, "the re-apply is not recorded as a new attempt in the ledger")
    counts = await run.delta()
    run.expect(counts["charge"] == 1, f"charge={counts['charge']}")
    return await run.finish(
        "failure before the effect",
        f"unknown -> lookup not_found -> re-apply, {counts_text(counts, 'charge')}",
    )


async def definite_rejection(harness: Harness) -> ScenarioResult:
    """The provider says no to the charge: the reservation is released, nothing is charged."""
    run = await ScenarioRun.start(harness, SUITE, "definite_rejection")
    tx, inputs = run.new_tx("f-reject")
    k = order_keys(tx)
    run.fault(FaultRule(FaultKind.REJECT, provider="payments", action="charge", key=k.charge))
    stock = await harness.shop.stock(inputs["sku"])
    orch = await harness.engine()
    result = await orch.execute(order_saga(), inputs, tx_id=tx)
    await orch.drain(timeout_seconds=10)
    final = await orch.result(tx)
    run.expect(final.status is TxState.COMPENSATED, f"the order ended {final.status}")
    run.expect(
        final.error is not None and final.error.code == "provider_rejected",
        f"error {result.error}",
    )
    run.expect(await harness.shop.stock(inputs["sku"]) == stock, "stock not restored")
    counts = await run.delta()
    run.expect(
        (counts["reserve"], counts["release"], counts["charge"], counts["email"]) == (1, 1, 0, 0),
        "counts differ from reserve=1 release=1 charge=0 email=0",
    )
    return await run.finish(
        "definite rejection",
        f"rejected -> compensated, {counts_text(counts, 'release', 'charge', 'email')}",
    )


async def timeout_beyond_budget(harness: Harness) -> ScenarioResult:
    """The answer comes later than the call budget (effect done): unknown, then lookup found."""
    run = await ScenarioRun.start(harness, SUITE, "timeout_beyond_budget")
    tx, inputs = run.new_tx("f-timeout")
    k = order_keys(tx)
    call_timeout = 0.5  # long enough for the provider to commit the effect even under load
    run.fault(
        FaultRule(
            FaultKind.TIMEOUT,
            provider="payments",
            action="charge",
            key=k.charge,
            delay_s=call_timeout * 3,
            effect_first=True,
        )
    )
    orch = await harness.engine(call_timeout_seconds=call_timeout)
    await orch.execute(order_saga(), inputs, tx_id=tx)
    await orch.drain(timeout_seconds=10)
    status = (await orch.result(tx)).status
    run.expect(status is TxState.COMMITTED, f"the order ended {status}")
    moves = [(e.from_state, e.to_state) for e in await orch.ledger(tx) if e.subject == k.charge]
    run.expect(("executing", "unknown") in moves, "the timeout was not recorded as unknown")
    calls = [c.split(":")[0] for c in await calls_of(harness, k.charge)]
    run.expect(calls == ["apply", "lookup"], f"charge calls {calls}")
    counts = await run.delta()
    run.expect(counts["charge"] == 1, f"charge={counts['charge']}")
    return await run.finish(
        "timeout beyond the call budget",
        f"unknown -> lookup found, {counts_text(counts, 'charge')}",
    )


async def lookup_unavailable_then_available(harness: Harness, *, k: int = 3) -> ScenarioResult:
    """Lost response, then ``k`` unavailable lookups (fewer than the budget), then found."""
    run = await ScenarioRun.start(harness, SUITE, "lookup_unavailable_then_available")
    tx, inputs = run.new_tx("f-lookup-k")
    keys_ = order_keys(tx)
    run.fault(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge", key=keys_.charge)
    )
    run.fault(
        FaultRule(
            FaultKind.LOOKUP_UNAVAILABLE,
            provider="payments",
            action="charge",
            key=keys_.charge,
            times=k,
        )
    )
    orch = await harness.engine()
    run.expect(k < orch.settings.reconcile_attempts - 1, "k must stay under the budget")
    await orch.execute(order_saga(), inputs, tx_id=tx)
    await orch.drain(timeout_seconds=10)
    v = await view(orch, tx)
    run.expect(v.tx.status is TxState.COMMITTED, f"the order ended {v.tx.status}")
    lookups = [c for c in await calls_of(harness, keys_.charge) if c.startswith("lookup")]
    expected = ["lookup:unavailable"] * k + ["lookup:found"]
    run.expect(lookups == expected, f"charge lookups {lookups}")
    counts = await run.delta()
    run.expect(counts["charge"] == 1, f"charge={counts['charge']}")
    return await run.finish(
        "lookup unavailable, then available",
        f"{k} x unavailable -> found -> committed, {counts_text(counts, 'charge')}",
    )


async def lookup_unavailable_forever(harness: Harness) -> ScenarioResult:
    """Lost response and lookups that never answer: parked in manual_review with evidence."""
    run = await ScenarioRun.start(harness, SUITE, "lookup_unavailable_forever")
    tx, inputs = run.new_tx("f-lookup-never")
    k = order_keys(tx)
    run.fault(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge", key=k.charge)
    )
    run.fault(
        FaultRule(
            FaultKind.LOOKUP_UNAVAILABLE,
            provider="payments",
            action="charge",
            key=k.charge,
            times=None,
        )
    )
    orch = await harness.engine()
    await orch.execute(order_saga(), inputs, tx_id=tx)
    await orch.drain(timeout_seconds=10)
    v = await view(orch, tx)
    charge = next(o for o in v.operations if o.name == "charge")
    run.expect(v.tx.status is TxState.MANUAL_REVIEW, f"the order ended {v.tx.status}")
    run.expect(charge.state is EffectState.MANUAL_REVIEW, f"the charge ended {charge.state}")
    run.expect(charge.last_error == "lookup_unavailable", f"last_error {charge.last_error!r}")
    evidence = [
        e
        for e in await orch.ledger(tx)
        if e.subject == k.charge and e.detail.get("lookup") == "unavailable"
    ]
    run.expect(len(evidence) >= 1, "no ledger row records the unavailable lookups")
    counts = await run.delta()
    run.expect(counts["charge"] <= 1, f"charge={counts['charge']}")
    run.detail["evidence"] = {"last_error": charge.last_error, "unavailable_rows": len(evidence)}
    return await run.finish(
        "lookup unavailable forever",
        f"{len(evidence)} x unavailable -> {v.tx.status.value}, {counts_text(counts, 'charge')}",
    )


class _ShiftedClock:
    """The provider's clock, which a scenario can move forward (its dedup window runs out)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


async def dedup_window_expired(harness: Harness) -> ScenarioResult:
    """Crash after apply; retry only after the provider's dedup window: never a blind resend.

    Two orders on a shop with a 5-second window: one whose key the provider has forgotten
    (FORGET_KEYS: lookup says not found, a resend would charge again) must park in
    manual_review; one whose key it still remembers is confirmed by lookup. Charge stays 1 each.
    """
    run = await ScenarioRun.start(harness, SUITE, "dedup_window_expired")
    window, shift = 5.0, 120.0
    clock = _ShiftedClock()
    forgot_tx, forgot_in = run.new_tx("f-window-forgot")
    kept_tx, kept_in = run.new_tx("f-window-kept")
    forgot, kept = order_keys(forgot_tx), order_keys(kept_tx)
    plan = FaultPlan(
        [FaultRule(FaultKind.FORGET_KEYS, provider="payments", action="charge", key=forgot.charge)]
    )
    run.plans.append(plan)
    short = await FakeShop.open(
        harness.dbs.provider, faults=plan, clock=clock, dedup_window_seconds=window
    )
    try:
        for tx, inputs in ((forgot_tx, forgot_in), (kept_tx, kept_in)):
            orch = await harness.engine()
            for p in short.providers():
                orch.register_provider(p)
            orch.crashpoints.arm("effect.after_apply", when=at(tx, "charge"))
            await run.run_until_crash(
                orch, orch.execute(order_saga(), inputs, tx_id=tx), "effect.after_apply"
            )
        clock.offset = shift
        worker = await harness.engine()
        for p in short.providers():
            worker.register_provider(p)
        # The worker's database clock runs past the dead leases and the dedup window alike.
        worker.store.advance_clock(shift)
        await worker.drain(timeout_seconds=10)
        fv, kv = await view(worker, forgot_tx), await view(worker, kept_tx)
    finally:
        for orch in list(harness.engines):
            await orch.close()
        harness.engines.clear()
        await short.close()
    charge = next(o for o in fv.operations if o.name == "charge")
    run.expect(
        fv.tx.status is TxState.MANUAL_REVIEW and charge.last_error == "dedup_window_expired",
        f"forgotten key: order {fv.tx.status}, charge {charge.state} ({charge.last_error})",
    )
    run.expect(kv.tx.status is TxState.COMMITTED, f"remembered key: order {kv.tx.status}")
    per_key = {}
    for label, k in (("forgot", forgot), ("kept", kept)):
        calls = await calls_of(harness, k.charge)
        per_key[label] = sum(
            1
            for e in await harness.shop.effects("payments.charge")
            if e.key == k.charge and e.status == "applied"
        )
        run.expect(
            [c.split(":")[0] for c in calls] == ["apply", "lookup"],
            f"{label}: charge calls {calls} (a resend after the window?)",
        )
    run.expect(per_key == {"forgot": 1, "kept": 1}, f"charges per order {per_key}")
    return await run.finish(
        "dedup window expired",
        f"forgotten key -> {fv.tx.status.value}, charge={per_key['forgot']}; "
        f"remembered key -> lookup found, charge={per_key['kept']}",
    )


async def indeterminate_5xx(harness: Harness) -> ScenarioResult:
    """A 503 after the effect (lookup finds it) and one before it (lookup, re-apply)."""
    run = await ScenarioRun.start(harness, SUITE, "indeterminate_5xx")
    outcomes: dict[str, tuple[TxState, int, list[str]]] = {}
    orch = await harness.engine()
    for applied in (True, False):
        tx, inputs = run.new_tx(f"f-503-{'after' if applied else 'before'}")
        k = order_keys(tx)
        run.fault(
            FaultRule(
                FaultKind.INDETERMINATE_5XX,
                provider="payments",
                action="charge",
                key=k.charge,
                applied=applied,
            )
        )
        await orch.execute(order_saga(), inputs, tx_id=tx)
        await orch.drain(timeout_seconds=10)
        charged = [
            e
            for e in await harness.shop.effects("payments.charge")
            if e.key == k.charge and e.status == "applied"
        ]
        calls = await calls_of(harness, k.charge)
        outcomes["after" if applied else "before"] = (
            (await orch.result(tx)).status,
            len(charged),
            calls,
        )
    after, before = outcomes["after"], outcomes["before"]
    run.expect(after[:2] == (TxState.COMMITTED, 1), f"503 after the effect: {after}")
    run.expect(before[:2] == (TxState.COMMITTED, 1), f"503 before the effect: {before}")
    run.expect(
        before[2] == ["apply:unknown:http 503", "lookup:not_found", "apply:confirmed"],
        f"503 before the effect: calls {before[2]}",
    )
    return await run.finish(
        "indeterminate 5xx",
        f"applied -> lookup found, charge={after[1]}; "
        f"not applied -> not_found -> re-apply, charge={before[1]}",
    )


async def duplicate_notification(harness: Harness) -> ScenarioResult:
    """The receipt is sent, the sender dies; two workers race on the outbox, then the same
    event is delivered once more by hand: still one email."""
    run = await ScenarioRun.start(harness, SUITE, "duplicate_notification")
    tx, inputs = run.new_tx("f-dup-email")
    k = order_keys(tx)
    orch = await harness.engine()
    orch.crashpoints.arm("effect.after_apply", when=at(tx, "receipt", kind="outbox"))
    await run.run_until_crash(
        orch, orch.execute(order_saga(), inputs, tx_id=tx), "effect.after_apply"
    )
    workers = await harness.recover(workers=2)
    v = await view(workers[0], tx)
    event = v.outbox[0] if v.outbox else None
    run.expect(
        event is not None and event.state is EffectState.CONFIRMED,
        f"receipt {event.state if event else 'missing'}",
    )
    redelivered: Any = None
    if event is not None:
        # A queue redelivering the same event: same key, same payload, the holder's fence.
        redelivered = await harness.shop.email.apply(
            "send", key=event.key, payload=event.payload, fence=event.fence
        )
        run.expect(
            getattr(redelivered, "remote_id", None) == event.remote_id,
            f"redelivery answered {redelivered!r}",
        )
    calls = await calls_of(harness, k.receipt)
    applies = [c for c in calls if c.startswith("apply")]
    run.expect(len(applies) >= 2, f"the event was not delivered twice ({calls})")
    counts = await run.delta()
    run.expect(counts["email"] == 1, f"email={counts['email']}")
    run.detail["deliveries"] = len(applies)
    return await run.finish(
        "duplicate notification",
        f"delivered {len(applies)} times, {counts_text(counts, 'email')}",
    )


async def compensation_rejected(harness: Harness) -> ScenarioResult:
    """The provider refuses the refund: never retried into a guess, parked for a person."""
    run = await ScenarioRun.start(harness, SUITE, "compensation_rejected")
    tx, inputs = run.new_tx("f-comp-reject")
    inputs["amount"] = 1500
    k = order_keys(tx)
    run.fault(FaultRule(FaultKind.REJECT, provider="payments", action="refund", key=k.refund))
    orch = await harness.engine()
    await orch.execute(order_saga(max_amount=1000), inputs, tx_id=tx)
    await orch.drain(timeout_seconds=10)
    v = await view(orch, tx)
    reason = (v.tx.error or {}).get("reason") if isinstance(v.tx.error, dict) else None
    run.expect(v.tx.status is TxState.MANUAL_REVIEW, f"the order ended {v.tx.status}")
    run.expect(reason == REASON_REVERSAL_REJECTED, f"reason {reason!r}")
    counts = await run.delta()
    run.expect(counts["refund"] == 0, f"refund={counts['refund']}")
    return await run.finish(
        "compensation rejected",
        f"refund rejected -> {v.tx.status.value} ({reason}), {counts_text(counts, 'refund')}",
    )


async def compensation_lost(harness: Harness) -> ScenarioResult:
    """The release's response is lost: looked up, found, the saga ends compensated."""
    run = await ScenarioRun.start(harness, SUITE, "compensation_lost")
    tx, inputs = run.new_tx("f-comp-lost")
    inputs["amount"] = 1500
    k = order_keys(tx)
    run.fault(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="inventory", action="release", key=k.release)
    )
    orch = await harness.engine()
    await orch.execute(order_saga(max_amount=1000), inputs, tx_id=tx)
    await orch.drain(timeout_seconds=10)
    status = (await orch.result(tx)).status
    run.expect(status is TxState.COMPENSATED, f"the order ended {status}")
    calls = await calls_of(harness, k.release)
    run.expect(calls == ["apply:lost_response", "lookup:found"], f"release calls {calls}")
    counts = await run.delta()
    run.expect(
        (counts["release"], counts["refund"]) == (1, 1), "counts differ from release=1 refund=1"
    )
    return await run.finish(
        "compensation lost",
        f"release lost -> lookup found -> {status.value}, "
        + counts_text(counts, "release", "refund"),
    )


async def compensation_unknown(harness: Harness) -> ScenarioResult:
    """A 503 before the refund acted: unknown, lookup not_found, re-apply, compensated."""
    run = await ScenarioRun.start(harness, SUITE, "compensation_unknown")
    tx, inputs = run.new_tx("f-comp-unknown")
    inputs["amount"] = 1500
    k = order_keys(tx)
    run.fault(
        FaultRule(
            FaultKind.INDETERMINATE_5XX,
            provider="payments",
            action="refund",
            key=k.refund,
            applied=False,
        )
    )
    orch = await harness.engine()
    await orch.execute(order_saga(max_amount=1000), inputs, tx_id=tx)
    await orch.drain(timeout_seconds=10)
    status = (await orch.result(tx)).status
    run.expect(status is TxState.COMPENSATED, f"the order ended {status}")
    calls = await calls_of(harness, k.refund)
    expected = ["apply:unknown:http 503", "lookup:not_found", "apply:confirmed"]
    run.expect(calls == expected, f"refund calls {calls}")
    counts = await run.delta()
    run.expect(counts["refund"] == 1, f"refund={counts['refund']}")
    return await run.finish(
        "compensation unknown",
        f"503 -> not_found -> re-apply -> {status.value}, {counts_text(counts, 'refund')}",
    )


async def anti_hanging_tombstone(harness: Harness) -> ScenarioResult:
    """A charge still in flight (the provider has not seen it) while another engine gives up on
    it: the provider must void the key, so the late original is refused (no hanging effect).

    The stale holder's request is frozen before it reaches the provider; its lease runs out; a
    recovering engine on its last allowed attempt (``reconcile_attempts=2``) looks the charge up
    with ``void_if_missing`` (the contract says ``supports_void``), learns it never happened and
    never will, and compensates. Then the original arrives: refused, charge=0.
    """
    run = await ScenarioRun.start(harness, SUITE, "anti_hanging_tombstone")
    tx, inputs = run.new_tx("f-tombstone")
    k = order_keys(tx)
    held = HoldingProvider(harness.shop.payments, "charge", hold="request")
    stale = await harness.engine(call_timeout_seconds=60)
    stale.register_provider(held)
    task = asyncio.create_task(stale.execute(order_saga(), inputs, tx_id=tx, budget_seconds=0))
    try:
        await asyncio.wait_for(held.reached.wait(), 10)
        worker = await harness.engine(reconcile_attempts=2)
        probe = HoldingProvider(harness.shop.payments, "none")  # records the lookup's flags
        worker.register_provider(probe)
        worker.store.advance_clock(stale.settings.lease_seconds + 1)
        await worker.drain(timeout_seconds=10)
        before_late = (await worker.result(tx)).status
    finally:
        held.gate.set()  # the original finally travels
        await asyncio.wait_for(task, 10)
    v = await view(worker, tx)
    calls = await calls_of(harness, k.charge)
    run.detail["lookup_void_if_missing"] = probe.voids
    if not any(probe.voids):
        run.reasons.append(
            "expected failure: the engine never passed void_if_missing=True to the lookup of a "
            "forward op it resolves before compensating or skipping it (orchestrator/protocol.py)"
        )
    run.expect(
        before_late is TxState.COMPENSATED, f"the recovering engine ended the order {before_late}"
    )
    run.expect(op_state(v, "charge") is EffectState.FAILED, f"charge op {op_state(v, 'charge')}")
    run.expect(
        calls[:1] == ["lookup:voided"] and calls[-1:] == ["apply:rejected:voided"],
        f"charge calls {calls}: expected the lookup to void the key and the late apply refused",
    )
    counts = await run.delta()
    run.expect(
        (counts["charge"], counts["release"]) == (0, 1), "counts differ from charge=0 release=1"
    )
    return await run.finish(
        "anti-hanging tombstone",
        f"in-flight charge voided -> {v.tx.status.value}, late original refused, "
        + counts_text(counts, "charge", "release"),
    )


#: Provider faults, one scenario each.
FAULT_SCENARIOS: list[tuple[str, Scenario]] = [
    ("response_lost_to_workers", response_lost_to_workers),
    ("fail_before_effect", fail_before_effect),
    ("definite_rejection", definite_rejection),
    ("timeout_beyond_budget", timeout_beyond_budget),
    ("lookup_unavailable_then_available", lookup_unavailable_then_available),
    ("lookup_unavailable_forever", lookup_unavailable_forever),
    ("dedup_window_expired", dedup_window_expired),
    ("indeterminate_5xx", indeterminate_5xx),
    ("duplicate_notification", duplicate_notification),
    ("compensation_rejected", compensation_rejected),
    ("compensation_lost", compensation_lost),
    ("compensation_unknown", compensation_unknown),
    ("anti_hanging_tombstone", anti_hanging_tombstone),
]

__all__ = ["FAULT_SCENARIOS"]
