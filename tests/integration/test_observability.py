"""Metrics and `agent-txn status` report what the database says."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

from fault_injection.sagas import order, order_saga
from orchestrator.worker import Worker
from providers.fake.faults import FaultKind, FaultRule
from tests.support.world import World


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_metrics_and_status(world: World) -> None:
    world.shop.faults.add(FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge"))
    await world.orch.execute(order_saga(), order("1"))
    world.shop.faults.add(FaultRule(FaultKind.REJECT, provider="payments", action="charge"))
    await world.orch.execute(order_saga(), order("2"))
    metrics = world.orch.metrics
    sample = metrics.registry.get_sample_value
    assert sample("agent_txn_effects_total", {"kind": "operation", "outcome": "unknown"}) == 1
    assert sample("agent_txn_effects_total", {"kind": "operation", "outcome": "failed"}) == 1
    assert sample("agent_txn_effects_total", {"kind": "compensation", "outcome": "confirmed"}) == 1
    assert sample("agent_txn_reconcile_attempts_total") == 1

    status = await world.orch.status()
    assert status["transactions"] == {"committed": 1, "compensated": 1}
    assert status["effects"]["outbox"] == {"confirmed": 1}
    assert status["manual_review"] == 0

    await metrics.refresh(world.orch.store)
    assert sample("agent_txn_transactions", {"status": "committed"}) == 1
    port = _free_port()
    metrics.serve(port)
    url = f"http://127.0.0.1:{port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    assert 'agent_txn_transactions{status="compensated"} 1.0' in body

    await Worker(world.orch, poll_seconds=0.01).run(once=True)
    assert (sample("agent_txn_claim_latency_seconds_count") or 0) >= 1
