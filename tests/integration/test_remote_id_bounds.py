"""A provider id longer than the ``remote_id`` column is still recorded, alike on both backends.

PostgreSQL refused a 300-character id (VARCHAR(256)) with ``ValueNotStorable`` on every retry
while the effect had happened at the provider; SQLite kept it whole. The engine now records a
bounded stand-in (prefix + SHA-256) and keeps the whole id in the result, from which templates
(``forward.remote_id``) still render it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from sqlalchemy import select

from ledger.effects import REMOTE_ID_MAX
from ledger.schema import operations, outbox
from ledger.states import EffectState, TxState
from orchestrator.engine import Orchestrator
from providers.contract import (
    FULL_REMOTE_ID_FIELD,
    ActionContract,
    ApplyOutcome,
    Confirmed,
    Found,
    JsonObject,
    LookupOutcome,
    Provider,
    Rejected,
    bounded_remote_id,
    full_remote_id,
)
from providers.fake.faults import FaultKind, FaultRule
from providers.fake.shop import FakeShop
from tests.support.sagas import order, order_saga
from tests.support.world import World, fast_settings

LONG = 300


def _long(remote_id: str) -> str:
    return (remote_id + ":" + "x" * LONG)[:LONG]


class LongIds:
    """A fake shop provider naming the effects of ``actions`` with 300-character ids.

    ``release`` accepts only the whole long id (a stand-in would be refused), so a reversal
    proves that ``forward.remote_id`` rendered the provider's real id."""

    def __init__(self, inner: Provider, actions: frozenset[str]) -> None:
        self._inner = inner
        self._long_actions = actions
        self._short: dict[str, str] = {}

    @property
    def name(self) -> str:
        return self._inner.name

    def contract(self, action: str) -> ActionContract:
        return self._inner.contract(action)

    def actions(self) -> Mapping[str, ActionContract]:
        return self._inner.actions()

    def _lengthen(self, remote_id: str) -> str:
        long_id = _long(remote_id)
        self._short[long_id] = remote_id
        return long_id

    async def apply(
        self, action: str, *, key: str, payload: JsonObject, fence: int
    ) -> ApplyOutcome:
        if action == "release":
            short = self._short.get(str(payload.get("reservation_id")))
            if short is None:
                return Rejected("unknown_reservation")
            payload = {**payload, "reservation_id": short}
        outcome = await self._inner.apply(action, key=key, payload=payload, fence=fence)
        if isinstance(outcome, Confirmed) and action in self._long_actions:
            return Confirmed(self._lengthen(outcome.remote_id), outcome.result)
        return outcome

    async def lookup(
        self, action: str, *, key: str, payload: JsonObject, void_if_missing: bool = False
    ) -> LookupOutcome:
        if action == "release" and "reservation_id" in payload:
            payload = {**payload, "reservation_id": self._short.get(payload["reservation_id"])}
        answer = await self._inner.lookup(
            action, key=key, payload=payload, void_if_missing=void_if_missing
        )
        if isinstance(answer, Found) and action in self._long_actions:
            return Found(self._lengthen(answer.remote_id), answer.result)
        return answer


async def _engine(world: World) -> Orchestrator:
    shop: FakeShop = world.shop
    providers: list[Provider] = [
        LongIds(shop.inventory, frozenset({"reserve"})),
        shop.payments,
        LongIds(shop.email, frozenset({"send"})),
    ]
    orch = await Orchestrator.open(world.urls.store, providers=providers, settings=fast_settings())
    world.extra.append(orch)
    return orch


async def _receipt_row(orch: Orchestrator, tx_id: str) -> Any:
    async with orch.store.read() as conn:
        rows = await conn.execute(
            select(outbox.c.state, outbox.c.remote_id, outbox.c.result).where(
                outbox.c.tx_id == tx_id
            )
        )
        return rows.one()


async def _reserve_row(orch: Orchestrator, tx_id: str) -> Any:
    async with orch.store.read() as conn:
        rows = await conn.execute(
            select(operations.c.state, operations.c.remote_id, operations.c.result).where(
                operations.c.tx_id == tx_id, operations.c.step == "reserve"
            )
        )
        return rows.one()


