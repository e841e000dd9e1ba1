"""Greedy delta debugging of a failing schedule down to a minimal one that still fails.

Candidates are the schedule with one part taken away or made simpler: the paused worker, the
crash, one saga, one fault, all workers but one, the extra recovery round, the aged clock, a
fault's skip or its "forever", the crash's position filter, the caller's budget. The first
candidate that still fails becomes the new best and the search restarts from it; the search
ends when no candidate fails (a local minimum) or the run budget is spent.

Every candidate runs through ``attempt`` — in :func:`fault_injection.schedules.run_random`, on a
fresh database pair — so rows of earlier runs can neither mask a failure nor fake one. A
candidate "still fails" only if it breaks one of the invariants the original broke (or, for a
failure without violations, fails at all): shrinking must not wander off to another bug.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fault_injection.results import ScenarioResult

if TYPE_CHECKING:  # schedules imports this module at run time
    from fault_injection.schedules import Schedule

__all__ = ["Shrunk", "candidates", "shrink"]

#: A failing schedule re-runs at most this many times while it is shrunk.
MAX_RUNS = 60

Attempt = Callable[["Schedule"], Awaitable[ScenarioResult]]


@dataclass
class Shrunk:
    """The smallest failing schedule found, its failing result and the runs it took."""

    schedule: Schedule
    result: ScenarioResult
    runs: int
    #: The original failed again on a fresh database pair (False: it needs history to fail).
    reproduced: bool


def _signature(result: ScenarioResult) -> set[str]:
    found = {str(v.invariant) for v in result.violations}
    return found or {"error"}


def _still_fails(result: ScenarioResult, wanted: set[str]) -> bool:
    return not result.passed and bool(_signature(result) & wanted)


def _drop_saga(s: Schedule, i: int) -> Schedule:
    def moved(n: int) -> int:
        return n - 1 if n > i else n

    crash = s.crash
    if crash is not None:
        crash = None if crash.saga == i else replace(crash, saga=moved(crash.saga))
    pause = s.pause
    if pause is not None:
        pause = None if pause.saga == i else replace(pause, saga=moved(pause.saga))
    return replace(s, sagas=s.sagas[:i] + s.sagas[i + 1 :], crash=crash, pause=pause)


def candidates(s: Schedule) -> Iterator[Schedule]:
    """Simpler variants of ``s``, biggest cuts first; each is strictly smaller or simpler."""
    if s.pause is not None:
        yield replace(s, pause=None)
    if s.crash is not None:
        yield replace(s, crash=None)
    if len(s.sagas) > 1:
        for i in range(len(s.sagas)):
            yield _drop_saga(s, i)
    for i in range(len(s.faults)):
        yield replace(s, faults=s.faults[:i] + s.faults[i + 1 :])
    if s.workers > 1:
        yield replace(s, workers=1)
    if s.rounds > 1:
        yield replace(s, rounds=1)
    if s.aged:
        yield replace(s, aged=False)
    for i, f in enumerate(s.faults):
        if f.times is None:
            yield replace(s, faults=(*s.faults[:i], replace(f, times=1), *s.faults[i + 1 :]))
        if f.skip:
            yield replace(s, faults=(*s.faults[:i], replace(f, skip=0), *s.faults[i + 1 :]))
    if s.crash is not None and s.crash.where:
        yield replace(s, crash=replace(s.crash, where=()))
    if s.budget_s:
        yield replace(s, budget_s=0.0)


async def shrink(
    schedule: Schedule,
    failure: ScenarioResult,
    attempt: Attempt,
    *,
    max_runs: int = MAX_RUNS,
) -> Shrunk:
    """Shrink failing ``schedule`` (whose run gave ``failure``) with greedy delta debugging."""
    wanted = _signature(failure)
    first = await attempt(schedule)
    runs = 1
    if not _still_fails(first, wanted):
        # Flaky or history-dependent: nothing to shrink against. Report the original.
        return Shrunk(schedule, failure, runs, reproduced=False)
    best, best_result = schedule, first
    improved = True
    while improved and runs < max_runs:
        improved = False
        for candidate in candidates(best):
            if runs >= max_runs:
                break
            result = await attempt(candidate)
            runs += 1
            if _still_fails(result, wanted):
                best, best_result, improved = candidate, result, True
                break
    return Shrunk(best, best_result, runs, reproduced=True)
