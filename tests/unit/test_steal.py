"""The stolen share of CPU time the bench prints beside each half of a DBOS pair."""

from __future__ import annotations

from pathlib import Path

import pytest

from fault_injection.steal import CpuTimes, parse_cpu_line, read_cpu_times, stolen_share

STAT = """cpu  178340 0 60902 669052 7805 0 6012 43935 120 0
cpu0 89170 0 30451 334526 3902 0 3006 21967 0 0
intr 123
"""


def test_the_all_cpu_line_is_read_with_its_steal_field() -> None:
    # user nice system idle iowait irq softirq steal (guest, guest_nice are inside user, nice)
    times = parse_cpu_line(STAT)
    assert times == CpuTimes(total=178340 + 60902 + 669052 + 7805 + 6012 + 43935, steal=43935)


@pytest.mark.parametrize("text", ["cpu0 1 2 3 4 5 6 7 8\n", "cpu  1 2 3 4 5 6 7\n", ""])
def test_no_all_cpu_line_or_no_steal_field_gives_none(text: str) -> None:
    assert parse_cpu_line(text) is None


def test_the_share_is_stolen_ticks_over_all_ticks_between_two_readings() -> None:
    assert stolen_share(CpuTimes(1000, 100), CpuTimes(1400, 200)) == pytest.approx(0.25)
    assert stolen_share(CpuTimes(1000, 100), CpuTimes(1400, 100)) == 0.0
    assert stolen_share(None, CpuTimes(1400, 100)) is None
    assert stolen_share(CpuTimes(1000, 100), CpuTimes(1000, 100)) is None  # no time passed


def test_reading_a_missing_file_gives_none(tmp_path: Path) -> None:
    assert read_cpu_times(tmp_path / "absent") is None
    (tmp_path / "stat").write_text(STAT, encoding="ascii")
    assert read_cpu_times(tmp_path / "stat") == parse_cpu_line(STAT)
