"""The fake shop on both backends: idempotency, fencing, voids, faults, business state.

Every assertion about effects reads the shop's own database (``counts``, ``effects``, ``stock``),
never an in-memory counter; one test reopens the database with a second shop to prove it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import sqlite3
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from sqlalchemy import make_url, text
from sqlalchemy.ext.asyncio import create_async_engine

from providers import (
    Confirmed,
    FakeShop,
    FaultKind,
    FaultPlan,
    FaultRule,
    FencedOut,
    Found,
    NotFound,
    Provider,
    ProviderRegistry,
    ProviderUnavailable,
    Rejected,
    ResponseLost,
    Unavailable,
    Unknown,
    UnknownAction,
    UnknownProvider,
)
from providers.fake.schema import MAX_STOCK
from providers.fake.store import ShopDatabaseError
from providers.registry import DuplicateProvider

CHARGE = {"amount": 1200, "currency": "EUR"}
WINDOW = 3600.0


class Clock:
    """A provider clock the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def shop(db_urls: Any, clock: Clock) -> AsyncIterator[FakeShop]:
    shop = await FakeShop.open(db_urls.provider, clock=clock, dedup_window_seconds=WINDOW)
    await shop.seed_stock({"sku-1": 10})
    try:
        yield shop
    finally:
        await shop.close()


def no_effects() -> dict[str, int]:
    return dict.fromkeys(
        [
            "inventory.reserve",
            "inventory.release",
            "payments.charge",
            "payments.refund",
            "email.send",
        ],
        0,
    )


def expect(**changes: int) -> dict[str, int]:
    counts = no_effects()
    for name, n in changes.items():
        counts[name.replace("_", ".", 1)] = n
    return counts


# -- contracts and registry -------------------------------------------------------------------


async def test_providers_satisfy_the_protocol_and_contracts(shop: FakeShop) -> None:
    assert [p.name for p in shop.providers()] == ["inventory", "payments", "email"]
    assert all(isinstance(p, Provider) for p in shop.providers())
    reserve = shop.inventory.contract("reserve")
    assert reserve.compensation == "release" and reserve.supports_void
    release = shop.inventory.contract("release")
    assert release.is_compensation and release.compensation is None
    charge = shop.payments.contract("charge")
    assert charge.compensation == "refund" and charge.echo_fields == ("amount", "currency")
    assert charge.dedup_window_seconds == WINDOW
    assert shop.payments.contract("refund").required_fields == ("charge_id", "amount")
    send = shop.email.contract("send")
    assert send.irreversible and send.required_fields == ("to", "template")
    for provider in shop.providers():
        for contract in provider.actions().values():
            if contract.read_only:  # reads: no key, nothing to dedup, fence or look up
                assert not contract.dedups_by_key and contract.compensation is None
                continue
            assert contract.dedups_by_key and contract.supports_fencing
            assert contract.supports_lookup and contract.lookup_authoritative
    with pytest.raises(UnknownAction, match="teleport"):
        shop.payments.contract("teleport")
    with pytest.raises(UnknownAction):
        await shop.payments.apply("teleport", key="k", payload={}, fence=1)
    with pytest.raises(UnknownAction):
        await shop.payments.lookup("teleport", key="k", payload={})


async def test_registry(shop: FakeShop) -> None:
    registry = ProviderRegistry(shop.providers())
    assert registry.names() == ["email", "inventory", "payments"]
    assert "payments" in registry and "bank" not in registry
    assert registry.get("payments") is shop.payments
    assert registry.contract("payments", "charge").compensation == "refund"
    with pytest.raises(UnknownProvider, match=r"'bank'.*registered: email, inventory, payments"):
        registry.get("bank")
    with pytest.raises(UnknownAction, match="'payments' has no action 'teleport'"):
        registry.contract("payments", "teleport")
    with pytest.raises(DuplicateProvider):
        registry.register(shop.payments)
    registry.register(shop.payments, replace=True)
    with pytest.raises(TypeError):
        registry.register(object())  # type: ignore[arg-type]


# -- idempotency ------------------------------------------------------------------------------


