"""The scenario suite on both backends: the seed's seven lines, provider faults, concurrency.

The PostgreSQL server restart runs once, last in this file, and leaves the server running.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import pytest

from fault_injection.harness import DatabasePair, Harness
from fault_injection.results import ScenarioResult
from fault_injection.scenarios import (
    CONCURRENCY_SCENARIOS,
    FAULT_SCENARIOS,
    POSTGRES_SCENARIOS,
    SEED_SCENARIOS,
    SERVER_RESTART_SCENARIO,
    run_scenarios,
)
from fault_injection.scenarios_concurrency import local_cluster, wait_for_postgres
from ledger import effects
from tests.conftest import DbUrls

SEED_LINES = [
    "PASS crash before call: lookup-before-apply, charge=1 email=1",
    "PASS effect committed/response lost: charge=1 email=1",
    "PASS response before local commit: charge=1 email=1",
    "PASS concurrent workers: reserve=1 charge=1 email=1",
    "PASS compensation replay: refund=1 release=1 email=0",
    "PASS manual review: compensation_unknown -> manual_review",
    "PASS post-commit outbox: no email observed before local commit",
]


@pytest.fixture
async def harness(db_urls: DbUrls) -> AsyncIterator[Harness]:
    """One harness (shop stocked, no engine yet) on the test's fresh database pair."""
    h = await Harness.open(DatabasePair(db_urls.store, db_urls.provider, db_urls.backend))
    try:
        yield h
    finally:
        await h.close()


def _failures(results: list[ScenarioResult]) -> list[str]:
    return [r.line for r in results if not r.passed]


async def test_seed_suite_prints_the_seed_lines(harness: Harness) -> None:
    results = await run_scenarios(harness, SEED_SCENARIOS, suite="seed")
    assert [r.line for r in results] == SEED_LINES
    assert all(r.passed and not r.violations for r in results)
    assert sum(r.crashes for r in results) == 4  # before call, after apply, prepare, commit


async def test_fault_suite_passes(harness: Harness) -> None:
    results = await run_scenarios(harness, FAULT_SCENARIOS, suite="faults")
    assert _failures(results) == []
    assert [r.name for r in results] == [name for name, _ in FAULT_SCENARIOS]
    injected: Counter[str] = Counter()
    for r in results:
        injected.update(r.faults)
    for kind in ("lose_response", "fail_before", "reject", "timeout", "lookup_unavailable"):
        assert injected[kind] >= 1, kind
    assert injected["indeterminate_5xx"] >= 3 and injected["forget_keys"] >= 1


async def test_concurrency_suite_passes(harness: Harness) -> None:
    results = await run_scenarios(harness, CONCURRENCY_SCENARIOS, suite="concurrency")
    assert _failures(results) == []
    drain = results[0]
    assert drain.sagas == 20 and drain.crashes == 20
    assert drain.counts["charge"] == 20 and drain.counts["email"] == 20


async def test_a_broken_engine_makes_a_scenario_fail(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Forget that a claimed-before effect may have been sent: recovery re-applies blindly.
    monkeypatch.setattr(effects.Claim, "maybe_sent", property(lambda self: False))
    chosen = [s for s in SEED_SCENARIOS if s[0] == "response_before_local_commit"]
    (result,) = await run_scenarios(harness, chosen, suite="seed")
    assert not result.passed
    assert result.line.startswith("FAIL response before local commit: charge=1 email=1; ")
    assert "not apply then lookup" in result.line
    assert any(v.invariant == 5 for v in result.violations)


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_connection_loss_during_recovery(harness: Harness) -> None:
    results = await run_scenarios(harness, POSTGRES_SCENARIOS, suite="concurrency")
    assert _failures(results) == []
    by_name = {r.name: r for r in results}
    assert by_name["connection_loss_during_recovery"].detail["backends_terminated"] >= 1
    assert "k_worker_processes_drain" in by_name  # real worker processes, not just tasks


# Restarting the server disturbs every client of it: restarts_postgres runs it alone on the
# server (tests/support/server_lock.py), and it is last among this module's scenarios.
@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.restarts_postgres
@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_server_restart_during_recovery_is_last(harness: Harness) -> None:
    cluster = await local_cluster(harness.dbs.store)
    if cluster is None:
        pytest.skip("the test server is not a local cluster this process may restart")
    try:
        results = await run_scenarios(harness, [SERVER_RESTART_SCENARIO], suite="concurrency")
    finally:
        assert await wait_for_postgres(cluster.host, cluster.port), "the server must be running"
    assert _failures(results) == []
    assert not results[0].line.startswith("SKIP")
