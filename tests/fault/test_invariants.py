"""The invariant checker: silent on a clean run, and each invariant caught when broken on purpose.

Every broken situation is produced the way it would happen for real where that is possible (a
protocol step patched out, a provider that forgets its keys or its fences, a crash left
unrecovered) and by editing rows only where no code path can produce it (a forged provider
effect, a tampered ledger). Each test asserts the invariant number *and* the check's slug, so
removing that check makes the test fail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import pytest
from sqlalchemy import insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from fault_injection._evidence import EvidenceReader
from fault_injection.harness import DatabasePair, Harness
from fault_injection.holding import HoldingProvider
from fault_injection.invariants import CheckReport, check_invariants, check_snapshot
from ledger import events
from ledger.effects import Claim
from ledger.schema import ledger as ledger_table
from ledger.schema import operations, transactions
from ledger.states import TxState
from orchestrator import keys
from orchestrator.crashpoints import SimulatedCrash
from orchestrator.engine import Orchestrator
from orchestrator.saga import Saga, Step
from providers.contract import Confirmed, LookupOutcome, Provider
from providers.fake import schema as shop_schema
from providers.fake.actions import ActionSpec
from providers.fake.faults import FaultKind, FaultRule
from providers.fake.shop import FakeShop
from providers.fake.store import Store as ShopStore
from tests.conftest import DbUrls
from tests.support.sagas import order, order_saga
from tests.support.world import World, fast_settings


def _step(name: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda ctx: ctx.get("name") == name


async def _check(world: World, **kwargs: Any) -> CheckReport:
    return await check_invariants(world.urls.store, world.urls.provider, **kwargs)


def _found(report: CheckReport, invariant: int) -> set[str]:
    """Slugs of the violations of one invariant."""
    return {v.name for v in report.violations if v.invariant == invariant}


def _explain(report: CheckReport) -> str:
    return "\n".join(f"{v.invariant} {v.name} {v.tx_id}: {v.message}" for v in report.violations)


async def _recover_elsewhere(world: World, **settings: object) -> Orchestrator:
    """A fresh engine, after the crashed one's leases expired, drains all work."""
    worker = await world.engine(**settings)
    worker.store.advance_clock(world.orch.settings.lease_seconds + 1)
    await worker.drain(timeout_seconds=10)
    return worker


async def _recover_with_forgetful_provider(world: World, action: str) -> None:
    """Recover through a shop whose clock runs an hour ahead and that prunes its idempotency
    cache after 60 s: its lookup answers "not found" and a re-send is a second, real effect."""
    later = await FakeShop.open(
        world.urls.provider, clock=lambda: time.time() + 3600, dedup_window_seconds=60
    )
    try:
        later.faults.add(FaultRule(FaultKind.FORGET_KEYS, action=action, times=None))
        worker = await Orchestrator.open(
            world.urls.store, providers=later.providers(), settings=fast_settings()
        )
        world.extra.append(worker)
        worker.store.advance_clock(world.orch.settings.lease_seconds + 1)
        await worker.drain(timeout_seconds=10)
    finally:
        await later.close()


async def _op_key(orch: Orchestrator, tx_id: str, step: str) -> str:
    view = await orch.get(tx_id)
    return next(o.key for o in view.operations if o.name == step)


async def _crash_at(world: World, point: str, step: str | None = None) -> str:
    """Run one order until ``point`` fires, abandon the engine, return the transaction id."""
    world.orch.crashpoints.arm(point, when=_step(step) if step else None)
    with pytest.raises(SimulatedCrash):
        await world.orch.execute(order_saga(), order("42"))
    await world.orch.abandon()
    store_engine = create_async_engine(world.urls.store)
    try:
        async with store_engine.connect() as conn:
            return str((await conn.execute(select(transactions.c.tx_id))).scalar_one())
    finally:
        await store_engine.dispose()


@asynccontextmanager
async def _raw(url: str) -> AsyncIterator[AsyncConnection]:
    """A writable connection that bypasses every API: how a forger (or a bug) edits rows."""
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            yield conn
    finally:
        await engine.dispose()


# -- a clean run ------------------------------------------------------------------------------


