"""``bench --concurrency auto`` and ``--dbos-concurrency auto``: an engine alone at each
setting, and the fastest of them (``fault_injection/sweep.py``).

The runs are stood in for here (DBOS's ``run_dbos`` replaced, or a function of the
concurrency), so what is checked is the sweep's own logic: every setting in every round, rounds
interleaved, the highest mean chosen, the checker's problems kept, and on PostgreSQL only the
settings the server has connections for. ``tests/integration/test_bench.py`` runs both sweeps
with the engines themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fault_injection import bench_cli, bench_dbos
from fault_injection import sweep as sweep_module
from fault_injection.bench_cli import sweep_settings_that_fit
from fault_injection.bench_dbos import DbosResult, sweep_dbos
from fault_injection.pg_connections import connections_needed
from fault_injection.steal import CpuTimes
from fault_injection.sweep import OURS_SWEEP_CONCURRENCY, Sweep, run_sweep
from ledger.pg_room import ConnectionRoom
from tests.support.dbos_results import dbos_result


@pytest.fixture(autouse=True)
def _no_reruns_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in runs here take no time, and this machine's own stolen CPU around one
    could set it aside; only the tests of the rerun ask for it."""
    monkeypatch.setattr(sweep_module, "SWEEP_RERUNS", 0)


def test_the_fastest_is_the_highest_mean_not_the_highest_run() -> None:
    # C=4 has the single best run, but C=1 is faster on average.
    sweep = Sweep(rates={1: [150.0, 148.0], 4: [160.0, 120.0], 8: [130.0, 131.0]}, sagas=10)
    assert sweep.fastest == 1


def test_a_tie_goes_to_fewer_in_flight() -> None:
    sweep = Sweep(rates={8: [100.0, 100.0], 2: [90.0, 110.0], 4: [95.0, 105.0]}, sagas=10)
    assert sweep.fastest == 2


def test_the_json_lists_every_setting_with_its_runs() -> None:
    sweep = Sweep(rates={4: [100.0, 104.0], 1: [90.0, 91.0]}, sagas=300)
    assert sweep.as_json("workflows_per_s") == {
        "sagas": 300,
        "fastest": 4,
        "runs": [
            # No steal was read for these runs: null, one per run.
            {"concurrency": 1, "workflows_per_s": [90.0, 91.0], "steal_share": [None, None]},
            {"concurrency": 4, "workflows_per_s": [100.0, 104.0], "steal_share": [None, None]},
        ],
        "set_aside": [],
    }


