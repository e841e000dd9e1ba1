"""Every parked saga can be decided: refused reversals, refused steps after the pivot, parked
outbox events, pages of the list, and operator input held to the schema's limits.

The set-ups are the auditor's (park_reject, park_comp, park_outbox); effects are checked in the
fake shop's own database, not only in our bookkeeping.
"""

from __future__ import annotations

from fault_injection.sagas import CHARGE, RECEIPT, RESERVE, order, order_saga
from ledger.effects import REMOTE_ID_MAX, EffectKind
from ledger.states import EffectState, TxState
from orchestrator import review
from orchestrator.engine import Orchestrator
from orchestrator.expressions import ref
from orchestrator.saga import Saga, Step
from providers.fake.faults import FaultKind, FaultRule
from tests.integration.test_review import run_cli
from tests.support.world import World

#: A step after the pivot (the charge): it may not turn the saga back.
NOTIFY = Step(
    "notify",
    "email",
    "send",
    {"to": "buyer@example.com", "template": "shipped", "charge": ref("steps.charge.remote_id")},
    retriable=True,
)


def _resolve(world: World, tx_id: str, op: str, as_state: str, *extra: str) -> str:
    done = run_cli(
        world,
        "review",
        "resolve",
        tx_id,
        "--op",
        op,
        "--as",
        as_state,
        "--operator",
        "ana",
        *(extra if "--reason" in extra else ("--reason", "checked by hand", *extra)),
    )
    assert "Traceback" not in done.stderr, done.stderr
    return f"{done.returncode}:{done.stdout}{done.stderr}"


def _effect(view_effects: list, name: str):  # type: ignore[no-untyped-def,type-arg]
    return next(e for e in view_effects if e.name == name)


async def _decisions(world: World, tx_id: str) -> list[str]:
    return [e.action for e in await world.orch.ledger(tx_id) if e.action == "operator_resolve"]


# -- 1. a refused or lost reversal ----------------------------------------------------------------


async def _park_rejected_refund(world: World) -> str:
    world.shop.faults.add(FaultRule(FaultKind.REJECT, provider="payments", action="refund"))
    result = await world.orch.execute(
        order_saga(max_amount=1000), order("rej", amount=1500), tx_id="parked-reject"
    )
    await world.orch.drain(timeout_seconds=10)
    world.shop.faults.clear()
    return result.tx_id


async def test_a_refused_reversal_waits_for_a_decision_and_the_saga_ends_compensated(
    world: World,
) -> None:
    tx_id = await _park_rejected_refund(world)
    view = await world.orch.get(tx_id)
    assert view.tx.status is TxState.MANUAL_REVIEW
    assert view.tx.error["reason"] == "the provider refused a compensation"  # type: ignore[index]
    refund = _effect(view.compensations, "charge")
    assert refund.state is EffectState.MANUAL_REVIEW and refund.last_error == "rejected"
    assert _effect(view.compensations, "reserve").state is EffectState.PENDING

    listed = run_cli(world, "review", "list")
    assert listed.returncode == 0 and "decide: --op charge --as confirmed\n" in listed.stdout

    # "Not reversed" would leave the charge standing with nothing to undo it: refused, and
    # nothing is written.
    refused = _resolve(world, tx_id, "charge", "failed")
    assert refused.startswith("2:") and "invalid_identifier" in refused
    assert await _decisions(world, tx_id) == []

    stock_parked = await world.shop.stock("sku-1")
    done = _resolve(world, tx_id, "charge", "confirmed", "--reason", "refunded at the bank")
    assert done.startswith("0:") and "now compensating" in done
    await world.orch.drain(timeout_seconds=10)

    final = await world.orch.get(tx_id)
    assert final.tx.status is TxState.COMPENSATED
    assert all(c.state is EffectState.CONFIRMED for c in final.compensations)
    counts = await world.shop.counts()
    # The refund was done by hand (not through the shop); the reservation was released by
    # the saga going on with the rest of its reversals.
    assert (counts["payments.refund"], counts["inventory.release"]) == (0, 1)
    assert await world.shop.stock("sku-1") == stock_parked + 1
    decided = [e for e in await world.orch.ledger(tx_id) if e.action == "operator_resolve"]
    assert decided[0].detail["reason"] == "refunded at the bank"


