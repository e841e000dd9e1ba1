"""``CrashPoints.armed``: the engine's hot call sites build a hit's context only when it is
true, so it must be true exactly while some point can still fire."""

from __future__ import annotations

import pytest

from orchestrator.crashpoints import CrashPoints, SimulatedCrash


def _armed(points: CrashPoints) -> bool:
    # Read through a call: mypy would otherwise take the property's value as fixed by the
    # previous assert about it.
    return points.armed


def test_armed_while_a_point_can_still_fire() -> None:
    points = CrashPoints()
    assert not _armed(points)
    points.arm("effect.after_apply", times=2)
    assert _armed(points)
    for _ in range(2):
        assert _armed(points)
        with pytest.raises(SimulatedCrash):
            points.hit("effect.after_apply", name="charge")
    assert not _armed(points)  # spent: the point is gone
    assert points.hits == {"effect.after_apply": 2}


def test_a_point_that_does_not_match_stays_armed() -> None:
    points = CrashPoints()
    points.arm("effect.before_apply", when=lambda ctx: ctx.get("name") == "charge")
    points.hit("effect.before_apply", name="reserve")
    assert _armed(points)
    with pytest.raises(SimulatedCrash):
        points.hit("effect.before_apply", name="charge")
    assert not _armed(points)


@pytest.mark.parametrize("point", [None, "record.after_commit"])
def test_disarming_clears_armed(point: str | None) -> None:
    points = CrashPoints()
    points.arm("record.after_commit", times=None)
    points.disarm(point)
    assert not _armed(points)
