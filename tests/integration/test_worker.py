"""Workers: in-process loops, a SIGTERM during a provider call, several worker processes."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
from pathlib import Path

import pytest

from fault_injection.invariants import check_invariants
from fault_injection.sagas import order, order_saga
from ledger.states import TxState
from orchestrator.config import MAX_POLL_SECONDS
from orchestrator.crashpoints import SimulatedCrash
from orchestrator.worker import Worker
from tests.support.world import ONE_PASS_CALL_TIMEOUT_S, World

ROOT = Path(__file__).resolve().parents[2]


async def _crash_many(world: World, n: int, point: str = "effect.after_apply") -> list[str]:
    """``n`` sagas, each dying after its charge was applied (in doubt, lease 1 s)."""
    orch = await world.engine(lease_seconds=1)
    ids = []
    for i in range(n):
        when = (lambda c: c.get("name") == "charge") if point.startswith("effect.") else None
        orch.crashpoints.arm(point, when=when)
        with pytest.raises(SimulatedCrash):
            await orch.execute(order_saga(), order(f"w{i}"), tx_id=f"w-{i}")
        ids.append(f"w-{i}")
    await orch.abandon()
    return ids


async def test_worker_finishes_crashed_sagas(world: World) -> None:
    ids = await _crash_many(world, 12)
    orch = await world.engine(call_timeout_seconds=ONE_PASS_CALL_TIMEOUT_S)
    orch.store.advance_clock(5)
    stats = await Worker(orch, concurrency=4, poll_seconds=0.01).run(once=True)
    assert stats.claimed == 12 and stats.finished == 12
    for tx_id in ids:
        assert (await orch.result(tx_id)).status is TxState.COMMITTED
    report = await check_invariants(world.urls.store, world.urls.provider)
    assert report.ok, report.violations
    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (12, 12)


async def test_workers_share_work_without_double_effects(world: World) -> None:
    ids = await _crash_many(world, 20, point="prepare.after_commit")
    workers = []
    for _ in range(3):
        orch = await world.engine(call_timeout_seconds=ONE_PASS_CALL_TIMEOUT_S)
        orch.store.advance_clock(5)
        workers.append(Worker(orch, concurrency=3, poll_seconds=0.01))
    stats = await asyncio.gather(*(w.run(once=True) for w in workers))
    assert sum(s.finished for s in stats) >= 20
    report = await check_invariants(world.urls.store, world.urls.provider)
    assert report.ok, report.violations
    assert (await world.shop.counts())["payments.charge"] == len(ids)


async def test_a_worker_with_sagas_in_hand_claims_again_once_half_its_slots_are_free(
    world: World,
) -> None:
    await _crash_many(world, 6, point="prepare.after_commit")
    orch = await world.engine(call_timeout_seconds=ONE_PASS_CALL_TIMEOUT_S)
    orch.store.advance_clock(5)
    worker = Worker(orch, concurrency=4, poll_seconds=0.01)
    assert worker.refill_at == 2
    loop = asyncio.get_running_loop()
    in_hand = [loop.create_future() for _ in range(3)]  # three sagas still being driven
    for job in in_hand:
        worker._spawn(job)

    # One slot free: the pass waits for a saga to finish rather than claiming one.
    waiting = asyncio.ensure_future(worker.run_pass())
    await asyncio.sleep(0.05)
    assert not waiting.done() and worker.stats.claimed == 0
    in_hand[0].set_result(None)
    assert await waiting == 1 and worker.stats.claimed == 0
    # Two free: the next pass claims two in one statement.
    await worker.run_pass()
    assert worker.stats.claimed == 2 and worker.stats.passes == 1
    for job in in_hand[1:]:
        job.set_result(None)
    stats = await worker.run(once=True)
    assert stats.claimed == 6
    with pytest.raises(ValueError):
        Worker(orch, concurrency=4, refill_at=5)


def _worker_cmd(world: World, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "--log-level",
        "INFO",
        "worker",
        "--db",
        world.urls.store,
        "--poll-seconds",
        "0.05",
        *extra,
    ]


async def _spawn(cmd: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *cmd,
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_sigterm_during_a_provider_call_hands_the_saga_over(world: World) -> None:
    await _crash_many(world, 1, point="prepare.after_commit")
    await asyncio.sleep(1.1)  # the dead holder's 1 s lease runs out
    env = {"AGENT_TXN_TEST_PROVIDER_URL": world.urls.provider, "SLOW_SECONDS": "2"}
    proc = await _spawn(
        _worker_cmd(world, "--app", "tests.support.slowshop:build", "--worker-id", "first"), env
    )
    charge_key = None
    for _ in range(200):  # wait until the slow charge is in flight at the provider
        effects_ = await world.shop.effects("payments.charge")
        if effects_:
            charge_key = effects_[0].key
            break
        await asyncio.sleep(0.05)
    assert charge_key is not None, "the worker never called the provider"
    proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()

    second = await world.engine(worker_id="second")
    await second.drain(timeout_seconds=10)
    result = await second.result("w-0")
    assert result.status is TxState.COMMITTED
    owners = [e.detail.get("owner") for e in await second.ledger("w-0") if e.action == "claim"]
    assert "first" in owners and "second" in owners  # the ledger shows the hand-over
    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["email.send"]) == (1, 1)
    report = await check_invariants(world.urls.store, world.urls.provider)
    assert report.ok, report.violations


async def test_sigterm_while_the_worker_is_opening_ends_it_cleanly(
    world: World, tmp_path: Path
) -> None:
    # The signal handlers are installed before the providers and the store are opened: a stop
    # asked for then is honoured once they are open (exit 0, nothing claimed), not the signal's
    # default action killing the process half-way through its opening.
    await _crash_many(world, 1, point="prepare.after_commit")
    await asyncio.sleep(1.1)  # due: a worker that ran would claim it
    marker = tmp_path / "opening"
    env = {
        "AGENT_TXN_TEST_PROVIDER_URL": world.urls.provider,
        "OPENING_MARKER": str(marker),
        "OPEN_SECONDS": "2",
    }
    proc = await _spawn(
        _worker_cmd(world, "--app", "tests.support.slowshop:build_slowly", "--worker-id", "early"),
        env,
    )
    for _ in range(600):
        if marker.exists():
            break
        await asyncio.sleep(0.05)
    assert marker.exists(), "the worker never started opening its providers"
    proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    owners = [e.detail.get("owner") for e in await world.orch.ledger("w-0") if e.action == "claim"]
    assert "early" not in owners


SEVERAL = 96  # the world's shop stocks 100 of the sku: every order still fills


async def test_several_worker_processes(world: World) -> None:
    if world.urls.backend != "postgres":
        pytest.skip("several writer processes are the PostgreSQL deployment")
    # Enough work that the processes' start-up (about a second of imports each, not started
    # at the same instant) is small beside it: with 40 sagas, as fast as a worker drains
    # them, the first two processes up could finish all before the others claimed any.
    ids = await _crash_many(world, SEVERAL, point="prepare.after_commit")
    await asyncio.sleep(1.1)
    procs = [
        await _spawn(
            _worker_cmd(
                world,
                "--once",
                "--fake-shop",
                world.urls.provider,
                "--concurrency",
                "4",
                "--worker-id",
                f"p{i}",
            ),
            {},
        )
        for i in range(4)
    ]
    outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 120)
    assert all(p.returncode == 0 for p in procs), [o[1].decode()[-500:] for o in outs]
    # SKIP LOCKED hands out disjoint batches: every process got a share of the work.
    finished = [int(o[0].decode().split("finished ")[1].split(",")[0]) for o in outs]
    assert sum(finished) >= SEVERAL and sum(n > 0 for n in finished) >= 3, finished
    first = await world.engine()
    await first.drain(timeout_seconds=10)
    for tx_id in ids:
        assert (await first.result(tx_id)).status is TxState.COMMITTED
    report = await check_invariants(world.urls.store, world.urls.provider)
    assert report.ok, report.violations
    assert (await world.shop.counts())["payments.charge"] == SEVERAL


@pytest.mark.parametrize("poll_seconds", [0.0, -1.0, math.inf, math.nan, MAX_POLL_SECONDS + 1])
async def test_a_worker_refuses_a_poll_interval_without_end(
    world: World, poll_seconds: float
) -> None:
    # inf: an idle worker would wait for ever before it polled again.
    orch = await world.engine()
    with pytest.raises(ValueError, match="poll_seconds"):
        Worker(orch, poll_seconds=poll_seconds)
    assert Worker(orch, poll_seconds=MAX_POLL_SECONDS).poll_seconds == MAX_POLL_SECONDS


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # The engine's settings refused these with pydantic's traceback.
        (["--lease-seconds", "5000"], "error: --lease-seconds: Input should be less than or"),
        (["--lease-seconds", "inf"], "error: --lease-seconds: Input should be less than or"),
        (["--worker-id", "w" * 129], "error: --worker-id: String should have at most 128"),
        (["--worker-id", ""], "error: --worker-id: String should have at least 1"),  # was unset
        (["--fake-shop", ""], "error: --fake-shop: Could not parse"),  # was taken as no shop
        # Accepted, and then an idle worker never polled again.
        (["--poll-seconds", "inf"], "Invalid value for '--poll-seconds'"),
    ],
)
def test_the_worker_command_refuses_settings_out_of_range_in_one_line(
    args: list[str], message: str, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from orchestrator.cli import app

    db = tmp_path / "store.db"
    got = CliRunner().invoke(app, ["worker", "--db", f"sqlite:///{db}", "--once", *args])
    assert got.exit_code == 2, got.output
    assert message in got.output
    assert "Traceback" not in got.output
    assert not db.exists()  # refused before anything was opened


def test_a_metrics_port_in_use_is_said_as_the_ports_problem(tmp_path: Path) -> None:
    import socket

    from typer.testing import CliRunner

    from orchestrator.cli import app

    db = f"sqlite:///{tmp_path / 'store.db'}"
    assert CliRunner().invoke(app, ["db", "upgrade", "--db", db]).exit_code == 0
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        got = CliRunner().invoke(app, ["worker", "--db", db, "--once", "--metrics-port", str(port)])
    assert got.exit_code == 2, got.output
    # An OSError, it was read as the store's: "StoreUnavailable: database unreachable".
    assert f"error: --metrics-port {port}: Address already in use" in got.output
