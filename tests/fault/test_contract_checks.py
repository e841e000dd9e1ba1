"""The provider contract checks pass on an honest provider and catch dishonest ones."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fault_injection.contract_checks import ContractCheck, check_provider_contract
from providers.contract import ActionContract, ApplyOutcome, LookupOutcome, Provider
from providers.fake.faults import FaultKind, FaultPlan, FaultRule
from providers.fake.shop import FakeShop
from tests.conftest import DbUrls

CHARGE = {"amount": 100, "currency": "EUR"}


class Liar:
    """Wraps a provider; can forget keys (new key per call), ignore fences, or overstate its
    dedup window."""

    def __init__(
        self,
        inner: Provider,
        *,
        new_key_each_call: bool = False,
        ignore_fence: bool = False,
        claimed_window: float | None = None,
    ) -> None:
        self.inner = inner
        self.new_key_each_call = new_key_each_call
        self.ignore_fence = ignore_fence
        self.claimed_window = claimed_window
        self.calls = 0

    @property
    def name(self) -> str:
        return self.inner.name

    def contract(self, action: str) -> ActionContract:
        c = self.inner.contract(action)
        if self.claimed_window is not None:
            c = dataclasses.replace(c, dedup_window_seconds=self.claimed_window)
        return c

    def actions(self) -> Mapping[str, ActionContract]:
        return self.inner.actions()

    async def apply(
        self, action: str, *, key: str, payload: Mapping[str, Any], fence: int
    ) -> ApplyOutcome:
        self.calls += 1
        if self.new_key_each_call:
            key = f"{key}-{self.calls}"
        if self.ignore_fence:
            fence = 10**6 + self.calls  # always "newer": the provider never sees a stale one
        return await self.inner.apply(action, key=key, payload=payload, fence=fence)

    async def lookup(
        self, action: str, *, key: str, payload: Mapping[str, Any], void_if_missing: bool = False
    ) -> LookupOutcome:
        return await self.inner.lookup(action, key=key, payload=payload)


def _failed(checks: list[ContractCheck]) -> set[str]:
    return {c.name for c in checks if not c.passed}


async def test_honest_fake_passes_every_check(db_urls: DbUrls) -> None:
    now = [1_000_000.0]
    shop = await FakeShop.open(
        db_urls.provider,
        clock=lambda: now[0],
        faults=FaultPlan([FaultRule(FaultKind.FORGET_KEYS, times=None)]),
        dedup_window_seconds=3600,
    )

    def advance(seconds: float) -> None:
        now[0] += seconds

    try:
        checks = await check_provider_contract(
            shop.payments,
            "charge",
            CHARGE,
            other_payload={**CHARGE, "amount": 999},
            advance_clock=advance,
        )
        assert _failed(checks) == set(), checks
        assert not any(c.skipped for c in checks)
        assert (await shop.counts())["payments.charge"] == 2  # one per fresh key, never doubled
    finally:
        await shop.close()


async def test_dishonest_providers_are_caught(db_urls: DbUrls) -> None:
    now = [1_000_000.0]
    shop = await FakeShop.open(
        db_urls.provider,
        clock=lambda: now[0],
        faults=FaultPlan([FaultRule(FaultKind.FORGET_KEYS, times=None)]),
        dedup_window_seconds=60,
    )

    def advance(seconds: float) -> None:
        now[0] += seconds

    try:
        forgetful = await check_provider_contract(
            Liar(shop.payments, new_key_each_call=True),
            "charge",
            CHARGE,
            other_payload={**CHARGE, "amount": 999},
        )
        assert "same key + same payload deduplicates" in _failed(forgetful)
        assert "same key + different payload is rejected" in _failed(forgetful)
        unfenced = await check_provider_contract(
            Liar(shop.payments, ignore_fence=True), "charge", CHARGE
        )
        assert _failed(unfenced) == {"a lower fence is refused"}
        boastful = await check_provider_contract(
            Liar(shop.payments, claimed_window=86_400), "charge", CHARGE, advance_clock=advance
        )
        assert _failed(boastful) == {"key kept for the declared dedup window"}
    finally:
        await shop.close()
