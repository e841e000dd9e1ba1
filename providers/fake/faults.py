"""Fault plans for the fake shop: which call misbehaves, how, and how often.

A :class:`FaultPlan` is an ordered list of :class:`FaultRule`. Before each call the shop asks
:meth:`FaultPlan.match` for a rule; the first rule that selects the call and still has uses left
wins, consumes one use and is counted in :attr:`FaultPlan.fired`. Rules are frozen; their use
counters live in the plan, so one rule object can be reused across plans.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

CallKind = Literal["apply", "lookup"]
_CALLS: frozenset[str] = frozenset({"apply", "lookup"})


class FaultKind(StrEnum):
    """The ways a fake provider call can go wrong."""

    #: The effect commits, then the call raises :class:`ResponseLost`.
    LOSE_RESPONSE = "lose_response"
    #: The call raises :class:`ProviderUnavailable` before anything is applied.
    FAIL_BEFORE = "fail_before"
    #: The call answers ``Rejected("injected_rejection")`` and performs no effect.
    REJECT = "reject"
    #: The answer is delayed by ``delay_s`` (after the effect, or before it with
    #: ``effect_first=False``); the caller's own timeout is what cuts it.
    TIMEOUT = "timeout"
    #: The effect is applied if ``applied`` is true, then the call answers ``Unknown("http 503")``.
    INDETERMINATE_5XX = "indeterminate_5xx"
    #: Lookups answer ``Unavailable("injected")``.
    LOOKUP_UNAVAILABLE = "lookup_unavailable"
    #: Keys older than the dedup window are forgotten, as a provider pruning its idempotency
    #: cache would: a re-apply performs a NEW effect and lookup answers ``NotFound``. Consulted
    #: only when the key's entry really is older than the window.
    FORGET_KEYS = "forget_keys"
    #: Reserved for webhook delivery (deliver a callback twice). Not used yet: it matches no
    #: apply or lookup, so it never fires.
    DUPLICATE_DELIVERY = "duplicate_delivery"


#: Which call each kind can affect.
_APPLIES_TO: dict[FaultKind, frozenset[str]] = {
    FaultKind.LOSE_RESPONSE: frozenset({"apply"}),
    FaultKind.FAIL_BEFORE: frozenset({"apply"}),
    FaultKind.REJECT: frozenset({"apply"}),
    FaultKind.TIMEOUT: frozenset({"apply"}),
    FaultKind.INDETERMINATE_5XX: frozenset({"apply"}),
    FaultKind.LOOKUP_UNAVAILABLE: frozenset({"lookup"}),
    FaultKind.FORGET_KEYS: frozenset({"apply", "lookup"}),
    FaultKind.DUPLICATE_DELIVERY: frozenset(),
}


class ResponseLost(ConnectionError):
    """The provider performed the call but its answer never arrived (injected)."""


class ProviderUnavailable(ConnectionError):
    """The provider refused the call before doing anything (injected)."""


@dataclass(frozen=True, slots=True)
class FaultRule:
    """One fault: its kind, which calls it selects (``None`` = any) and how often it fires."""

    kind: FaultKind
    provider: str | None = None
    action: str | None = None
    key: str | None = None
    #: How many times the rule fires; ``None`` = forever.
    times: int | None = 1
    #: Let the first ``skip`` calls this rule selects through untouched.
    skip: int = 0
    #: TIMEOUT: how long the answer is held back, in seconds.
    delay_s: float = 10.0
    #: INDETERMINATE_5XX: whether the effect is applied before the 503.
    applied: bool = True
    #: TIMEOUT: apply first and delay the answer (``True``) or delay before applying.
    effect_first: bool = True

    def __post_init__(self) -> None:
        if self.times is not None and self.times < 0:
            raise ValueError(f"times must be >= 0 or None, not {self.times}")
        if self.skip < 0:
            raise ValueError(f"skip must be >= 0, not {self.skip}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, not {self.delay_s}")

    def selects(self, call: CallKind, provider: str, action: str, key: str) -> bool:
        """True if this rule's kind and filters cover the call (use counts aside)."""
        return (
            call in _APPLIES_TO[self.kind]
            and self.provider in (None, provider)
            and self.action in (None, action)
            and self.key in (None, key)
        )


class FaultPlan:
    """An ordered, mutable set of fault rules with per-rule use counters.

    ``match`` never awaits, so it is atomic on one event loop; a lock also makes it safe when
    tests drive the plan from another thread.
    """

    def __init__(self, rules: Iterable[FaultRule] = ()) -> None:
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = []
        # Parallel to _rules: calls each rule selected, and times it fired.
        self._seen: list[int] = []
        self._used: list[int] = []
        #: Faults actually injected, by kind.
        self.fired: Counter[FaultKind] = Counter()
        for rule in rules:
            self.add(rule)

    @property
    def rules(self) -> tuple[FaultRule, ...]:
        """The rules in match order."""
        with self._lock:
            return tuple(self._rules)

    def add(self, rule: FaultRule) -> FaultRule:
        """Append ``rule`` (it matches after every rule added before it); returns it."""
        with self._lock:
            self._rules.append(rule)
            self._seen.append(0)
            self._used.append(0)
        return rule

    def clear(self) -> None:
        """Drop every rule and reset :attr:`fired`."""
        with self._lock:
            self._rules.clear()
            self._seen.clear()
            self._used.clear()
            self.fired.clear()

    def remaining(self, rule: FaultRule) -> int | None:
        """Uses left for the first occurrence of ``rule`` (``None`` = unlimited)."""
        with self._lock:
            index = self._rules.index(rule)
            if rule.times is None:
                return None
            return max(rule.times - self._used[index], 0)

    def match(
        self,
        call: CallKind,
        provider: str,
        action: str,
        key: str,
        *,
        kinds: Collection[FaultKind] | None = None,
    ) -> FaultRule | None:
        """The rule to inject for this call, consuming one of its uses; ``None`` if none.

        Every rule that selects the call counts it towards its own ``skip``, whether or not an
        earlier rule fires, so a rule's behaviour does not depend on its neighbours. ``kinds``
        limits which rules are consulted (the shop asks for FORGET_KEYS separately, only when
        a key really is past the dedup window).
        """
        if call not in _CALLS:
            raise ValueError(f"call must be 'apply' or 'lookup', not {call!r}")
        with self._lock:
            chosen: FaultRule | None = None
            for index, rule in enumerate(self._rules):
                if kinds is not None and rule.kind not in kinds:
                    continue
                if not rule.selects(call, provider, action, key):
                    continue
                self._seen[index] += 1
                if chosen is not None or self._seen[index] <= rule.skip:
                    continue
                if rule.times is not None and self._used[index] >= rule.times:
                    continue
                self._used[index] += 1
                self.fired[rule.kind] += 1
                chosen = rule
            return chosen

    def __repr__(self) -> str:
        return f"FaultPlan(rules={self.rules!r}, fired={dict(self.fired)!r})"


__all__ = [
    "CallKind",
    "FaultKind",
    "FaultPlan",
    "FaultRule",
    "ProviderUnavailable",
    "ResponseLost",
]