async def test_same_key_and_payload_replays_the_first_result(shop: FakeShop) -> None:
    first = await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    assert isinstance(first, Confirmed)
    assert first.result == {"charge_id": first.remote_id, **CHARGE}
    again = await shop.payments.apply("charge", key="k1", payload=dict(CHARGE), fence=1)
    assert again == first
    assert await shop.counts() == expect(payments_charge=1)
    assert len(await shop.charges()) == 1
    assert [c.outcome for c in await shop.calls("k1")] == ["confirmed", "replayed"]


async def test_same_key_different_payload_is_rejected(shop: FakeShop) -> None:
    first = await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    assert isinstance(first, Confirmed)
    other = {"amount": 9999, "currency": "EUR"}
    assert await shop.payments.apply("charge", key="k1", payload=other, fence=1) == Rejected(
        "idempotency_payload_mismatch"
    )
    # Another action of the same provider cannot reuse the key either.
    refund = {"charge_id": first.remote_id, "amount": 1}
    assert await shop.payments.apply("refund", key="k1", payload=refund, fence=1) == Rejected(
        "idempotency_payload_mismatch"
    )
    assert await shop.counts() == expect(payments_charge=1)
    # Keys are scoped per provider, like three separate services.
    assert isinstance(
        await shop.email.apply("send", key="k1", payload={"to": "a@b", "template": "t"}, fence=1),
        Confirmed,
    )


async def test_invalid_payloads_are_rejected_before_anything(shop: FakeShop) -> None:
    missing = await shop.payments.apply("charge", key="k1", payload={"amount": 5}, fence=1)
    assert missing == Rejected("invalid_payload: missing required fields: currency")
    bad = await shop.payments.apply(
        "charge", key="k1", payload={"amount": 1.5, "currency": "EUR"}, fence=1
    )
    assert isinstance(bad, Rejected) and bad.reason.startswith("invalid_payload: amount")
    not_object = await shop.payments.apply("charge", key="k1", payload=[1], fence=1)  # type: ignore[arg-type]
    assert not_object == Rejected("invalid_payload: payload must be a JSON object")
    # Validation failures are not remembered: the key is still free.
    assert isinstance(
        await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1), Confirmed
    )
    assert await shop.counts() == expect(payments_charge=1)


async def test_concurrent_applies_of_one_key_make_one_effect(shop: FakeShop) -> None:
    outcomes = await asyncio.gather(
        *(shop.payments.apply("charge", key="hot", payload=CHARGE, fence=1) for _ in range(12))
    )
    assert all(isinstance(o, Confirmed) for o in outcomes)
    assert len({o.remote_id for o in outcomes if isinstance(o, Confirmed)}) == 1
    assert await shop.counts() == expect(payments_charge=1)
    assert sum(c.created_effect for c in await shop.calls("hot")) == 1


async def test_concurrent_reservations_never_oversell(shop: FakeShop) -> None:
    payload = {"sku": "sku-1", "quantity": 3}
    outcomes = await asyncio.gather(
        *(shop.inventory.apply("reserve", key=f"r{i}", payload=payload, fence=1) for i in range(6))
    )
    assert sum(isinstance(o, Confirmed) for o in outcomes) == 3
    assert sum(o == Rejected("out_of_stock") for o in outcomes) == 3
    assert await shop.stock("sku-1") == 1


# -- fencing ----------------------------------------------------------------------------------


async def test_lower_fence_after_higher_is_fenced_out(shop: FakeShop) -> None:
    assert await shop.payments.lookup("charge", key="k1", payload=CHARGE) == NotFound()
    stale = await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=5)
    assert isinstance(stale, Confirmed)
    assert await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=3) == FencedOut(5)
    # Equal or higher fences are the current owner: they replay.
    assert await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=5) == stale
    assert await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=7) == stale
    assert await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=6) == FencedOut(7)
    assert await shop.counts() == expect(payments_charge=1)


async def test_fence_is_recorded_even_when_the_apply_is_rejected(shop: FakeShop) -> None:
    rejected = await shop.payments.apply(
        "charge", key="k1", payload={**CHARGE, "card": "declined"}, fence=9
    )
    assert rejected == Rejected("card_declined")
    assert await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=2) == FencedOut(9)
    assert await shop.counts() == no_effects()


# -- void tombstones --------------------------------------------------------------------------


