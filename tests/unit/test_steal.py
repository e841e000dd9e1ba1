"""The stolen share of CPU time the bench prints beside each half of a DBOS pair."""

from __future__ import annotations

from pathlib import Path

import pytest

from fault_injection.steal import (
    CpuTimes,
    alike,
    parse_cpu_line,
    read_cpu_times,
    steal_caution,
    stolen_share,
)

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


def test_no_caution_below_the_share_or_without_readings() -> None:
    assert steal_caution([0.0, 0.049, None], of="halves") is None
    assert steal_caution([]) is None
    assert steal_caution([None]) is None


def test_a_run_alone_names_its_share() -> None:
    caution = steal_caution([0.3])
    assert caution is not None
    assert caution.startswith("the hypervisor took 30% of the machine's CPU in this run:")


def test_halves_name_the_range_and_how_many_of_them_reached_it() -> None:
    caution = steal_caution([0.13, 0.01, 0.34, None, 0.2], of="halves")
    assert caution is not None
    # The unread half is not counted among the halves; the quiet one is, outside the range.
    assert caution.startswith("the hypervisor took 13% to 34% of the machine's CPU in 3 of 4")
    one = steal_caution([0.01, 0.07], of="halves")
    assert one is not None and "took 7% of the machine's CPU in 1 of 2 halves:" in one


def test_halves_are_alike_within_five_points_and_only_when_both_were_read() -> None:
    assert alike(0.30, 0.26) and alike(0.0, 0.0)
    assert not alike(0.07, 0.01)
    assert not alike(None, 0.0) and not alike(0.0, None)
