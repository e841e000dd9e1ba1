"""How much of the machine's CPU time the hypervisor gave to someone else during a run.

Why: on a virtual machine the wall clock of a CPU-bound run includes the time its virtual CPUs
were not running at all ("steal", the eighth field of ``/proc/stat``'s ``cpu`` line). On this
kind of machine that share moves from nothing to a fifth of the time within minutes, and a pair
of ``agent-txn bench --compare dbos`` whose halves fell in different windows gives a ratio that
says more about the neighbours than about either engine (``docs/benchmarks.md``). The bench
prints each half's share, so a reader can tell a disturbed pair from a fair one.
"""

from __future__ import annotations

from collections.abc import Sequence
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


#: A run (or a half of a pair) that lost at least this share of the machine's CPU to the
#: hypervisor gets a caution under its figures. Why 5 %: on the machines the bench's figures
#: come from, a quiet window read 0 to 1 %, and in a window of 2 to 35 % a half, one run's
#: pair ratios spread from 5.8 to 15.7 times DBOS's (``docs/benchmarks-log.md``, item 73).
STEAL_CAUTION_SHARE = 0.05


def steal_caution(shares: Sequence[float | None], *, of: str | None = None) -> str | None:
    """The caution to print under figures measured while the hypervisor took
    :data:`STEAL_CAUTION_SHARE` or more of the machine's CPU (``None``: no reading reached
    it). ``shares`` are the runs' readings (``None`` where there was none): one run's, said as
    "this run", or several, said as "N of M ``of``" ("halves", "sweep runs")."""
    read = [s for s in shares if s is not None]
    high = [s for s in read if s >= STEAL_CAUTION_SHARE]
    if not high:
        return None
    span = f"{max(high):.0%}" if len(high) == 1 else f"{min(high):.0%} to {max(high):.0%}"
    where = "this run" if of is None else f"{len(high)} of {len(read)} {of}"
    return (
        f"the hypervisor took {span} of the machine's CPU in {where}: these figures measure "
        'its other guests too. Run again in a quieter window (docs/benchmarks.md, "Stolen '
        'CPU time").'
    )


#: Two halves of a pair lost "alike" shares when these differ by at most this much (5 points).
#: Why a bound at all: in a run with 2 to 35 % stolen per half, the difference between a pair's
#: two shares explained nearly all of its ratio's spread (correlation -0.97 with the ratio's
#: logarithm, ``docs/benchmarks-log.md``, item 73), the level they shared little of it.
ALIKE_STEAL_POINTS = 0.05


def alike(ours: float | None, theirs: float | None) -> bool:
    """Whether two halves lost alike shares of the machine's CPU (both read)."""
    return ours is not None and theirs is not None and abs(ours - theirs) <= ALIKE_STEAL_POINTS