async def test_void_tombstone_refuses_a_late_original(shop: FakeShop) -> None:
    outcome = await shop.payments.lookup("charge", key="k1", payload=CHARGE, void_if_missing=True)
    assert outcome == NotFound(voided=True)
    late = await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    assert late == Rejected("voided")
    assert await shop.payments.lookup("charge", key="k1", payload=CHARGE) == NotFound(voided=True)
    assert await shop.counts() == no_effects()
    assert [e.status for e in await shop.effects("payments.charge")] == ["voided"]


async def test_void_does_not_touch_an_existing_effect(shop: FakeShop) -> None:
    done = await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    assert isinstance(done, Confirmed)
    found = await shop.payments.lookup("charge", key="k1", payload=CHARGE, void_if_missing=True)
    assert found == Found(done.remote_id, done.result)
    # Actions without supports_void ignore the flag and say so.
    refund = {"charge_id": done.remote_id, "amount": 1}
    assert not shop.payments.contract("refund").supports_void
    assert await shop.payments.lookup(
        "refund", key="r1", payload=refund, void_if_missing=True
    ) == NotFound(voided=False)
    assert isinstance(
        await shop.payments.apply("refund", key="r1", payload=refund, fence=1), Confirmed
    )


# -- business state ---------------------------------------------------------------------------


async def test_reserve_and_release_move_stock(shop: FakeShop) -> None:
    reserved = await shop.inventory.apply(
        "reserve", key="r1", payload={"sku": "sku-1", "quantity": 4}, fence=1
    )
    assert isinstance(reserved, Confirmed)
    assert reserved.result == {"reservation_id": reserved.remote_id, "sku": "sku-1", "quantity": 4}
    assert await shop.stock("sku-1") == 6
    release = {"reservation_id": reserved.remote_id}
    released = await shop.inventory.apply("release", key="rel1", payload=release, fence=1)
    assert isinstance(released, Confirmed)
    assert released.result == {
        "release_id": released.remote_id,
        "reservation_id": reserved.remote_id,
    }
    assert await shop.stock("sku-1") == 10
    # Same key replays; a different key for the same reservation is refused.
    assert await shop.inventory.apply("release", key="rel1", payload=release, fence=1) == released
    assert await shop.inventory.apply("release", key="rel2", payload=release, fence=1) == Rejected(
        "already_released"
    )
    assert await shop.inventory.apply(
        "release", key="rel3", payload={"reservation_id": "res_nope"}, fence=1
    ) == Rejected("unknown_reservation")
    assert await shop.stock("sku-1") == 10
    assert await shop.counts() == expect(inventory_reserve=1, inventory_release=1)
    with pytest.raises(KeyError):
        await shop.stock("sku-404")


async def test_out_of_stock_is_a_definite_and_remembered_rejection(shop: FakeShop) -> None:
    payload = {"sku": "sku-1", "quantity": 11}
    assert await shop.inventory.apply("reserve", key="r1", payload=payload, fence=1) == Rejected(
        "out_of_stock"
    )
    assert await shop.stock("sku-1") == 10
    await shop.seed_stock({"sku-1": 50})
    # Rejected means "will not perform this effect for this key", even after a restock.
    assert await shop.inventory.apply("reserve", key="r1", payload=payload, fence=1) == Rejected(
        "out_of_stock"
    )
    assert await shop.stock("sku-1") == 50
    assert await shop.counts() == no_effects()
    assert await shop.reservations() == []
    lookup = await shop.inventory.lookup("reserve", key="r1", payload=payload)
    assert lookup == NotFound(voided=True)
    unknown = await shop.inventory.apply(
        "reserve", key="r2", payload={"sku": "sku-404", "quantity": 1}, fence=1
    )
    assert unknown == Rejected("unknown_sku")


