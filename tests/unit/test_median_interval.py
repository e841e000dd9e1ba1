"""The interval the bench gives for the median ratio against DBOS.

What could break: ranks one off (an interval that covers the median 88 % of the time where
95 % is claimed, or one wider than it needs to be), an interval given for too few pairs to
have one, and the bench's JSON losing the interval's keys.
"""

from __future__ import annotations

import random
import statistics
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fault_injection.bench_dbos import ComparePair, compare_json
from fault_injection.median_interval import median_interval
from tests.support.dbos_results import dbos_result


@pytest.mark.parametrize(
    ("n", "ranks", "coverage"),
    [
        # The sign-test table's ranks at 95 % (e.g. Conover, Practical Nonparametric
        # Statistics, table A3): the narrowest interval of ranks whose coverage is ≥ 95 %.
        (6, (1, 6), 0.96875),
        (10, (2, 9), 0.978515625),
        (20, (6, 15), 0.958610534667969),
        (30, (10, 21), 0.957226),
    ],
)
def test_the_ranks_are_the_sign_test_tables(
    n: int, ranks: tuple[int, int], coverage: float
) -> None:
    values = [float(v) for v in range(100, 100 + n)]
    random.Random(n).shuffle(values)
    got = median_interval(values)
    assert got is not None
    assert got.ranks == ranks
    assert (got.low, got.high) == (99.0 + ranks[0], 99.0 + ranks[1])
    assert got.coverage == pytest.approx(coverage, abs=1e-6)
    assert got.median == statistics.median(values)


def test_five_pairs_have_no_95_percent_interval() -> None:
    # Even the whole range of five values covers the median only 93.75 % of the time.
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    five = median_interval([1.0, 2.0, 3.0, 4.0, 5.0], level=0.9)
    assert five is not None and five.ranks == (1, 5)


def test_the_interval_covers_a_skewed_median_as_often_as_it_says() -> None:
    # Twenty draws of a long-tailed ratio (log-normal, like the pairs on a noisy machine),
    # 4 000 times: the share of intervals holding the true median is the coverage claimed.
    rng = random.Random(7)
    true_median = 10.0  # of 10 * exp(N(0, 0.3))
    held = 0
    trials = 4000
    for _ in range(trials):
        draws = [10.0 * rng.lognormvariate(0.0, 0.3) for _ in range(20)]
        got = median_interval(draws)
        assert got is not None
        held += got.low <= true_median <= got.high
    # Claimed 95.86 %; ranks one narrower (7, 14) would hold it 88.5 % of the time.
    assert 0.945 <= held / trials <= 0.972


@given(st.lists(st.floats(min_value=0.1, max_value=100.0), min_size=6, max_size=40))
def test_the_interval_is_two_of_the_values_around_the_median(values: list[float]) -> None:
    got = median_interval(values)
    assert got is not None
    assert got.low in values and got.high in values
    assert got.low <= got.median <= got.high


def test_a_level_outside_zero_and_one_is_refused() -> None:
    with pytest.raises(ValueError, match="level"):
        median_interval([1.0] * 10, level=1.0)


def _pair(ours_per_s: float, dbos_per_s: float, dbos_concurrency: int = 16) -> ComparePair:
    check = SimpleNamespace(ok=True)
    ours = SimpleNamespace(
        sagas=100,
        concurrency=16,
        sagas_per_s=ours_per_s,
        cpu_ms_per_saga=1.0,
        server_cpu_ms_per_saga=None,
        check=check,
        as_json=lambda: {"sagas_per_s": ours_per_s},
    )
    return ComparePair(ours, dbos_result(concurrency=dbos_concurrency, per_s=dbos_per_s))


def test_the_bench_json_carries_the_interval_from_six_pairs_on() -> None:
    ratios = [8.0, 9.0, 9.5, 10.5, 11.0, 12.0]
    data = compare_json([_pair(r * 100.0, 100.0) for r in ratios])
    assert data["ratio_vs_dbos"] == pytest.approx(10.0)
    assert data["ratio_vs_dbos_ci95_low"] == pytest.approx(8.0)
    assert data["ratio_vs_dbos_ci95_high"] == pytest.approx(12.0)
    assert data["ratio_vs_dbos_ci95_coverage"] == pytest.approx(0.96875)

    few = compare_json([_pair(r * 100.0, 100.0) for r in ratios[:5]])
    assert few["ratio_vs_dbos_ci95_low"] is None
    assert few["ratio_vs_dbos_ci95_high"] is None
    assert few["ratio_vs_dbos_ci95_coverage"] is None


def test_the_bench_json_says_each_halfs_concurrency() -> None:
    """``--dbos-concurrency``: the halves of a pair may run at different settings."""
    data = compare_json([_pair(1000.0, 100.0, dbos_concurrency=4) for _ in range(3)])
    assert data["dbos_concurrency"] == 4
    assert [(p["concurrency"], p["dbos_concurrency"]) for p in data["pairs"]] == [(16, 4)] * 3
