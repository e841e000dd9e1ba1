"""Named crash points at every boundary of the protocol; no-ops unless armed.

The engine calls :meth:`CrashPoints.hit` at each boundary where a process could die: between
persisting an intent and calling the provider, between the provider's answer and the local
record, inside a local transaction before its commit, and so on. ``fault_injection`` arms them to
prove recovery: by default an armed point raises :class:`SimulatedCrash`, a ``BaseException`` so
no ``except Exception`` in the engine can swallow it and tidy up; a subprocess may instead arm a
point with an action that SIGKILLs itself there.

Context passed to ``hit`` (for matching a position): ``kind`` (operation / compensation /
outbox), ``name`` (step or event), ``ordinal``, ``tx_id``, ``key``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

POINTS: Final[Mapping[str, str]] = {
    "prepare.before_commit": "plan built in a local transaction that is not committed yet",
    "prepare.after_commit": "intent durable (first op claimed); no provider call yet",
    "effect.before_lookup": "claimed an op that may have been sent; lookup not asked yet",
    "effect.after_lookup": "the provider answered the lookup; the answer is not recorded",
    "effect.before_apply": "claimed; the provider has not been called",
    "effect.after_apply": "the provider answered; the answer is not recorded locally",
    "record.before_commit": "outcome (and the next claim) written but not committed",
    "record.after_commit": "outcome committed; the next call has not started",
    "commit.before_commit": "transaction commit + outbox rows written but not committed",
    "commit.after_commit": "transaction committed; outbox not dispatched",
    "compensation.after_plan": "reverse plan committed; no reversal sent",
}


class SimulatedCrash(BaseException):
    """Raised by an armed crash point: the engine must be abandoned, not cleaned up."""

    def __init__(self, point: str) -> None:
        super().__init__(f"simulated crash at {point}")
        self.point = point


@dataclass
class _Arming:
    when: Callable[[Mapping[str, Any]], bool] | None
    times: int | None
    action: Callable[[str, Mapping[str, Any]], None] | None


def _crash(point: str, _ctx: Mapping[str, Any]) -> None:
    raise SimulatedCrash(point)


@dataclass
class CrashPoints:
    """The set of armed points of one engine (injected; no module-level state)."""

    _armed: dict[str, _Arming] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)

    def arm(
        self,
        point: str,
        *,
        when: Callable[[Mapping[str, Any]], bool] | None = None,
        times: int | None = 1,
        action: Callable[[str, Mapping[str, Any]], None] | None = None,
    ) -> None:
        """Arm ``point``: the next ``times`` hits whose context satisfies ``when`` fire ``action``
        (default: raise :class:`SimulatedCrash`)."""
        if point not in POINTS:
            raise KeyError(f"no crash point named {point!r}; known: {sorted(POINTS)}")
        self._armed[point] = _Arming(when, times, action)

    def disarm(self, point: str | None = None) -> None:
        """Disarm one point, or all."""
        if point is None:
            self._armed.clear()
        else:
            self._armed.pop(point, None)

    @property
    def armed(self) -> bool:
        """Whether any point is armed. The engine's hot call sites ask this before they build
        a hit's context: about sixteen hits a saga, each a keyword dict, on every saga of an
        engine whose points are never armed (``docs/benchmarks-log.md``, item 64)."""
        return bool(self._armed)

    def hit(self, point: str, **ctx: Any) -> None:
        """Called by the engine at ``point``; fires if armed and matching."""
        arming = self._armed.get(point)
        if arming is None:
            return
        if arming.when is not None and not arming.when(ctx):
            return
        if arming.times is not None:
            arming.times -= 1
            if arming.times <= 0:
                del self._armed[point]
        self.hits[point] = self.hits.get(point, 0) + 1
        (arming.action or _crash)(point, ctx)