async def test_clean_run_has_no_violations(world: World) -> None:
    orch, faults = world.orch, world.shop.faults
    happy = await orch.execute(order_saga(), order("1"))
    faults.add(FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge"))
    lost = await orch.execute(order_saga(), order("2"))
    faults.add(FaultRule(FaultKind.REJECT, provider="inventory", action="reserve"))
    rejected = await orch.execute(order_saga(), order("3"))
    faults.add(FaultRule(FaultKind.REJECT, provider="payments", action="charge"))
    turned_back = await orch.execute(order_saga(), order("4"))
    for provider, action in (("payments", "refund"), ("inventory", "release")):
        faults.add(FaultRule(FaultKind.LOSE_RESPONSE, provider=provider, action=action))
    compensated = await orch.execute(order_saga(max_amount=1000), order("5", amount=1500))
    await orch.drain(timeout_seconds=10)
    statuses = [
        (await orch.result(r.tx_id)).status
        for r in (happy, lost, rejected, turned_back, compensated)
    ]
    assert statuses == [
        TxState.COMMITTED,
        TxState.COMMITTED,
        TxState.FAILED,
        TxState.COMPENSATED,
        TxState.COMPENSATED,
    ]

    report = await _check(world)

    assert report.ok, _explain(report)
    assert report.transactions == 5
    assert report.effects >= 12  # 2 x (reserve, charge, email) + releases, refunds, rejections
    assert report.ledger_rows > 40
    assert report.to_json()["ok"] is True

    # Limited to one transaction: only its rows and the provider rows under its keys.
    only = await _check(world, tx_ids=[lost.tx_id])
    assert only.ok and only.transactions == 1
    assert only.effects == 3  # reserve, charge (response lost, found by lookup), receipt


# -- a reader kept open: what a run that checks after every schedule uses ----------------------


async def test_a_reader_kept_open_sees_what_happened_after_it_opened(world: World) -> None:
    happy = await world.orch.execute(order_saga(), order("1"))
    await world.orch.drain(timeout_seconds=10)
    reader = await EvidenceReader.open(world.urls.store, world.urls.provider)
    try:
        first = check_snapshot(await reader.load(None))
        assert first.ok and first.transactions == 1, _explain(first)

        # After it opened: a crash right after the charge, then a recovery through a shop that
        # forgot the key, which charges a second time. A reader that still read the state it
        # first saw would call this clean.
        dying = await world.engine()
        dying.crashpoints.arm("effect.after_apply", when=_step("charge"))
        with pytest.raises(SimulatedCrash):
            await dying.execute(order_saga(), order("42"))
        await dying.abandon()
        (tx_id,) = set((await reader.load(None)).txs) - {happy.tx_id}
        await _recover_with_forgetful_provider(world, "charge")
        later = check_snapshot(await reader.load(None))
        scoped = check_snapshot(await reader.load([tx_id]))
    finally:
        await reader.close()

    assert later.transactions == 2 and {"double_effect", "double_charge"} <= _found(later, 1)
    assert scoped.transactions == 1 and "double_effect" in _found(scoped, 1)
    assert all(v.tx_id != happy.tx_id for v in later.violations)


async def test_the_harness_checks_through_one_reader_and_closes_it(
    db_urls: DbUrls, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[EvidenceReader] = []
    closed: list[EvidenceReader] = []
    real_open, real_close = EvidenceReader.open, EvidenceReader.close

    async def counting_open(store_url: str, provider_url: str) -> EvidenceReader:
        reader = await real_open(store_url, provider_url)
        opened.append(reader)
        return reader

    async def counting_close(self: EvidenceReader) -> None:
        closed.append(self)
        await real_close(self)

    monkeypatch.setattr(EvidenceReader, "open", staticmethod(counting_open))
    monkeypatch.setattr(EvidenceReader, "close", counting_close)
    harness = await Harness.open(DatabasePair(db_urls.store, db_urls.provider, db_urls.backend))
    try:
        orch = await harness.engine()
        reports = []
        for n in range(3):
            await orch.execute(order_saga(), order(str(n)))
            await orch.drain(timeout_seconds=10)  # the receipt too
            reports.append(await harness.check())
    finally:
        await harness.close()

    assert [r.transactions for r in reports] == [1, 2, 3]
    assert all(r.ok for r in reports), [_explain(r) for r in reports]
    assert len(opened) == 1 and closed == opened


# -- 1: at most one effect per key; one live charge per business intent -----------------------


async def test_forgotten_key_double_charge_is_caught(world: World) -> None:
    tx_id = await _crash_at(world, "effect.after_apply", "charge")
    await _recover_with_forgetful_provider(world, "charge")
    assert (await world.shop.counts())["payments.charge"] == 2  # the money moved twice

    report = await _check(world)

    assert {"double_effect", "double_charge"} <= _found(report, 1), _explain(report)
    double = next(v for v in report.violations if v.name == "double_effect")
    assert double.tx_id == tx_id and double.evidence["count"] == 2
    assert len({e["remote_id"] for e in double.evidence["effects"]}) == 2
    assert double.ledger_excerpt and double.ledger_excerpt[-1]["seq"] > 0


async def test_second_live_charge_for_one_business_intent_is_caught(world: World) -> None:
    # A refund that answers success and changes nothing: the first attempt looks compensated,
    # so the business key is free again, and the retry charges the same order a second time.
    payments = world.shop.payments
    real = payments._specs["refund"]

    async def fake_refund(_conn: AsyncConnection, _key: str, payload: Any) -> Confirmed:
        return Confirmed(
            "re_fake", {"charge_id": payload["charge_id"], "amount": payload["amount"]}
        )

    payments._specs["refund"] = ActionSpec(real.contract, real.validate, fake_refund)
    first = await world.orch.execute(order_saga(max_amount=1000), order("42", amount=1500))
    assert first.status is TxState.COMPENSATED
    retry = await world.orch.execute(order_saga(), order("42", amount=900))
    assert retry.status is TxState.COMMITTED

    report = await _check(world)

    assert "double_charge" in _found(report, 1), _explain(report)
    intent = next(v for v in report.violations if v.name == "double_charge")
    assert intent.evidence["business_intent"] == "default/order:42"  # tenant first
    assert {c["tx_id"] for c in intent.evidence["charges"]} == {first.tx_id, retry.tx_id}
    # ... and the hollow compensation itself is caught from the shop's business state.
    assert "reversal_not_in_business_state" in _found(report, 3)


# -- 2: nothing in flight once drained ------------------------------------------------------


async def test_unrecovered_crash_leaves_a_transaction_in_flight(world: World) -> None:
    tx_id = await _crash_at(world, "effect.before_apply", "charge")

    report = await _check(world)

    assert {"in_flight", "effect_in_flight"} <= _found(report, 2), _explain(report)
    stuck = next(v for v in report.violations if v.name == "in_flight")
    assert stuck.tx_id == tx_id and stuck.evidence["status"] == "executing"
    # A run that is still going is not judged on it.
    assert not _found(await _check(world, require_settled=False), 2)


# -- 3: outcomes proved by the provider -------------------------------------------------------


async def test_provider_effect_for_a_failed_transaction_is_caught(world: World) -> None:
    world.shop.faults.add(FaultRule(FaultKind.REJECT, provider="inventory", action="reserve"))
    result = await world.orch.execute(order_saga(), order("42"))
    assert result.status is TxState.FAILED
    charge_key = await _op_key(world.orch, result.tx_id, "charge")  # skipped: never sent
    assert (await _check(world)).ok
    async with _raw(world.urls.provider) as conn:
        await conn.execute(
            insert(shop_schema.effects).values(
                provider="payments",
                key=charge_key,
                action="charge",
                payload="{}",
                payload_sha256="0" * 64,
                remote_id="ch_forged",
                status="applied",
                created_at=time.time(),
            )
        )

    report = await _check(world)

    assert "failed_with_effect" in _found(report, 3), _explain(report)
    v = next(v for v in report.violations if v.name == "failed_with_effect")
    assert v.tx_id == result.tx_id
    assert v.evidence["provider_effects"][0]["remote_id"] == "ch_forged"


async def test_confirmation_the_provider_never_saw_is_caught(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("42"))
    async with _raw(world.urls.provider) as conn:
        await conn.execute(
            update(shop_schema.effects)
            .where(shop_schema.effects.c.action == "charge")
            .values(remote_id="ch_someone_else")
        )

    report = await _check(world)

    assert "unbacked_confirmation" in _found(report, 3), _explain(report)
    assert {v.tx_id for v in report.violations if v.invariant == 3} == {result.tx_id}


async def _set_status(world: World, tx_id: str, status: TxState) -> None:
    async with _raw(world.urls.store) as conn:
        await conn.execute(
            update(transactions)
            .where(transactions.c.tx_id == tx_id)
            .values(status=status.value, lease_owner=None, lease_until=None)
        )


async def test_commit_with_an_unconfirmed_op_is_caught(world: World) -> None:
    tx_id = await _crash_at(world, "commit.before_commit")
    await _set_status(world, tx_id, TxState.COMMITTED)  # a commit that skipped the record

    report = await _check(world)

    assert "committed_op_not_confirmed" in _found(report, 3), _explain(report)
    v = next(v for v in report.violations if v.name == "committed_op_not_confirmed")
    assert v.tx_id == tx_id and v.evidence["op"]["state"] == "executing"


async def test_compensated_without_reversals_is_caught(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("42"))
    await _set_status(world, result.tx_id, TxState.COMPENSATED)

    report = await _check(world)

    missing = [v for v in report.violations if v.name == "reversal_missing"]
    assert {v.evidence["op"]["key"] for v in missing} == {
        await _op_key(world.orch, result.tx_id, "reserve"),
        await _op_key(world.orch, result.tx_id, "charge"),
    }, _explain(report)


async def test_compensated_with_an_irreversible_effect_is_caught(world: World) -> None:
    base = order_saga(max_amount=1000)
    # An irreversible pivot (an email) after the reversible steps: the failing check turns the
    # saga back, nothing can unsend the email, so the engine parks it. Compensated is a lie.
    notify = Step("notify", "email", "send", {"to": "buyer@example.com", "template": "paid"})
    pivot = Saga(
        "pivot",
        steps=[*base.steps, notify],
        inputs=base.inputs,
        checks=base.checks,
        business_key=base.business_key,
    )
    result = await world.orch.execute(pivot, order("42", amount=1500))
    assert result.status is TxState.MANUAL_REVIEW  # the charge cannot be reversed
    assert (await _check(world)).ok
    await _set_status(world, result.tx_id, TxState.COMPENSATED)

    report = await _check(world)

    assert "irreversible_in_compensated" in _found(report, 3), _explain(report)


async def test_reversal_missing_at_the_provider_is_caught(world: World) -> None:
    result = await world.orch.execute(order_saga(max_amount=1000), order("42", amount=1500))
    assert result.status is TxState.COMPENSATED
    async with _raw(world.urls.provider) as conn:
        await conn.execute(
            shop_schema.effects.delete().where(shop_schema.effects.c.action == "refund")
        )

    report = await _check(world)

    assert {"reversal_not_at_provider", "unbacked_confirmation"} <= _found(report, 3), _explain(
        report
    )


# -- 4: no outbox effect before the commit ----------------------------------------------------


async def test_email_before_the_commit_is_caught(world: World) -> None:
    tx_id = await _crash_at(world, "commit.before_commit")
    # Charge confirmed at the provider, commit rolled back: a receipt now would be observable
    # before the commit. Send it under the key the outbox would have used.
    settings = world.orch.settings
    key = keys.event_key(
        tenant=settings.tenant,
        environment=settings.environment,
        provider="email",
        tx_id=tx_id,
        event="receipt",
        version=1,
    )
    sent = await world.shop.email.apply(
        "send", key=key, payload={"to": "buyer@example.com", "template": "receipt"}, fence=1
    )
    assert isinstance(sent, Confirmed)

    report = await _check(world, require_settled=False)

    assert _found(report, 4) == {"outbox_before_commit"}, _explain(report)
    v = next(v for v in report.violations if v.invariant == 4)
    assert v.tx_id == tx_id and v.evidence["tx_status"] == "executing"
    assert v.evidence["effect"]["key"] == key


async def test_stray_notification_is_caught(world: World) -> None:
    await world.orch.execute(order_saga(), order("42"))
    await world.shop.email.apply(
        "send", key="not-ours", payload={"to": "x@example.com", "template": "t"}, fence=1
    )

    report = await _check(world)

    assert _found(report, 4) == {"outbox_without_event"}, _explain(report)


async def test_receipt_sent_twice_is_caught(world: World) -> None:
    tx_id = await _crash_at(world, "effect.after_apply", "receipt")
    await _recover_with_forgetful_provider(world, "send")
    assert (await world.shop.counts())["email.send"] == 2

    report = await _check(world)

    assert _found(report, 4) == {"outbox_sent_twice"}, _explain(report)
    v = next(v for v in report.violations if v.invariant == 4)
    assert v.tx_id == tx_id and len(v.evidence["provider_effects"]) == 2


async def test_outbox_ledger_row_before_the_commit_is_caught(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("42"))
    # Move the transaction's commit row after the outbox rows, as a commit that landed after
    # its event was planned would look. The chain breaks too (that is invariant 7's business).
    async with _raw(world.urls.store) as conn:
        await _drop_append_only_trigger(conn, world)
        await conn.execute(
            update(ledger_table)
            .where(ledger_table.c.tx_id == result.tx_id, ledger_table.c.action == "commit")
            .values(seq=10_000)
        )

    report = await _check(world)

    assert "outbox_claimed_before_commit" in _found(report, 4), _explain(report)


# -- 5: no re-send without a lookup -----------------------------------------------------------


async def test_reclaim_that_skips_the_lookup_is_caught(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The protocol "forgets" that a claim from executing may have been sent already.
    monkeypatch.setattr(Claim, "maybe_sent", property(lambda _self: False))
    tx_id = await _crash_at(world, "effect.after_apply", "charge")
    await _recover_elsewhere(world)
    assert (await world.shop.counts())["payments.charge"] == 1  # the key dedup saved the money

    report = await _check(world)

    assert _found(report, 5) == {"resend_without_lookup", "ledger_resend_without_lookup"}, _explain(
        report
    )
    assert not _found(report, 1)
    provider_side = next(v for v in report.violations if v.name == "resend_without_lookup")
    assert provider_side.tx_id == tx_id
    assert [c["call"] for c in provider_side.evidence["calls"]] == ["apply", "apply"]


async def test_lookup_then_resend_is_clean(world: World) -> None:
    await _crash_at(world, "effect.after_apply", "charge")
    await _recover_elsewhere(world)
    assert (await _check(world)).ok


# -- 6: fencing -------------------------------------------------------------------------------


# The suite's own frozen-call wrapper (a worker in a long GC pause).
_PausingProvider = HoldingProvider


async def test_provider_that_ignores_fences_is_caught(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_fencing(*_args: Any, **_kwargs: Any) -> None:
        return None  # never "stale": every fence is accepted

    monkeypatch.setattr(ShopStore, "check_fence", no_fencing)
    paused = _PausingProvider(world.shop.payments, "charge")
    stale = await world.engine(call_timeout_seconds=30)
    stale.register_provider(paused)
    task = asyncio.create_task(stale.execute(order_saga(), order("42"), budget_seconds=0))
    await asyncio.wait_for(paused.reached.wait(), 10)
    await _recover_elsewhere(world)  # a healthy worker takes over with fence 2 and finishes
    paused.gate.set()  # the stale worker wakes and sends its apply with fence 1
    await asyncio.wait_for(task, 10)

    report = await _check(world)

    assert "stale_fence_applied" in _found(report, 6), _explain(report)
    v = next(v for v in report.violations if v.name == "stale_fence_applied")
    assert (v.evidence["stale"]["fence"], v.evidence["newer"]["fence"]) == (1, 2)
    assert v.evidence["stale"]["outcome"] != "fenced_out"


@pytest.mark.parametrize("fault", [None, FaultKind.LOSE_RESPONSE, FaultKind.FAIL_BEFORE])
async def test_fenced_out_stale_holder_is_clean(world: World, fault: FaultKind | None) -> None:
    # The healthy holder's apply passes; a fault on the stale one relabels its log row
    # ("lost_response" hides the fenced_out, "unavailable" never reached the fence check).
    if fault is not None:
        world.shop.faults.add(FaultRule(fault, provider="payments", action="charge", skip=1))
    paused = _PausingProvider(world.shop.payments, "charge")
    stale = await world.engine(call_timeout_seconds=30)
    stale.register_provider(paused)
    task = asyncio.create_task(stale.execute(order_saga(), order("42"), budget_seconds=0))
    await asyncio.wait_for(paused.reached.wait(), 10)
    await _recover_elsewhere(world)
    paused.gate.set()
    await asyncio.wait_for(task, 10)
    assert (await world.shop.counts())["payments.charge"] == 1
    charge = (await world.shop.effects("payments.charge"))[0]
    last = (await world.shop.calls(key=charge.key))[-1]  # the stale holder's apply
    assert (last.fence, last.outcome) == (
        1,
        "unavailable" if fault is FaultKind.FAIL_BEFORE else "fenced_out",
    )

    report = await _check(world)

    assert report.ok, _explain(report)


class _AfterLookup(_PausingProvider):
    """Lets ``stale``'s held apply land right after this holder's lookup, before its apply."""

    def __init__(self, inner: Provider, stale: _PausingProvider) -> None:
        super().__init__(inner, action="")
        self.stale = stale

    async def lookup(
        self, action: str, *, key: str, payload: Mapping[str, Any], void_if_missing: bool = False
    ) -> LookupOutcome:
        answer = await super().lookup(
            action, key=key, payload=payload, void_if_missing=void_if_missing
        )
        self.stale.gate.set()
        await asyncio.wait_for(self.stale.done.wait(), 10)
        return answer


async def test_old_apply_landing_after_the_new_holders_lookup_is_clean(world: World) -> None:
    # lookup (new holder: not found), apply fence 1 (old holder, in flight all along), apply
    # fence 2 (new holder: replayed). No one re-sent blindly and the key deduplicated.
    paused = _PausingProvider(world.shop.payments, "charge")
    stale = await world.engine(call_timeout_seconds=30)
    stale.register_provider(paused)
    task = asyncio.create_task(stale.execute(order_saga(), order("42"), budget_seconds=0))
    await asyncio.wait_for(paused.reached.wait(), 10)
    healthy = await world.engine()
    healthy.register_provider(_AfterLookup(world.shop.payments, paused))
    healthy.store.advance_clock(world.orch.settings.lease_seconds + 1)
    await healthy.drain(timeout_seconds=10)
    await asyncio.wait_for(task, 10)
    charge = (await world.shop.effects("payments.charge"))[0]
    calls = [(c.call, c.fence, c.outcome) for c in await world.shop.calls(key=charge.key)]
    assert calls == [
        ("lookup", None, "not_found"),
        ("apply", 1, "confirmed"),
        ("apply", 2, "replayed"),
    ]

    report = await _check(world)

    assert report.ok, _explain(report)


async def test_stale_holder_row_in_the_ledger_is_caught(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("42"))
    charge_key = await _op_key(world.orch, result.tx_id, "charge")
    # A stale holder's outcome that landed: correctly chained (so invariant 7 stays quiet, and
    # replay still ends in "confirmed"), but carrying a fence no claim of this op handed out.
    store = world.orch.store
    async with store.transaction() as work:
        chain = await events.chain_of(work.conn, result.tx_id)
        work.log(
            chain,
            action="apply",
            subject=charge_key,
            from_state="executing",
            to_state="confirmed",
            detail={"fence": 7, "remote_id": "ch_stale"},
        )

    report = await _check(world)

    assert _found(report, 6) == {"ledger_fence_mismatch"}, _explain(report)
    assert not _found(report, 7)


async def test_reused_fence_in_the_ledger_is_caught(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("42"))
    charge_key = await _op_key(world.orch, result.tx_id, "charge")
    # A second claim that handed out fence 1 again, and its outcome: chained, replay-consistent.
    async with world.orch.store.transaction() as work:
        chain = await events.chain_of(work.conn, result.tx_id)
        for action, from_state, to_state in (
            ("claim", "pending", "executing"),
            ("apply", "executing", "confirmed"),
        ):
            work.log(
                chain,
                action=action,
                subject=charge_key,
                from_state=from_state,
                to_state=to_state,
                detail={"fence": 1},
            )

    report = await _check(world)

    assert _found(report, 6) == {"ledger_fence_regressed"}, _explain(report)
    assert not _found(report, 7)


# -- 7: the ledger verifies -------------------------------------------------------------------


async def _drop_append_only_trigger(conn: AsyncConnection, world: World) -> None:
    if world.orch.store.dialect == "sqlite":
        await conn.execute(text("DROP TRIGGER ledger_append_only_update"))
    else:
        await conn.execute(text("DROP TRIGGER ledger_append_only_update ON ledger"))


async def test_tampered_ledger_is_caught(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("42"))
    async with _raw(world.urls.store) as conn:
        await _drop_append_only_trigger(conn, world)
        seq = (
            await conn.execute(
                select(ledger_table.c.seq).where(ledger_table.c.to_state == "confirmed").limit(1)
            )
        ).scalar_one()
        await conn.execute(
            ledger_table.update().where(ledger_table.c.seq == seq).values(to_state="failed")
        )

    report = await _check(world)

    assert _found(report, 7) == {"ledger_verify", "append_only_not_enforced"}, _explain(report)
    verify = next(v for v in report.violations if v.name == "ledger_verify")
    assert verify.tx_id == result.tx_id
    assert any(p["seq"] == seq and "hash" in p["problem"] for p in verify.evidence["problems"])


# -- 8: one payload per key -------------------------------------------------------------------


async def test_same_key_other_payload_reaching_the_provider_is_caught(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("42"))
    charge_key = await _op_key(world.orch, result.tx_id, "charge")
    answer = await world.shop.payments.apply(
        "charge", key=charge_key, payload={"amount": 9999, "currency": "EUR"}, fence=5
    )
    assert getattr(answer, "reason", None) == "idempotency_payload_mismatch"

    report = await _check(world)

    assert _found(report, 8) == {"payload_mismatch_reached_provider"}, _explain(report)
    assert next(v for v in report.violations if v.invariant == 8).tx_id == result.tx_id


async def test_provider_holding_another_payload_is_caught(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("42"))
    charge_key = await _op_key(world.orch, result.tx_id, "charge")
    async with _raw(world.urls.store) as conn:
        await conn.execute(
            update(operations)
            .where(operations.c.op_key == charge_key)
            .values(payload_sha256="f" * 64)
        )

    report = await _check(world)

    assert _found(report, 8) == {"payload_fingerprint_differs"}, _explain(report)


# -- 9: stored errors leak nothing ------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "problem"),
    [
        (
            {"code": "provider_rejected", "step": "charge", "reason": "injected_rejection"},
            "provider",
        ),
        ({"code": "manual_review", "step": "charge", "reason": "ResponseLost: boom"}, "exception"),
        ({"code": "manual_review", "reason": "SELECT * FROM effects WHERE 1"}, "SQL"),
        ({"code": "card_declined", "step": "charge"}, "unregistered"),
        ({"code": "provider_rejected", "step": "charge", "body": "x"}, "unexpected keys"),
    ],
)
async def test_provider_text_in_a_stored_error_is_caught(
    world: World, error: dict[str, Any], problem: str
) -> None:
    world.shop.faults.add(FaultRule(FaultKind.REJECT, provider="payments", action="charge"))
    result = await world.orch.execute(order_saga(), order("42"))
    assert result.status is TxState.COMPENSATED
    assert (await _check(world)).ok
    async with _raw(world.urls.store) as conn:
        await conn.execute(
            update(transactions).where(transactions.c.tx_id == result.tx_id).values(error=error)
        )

    report = await _check(world)

    assert _found(report, 9) == {"error_leak"}, _explain(report)
    v = next(v for v in report.violations if v.invariant == 9)
    assert v.tx_id == result.tx_id and v.evidence["where"] == "transactions.error"
    assert any(problem in p for p in v.evidence["problems"])