async def test_charge_refund_and_over_refund(shop: FakeShop) -> None:
    declined = await shop.payments.apply(
        "charge", key="c0", payload={**CHARGE, "card": "declined"}, fence=1
    )
    assert declined == Rejected("card_declined")
    charged = await shop.payments.apply("charge", key="c1", payload=CHARGE, fence=1)
    assert isinstance(charged, Confirmed)
    part = {"charge_id": charged.remote_id, "amount": 700}
    refunded = await shop.payments.apply("refund", key="f1", payload=part, fence=1)
    assert isinstance(refunded, Confirmed)
    assert refunded.result == {"refund_id": refunded.remote_id, **part}
    assert await shop.payments.apply("refund", key="f2", payload=part, fence=1) == Rejected(
        "over_refund"
    )
    rest = {"charge_id": charged.remote_id, "amount": 500}
    assert isinstance(
        await shop.payments.apply("refund", key="f3", payload=rest, fence=1), Confirmed
    )
    ghost = {"charge_id": "ch_ghost", "amount": 1}
    assert await shop.payments.apply("refund", key="f4", payload=ghost, fence=1) == Rejected(
        "unknown_charge"
    )
    wrong = {**rest, "currency": "USD"}
    assert await shop.payments.apply("refund", key="f5", payload=wrong, fence=1) == Rejected(
        "currency_mismatch"
    )
    [charge] = await shop.charges()
    assert (charge["amount"], charge["refunded"]) == (1200, 1200)
    assert await shop.counts() == expect(payments_charge=1, payments_refund=2)


async def test_send_records_the_email(shop: FakeShop) -> None:
    sent = await shop.email.apply(
        "send", key="m1", payload={"to": "ann@example.com", "template": "receipt"}, fence=1
    )
    assert isinstance(sent, Confirmed) and sent.result == {"message_id": sent.remote_id}
    [email] = await shop.emails()
    assert (email["to"], email["template"], email["key"]) == ("ann@example.com", "receipt", "m1")


async def test_counts_live_in_the_database(db_urls: Any, shop: FakeShop) -> None:
    await shop.payments.apply("charge", key="c1", payload=CHARGE, fence=1)
    await shop.inventory.apply(
        "reserve", key="r1", payload={"sku": "sku-1", "quantity": 1}, fence=1
    )
    await shop.email.apply("send", key="m1", payload={"to": "a@b", "template": "t"}, fence=1)
    async with await FakeShop.open(db_urls.provider) as second:
        assert await second.counts() == expect(payments_charge=1, inventory_reserve=1, email_send=1)
        assert await second.stock("sku-1") == 9
        # The second shop also shares the idempotency cache.
        replay = await second.payments.apply("charge", key="c1", payload=CHARGE, fence=1)
        assert isinstance(replay, Confirmed)
        assert len(await second.calls()) == 4
    assert await shop.counts() == expect(payments_charge=1, inventory_reserve=1, email_send=1)


# -- faults -----------------------------------------------------------------------------------


async def test_lose_response_commits_the_effect(shop: FakeShop) -> None:
    shop.faults.add(FaultRule(FaultKind.LOSE_RESPONSE, provider="payments"))
    with pytest.raises(ResponseLost):
        await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    assert await shop.counts() == expect(payments_charge=1)
    found = await shop.payments.lookup("charge", key="k1", payload=CHARGE)
    assert isinstance(found, Found)
    assert await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1) == Confirmed(
        found.remote_id, found.result
    )
    assert shop.faults.fired == {FaultKind.LOSE_RESPONSE: 1}
    [first, *_] = await shop.calls("k1")
    assert (first.outcome, first.fault, first.created_effect) == (
        "lost_response",
        "lose_response",
        True,
    )


async def test_fail_before_applies_nothing(shop: FakeShop) -> None:
    shop.faults.add(FaultRule(FaultKind.FAIL_BEFORE, action="charge"))
    with pytest.raises(ProviderUnavailable):
        await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    assert await shop.counts() == no_effects()
    assert await shop.payments.lookup("charge", key="k1", payload=CHARGE) == NotFound()
    assert isinstance(
        await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1), Confirmed
    )
    assert [c.outcome for c in await shop.calls("k1")] == ["unavailable", "not_found", "confirmed"]


async def test_injected_rejection_has_no_effect(shop: FakeShop) -> None:
    shop.faults.add(FaultRule(FaultKind.REJECT, key="k1"))
    assert await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1) == Rejected(
        "injected_rejection"
    )
    assert await shop.counts() == no_effects()
    assert await shop.charges() == []
    # Definite: the key keeps its rejection.
    assert await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1) == Rejected(
        "injected_rejection"
    )


async def test_injected_rejection_never_hides_an_existing_effect(shop: FakeShop) -> None:
    done = await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    shop.faults.add(FaultRule(FaultKind.REJECT))
    assert await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1) == done


