"""A stand-in for one DBOS run's result, for the tests of the comparison's own arithmetic."""

from __future__ import annotations

from fault_injection.bench_dbos import DbosResult


def dbos_result(
    *, concurrency: int, per_s: float, sagas: int = 100, problems: list[str] | None = None
) -> DbosResult:
    """A DBOS run at ``concurrency`` in flight that did ``per_s`` workflows a second; its
    checker passed unless ``problems`` are given."""
    return DbosResult(
        backend="sqlite",
        sagas=sagas,
        concurrency=concurrency,
        settings="WAL",
        sagas_per_s=per_s,
        p50_ms=1.0,
        p99_ms=2.0,
        commits_per_saga=8.0,
        statements_per_saga=16.0,
        cpu_ms_per_saga=10.0,
        elapsed_s=1.0,
        check_ok=not problems,
        problems=problems or [],
    )