def _assert_recorded_bounded(row: Any, shop_id: str) -> None:
    assert row.state == EffectState.CONFIRMED.value
    assert len(row.remote_id) <= REMOTE_ID_MAX
    assert row.remote_id == bounded_remote_id(_long(shop_id), REMOTE_ID_MAX)
    assert row.result[FULL_REMOTE_ID_FIELD] == _long(shop_id)
    assert full_remote_id(row.remote_id, row.result) == _long(shop_id)


async def test_an_over_long_id_is_recorded_and_the_saga_commits(world: World) -> None:
    orch = await _engine(world)

    result = await orch.execute(order_saga(), order("42"))
    await orch.drain(timeout_seconds=10)

    assert (await orch.result(result.tx_id)).status is TxState.COMMITTED
    counts = await world.shop.counts()
    assert (counts["inventory.reserve"], counts["email.send"]) == (1, 1)
    (reservation,) = await world.shop.effects("inventory.reserve")
    # The caller is handed the provider's whole id, by the run and by a later read alike.
    assert result.remote_ids["reserve"] == _long(reservation.remote_id)
    assert (await orch.result(result.tx_id)).remote_ids["reserve"] == _long(reservation.remote_id)
    _assert_recorded_bounded(await _reserve_row(orch, result.tx_id), reservation.remote_id)
    # The receipt's record rides on a later transaction (ledger/riders.py): bounded there too.
    await orch.store.riders.settle()
    (email,) = await world.shop.effects("email.send")
    _assert_recorded_bounded(await _receipt_row(orch, result.tx_id), email.remote_id)


async def test_an_over_long_id_found_by_lookup_is_recorded_once(world: World) -> None:
    # The answer is lost after the reservation: recovery's lookup brings the long id.
    world.shop.faults.add(
        FaultRule(FaultKind.LOSE_RESPONSE, provider="inventory", action="reserve")
    )
    orch = await _engine(world)

    result = await orch.execute(order_saga(), order("42"))
    await orch.drain(timeout_seconds=10)

    assert (await orch.result(result.tx_id)).status is TxState.COMMITTED
    assert (await world.shop.counts())["inventory.reserve"] == 1
    (reservation,) = await world.shop.effects("inventory.reserve")
    _assert_recorded_bounded(await _reserve_row(orch, result.tx_id), reservation.remote_id)


async def test_the_reversal_names_the_whole_over_long_id(world: World) -> None:
    world.shop.faults.add(FaultRule(FaultKind.REJECT, provider="payments", action="charge"))
    orch = await _engine(world)

    result = await orch.execute(order_saga(), order("42"))
    await orch.drain(timeout_seconds=10)

    assert (await orch.result(result.tx_id)).status is TxState.COMPENSATED
    counts = await world.shop.counts()
    # release accepted the whole id: a stand-in would have been refused (and parked the saga).
    assert (counts["inventory.reserve"], counts["inventory.release"]) == (1, 1)
    assert counts["payments.charge"] == 0
    (reservation,) = await world.shop.effects("inventory.reserve")
    _assert_recorded_bounded(await _reserve_row(orch, result.tx_id), reservation.remote_id)


# -- the stand-in itself -----------------------------------------------------------------------


def test_an_id_that_fits_is_kept_as_is() -> None:
    fits = "r" * REMOTE_ID_MAX
    assert bounded_remote_id(fits, REMOTE_ID_MAX) == fits
    assert full_remote_id(fits, {FULL_REMOTE_ID_FIELD: "other"}) == fits


def test_the_stand_in_is_stable_bounded_and_unique() -> None:
    a, b = "a" * 300, "a" * 299 + "b"
    assert bounded_remote_id(a, 256) == bounded_remote_id(a, 256)
    assert len(bounded_remote_id(a, 256)) == 256
    assert bounded_remote_id(a, 256) != bounded_remote_id(b, 256)
    assert bounded_remote_id(a, 256).startswith("a" * 100)


def test_a_result_field_that_does_not_match_the_stand_in_is_ignored() -> None:
    stored = bounded_remote_id("a" * 300, 256)
    assert full_remote_id(stored, {FULL_REMOTE_ID_FIELD: "b" * 300}) == stored
    assert full_remote_id(stored, {FULL_REMOTE_ID_FIELD: "a" * 300}) == "a" * 300
    assert full_remote_id(None, {}) is None


def test_a_limit_too_small_for_a_digest_is_refused() -> None:
    with pytest.raises(ValueError, match="digest"):
        bounded_remote_id("a" * 100, 10)