async def test_a_reversal_in_doubt_cannot_be_failed_into_a_dead_end(world: World) -> None:
    orch = await world.engine(compensation_attempts=2)
    for kind in (FaultKind.LOSE_RESPONSE, FaultKind.LOOKUP_UNAVAILABLE):
        world.shop.faults.add(FaultRule(kind, provider="payments", action="refund", times=None))
    result = await orch.execute(
        order_saga(max_amount=1000), order("comp", amount=1500), tx_id="parked-comp"
    )
    await orch.drain(timeout_seconds=15)
    world.shop.faults.clear()
    assert (await orch.get(result.tx_id)).tx.status is TxState.MANUAL_REVIEW

    refused = _resolve(world, result.tx_id, "charge", "failed")
    assert refused.startswith("2:") and "invalid_identifier" in refused
    assert (await orch.get(result.tx_id)).tx.status is TxState.MANUAL_REVIEW

    refund = (await world.shop.effects("payments.refund"))[0]  # it did happen
    done = _resolve(world, result.tx_id, "charge", "confirmed", "--remote-id", refund.remote_id)
    assert done.startswith("0:"), done
    await orch.drain(timeout_seconds=10)
    assert (await orch.result(result.tx_id)).status is TxState.COMPENSATED
    counts = await world.shop.counts()
    assert (counts["payments.refund"], counts["inventory.release"]) == (1, 1)


# -- 1b. a refused step after the pivot ------------------------------------------------------------


async def test_a_refused_step_after_the_pivot_waits_for_a_decision(world: World) -> None:
    saga = Saga(
        "order_notified",
        inputs={"order_id": str, "sku": str, "amount": int},
        steps=[RESERVE, CHARGE, NOTIFY],
        outbox=[RECEIPT],
    )
    world.shop.faults.add(FaultRule(FaultKind.REJECT, provider="email", action="send"))
    result = await world.orch.execute(saga, order("pivot"), tx_id="parked-pivot")
    await world.orch.drain(timeout_seconds=10)
    world.shop.faults.clear()
    view = await world.orch.get(result.tx_id)
    assert view.tx.status is TxState.MANUAL_REVIEW
    assert view.tx.error["reason"] == "a step after the pivot was rejected"  # type: ignore[index]
    assert _effect(view.operations, "notify").state is EffectState.MANUAL_REVIEW

    refused = _resolve(world, result.tx_id, "notify", "failed")
    assert refused.startswith("2:") and "pivot" in refused
    done = _resolve(world, result.tx_id, "notify", "confirmed", "--reason", "phoned the buyer")
    assert done.startswith("0:") and "now executing" in done
    await world.orch.drain(timeout_seconds=10)
    assert (await world.orch.result(result.tx_id)).status is TxState.COMMITTED
    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["payments.refund"]) == (1, 0)


# -- 2. a committed saga's parked outbox event ----------------------------------------------------


async def test_a_parked_outbox_event_is_listed_counted_and_resolved(world: World) -> None:
    orch = await world.engine(reconcile_attempts=2)
    for kind in (FaultKind.LOSE_RESPONSE, FaultKind.LOOKUP_UNAVAILABLE):
        world.shop.faults.add(FaultRule(kind, provider="email", action="send", times=None))
    result = await orch.execute(order_saga(), order("p-outbox"), tx_id="parked-outbox")
    await orch.drain(timeout_seconds=15)
    world.shop.faults.clear()
    view = await orch.get(result.tx_id)
    assert view.tx.status is TxState.COMMITTED
    assert _effect(view.outbox, "receipt").state is EffectState.MANUAL_REVIEW

    assert (await orch.status())["manual_review"] == 1
    listed = run_cli(world, "review", "list")
    assert result.tx_id in listed.stdout and "outbox event is parked" in listed.stdout
    assert "decide: --op receipt --as confirmed|failed" in listed.stdout

    sent = (await world.shop.effects("email.send"))[0]
    done = _resolve(world, result.tx_id, "receipt", "confirmed", "--remote-id", sent.remote_id)
    assert done.startswith("0:") and "now committed" in done
    final = await orch.get(result.tx_id)
    receipt = _effect(final.outbox, "receipt")
    assert (receipt.state, receipt.remote_id) == (EffectState.CONFIRMED, sent.remote_id)
    assert (await orch.status())["manual_review"] == 0
    assert "nothing is waiting for review" in run_cli(world, "review", "list").stdout
    assert (await world.shop.counts())["email.send"] == 1