def test_the_sweep_runs_every_setting_each_round_and_picks_the_fastest(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # DBOS as it behaved on PostgreSQL: fastest at 4 in flight.
    speed = {1: 60.0, 2: 100.0, 4: 120.0, 8: 110.0}
    calls: list[tuple[int, int]] = []

    def fake_run_dbos(db: str | None, workdir: Path, **kwargs: Any) -> DbosResult:
        assert (db, workdir) == ("postgresql://server/x", tmp_path)
        assert (kwargs["sagas"], kwargs["warmup"], kwargs["sqlite_tuning"]) == (50, 5, "fast")
        c = kwargs["concurrency"]
        calls.append((len(calls), c))
        # Each run a little apart from the last, as real runs are.
        return dbos_result(concurrency=c, per_s=speed[c] + len(calls) / 100)

    monkeypatch.setattr(bench_dbos, "run_dbos", fake_run_dbos)
    seen: list[tuple[int, int]] = []
    sweep = sweep_dbos(
        "postgresql://server/x",
        tmp_path,
        sagas=50,
        warmup=5,
        sqlite_tuning="fast",
        concurrencies=(1, 2, 4, 8),
        rounds=2,
        on_run=lambda r, c, _result, _steal: seen.append((r, c)),
    )
    # Interleaved: every setting once, then every setting again.
    assert [c for _, c in calls] == [1, 2, 4, 8, 1, 2, 4, 8]
    assert seen == [(0, 1), (0, 2), (0, 4), (0, 8), (1, 1), (1, 2), (1, 4), (1, 8)]
    assert {c: len(r) for c, r in sweep.rates.items()} == {1: 2, 2: 2, 4: 2, 8: 2}
    assert sweep.fastest == 4
    assert sweep.problems == []


def test_what_dboss_checker_found_in_a_sweep_run_is_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def fake_run_dbos(db: str | None, workdir: Path, **kwargs: Any) -> DbosResult:
        c = kwargs["concurrency"]
        problems = ["charge: 2 effects for 1 workflows"] if c == 2 else None
        return dbos_result(concurrency=c, per_s=100.0, problems=problems)

    monkeypatch.setattr(bench_dbos, "run_dbos", fake_run_dbos)
    sweep = sweep_dbos(
        None, tmp_path, sagas=1, warmup=0, sqlite_tuning="default", concurrencies=(1, 2), rounds=1
    )
    assert sweep.problems == ["DBOS alone at C=2: charge: 2 effects for 1 workflows"]


def test_ours_is_swept_with_its_own_key_and_checker_and_label(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sweep_module, "read_cpu_times", lambda: None)  # no /proc/stat
    # Ours as it behaved on PostgreSQL: flat past 16, a little slower at 64.
    speed = {1: 400.0, 16: 1250.0, 32: 1260.0, 64: 1150.0}
    seen: list[tuple[int, int]] = []
    sweep = run_sweep(
        lambda c: (speed[c], ["payments.charge: 2 effects for 1 intents"] if c == 64 else []),
        rate=lambda result: result[0],
        problems=lambda result: result[1],
        who="ours",
        sagas=1000,
        concurrencies=(1, 16, 32, 64),
        on_run=lambda r, c, _result, _steal: seen.append((r, c)),
    )
    assert seen == [(r, c) for r in (0, 1) for c in (1, 16, 32, 64)]
    assert sweep.fastest == 32
    assert sweep.problems == ["ours alone at C=64: payments.charge: 2 effects for 1 intents"] * 2
    assert sweep.as_json("sagas_per_s")["runs"][0] == {
        "concurrency": 1,
        "sagas_per_s": [400.0] * 2,
        "steal_share": [None, None],
    }


def _stolen_in_each_run(monkeypatch: pytest.MonkeyPatch, stolen: list[int]) -> list[CpuTimes]:
    """``/proc/stat`` as read around runs that each last 1 000 ticks, of which ``stolen[i]``
    are stolen in the ``i``-th run; returns the readings left (none once all ran)."""
    readings = [
        CpuTimes(total=2000 * i + 1000 * after, steal=sum(stolen[:i]) + stolen[i] * after)
        for i in range(len(stolen))
        for after in (0, 1)
    ]
    monkeypatch.setattr(sweep_module, "read_cpu_times", lambda: readings.pop(0))
    return readings


def test_each_sweep_run_reads_the_stolen_share_around_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's runs are short, and a neighbour that slows one can make another setting look
    fastest: each run's stolen share goes to ``on_run`` and into the JSON beside its rate."""
    readings = _stolen_in_each_run(monkeypatch, [0, 40, 10, 0])  # under 5 %: none run again
    seen: list[tuple[int, int, float | None]] = []
    sweep = run_sweep(
        lambda c: float(c),
        rate=lambda result: result,
        problems=lambda _result: [],
        who="ours",
        sagas=10,
        concurrencies=(1, 2),
        rounds=2,
        on_run=lambda r, c, _result, steal: seen.append((r, c, steal)),
    )
    assert readings == []  # before and after each run, nothing else
    assert seen == [(0, 1, 0.0), (0, 2, 0.04), (1, 1, 0.01), (1, 2, 0.0)]
    runs = sweep.as_json("sagas_per_s")["runs"]
    assert [run["steal_share"] for run in runs] == [[0.0, 0.01], [0.04, 0.0]]
    assert sweep.steal_shares == [0.0, 0.01, 0.04, 0.0]
    assert sweep.reruns == [] and sweep.as_json("sagas_per_s")["set_aside"] == []


def test_a_run_that_lost_five_percent_is_run_once_more_and_the_rerun_stands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sweep_module, "SWEEP_RERUNS", 1)
    # A neighbour slowed C=2 in round 1 (30 %) and C=1 in round 2 (10 %, and its rerun too).
    readings = _stolen_in_each_run(monkeypatch, [0, 300, 20, 100, 100, 0])
    speeds = iter([100.0, 20.0, 110.0, 70.0, 75.0, 105.0])  # the rates, in the order run
    problems = iter([[], ["charge: 2 effects for 1 intents"], [], [], [], []])
    seen: list[tuple[int, int, float]] = []
    reruns: list[tuple[int, int, float]] = []
    sweep = run_sweep(
        lambda c: (next(speeds), next(problems)),
        rate=lambda result: result[0],
        problems=lambda result: result[1],
        who="ours",
        sagas=10,
        concurrencies=(1, 2),
        rounds=2,
        on_run=lambda r, c, result, _steal: seen.append((r, c, result[0])),
        on_rerun=lambda r, c, steal: reruns.append((r, c, steal)),
    )
    assert readings == []
    assert seen == [(0, 1, 100.0), (0, 2, 20.0), (0, 2, 110.0), (1, 1, 70.0), (1, 1, 75.0),
                    (1, 2, 105.0)]  # fmt: skip
    assert reruns == [(0, 2, 0.3), (1, 1, 0.1)]
    # The set-aside readings are not in the means: with them C=1 would be the fastest
    # (81.7 against 78.3 sagas/s), without them C=2 is (107.5 against 87.5).
    assert sweep.rates == {1: [100.0, 75.0], 2: [110.0, 105.0]}
    assert sweep.steal == {1: [0.0, 0.1], 2: [0.02, 0.0]}
    assert sweep.fastest == 2
    # A set-aside run's checker problems still fail the bench.
    assert sweep.problems == ["ours alone at C=2: charge: 2 effects for 1 intents"]
    assert sweep.as_json("sagas_per_s")["set_aside"] == [
        {"round": 1, "concurrency": 2, "sagas_per_s": 20.0, "steal_share": 0.3},
        {"round": 2, "concurrency": 1, "sagas_per_s": 70.0, "steal_share": 0.1},
    ]


