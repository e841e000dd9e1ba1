"""How much of the machine's CPU time the hypervisor gave to someone else during a run.

Why: on a virtual machine the wall clock of a CPU-bound run includes the time its virtual CPUs
were not running at all ("steal", the eighth field of ``/proc/stat``'s ``cpu`` line). On this
kind of machine that share moves from nothing to a fifth of the time within minutes, and a pair
of ``agent-txn bench --compare dbos`` whose halves fell in different windows gives a ratio that
says more about the neighbours than about either engine (``docs/benchmarks.md``). The bench
prints each half's share, so a reader can tell a disturbed pair from a fair one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """The ``cpu`` line's counters, in clock ticks: all of them, and the stolen ones."""

    total: int
    steal: int


def parse_cpu_line(text: str) -> CpuTimes | None:
    """The all-CPU line of a ``/proc/stat`` text; ``None`` if it has none (or no steal field,
    as before Linux 2.6.11)."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(f) for f in fields[1:]]
            if len(ticks) < 8:
                return None
            # guest and guest_nice (fields 9 and 10) are already counted in user and nice.
            return CpuTimes(total=sum(ticks[:8]), steal=ticks[7])
    return None


def read_cpu_times(path: Path = PROC_STAT) -> CpuTimes | None:
    """The machine's counters now; ``None`` where there is no ``/proc/stat`` (not Linux)."""
    try:
        return parse_cpu_line(path.read_text(encoding="ascii"))
    except OSError:
        return None


def stolen_share(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """The share (0..1) of the CPU time between two readings that was stolen."""
    if before is None or after is None or after.total <= before.total:
        return None
    return (after.steal - before.steal) / (after.total - before.total)
