"""The crash matrix on SQLite and PostgreSQL: every crash point at every position it applies to,
crashed in-process and by a real SIGKILL of a subprocess, then recovered and checked.

The whole matrix of one mode runs in one test per backend on one database pair (cells use their
own tx ids and compare provider counters as deltas), so it stays fast; a failing cell is printed
with its one-line repro. The last tests prove the matrix can fail at all.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import create_async_engine

from fault_injection.forkserver import ForkServer, ForkServerGone
from fault_injection.harness import DatabasePair
from fault_injection.matrix import (
    MODES,
    Cell,
    Victim,
    matrix_cells,
    run_cell,
    run_cells,
    run_matrix,
)
from fault_injection.victim import CANCELLED, NOT_REACHED, POSITIONS
from ledger.effects import Claim
from orchestrator.crashpoints import POINTS
from tests.conftest import DbUrls


def _pair(db_urls: DbUrls) -> DatabasePair:
    return DatabasePair(db_urls.store, db_urls.provider, db_urls.backend)


def test_every_point_has_cells_at_every_position_it_applies_to() -> None:
    cells = matrix_cells()
    names = [c.name for c in cells]
    assert len(names) == len(set(names))
    per_mode = [c for c in cells if c.mode == "inprocess"]
    # effect.* (4 points) and record.* (2) at all 7 positions, plus 2 + 2 + 1 once-only cells.
    assert len(per_mode) == 6 * 7 + 5
    assert {c.point for c in per_mode} == set(POINTS)
    assert len(cells) == 2 * len(per_mode)
    for point in POINTS:
        positions = {c.position for c in per_mode if c.point == point}
        family = point.split(".", 1)[0]
        expected = {
            "prepare": {"reserve"},
            "commit": {"receipt"},
            "compensation": {"undo-wrap"},
        }.get(family, set(POSITIONS))
        assert positions == expected, point
    assert "effect.after_apply@charge/kill" in names
    assert "effect.before_lookup@undo-reserve/inprocess" in names


def test_a_cell_that_does_not_apply_is_refused() -> None:
    with pytest.raises(ValueError, match="does not apply"):
        Cell("prepare.after_commit", "charge", "kill")
    with pytest.raises(ValueError, match="mode"):
        Cell("effect.after_apply", "charge", "sometimes")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
async def test_crash_matrix(db_urls: DbUrls, mode: str) -> None:
    dbs = _pair(db_urls)
    started = time.perf_counter()
    results = await run_cells(matrix_cells((mode,)), dbs)
    seconds = time.perf_counter() - started
    failed = [f"{r.line}\n    repro: {r.repro}" for r in results if not r.passed]
    print(f"\ncrash matrix {db_urls.backend}/{mode}: {len(results)} cells in {seconds:.1f}s")
    for r in results:
        print(f"  {r.seconds:5.2f}s {r.line}")
    assert not failed, "\n".join(failed)
    assert all(r.crashes == 1 and r.sagas == 1 for r in results)


async def test_kill_cells_start_victims_afresh_when_no_fork_server_starts(
    db_urls: DbUrls, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []

    async def no_fork_server(env: dict[str, str]) -> ForkServer:
        started.append(1)
        raise ForkServerGone("no fork server here")

    monkeypatch.setattr(ForkServer, "start", no_fork_server)
    cells = [
        Cell("effect.after_apply", "charge", "kill"),
        Cell("record.after_commit", "reserve", "kill"),
    ]
    results = await run_cells(cells, _pair(db_urls))
    assert started == [1]
    assert [r.passed for r in results] == [True, True], [r.line for r in results]
    assert all(r.detail["returncode"] == -9 for r in results)


async def test_run_matrix_runs_only_the_named_cells(tmp_path: Path) -> None:
    seen: list[str] = []
    results = await run_matrix(
        None,
        tmp_path,
        modes=("inprocess",),
        only="effect.after_apply@charge/*",
        progress=lambda r: seen.append(r.name),
    )
    assert [r.name for r in results] == seen == ["effect.after_apply@charge/inprocess"]
    (result,) = results
    assert result.passed, result.line
    assert (
        result.line
        == "PASS effect.after_apply@charge/inprocess: committed reserve=2 charge=1 email=1"
    )
    assert result.suite == "matrix" and result.crashes == 1 and result.sagas == 1
    assert result.counts["payments.charge"] == 1 and result.counts["email.send"] == 1
    assert result.repro is not None and result.repro.startswith(
        "agent-txn fault-inject run --suite matrix --only effect.after_apply@charge/inprocess --db "
    )
    with pytest.raises(ValueError, match="no matrix cell matches"):
        await run_matrix(None, tmp_path, only="no.such@cell/kill")


@pytest.mark.parametrize("mode", MODES)
async def test_a_point_that_is_never_reached_fails_the_cell(db_urls: DbUrls, mode: str) -> None:
    dbs = _pair(db_urls)
    cell = Cell("effect.after_apply", "charge", mode)
    first = await run_cell(cell, dbs, tx_id="mx-reused")
    assert first.passed, first.line
    # The same tx id again: execute returns the stored outcome and never calls the provider,
    # so the armed point is never reached. That must be a FAIL, never a silent pass.
    again = await run_cell(cell, dbs, tx_id="mx-reused")
    assert not again.passed
    assert again.line.startswith(f"FAIL {cell.name}: effect.after_apply was never reached")
    assert again.crashes == 0
    if mode == "kill":
        assert again.detail["returncode"] == NOT_REACHED


async def test_victim_exits_3_when_its_point_is_not_reached(db_urls: DbUrls) -> None:
    dbs = _pair(db_urls)
    cell = Cell("effect.before_apply", "receipt", "kill")
    assert (await run_cell(cell, dbs, tx_id="mx-done")).passed
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fault_injection.victim",
        "--store",
        dbs.store,
        "--provider",
        dbs.provider,
        "--point",
        cell.point,
        "--position",
        cell.position,
        "--tx-id",
        "mx-done",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    assert proc.returncode == NOT_REACHED, err.decode(errors="replace")[-2000:]


@pytest.mark.parametrize("mode", MODES)
async def test_the_matrix_fails_when_recovery_skips_the_lookup(
    db_urls: DbUrls, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Recovery that never suspects an effect was sent re-applies blindly. The key dedups at the
    # provider, so the counters alone stay right; the checker's lookup-before-resend invariant
    # (provider call log and our ledger) is what must catch it. In kill mode the victim is not
    # patched (it dies before the re-send anyway); the recovering parent is.
    monkeypatch.setattr(Claim, "maybe_sent", property(lambda self: False))
    result = await run_cell(Cell("effect.after_apply", "charge", mode), _pair(db_urls))
    assert not result.passed, result.line
    names = {v.name for v in result.violations}
    assert {"resend_without_lookup", "ledger_resend_without_lookup"} <= names, result.line
    assert "violation(s)" in result.line


async def _tables(url: str) -> list[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda sync: inspect(sync).get_table_names())
    finally:
        await engine.dispose()


async def test_a_waiting_victim_sent_home_touches_nothing(db_urls: DbUrls) -> None:
    dbs = _pair(db_urls)
    cell = Cell("effect.after_apply", "charge", "kill")
    victim = await Victim.start(cell, dbs, "mx-x", wait=True)
    await victim.cancel()
    assert victim.proc.returncode == CANCELLED
    # The databases are fresh: a victim that never got its go created nothing in either.
    assert await _tables(dbs.store) == []
    assert await _tables(dbs.provider) == []
