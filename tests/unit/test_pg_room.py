"""What the bench reckons a run needs in PostgreSQL connections, and what the server admits
(``fault_injection/pg_connections.py``; the reading itself is tested against a server in
``tests/integration/test_pg_connections.py``)."""

from __future__ import annotations

import pytest

from fault_injection.pg_connections import connections_needed, too_many
from ledger.pg_room import ConnectionRoom


def test_a_superuser_may_take_the_reserved_slots_and_others_may_not() -> None:
    assert ConnectionRoom(100, 3, 10, superuser=True).free == 90
    assert ConnectionRoom(100, 3, 10, superuser=False).free == 87


def test_a_full_server_admits_none_not_a_negative_number() -> None:
    assert ConnectionRoom(100, 3, 99, superuser=False).free == 0


@pytest.mark.parametrize(
    ("concurrency", "workers", "provider", "peak_measured"),
    [
        # Peak client connections seen in pg_stat_activity during such runs (2026-12-05).
        (32, 0, "memory", 33),
        (64, 0, "memory", 65),
        (8, 0, "fake", 17),
        (16, 0, "fake", 32),
        (8, 2, "memory", 19),
        (8, 4, "fake", 70),
    ],
)
def test_the_estimate_covers_what_runs_were_seen_to_hold(
    concurrency: int, workers: int, provider: str, peak_measured: int
) -> None:
    needed = connections_needed(concurrency=concurrency, workers=workers, provider=provider)
    assert peak_measured <= needed <= peak_measured + 8


def test_a_run_that_fits_is_not_refused_and_one_that_does_not_is_told_what_to_change() -> None:
    room = ConnectionRoom(100, 3, 4, superuser=True)
    assert too_many(96, room, what="--concurrency 94") is None
    refusal = too_many(97, room, what="--concurrency 95")
    assert refusal is not None
    assert refusal.startswith("--concurrency 95 keeps up to 97 PostgreSQL connections")
    assert "admits 96 more now (max_connections 100, 4 in use)" in refusal
    assert "reserved" not in refusal  # a superuser's room has none held back
    assert "3 reserved for superusers" in (
        too_many(97, ConnectionRoom(100, 3, 4, superuser=False), what="x") or ""
    )


def test_what_a_process_holds_already_is_its_own_to_reuse() -> None:
    room = ConnectionRoom(100, 3, 90, superuser=True)  # 10 free, of which this process holds 0
    assert room.admits(10) and not room.admits(11)
    assert room.admits(15, held=5) and not room.admits(16, held=5)