# -- 3. the list pages instead of stopping silently ---------------------------------------------


async def _park_charges(world: World, n: int) -> list[str]:
    for kind in (FaultKind.LOSE_RESPONSE, FaultKind.LOOKUP_UNAVAILABLE):
        world.shop.faults.add(FaultRule(kind, provider="payments", action="charge", times=None))
    orch = await world.engine(reconcile_attempts=1)
    ids = []
    for i in range(n):
        result = await orch.execute(order_saga(), order(f"page-{i}"), tx_id=f"parked-page-{i}")
        ids.append(result.tx_id)
    await orch.drain(timeout_seconds=15)
    world.shop.faults.clear()
    for tx_id in ids:
        assert (await orch.get(tx_id)).tx.status is TxState.MANUAL_REVIEW
    return ids


async def test_the_list_says_how_many_more_and_pages_on(world: World) -> None:
    ids = await _park_charges(world, 3)
    first = run_cli(world, "review", "list", "--limit", "2")
    assert first.returncode == 0 and "1 more: --skip 2" in first.stdout
    rest = run_cli(world, "review", "list", "--limit", "2", "--skip", "2")
    assert rest.returncode == 0 and "more:" not in rest.stdout
    shown = [t for t in ids if t + " " in first.stdout or t + " " in rest.stdout]
    assert shown == ids
    page = await review.list_parked(world.orch, limit=2, skip=1)
    assert ([p.tx_id for p in page.items], page.total, page.more) == (ids[1:], 3, 0)
    bad = run_cli(world, "review", "list", "--limit", "0")
    assert bad.returncode == 2 and "invalid_identifier" in bad.stderr


# -- 4. operator input held to the schema's limits ----------------------------------------------


async def test_over_long_or_empty_operator_input_is_refused_not_cut(world: World) -> None:
    (tx_id,) = await _park_charges(world, 1)
    charge = (await world.shop.effects("payments.charge"))[0]
    for extra in (
        ("--remote-id", "r" * (REMOTE_ID_MAX + 1)),
        ("--remote-id", ""),
        ("--remote-id", "  "),
        ("--reason", "x" * (review.REASON_MAX + 1)),
    ):
        refused = _resolve(world, tx_id, "charge", "confirmed", *extra)
        assert refused.startswith("2:") and "invalid_identifier" in refused, (extra, refused)
        assert "sqlalchemy" not in refused.lower() and "INSERT" not in refused
    assert await _decisions(world, tx_id) == []
    assert (await world.orch.get(tx_id)).tx.status is TxState.MANUAL_REVIEW

    # At the limits exactly, everything lands whole.
    remote_id = charge.remote_id.ljust(REMOTE_ID_MAX, "~")
    reason = "y" * review.REASON_MAX
    status = await review.resolve(
        world.orch,
        tx_id,
        "charge",
        as_state="confirmed",
        reason=reason,
        operator="ana",
        remote_id=remote_id,
    )
    assert status is TxState.EXECUTING
    stored = _effect((await world.orch.get(tx_id)).operations, "charge")
    assert stored.remote_id == remote_id
    decided = [e for e in await world.orch.ledger(tx_id) if e.action == "operator_resolve"]
    assert decided[0].detail["reason"] == reason


async def test_decisions_read_the_transactions_own_definition(world: World) -> None:
    """``review show`` lists, per parked effect, the decisions ``resolve`` accepts."""
    tx_id = await _park_rejected_refund(world)
    fresh = await Orchestrator.open(world.urls.store, providers=world.shop.providers())
    world.extra.append(fresh)  # knows no saga by name: reads the pinned definition
    shown = await review.show(fresh, tx_id)
    assert [(p.kind, p.name, p.decisions) for p in shown.parked] == [
        (EffectKind.COMPENSATION.value, "charge", ("confirmed",))
    ]
