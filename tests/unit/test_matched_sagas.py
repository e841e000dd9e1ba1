"""How ``agent-txn bench --compare dbos --match-time`` sizes our half of a pair."""

from __future__ import annotations

import pytest

from fault_injection.bench_dbos import matched_sagas


@pytest.mark.parametrize(
    ("dbos_seconds", "ours_per_s", "expected"),
    [
        (10.0, 500.0, 5000),  # our half as long as DBOS's: 10 s at 500 sagas/s
        (0.5, 500.0, 1000),  # never fewer than --sagas
        (100.0, 500.0, 20_000),  # never more than MATCH_CAP times --sagas
    ],
)
def test_matched_sagas_fill_dboss_time_within_bounds(
    dbos_seconds: float, ours_per_s: float, expected: int
) -> None:
    assert matched_sagas(1000, dbos_seconds, ours_per_s) == expected
