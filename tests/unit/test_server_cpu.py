"""The local PostgreSQL server's CPU a saga, read from ``/proc`` (fault_injection.server_cpu)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fault_injection.server_cpu import (
    ServerReading,
    is_local_postgres,
    parse_stat,
    per_saga_ms,
    read_server,
    server_cpu_seconds,
)

PG = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"


def _stat(pid: int, comm: str, utime: int, stime: int, start: int) -> str:
    # proc(5): pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt
    # cmajflt utime stime cutime cstime priority nice threads itrealvalue starttime vsize ...
    middle = "S 1 1 1 0 -1 4194560 10 0 0 0"
    return f"{pid} ({comm}) {middle} {utime} {stime} 0 0 20 0 1 0 {start} 1000 50\n"


def _proc(tmp_path: Path, processes: list[tuple[int, str, int, int, int]]) -> Path:
    for pid, comm, utime, stime, start in processes:
        (tmp_path / str(pid)).mkdir(exist_ok=True)
        (tmp_path / str(pid) / "stat").write_text(_stat(pid, comm, utime, stime, start))
    (tmp_path / "self").mkdir(exist_ok=True)  # not a pid: skipped
    return tmp_path


def test_a_stat_line_gives_name_start_and_user_plus_system_ticks() -> None:
    assert parse_stat(_stat(42, "postgres", 7, 5, 9000)) == ("postgres", 9000, 12)


def test_a_name_with_spaces_and_parentheses_does_not_shift_the_fields() -> None:
    assert parse_stat(_stat(42, "a) (b c", 7, 5, 9000)) == ("a) (b c", 9000, 12)


@pytest.mark.parametrize(
    "text", ["", "42 postgres S 1", "42 (postgres) S 1 2 3", "42 (x) " + "z " * 30]
)
def test_a_line_that_is_not_a_stat_line_gives_none(text: str) -> None:
    assert parse_stat(text) is None


@pytest.mark.parametrize(
    ("url", "local"),
    [
        (PG, True),
        ("postgresql+asyncpg://postgres@localhost/test", True),
        ("postgresql+psycopg://postgres@[::1]:5432/test", True),
        ("postgresql+asyncpg://postgres@/test", True),  # the default Unix socket
        ("postgresql+asyncpg://postgres@/test?host=/var/run/postgresql", True),
        ("postgresql+asyncpg://postgres@db.example.com/test", False),
        ("postgresql+asyncpg://postgres@10.0.0.5/test", False),
        ("sqlite+aiosqlite:///agent.db", False),
    ],
)
def test_only_a_postgresql_server_on_this_host_is_read(url: str, local: bool) -> None:
    assert is_local_postgres(url) is local


def test_the_servers_processes_are_summed_and_others_left_out(tmp_path: Path) -> None:
    proc = _proc(
        tmp_path,
        [(10, "postgres", 100, 50, 1), (11, "postgres", 30, 20, 2), (12, "python3", 999, 9, 3)],
    )
    before = read_server(PG, proc)
    assert before is not None and set(before.ticks) == {(10, 1), (11, 2)}

    _proc(tmp_path, [(10, "postgres", 160, 70, 1), (11, "postgres", 30, 20, 2)])
    after = read_server(PG, proc)

    assert after is not None
    assert server_cpu_seconds(before, after) == pytest.approx(80 / after.ticks_per_second)


def test_a_process_started_between_readings_counts_from_zero_even_on_a_reused_pid() -> None:
    before = ServerReading({(10, 1): 100, (11, 2): 40}, 100)
    # pid 11 ended (its 40 ticks are gone) and the kernel gave its pid to a new backend
    after = ServerReading({(10, 1): 130, (11, 77): 5, (12, 78): 15}, 100)

    assert server_cpu_seconds(before, after) == pytest.approx((30 + 5 + 15) / 100)


def test_no_reading_where_the_server_cannot_be_seen(tmp_path: Path) -> None:
    assert read_server("sqlite+aiosqlite:///agent.db", tmp_path) is None
    assert read_server("postgresql+asyncpg://u@db.example.com/x", tmp_path) is None
    assert read_server(PG, tmp_path / "absent") is None
    assert read_server(PG, _proc(tmp_path, [(12, "python3", 1, 1, 1)])) is None  # no server
    assert server_cpu_seconds(None, ServerReading({}, 100)) is None
    assert per_saga_ms(None, 10) is None
    assert per_saga_ms(0.5, 100) == pytest.approx(5.0)
