"""Manual review round trip: parked by an always-unavailable lookup, resolved by the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fault_injection.invariants import check_invariants
from fault_injection.sagas import order, order_saga
from ledger.states import EffectState, TxState
from providers.fake.faults import FaultKind, FaultRule
from tests.support.world import World

ROOT = Path(__file__).resolve().parents[2]


async def _park(world: World) -> str:
    for kind in (FaultKind.LOSE_RESPONSE, FaultKind.LOOKUP_UNAVAILABLE):
        world.shop.faults.add(FaultRule(kind, provider="payments", action="charge", times=None))
    result = await world.orch.execute(order_saga(), order("42"), tx_id="parked-42")
    await world.orch.drain(timeout_seconds=10)
    world.shop.faults.clear()
    view = await world.orch.get(result.tx_id)
    assert view.tx.status is TxState.MANUAL_REVIEW
    charge = next(o for o in view.operations if o.name == "charge")
    assert charge.state is EffectState.MANUAL_REVIEW and charge.last_error == "lookup_unavailable"
    return result.tx_id


def run_cli(world: World, *args: str) -> subprocess.CompletedProcess[str]:
    """``agent-txn ARGS --db <the world's store>`` in a fresh process (also used by
    ``test_review_parked.py``)."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args, "--db", world.urls.store],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("decision", ["confirmed", "failed"])
async def test_review_round_trip(world: World, decision: str) -> None:
    tx_id = await _park(world)
    listed = run_cli(world, "review", "list")
    assert (
        listed.returncode == 0 and tx_id in listed.stdout and "lookup_unavailable" in listed.stdout
    )

    charge = (await world.shop.effects("payments.charge"))[0]  # the effect did happen
    extra = ["--remote-id", charge.remote_id or ""] if decision == "confirmed" else []
    done = run_cli(
        world,
        "review",
        "resolve",
        tx_id,
        "--op",
        "charge",
        "--as",
        decision,
        "--reason",
        "checked the payment dashboard",
        "--operator",
        "ana",
        *extra,
    )
    assert done.returncode == 0, done.stderr
    await world.orch.drain(timeout_seconds=10)

    final = await world.orch.result(tx_id)
    ledger = await world.orch.ledger(tx_id)
    decided = [e for e in ledger if e.action == "operator_resolve"]
    assert decided and decided[0].detail["operator"] == "ana"
    assert decided[0].detail["reason"] == "checked the payment dashboard"
    counts = await world.shop.counts()
    if decision == "confirmed":
        assert final.status is TxState.COMMITTED and final.error is None
        assert (counts["payments.charge"], counts["email.send"]) == (1, 1)
        report = await check_invariants(world.urls.store, world.urls.provider)
        assert report.ok, report.violations
    else:
        # The operator said it never happened: the reservation is released. (Here the operator
        # was wrong on purpose: the provider's own table still shows the charge, and the
        # checker says so — a person's mistake is evidence too.)
        assert final.status is TxState.COMPENSATED
        assert counts["inventory.release"] == 1


async def test_resolving_something_not_parked_is_refused(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("43"))
    done = run_cli(
        world,
        "review",
        "resolve",
        result.tx_id,
        "--op",
        "charge",
        "--as",
        "failed",
        "--reason",
        "x",
        "--operator",
        "ana",
    )
    assert (
        done.returncode == 2 and "not_resolvable" in done.stderr and "Traceback" not in done.stderr
    )
    bad = run_cli(
        world,
        "review",
        "resolve",
        result.tx_id,
        "--op",
        "charge",
        "--as",
        "maybe",
        "--reason",
        "x",
        "--operator",
        "ana",
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["--as", "failed", "--reason", "x", "--operator", ""], "operator"),  # said "reason"
        (["--as", "confirmed", "--reason", " ", "--operator", "ana"], "reason"),
        # A failed effect has no provider id: the id was dropped without a word.
        (
            ["--as", "failed", "--reason", "x", "--operator", "ana", "--remote-id", "ch_1"],
            "remote_id",
        ),
    ],
)
async def test_a_decision_with_a_missing_or_stray_field_names_it_and_changes_nothing(
    world: World, extra: list[str], field: str
) -> None:
    tx_id = await _park(world)
    before = await world.orch.get(tx_id)
    done = run_cli(world, "review", "resolve", tx_id, "--op", "charge", *extra)
    assert done.returncode == 2, done.stderr
    assert f'"field":"{field}"' in done.stderr and "Traceback" not in done.stderr
    after = await world.orch.get(tx_id)
    assert after.tx.status is TxState.MANUAL_REVIEW
    assert after.operations == before.operations  # the charge still parked, as it was
