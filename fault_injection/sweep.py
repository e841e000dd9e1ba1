"""An engine's fastest setting: runs of it alone at each concurrency, round after round.

``agent-txn bench --concurrency auto`` sweeps ours and ``--dbos-concurrency auto`` sweeps
DBOS's (``fault_injection.bench_dbos.sweep_dbos``); the pairs then run each engine at the
setting of its highest mean rate. Why: the issue's target is against "DBOS in its fastest
settings", and which setting is fastest depends on the engine, the backend and the machine
(DBOS: 1 in flight on SQLite, 4 on PostgreSQL; ours: 16 to 64, flat, where we measured). A
caller should not have to know either number to run the comparison fairly. A run the
hypervisor took 5 % or more of the CPU from is set aside and run once more
(:data:`SWEEP_RERUNS`): a neighbour's burst otherwise decides the setting.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fault_injection.steal import STEAL_CAUTION_SHARE, read_cpu_times, stolen_share

#: What ``--concurrency auto`` tries for ours. Ours was slowest sequentially and about flat
#: from 16 to 64 on every machine measured (``docs/benchmarks.md``); 64 is there to show where
#: more in flight stops paying on a machine of its own.
OURS_SWEEP_CONCURRENCY: tuple[int, ...] = (1, 4, 8, 16, 32, 64)
#: Sagas each run of our sweep measures, at most (after its warm-up): as many as the measured
#: runs will, up to this (``fault_injection.bench_cli._sweep_ours``). Shorter runs than the
#: measured ones misread the higher settings: on PostgreSQL at 32 in flight, runs of 1 000
#: sagas read 986-1 032 sagas/s where runs of 3 000 read 1 405-1 420, and 16 about 1 230
#: either way, so a sweep of 1 000-saga runs chose 16 for pairs of about 9 500 sagas a half
#: (``docs/benchmarks-log.md``, item 69). Two to three seconds a run at our rates in flight.
OURS_SWEEP_SAGAS = 3000
#: Rounds of a sweep. Each round tries every setting once, so a drift of the machine's speed
#: during the sweep reaches every setting alike instead of the last ones tried.
SWEEP_ROUNDS = 2
#: Times a sweep run that lost :data:`~fault_injection.steal.STEAL_CAUTION_SHARE` or more of
#: the machine's CPU to the hypervisor is run again; the last reading stands. Why: a sweep's
#: runs last seconds, and one that a neighbour slowed by a third made its setting lose the
#: round (on the eleventh machine ours at 1, 4 and 8 in flight lost 10 to 12 % and read 30 %
#: under the round before). Once, not until quiet: a window of steal can outlast the sweep,
#: and then the caution under the sweep says so.
SWEEP_RERUNS = 1

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Rerun:
    """A sweep run set aside because the hypervisor took too much of the CPU during it."""

    #: Counted from 0, as ``on_run`` counts (the JSON's ``set_aside`` from 1, as printed).
    round: int
    concurrency: int
    rate: float
    steal: float


@dataclass(frozen=True, slots=True)
class Sweep:
    """One engine alone at each concurrency, round after round (:func:`run_sweep`)."""

    #: Sagas (or workflows) per second of each run, by concurrency, in round order.
    rates: dict[int, list[float]]
    #: Sagas (or workflows) each run measured.
    sagas: int
    #: What the engine's checker found wrong in any run.
    problems: list[str] = field(default_factory=list)
    #: The machine's stolen share of CPU time during each run (``fault_injection.steal``), by
    #: concurrency, in round order; ``None`` where it could not be read.
    steal: dict[int, list[float | None]] = field(default_factory=dict)
    #: The runs set aside for a rerun (:data:`SWEEP_RERUNS`), in the order they ran: round,
    #: concurrency, rate and stolen share. Not in :attr:`rates`.
    reruns: list[Rerun] = field(default_factory=list)

    @property
    def means(self) -> dict[int, float]:
        """Each concurrency's mean rate over the rounds, in ascending concurrency."""
        return {c: statistics.fmean(self.rates[c]) for c in sorted(self.rates)}

    @property
    def fastest(self) -> int:
        """The concurrency of the highest mean rate (the lowest such one on a tie)."""
        means = self.means
        return max(means, key=means.__getitem__)

    def as_json(self, rate_key: str) -> dict[str, Any]:
        """The JSON of a sweep: ``sagas`` a run, the ``fastest`` setting, and ``runs``, each
        setting's rates under ``rate_key`` (``sagas_per_s`` for ours, ``workflows_per_s`` for
        DBOS's)."""
        return {
            "sagas": self.sagas,
            "fastest": self.fastest,
            "runs": [
                {
                    "concurrency": c,
                    rate_key: list(self.rates[c]),
                    "steal_share": list(self.steal.get(c, [None] * len(self.rates[c]))),
                }
                for c in sorted(self.rates)
            ],
            "set_aside": [
                {
                    "round": r.round + 1,
                    "concurrency": r.concurrency,
                    rate_key: r.rate,
                    "steal_share": r.steal,
                }
                for r in self.reruns
            ],
        }

    @property
    def steal_shares(self) -> list[float | None]:
        """Every run's stolen share, setting by setting."""
        return [share for c in sorted(self.steal) for share in self.steal[c]]


