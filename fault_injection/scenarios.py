"""The scenario suite: the seed's seven assertions, provider faults, and concurrency.

Each scenario is an ``async def`` taking a :class:`~fault_injection.harness.Harness` and
returning a :class:`~fault_injection.results.ScenarioResult` that passes only when the
scenario's own expectation holds (counts read from the provider's database, final statuses)
**and** the invariant checker is clean for its transactions. Scenarios use their own tx ids and
order ids, so a whole suite shares one database pair::

    results = await run_suite("seed", None, Path("/tmp/fi"))
    for r in results:
        print(r.line)  # PASS crash before call: lookup-before-apply, charge=1 email=1 ...

Suites: ``seed`` (:data:`SEED_SCENARIOS`), ``faults`` (:data:`FAULT_SCENARIOS`) and
``concurrency`` (:data:`CONCURRENCY_SCENARIOS`, plus :data:`POSTGRES_SCENARIOS` on PostgreSQL,
plus the opt-in :data:`SERVER_RESTART_SCENARIO`, always last).
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from fault_injection.harness import Harness, fresh_databases
from fault_injection.results import ScenarioResult
from fault_injection.scenarios_concurrency import (
    CONCURRENCY_SCENARIOS,
    POSTGRES_SCENARIOS,
    SERVER_RESTART_SCENARIO,
    with_workers,
)
from fault_injection.scenarios_faults import FAULT_SCENARIOS
from fault_injection.scenarios_seed import SEED_SCENARIOS, Scenario, retire_engines
from orchestrator.crashpoints import SimulatedCrash

SuiteName = Literal["seed", "faults", "concurrency"]

#: A scenario that has not finished after this long is reported as failed (a hang is a bug).
SCENARIO_TIMEOUT_SECONDS = 300.0


def suite_scenarios(
    name: SuiteName,
    backend: str,
    *,
    workers: int = 4,
    allow_server_restart: bool = False,
) -> list[tuple[str, Scenario]]:
    """The scenarios of suite ``name`` on ``backend`` (``sqlite`` / ``postgres``), in order."""
    if name == "seed":
        return list(SEED_SCENARIOS)
    if name == "faults":
        return list(FAULT_SCENARIOS)
    if name != "concurrency":
        raise ValueError(f"no suite named {name!r}; known: seed, faults, concurrency")
    chosen = list(CONCURRENCY_SCENARIOS)
    if backend == "postgres":
        chosen += POSTGRES_SCENARIOS
        if allow_server_restart:
            chosen.append(SERVER_RESTART_SCENARIO)  # last: it disturbs every client
    return [(n, with_workers(s, workers)) for n, s in chosen]


async def run_scenarios(
    harness: Harness,
    scenarios: Sequence[tuple[str, Scenario]],
    *,
    suite: str,
    progress: Callable[[ScenarioResult], None] | None = None,
    timeout_seconds: float = SCENARIO_TIMEOUT_SECONDS,
) -> list[ScenarioResult]:
    """Run ``scenarios`` one after another on ``harness``; a scenario that raises or hangs is
    a failed result (with the error), never an aborted suite."""
    results: list[ScenarioResult] = []
    for name, scenario in scenarios:
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_seconds):
                result = await scenario(harness)
        except (Exception, SimulatedCrash) as exc:
            # A crash point firing outside its scenario's control is a failure, not an exit.
            where = traceback.extract_tb(exc.__traceback__)[-1:]
            at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
            result = ScenarioResult(
                suite=suite,
                name=name,
                passed=False,
                line=f"FAIL {name}: raised {type(exc).__name__}: {exc}"[:400] + at,
                seconds=time.monotonic() - started,
                detail={"error": type(exc).__name__},
            )
        finally:
            await retire_engines(harness)
            harness.shop.faults.clear()
        result.suite = suite
        if not result.passed and result.repro is None:
            # Scenarios are deterministic in what they inject: rerunning the suite repeats it.
            result.repro = f"agent-txn fault-inject run --suite {suite}"
        results.append(result)
        if progress is not None:
            progress(result)
    return results


async def run_suite(
    name: SuiteName,
    db: str | None,
    workdir: Path,
    *,
    workers: int = 4,
    progress: Callable[[ScenarioResult], None] | None = None,
    allow_server_restart: bool = False,
) -> list[ScenarioResult]:
    """Run suite ``name`` on a fresh database pair (SQLite files under ``workdir`` when ``db``
    is ``None`` or a SQLite URL, else new databases on that PostgreSQL server), then drop it."""
    if workers < 1:
        raise ValueError("workers must be at least 1")
    async with fresh_databases(db, workdir) as dbs:
        harness = await Harness.open(dbs)
        try:
            chosen = suite_scenarios(
                name, dbs.backend, workers=workers, allow_server_restart=allow_server_restart
            )
            return await run_scenarios(harness, chosen, suite=name, progress=progress)
        finally:
            await harness.close()


__all__ = [
    "CONCURRENCY_SCENARIOS",
    "FAULT_SCENARIOS",
    "POSTGRES_SCENARIOS",
    "SEED_SCENARIOS",
    "SERVER_RESTART_SCENARIO",
    "SuiteName",
    "run_scenarios",
    "run_suite",
    "suite_scenarios",
]