@pytest.mark.parametrize(("concurrencies", "rounds"), [((), 2), ((1, 2), 0)])
def test_a_sweep_of_nothing_is_refused(concurrencies: tuple[int, ...], rounds: int) -> None:
    with pytest.raises(ValueError, match="at least one setting and one round"):
        run_sweep(
            lambda c: c,
            rate=float,
            problems=lambda _c: [],
            who="ours",
            sagas=1,
            concurrencies=concurrencies,
            rounds=rounds,
        )


def _room_for(connections: int) -> ConnectionRoom:
    """A server with exactly ``connections`` free for a superuser."""
    return ConnectionRoom(max_connections=100, reserved=3, in_use=100 - connections, superuser=True)


@pytest.mark.parametrize("provider", ["memory", "fake"])
def test_on_postgresql_our_sweep_tries_only_what_the_server_has_room_for(provider: str) -> None:
    # Room for 32 in flight exactly, not for 64.
    room = _room_for(connections_needed(concurrency=32, workers=0, provider=provider))
    fitting = sweep_settings_that_fit(room, provider)
    assert fitting == tuple(c for c in OURS_SWEEP_CONCURRENCY if c <= 32)
    # The room unknown: every setting (the run reports a refusal itself).
    assert sweep_settings_that_fit(None, provider) == OURS_SWEEP_CONCURRENCY


def test_with_no_room_even_for_one_the_smallest_is_left_to_be_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench_cli, "OURS_SWEEP_CONCURRENCY", (4, 8))
    assert sweep_settings_that_fit(_room_for(0), "memory") == (4,)