@pytest.mark.parametrize("effect_first", [True, False])
async def test_timeout_is_cut_by_the_callers_deadline(shop: FakeShop, effect_first: bool) -> None:
    shop.faults.add(FaultRule(FaultKind.TIMEOUT, delay_s=30.0, effect_first=effect_first))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(
            shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1), timeout=0.3
        )
    expected = expect(payments_charge=1) if effect_first else no_effects()
    assert await shop.counts() == expected
    assert shop.faults.fired == {FaultKind.TIMEOUT: 1}


@contextlib.asynccontextmanager
async def _shop_held(db_urls: Any, key: str) -> AsyncIterator[None]:
    """Another client of the shop database holds what an apply of ``key`` must wait for (the
    file's write lock on SQLite, the key's advisory lock on PostgreSQL) until the block ends;
    the apply started in the block is then waiting inside the shop's transaction."""
    url = make_url(db_urls.provider)
    if db_urls.backend == "sqlite":
        holder = sqlite3.connect(str(url.database), isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            yield
            holder.execute("ROLLBACK")
        finally:
            holder.close()
        return
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            await conn.execute(
                text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": f"payments:{key}"}
            )
            yield
            await conn.rollback()
    finally:
        await engine.dispose()


async def _until_waiting(db_urls: Any) -> None:
    """Until the apply waits on the held lock (PostgreSQL shows it; SQLite's busy handler does
    not, so there the test gives it a moment: the verdict does not depend on it, since the
    caller is cancelled before the held lock lets the shop commit either way)."""
    if db_urls.backend == "sqlite":
        await asyncio.sleep(0.2)
        return
    engine = create_async_engine(make_url(db_urls.provider))
    waiting = text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
    try:
        async with engine.connect() as conn:
            for _ in range(1000):
                if (await conn.execute(waiting)).scalar_one():
                    return
                await asyncio.sleep(0.01)
        raise AssertionError("the apply never waited on the held lock")
    finally:
        await engine.dispose()


async def test_a_call_whose_caller_gave_up_still_lands(db_urls: Any, shop: FakeShop) -> None:
    # A client's timeout does not reach into a real provider's database: the request that got
    # there finishes there. Cut short instead, SQLite kept the cancelled statement's write lock
    # until garbage collection (the shop's store, ``Store.call``).
    async with _shop_held(db_urls, "k1"):
        caller = asyncio.create_task(
            shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
        )
        await _until_waiting(db_urls)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
    await shop.settle()
    assert await shop.counts() == expect(payments_charge=1)
    assert [(c.outcome, c.created_effect) for c in await shop.calls("k1")] == [("confirmed", True)]


@pytest.fixture
def no_gc() -> Iterator[None]:
    """The garbage collector off: a connection left locked until it runs stays locked."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_gc")
async def test_callers_cut_at_any_point_leave_every_call_landed(shop: FakeShop) -> None:
    # Deadlines from 0 to 4 ms cut callers before, inside and after the shop's statements. On
    # SQLite a statement cut inside aiosqlite left its connection's write lock held (with the
    # collector off, for good): every later write waited out the 30 s busy timeout.
    async def give_up_early(i: int) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(random.Random(i).uniform(0.0, 0.004)):
                await shop.payments.apply("charge", key=f"k{i}", payload=CHARGE, fence=1)

    for first in range(0, 40, 8):
        await asyncio.gather(*(give_up_early(i) for i in range(first, first + 8)))
    await shop.settle()
    assert await shop.counts() == expect(payments_charge=40)
    assert sorted(c.key for c in await shop.calls()) == sorted(f"k{i}" for i in range(40))


async def test_short_timeout_still_answers(shop: FakeShop) -> None:
    shop.faults.add(FaultRule(FaultKind.TIMEOUT, delay_s=0.01))
    assert isinstance(
        await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1), Confirmed
    )


@pytest.mark.parametrize("applied", [True, False])
async def test_indeterminate_5xx(shop: FakeShop, applied: bool) -> None:
    shop.faults.add(FaultRule(FaultKind.INDETERMINATE_5XX, applied=applied))
    outcome = await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    assert outcome == Unknown("http 503")
    assert await shop.counts() == (expect(payments_charge=1) if applied else no_effects())
    lookup = await shop.payments.lookup("charge", key="k1", payload=CHARGE)
    assert isinstance(lookup, Found) is applied
    assert (await shop.calls("k1"))[0].outcome == "unknown:http 503"


async def test_lookup_unavailable(shop: FakeShop) -> None:
    await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    shop.faults.add(FaultRule(FaultKind.LOOKUP_UNAVAILABLE, times=2))
    for _ in range(2):
        outcome = await shop.payments.lookup(
            "charge", key="k1", payload=CHARGE, void_if_missing=True
        )
        assert outcome == Unavailable("injected")
    assert isinstance(await shop.payments.lookup("charge", key="k1", payload=CHARGE), Found)


async def test_keys_are_remembered_past_the_window_without_forget_keys(
    shop: FakeShop, clock: Clock
) -> None:
    first = await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    clock.now += WINDOW * 10
    assert await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1) == first
    assert await shop.counts() == expect(payments_charge=1)


async def test_forget_keys_makes_a_reapply_a_second_effect(shop: FakeShop, clock: Clock) -> None:
    shop.faults.add(FaultRule(FaultKind.FORGET_KEYS, times=None))
    first = await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    assert isinstance(first, Confirmed)
    # Inside the window the key is still remembered, and the rule does not fire.
    clock.now += WINDOW - 1
    assert await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1) == first
    assert not shop.faults.fired
    clock.now += 2
    assert await shop.payments.lookup("charge", key="k1", payload=CHARGE) == NotFound()
    second = await shop.payments.apply("charge", key="k1", payload=CHARGE, fence=1)
    assert isinstance(second, Confirmed) and second.remote_id != first.remote_id
    # The double charge the engine must avoid, visible in the provider's own tables.
    assert await shop.counts() == expect(payments_charge=2)
    assert len(await shop.charges()) == 2
    assert shop.faults.fired == {FaultKind.FORGET_KEYS: 1}


async def test_forget_keys_on_apply_without_prior_lookup(db_urls: Any, clock: Clock) -> None:
    plan = FaultPlan([FaultRule(FaultKind.FORGET_KEYS, provider="inventory")])
    async with await FakeShop.open(
        db_urls.provider, faults=plan, clock=clock, dedup_window_seconds=60
    ) as shop:
        await shop.seed_stock({"sku-1": 5})
        payload = {"sku": "sku-1", "quantity": 2}
        await shop.inventory.apply("reserve", key="r1", payload=payload, fence=1)
        clock.now += 61
        again = await shop.inventory.apply("reserve", key="r1", payload=payload, fence=1)
        assert isinstance(again, Confirmed)
        assert await shop.stock("sku-1") == 1
        assert await shop.counts() == expect(inventory_reserve=2)
        # times=1 is spent: the new entry is remembered from now on.
        clock.now += 61
        assert await shop.inventory.apply("reserve", key="r1", payload=payload, fence=1) == again
        statuses = [(e.status, e.forgotten_at is not None) for e in await shop.effects("reserve")]
        assert statuses == [("applied", True), ("applied", False)]


async def test_stock_takes_the_columns_whole_range_and_no_more(shop: FakeShop) -> None:
    """Past the 32-bit INTEGER column the driver failed, printing the SQL and its parameters
    on PostgreSQL (from 2**31 on); SQLite took more, or raised OverflowError past 64 bits."""
    await shop.seed_stock({"sku-big": MAX_STOCK})
    assert await shop.stock("sku-big") == MAX_STOCK
    with pytest.raises(ValueError, match=f"stock of 'sku-big' cannot be above {MAX_STOCK}"):
        await shop.seed_stock({"sku-1": 3, "sku-big": MAX_STOCK + 1})
    # One transaction: nothing of the refused levels was written.
    assert (await shop.stock("sku-1"), await shop.stock("sku-big")) == (10, MAX_STOCK)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite+aiosqlite://", "needs a SQLite file, not an in-memory database"),
        ("sqlite:///:memory:", "needs a SQLite file, not an in-memory database"),
        ("mysql://u@db.example/shop", "unsupported database for the fake shop: 'mysql'"),
    ],
)
async def test_a_database_the_shop_cannot_keep_is_a_shop_database_error(
    url: str, message: str
) -> None:
    """A type of its own, so that the commands that open a shop can say it in one line (it was
    a bare ValueError, a traceback); still a ValueError for callers that catch that."""
    with pytest.raises(ShopDatabaseError, match=message) as raised:
        await FakeShop.open(url)
    assert isinstance(raised.value, ValueError)
