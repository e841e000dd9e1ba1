"""``bench --dbos-concurrency auto``: DBOS alone at each setting, and the fastest of them.

The sweep's DBOS runs are stood in for here (``run_dbos`` replaced), so what is checked is the
sweep's own logic: every setting in every round, rounds interleaved, the highest mean chosen,
DBOS's checker problems kept. ``tests/integration/test_bench.py`` runs it with DBOS itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fault_injection import bench_dbos
from fault_injection.bench_dbos import DbosResult, DbosSweep, sweep_dbos
from tests.support.dbos_results import dbos_result


def test_the_fastest_is_the_highest_mean_not_the_highest_run() -> None:
    # C=4 has the single best run, but C=1 is faster on average.
    sweep = DbosSweep(rates={1: [150.0, 148.0], 4: [160.0, 120.0], 8: [130.0, 131.0]}, sagas=10)
    assert sweep.fastest == 1


def test_a_tie_goes_to_fewer_in_flight() -> None:
    sweep = DbosSweep(rates={8: [100.0, 100.0], 2: [90.0, 110.0], 4: [95.0, 105.0]}, sagas=10)
    assert sweep.fastest == 2


def test_the_json_lists_every_setting_with_its_runs() -> None:
    sweep = DbosSweep(rates={4: [100.0, 104.0], 1: [90.0, 91.0]}, sagas=300)
    assert sweep.as_json() == {
        "sagas": 300,
        "fastest": 4,
        "runs": [
            {"concurrency": 1, "workflows_per_s": [90.0, 91.0]},
            {"concurrency": 4, "workflows_per_s": [100.0, 104.0]},
        ],
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
        on_run=lambda r, c, _result: seen.append((r, c)),
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