def run_sweep(
    run_one: Callable[[int], R],
    *,
    rate: Callable[[R], float],
    problems: Callable[[R], list[str]],
    who: str,
    sagas: int,
    concurrencies: Sequence[int],
    rounds: int = SWEEP_ROUNDS,
    on_run: Callable[[int, int, R, float | None], None] | None = None,
    on_rerun: Callable[[int, int, float], None] | None = None,
) -> Sweep:
    """``run_one(concurrency)`` at each of ``concurrencies``, ``rounds`` times over, rounds
    interleaved; ``on_run(round, concurrency, result, steal)`` after each, ``steal`` being the
    machine's stolen share of CPU time during the run (a sweep's runs are short, and one that
    a neighbour slowed can pick the wrong setting: the reader should see it).

    A run that lost :data:`~fault_injection.steal.STEAL_CAUTION_SHARE` or more is set aside
    and run again, :data:`SWEEP_RERUNS` times at most (``on_rerun(round, concurrency, steal)``
    before each rerun); the last reading stands. A run's checker problems are kept, a set-aside
    run's too, prefixed "``who`` alone at C=…", so that a sweep's failure fails the bench as a
    pair's would."""
    if not concurrencies or rounds < 1:
        raise ValueError("a sweep needs at least one setting and one round")
    rates: dict[int, list[float]] = {c: [] for c in concurrencies}
    steal: dict[int, list[float | None]] = {c: [] for c in concurrencies}
    reruns: list[Rerun] = []
    found: list[str] = []
    for round_ in range(rounds):
        for c in concurrencies:
            for attempt in range(SWEEP_RERUNS + 1):
                before = read_cpu_times()
                result = run_one(c)
                share = stolen_share(before, read_cpu_times())
                found += [f"{who} alone at C={c}: {problem}" for problem in problems(result)]
                if on_run is not None:
                    on_run(round_, c, result, share)
                if share is None or share < STEAL_CAUTION_SHARE or attempt == SWEEP_RERUNS:
                    break
                reruns.append(Rerun(round_, c, rate(result), share))
                if on_rerun is not None:
                    on_rerun(round_, c, share)
            rates[c].append(rate(result))
            steal[c].append(share)
    return Sweep(rates=rates, sagas=sagas, problems=found, steal=steal, reruns=reruns)


__all__ = [
    "OURS_SWEEP_CONCURRENCY",
    "OURS_SWEEP_SAGAS",
    "SWEEP_RERUNS",
    "SWEEP_ROUNDS",
    "Rerun",
    "Sweep",
    "run_sweep",
]
