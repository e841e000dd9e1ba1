"""FaultPlan matching: filters, wildcards, times, skip, call kinds and the fired counter."""

from __future__ import annotations

import pytest

from providers.fake.faults import FaultKind, FaultPlan, FaultRule


def test_empty_plan_matches_nothing() -> None:
    plan = FaultPlan()
    assert plan.match("apply", "payments", "charge", "k1") is None
    assert not plan.fired


def test_default_rule_fires_once_then_is_spent() -> None:
    plan = FaultPlan()
    rule = plan.add(FaultRule(FaultKind.LOSE_RESPONSE))
    assert plan.match("apply", "payments", "charge", "k1") is rule
    assert plan.remaining(rule) == 0
    assert plan.match("apply", "payments", "charge", "k1") is None
    assert plan.fired == {FaultKind.LOSE_RESPONSE: 1}


def test_none_fields_are_wildcards_and_set_fields_filter() -> None:
    plan = FaultPlan()
    rule = plan.add(FaultRule(FaultKind.REJECT, provider="payments", times=None))
    assert plan.match("apply", "inventory", "reserve", "k") is None
    assert plan.match("apply", "payments", "charge", "any") is rule
    assert plan.match("apply", "payments", "refund", "other") is rule

    keyed = FaultPlan([FaultRule(FaultKind.REJECT, action="charge", key="k7", times=None)])
    assert keyed.match("apply", "payments", "charge", "k6") is None
    assert keyed.match("apply", "payments", "refund", "k7") is None
    assert keyed.match("apply", "payments", "charge", "k7") is not None


def test_times_counts_uses_and_none_is_forever() -> None:
    plan = FaultPlan([FaultRule(FaultKind.REJECT, times=2)])
    hits = [plan.match("apply", "p", "a", f"k{i}") for i in range(4)]
    assert [h is not None for h in hits] == [True, True, False, False]

    forever = FaultPlan([FaultRule(FaultKind.REJECT, times=None)])
    assert all(forever.match("apply", "p", "a", "k") for _ in range(50))
    assert forever.fired[FaultKind.REJECT] == 50
    assert forever.remaining(forever.rules[0]) is None


def test_times_zero_never_fires() -> None:
    plan = FaultPlan([FaultRule(FaultKind.REJECT, times=0)])
    assert plan.match("apply", "p", "a", "k") is None


def test_skip_lets_the_first_matching_calls_through() -> None:
    plan = FaultPlan([FaultRule(FaultKind.FAIL_BEFORE, key="k", skip=2)])
    # Calls for other keys do not count towards the skip.
    assert plan.match("apply", "p", "a", "other") is None
    assert plan.match("apply", "p", "a", "k") is None
    assert plan.match("apply", "p", "a", "k") is None
    assert plan.match("apply", "p", "a", "k") is not None
    assert plan.match("apply", "p", "a", "k") is None
    assert plan.fired == {FaultKind.FAIL_BEFORE: 1}


def test_first_rule_wins_but_every_selecting_rule_counts_the_call() -> None:
    first = FaultRule(FaultKind.LOSE_RESPONSE)
    second = FaultRule(FaultKind.REJECT, skip=1)
    plan = FaultPlan([first, second])
    # Call 1: first fires; second counts it towards its skip of 1.
    assert plan.match("apply", "p", "a", "k") is first
    # Call 2: first is spent, second has skipped one call already and fires.
    assert plan.match("apply", "p", "a", "k") is second
    assert plan.match("apply", "p", "a", "k") is None
    assert plan.fired == {FaultKind.LOSE_RESPONSE: 1, FaultKind.REJECT: 1}


def test_call_kinds() -> None:
    plan = FaultPlan(
        [
            FaultRule(FaultKind.LOOKUP_UNAVAILABLE, times=None),
            FaultRule(FaultKind.TIMEOUT, times=None),
        ]
    )
    assert plan.match("lookup", "p", "a", "k") is not None
    assert plan.match("lookup", "p", "a", "k") == FaultRule(
        FaultKind.LOOKUP_UNAVAILABLE, times=None
    )
    assert plan.match("apply", "p", "a", "k") == FaultRule(FaultKind.TIMEOUT, times=None)

    forget = FaultPlan([FaultRule(FaultKind.FORGET_KEYS, times=None)])
    assert forget.match("apply", "p", "a", "k") is not None
    assert forget.match("lookup", "p", "a", "k") is not None


def test_duplicate_delivery_is_reserved_and_never_fires() -> None:
    plan = FaultPlan([FaultRule(FaultKind.DUPLICATE_DELIVERY, times=None)])
    assert plan.match("apply", "p", "a", "k") is None
    assert plan.match("lookup", "p", "a", "k") is None
    assert not plan.fired


def test_kinds_filter_consults_only_those_rules() -> None:
    plan = FaultPlan([FaultRule(FaultKind.FORGET_KEYS), FaultRule(FaultKind.LOSE_RESPONSE, skip=1)])
    hit = plan.match("apply", "p", "a", "k", kinds={FaultKind.LOSE_RESPONSE})
    # Filtered out rules neither fire nor count the call: LOSE_RESPONSE skipped this one.
    assert hit is None
    assert plan.remaining(plan.rules[0]) == 1
    assert plan.match("apply", "p", "a", "k", kinds={FaultKind.FORGET_KEYS}) == plan.rules[0]


def test_clear_drops_rules_and_counter() -> None:
    plan = FaultPlan([FaultRule(FaultKind.REJECT, times=None)])
    assert plan.match("apply", "p", "a", "k") is not None
    plan.clear()
    assert plan.rules == ()
    assert not plan.fired
    assert plan.match("apply", "p", "a", "k") is None


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="times"):
        FaultRule(FaultKind.REJECT, times=-1)
    with pytest.raises(ValueError, match="skip"):
        FaultRule(FaultKind.REJECT, skip=-1)
    with pytest.raises(ValueError, match="delay_s"):
        FaultRule(FaultKind.TIMEOUT, delay_s=-0.5)
    with pytest.raises(ValueError, match="call"):
        FaultPlan().match("delete", "p", "a", "k")  # type: ignore[arg-type]


def test_rules_are_frozen() -> None:
    rule = FaultRule(FaultKind.REJECT)
    with pytest.raises(AttributeError):
        rule.times = 5  # type: ignore[misc]
