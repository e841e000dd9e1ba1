"""A recovery pass's reads of due outbox events: by the store's clock, limited, and built once.

Every worker runs :func:`ledger.effects.due` on every pass, idle ones included, so its statement
is built once per store (:meth:`ledger.store.Store.statement`) and its limit is bound. What
could break: a cached statement that kept an old clock (a due event never seen again, or one
sent before its backoff ran out), or a limit frozen at the first caller's value.
"""

from __future__ import annotations

from typing import Any

import pytest

from ledger import effects
from ledger.effects import EffectKind
from ledger.states import EffectState, TxState
from providers.fake.faults import FaultKind, FaultRule
from tests.support.sagas import order, order_saga
from tests.support.world import World

#: Longer than any test here: an event that failed waits this long before it is due again.
BACKOFF_S = 60.0


async def _events_waiting(world: World, n: int) -> list[str]:
    """Run ``n`` sagas whose receipt email fails, on an engine that then backs off for
    :data:`BACKOFF_S`; their tx ids."""
    slow = await world.engine(backoff_initial_seconds=BACKOFF_S, backoff_max_seconds=BACKOFF_S)
    world.shop.faults.add(
        FaultRule(FaultKind.FAIL_BEFORE, provider="email", action="send", times=None)
    )
    tx_ids = []
    for i in range(n):
        result = await slow.execute(order_saga(), order(f"due-{i}"))
        assert result.status is TxState.COMMITTED
        tx_ids.append(result.tx_id)
    await slow.store.riders.settle()
    world.shop.faults.clear()
    for tx_id in tx_ids:
        [event] = (await world.orch.get(tx_id)).outbox
        # The shop failed before sending; to us the answer is lost: in doubt, to be looked up.
        assert event.state is EffectState.UNKNOWN
    return tx_ids


async def _due(world: World, *, limit: int = 100) -> list[str]:
    async with world.orch.store.read() as conn:
        found = await effects.due(conn, EffectKind.OUTBOX, world.orch.store, limit=limit)
    return [e.tx_id for e in found]


async def test_due_events_follow_the_stores_clock_and_limit(world: World) -> None:
    tx_ids = await _events_waiting(world, 3)
    assert await _due(world) == []  # inside their backoff

    world.orch.store.advance_clock(BACKOFF_S + 1)
    assert sorted(await _due(world)) == sorted(tx_ids)
    assert len(await _due(world, limit=2)) == 2
    assert len(await _due(world, limit=1)) == 1
    assert sorted(await _due(world)) == sorted(tx_ids)  # not the limit of the call before

    world.orch.store.advance_clock(-(BACKOFF_S + 1))
    assert await _due(world) == []  # back inside the backoff: the clock is the store's again


async def test_idle_recovery_passes_build_the_due_statement_once(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[Any] = []
    original = effects._due_statement

    def counting(kind: EffectKind, now: Any) -> Any:
        built.append(kind)
        return original(kind, now)

    monkeypatch.setattr(effects, "_due_statement", counting)
    before = world.orch.store.stats.snapshot()
    for _ in range(3):
        report = await world.orch.recover()
        assert (report.transactions, report.events) == (0, 0)
    assert built == [EffectKind.OUTBOX]
    # Two statements an idle pass: the claim (nothing due) and the due events.
    assert world.orch.store.stats.statements - before.statements == 6

    world.orch.store.advance_clock(1)  # a new clock offset is a new statement, once
    await world.orch.recover()
    await world.orch.recover()
    assert built == [EffectKind.OUTBOX, EffectKind.OUTBOX]


async def test_a_recovery_pass_sends_an_event_once_its_backoff_is_over(world: World) -> None:
    [tx_id] = await _events_waiting(world, 1)
    report = await world.orch.recover()
    assert report.events == 0 and (await world.shop.counts())["email.send"] == 0

    world.orch.store.advance_clock(BACKOFF_S + 1)
    report = await world.orch.recover()
    assert report.events == 1 and report.tx_ids == [tx_id]
    assert (await world.shop.counts())["email.send"] == 1
