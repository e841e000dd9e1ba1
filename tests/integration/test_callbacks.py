"""Lifecycle callback delivery on both backends, against a real local HTTP receiver.

Pinned here: a run is POSTed with its payload and a run-id header that stays the same on every
attempt; a 2xx ends it delivered (and it is never sent again); anything else is retried after a
backoff, at most 5 attempts in all, then it ends failed; nothing the receiver answers is stored;
a worker whose fence moved cannot record; a lost 5th attempt is never followed by a 6th; claims of
concurrent workers are disjoint; operator requeue counts each category and honours its limit;
the worker loop delivers callbacks in its pass.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx
import pytest

from ledger import callbacks
from ledger.callbacks import CallbackRunRow
from ledger.schema import callback_runs
from ledger.store import Store
from orchestrator.callback_delivery import RUN_ID_HEADER, backoff_ms, deliver_due
from orchestrator.engine import Orchestrator
from orchestrator.worker import Worker
from tests.support.audit_rows import seed_callbacks, seed_command, seed_execution
from tests.support.receiver import SECRET_BODY, receiver
from tests.support.world import fast_settings

if TYPE_CHECKING:
    from tests.conftest import DbUrls

LEASE_MS = 30_000
#: Longer than any backoff before a 5th attempt (2 ** 3 s), so every retry is due after it.
PAST_BACKOFF_S = 60


@pytest.fixture
async def store(db_urls: DbUrls) -> AsyncIterator[Store]:
    s = await Store.open(db_urls.store, auto_upgrade="empty")
    try:
        await seed_command(s)
        await seed_execution(s, "e1")
        yield s
    finally:
        await s.close()


async def _run(store: Store, run_id: str) -> CallbackRunRow:
    async with store.read() as conn:
        rows = {r.run_id: r for r in await callbacks.for_execution(conn, "e1")}
    return rows[run_id]


async def _claim(
    store: Store, owner: str, *, lease_ms: int = LEASE_MS, limit: int = 10
) -> list[CallbackRunRow]:
    async with store.transaction() as work:
        return await callbacks.claim_due(work, owner=owner, lease_ms=lease_ms, limit=limit)


async def _record(
    store: Store,
    run: CallbackRunRow,
    *,
    delivered: bool = False,
    error: str | None = "http 500",
    retry_in_ms: int | None = 0,
) -> bool:
    async with store.transaction() as work:
        return await callbacks.record(
            work,
            run.run_id,
            fence=run.fence,
            delivered=delivered,
            error=error,
            retry_in_ms=retry_in_ms,
        )


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"


# -- delivery -------------------------------------------------------------------------------------


async def test_a_2xx_delivers_once_with_the_run_id_header_and_the_payload(store: Store) -> None:
    with receiver([204]) as hook:
        [run_id] = await seed_callbacks(store, "e1", [hook.url])
        report = await deliver_due(store, owner="w1", lease_ms=LEASE_MS)
        assert (report.claimed, report.delivered, report.retrying, report.failed) == (1, 1, 0, 0)
        again = await deliver_due(store, owner="w1", lease_ms=LEASE_MS)
    assert again.claimed == 0
    assert hook.run_ids == [run_id]
    assert hook.requests[0].path == "/hook"
    assert hook.requests[0].body == {
        "event": "succeeded",
        "execution_id": "e1",
        "status": "succeeded",
    }
    row = await _run(store, run_id)
    assert (row.state, row.attempts, row.last_error, row.lease_owner) == (
        "delivered",
        1,
        None,
        None,
    )


async def test_a_failing_receiver_gets_five_attempts_with_one_run_id_then_the_run_fails(
    store: Store,
) -> None:
    with receiver([500]) as hook:
        [run_id] = await seed_callbacks(store, "e1", [hook.url])
        outcomes = []
        for _ in range(8):  # more passes than attempts: the cap, not the loop, ends it
            report = await deliver_due(store, owner="w1", lease_ms=LEASE_MS)
            outcomes.append((report.claimed, report.retrying, report.failed))
            store.advance_clock(PAST_BACKOFF_S)
    assert hook.run_ids == [run_id] * 5
    assert hook.effects == {run_id}
    assert outcomes == [(1, 1, 0)] * 4 + [(1, 0, 1)] + [(0, 0, 0)] * 3
    row = await _run(store, run_id)
    assert (row.state, row.attempts, row.last_error) == ("failed", 5, "http 500")
    assert SECRET_BODY not in str(row)


async def test_a_retry_waits_for_its_backoff(store: Store) -> None:
    with receiver([503, 200]) as hook:
        [run_id] = await seed_callbacks(store, "e1", [hook.url])
        await deliver_due(store, owner="w1", lease_ms=LEASE_MS)
        row = await _run(store, run_id)
        assert (row.state, row.attempts, row.last_error) == ("pending", 1, "http 503")
        assert row.next_attempt_at is not None
        # Not due yet: the backoff after a first failure is up to a second, so push the due time
        # out of reach and check a pass leaves it alone.
        async with store.transaction() as work:
            await work.conn.execute(
                callback_runs.update().values(next_attempt_at=row.next_attempt_at + 3_600_000)
            )
        assert (await deliver_due(store, owner="w1", lease_ms=LEASE_MS)).claimed == 0
        store.advance_clock(3_601)
        report = await deliver_due(store, owner="w1", lease_ms=LEASE_MS)
    assert report.delivered == 1
    assert hook.run_ids == [run_id, run_id]
    row = await _run(store, run_id)
    assert (row.state, row.attempts, row.last_error) == ("delivered", 2, None)


async def test_a_network_error_is_an_attempt_recorded_by_its_type_name(store: Store) -> None:
    [run_id] = await seed_callbacks(store, "e1", [_closed_port_url()])
    report = await deliver_due(store, owner="w1", lease_ms=LEASE_MS)
    assert (report.claimed, report.retrying) == (1, 1)
    row = await _run(store, run_id)
    assert (row.state, row.attempts, row.last_error) == ("pending", 1, "ConnectError")


async def test_a_target_that_can_never_work_fails_at_once(store: Store) -> None:
    [run_id] = await seed_callbacks(store, "e1", ["ftp://127.0.0.1/hook"])
    report = await deliver_due(store, owner="w1", lease_ms=LEASE_MS)
    assert (report.claimed, report.failed, report.retrying) == (1, 1, 0)
    row = await _run(store, run_id)
    assert (row.state, row.attempts, row.last_error) == ("failed", 1, "UnsupportedProtocol")


async def test_each_target_of_an_execution_gets_its_own_run_id(store: Store) -> None:
    with receiver([200]) as a, receiver([200]) as b:
        ids = await seed_callbacks(store, "e1", [a.url, b.url])
        report = await deliver_due(store, owner="w1", lease_ms=LEASE_MS)
    assert report.delivered == 2
    assert a.run_ids + b.run_ids == ids
    assert len(set(ids)) == 2


def test_backoff_grows_and_is_capped() -> None:
    import random

    rng = random.Random(7)
    assert all(0 <= backoff_ms(1, rng=rng) <= 1_000 for _ in range(100))
    assert all(0 <= backoff_ms(4, rng=rng) <= 8_000 for _ in range(100))
    assert max(backoff_ms(4, rng=rng) for _ in range(200)) > 1_000  # it does grow
    assert all(backoff_ms(40, rng=rng) <= 300_000 for _ in range(100))


# -- fencing --------------------------------------------------------------------------------------


async def test_a_worker_whose_fence_moved_cannot_record(store: Store) -> None:
    [run_id] = await seed_callbacks(store, "e1", ["http://127.0.0.1:9/hook"])
    [first] = await _claim(store, "w1", lease_ms=1_000)
    store.advance_clock(2)  # w1's lease expires; w2 reclaims the run
    [second] = await _claim(store, "w2")
    assert (second.run_id, second.fence, second.attempts) == (run_id, first.fence + 1, 2)
    assert not await _record(store, first, delivered=True, error=None, retry_in_ms=None)
    row = await _run(store, run_id)
    assert (row.state, row.lease_owner, row.fence) == ("running", "w2", second.fence)
    assert await _record(store, second, delivered=True, error=None, retry_in_ms=None)
    assert (await _run(store, run_id)).state == "delivered"
    assert not await _record(store, second)  # a finished run takes no second outcome


async def test_deliver_due_reports_an_outcome_refused_by_a_moved_fence(store: Store) -> None:
    [run_id] = await seed_callbacks(store, "e1", ["http://receiver.test/hook"])
    seen: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        # While w1 is sending, its lease runs out and w2 claims the run.
        seen.append(request.headers[RUN_ID_HEADER])
        store.advance_clock(5)
        assert [r.run_id for r in await _claim(store, "w2")] == [run_id]
        return httpx.Response(200)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        report = await deliver_due(store, owner="w1", lease_ms=1_000, client=client)
    assert (report.claimed, report.delivered, report.fenced_out) == (1, 0, 1)
    assert seen == [run_id]
    row = await _run(store, run_id)
    assert (row.state, row.lease_owner) == ("running", "w2")


async def test_a_lost_fifth_attempt_is_never_followed_by_a_sixth(store: Store) -> None:
    [run_id] = await seed_callbacks(store, "e1", ["http://127.0.0.1:9/hook"])
    for attempt in range(1, 6):  # every holder dies with the lease
        [claimed] = await _claim(store, f"w{attempt}", lease_ms=1_000)
        assert claimed.attempts == attempt
        store.advance_clock(2)
    assert await _claim(store, "w6") == []
    row = await _run(store, run_id)
    assert (row.state, row.attempts, row.last_error) == ("failed", 5, "lease_expired")


async def test_concurrent_claimers_take_disjoint_runs(store: Store, db_urls: DbUrls) -> None:
    targets = [f"http://127.0.0.1:9/hook/{i}" for i in range(30)]
    ids = await seed_callbacks(store, "e1", targets)
    other = await Store.open(db_urls.store, auto_upgrade="never")
    try:
        a, b = await asyncio.gather(_claim(store, "w1", limit=20), _claim(other, "w2", limit=20))
    finally:
        await other.close()
    got_a, got_b = {r.run_id for r in a}, {r.run_id for r in b}
    assert not got_a & got_b
    assert got_a | got_b == set(ids)


# -- requeue --------------------------------------------------------------------------------------


async def _requeue(
    store: Store, *, older_than_ms: int = 300_000, limit: int = 500
) -> dict[str, int]:
    async with store.transaction() as work:
        return await callbacks.requeue(work, older_than_ms=older_than_ms, limit=limit)


async def test_requeue_counts_each_category_and_leaves_the_rest(store: Store) -> None:
    # Each run is driven to its state before the next exists, so every claim takes only it.
    async def new(name: str) -> CallbackRunRow:
        [run_id] = await seed_callbacks(store, "e1", [f"http://127.0.0.1:9/{name}"])
        [claimed] = await _claim(store, "w1")
        assert claimed.run_id == run_id
        return claimed

    run = await new("failed_out")  # five failed attempts: none left
    for _ in range(4):
        assert await _record(store, run)
        [run] = await _claim(store, "w1")
    assert await _record(store, run)
    assert await _record(store, await new("failed_early"), error="X", retry_in_ms=None)
    assert await _record(store, await new("done"), delivered=True, error=None)
    assert await _record(store, await new("stale_pending"), retry_in_ms=3_600_000)  # backing off
    [live] = await seed_callbacks(store, "e1", ["http://127.0.0.1:9/live_running"])
    assert [r.run_id for r in await _claim(store, "w1", lease_ms=10**9)] == [live]
    [lost] = await seed_callbacks(store, "e1", ["http://127.0.0.1:9/stale_running"])
    assert [r.run_id for r in await _claim(store, "w1", lease_ms=1_000)] == [lost]
    store.advance_clock(600)  # all of the above is stale now (older than 300 s)
    await seed_callbacks(store, "e1", ["http://127.0.0.1:9/young_pending"])
    # young_running: its lease expired, but its holder touched it seconds ago (shaped directly:
    # any claim now would take the older stale_running first).
    [young_running] = await seed_callbacks(store, "e1", ["http://127.0.0.1:9/young_running"])
    async with store.transaction() as work:
        await work.conn.execute(
            callback_runs.update()
            .where(callback_runs.c.run_id == young_running)
            .values(
                state="running",
                lease_owner="w9",
                lease_until=work.db_now - 1,
                fence=1,
                attempts=1,
                updated_at=work.now_ms,
            )
        )
    async with store.read() as conn:
        before = {r.target.rsplit("/", 1)[1]: r for r in await callbacks.for_execution(conn, "e1")}
    assert {name: (r.state, r.attempts) for name, r in before.items()} == {
        "failed_out": ("failed", 5),
        "failed_early": ("failed", 1),
        "done": ("delivered", 1),
        "stale_pending": ("pending", 1),
        "live_running": ("running", 1),
        "stale_running": ("running", 1),
        "young_pending": ("pending", 0),
        "young_running": ("running", 1),
    }

    counts = await _requeue(store)

    assert counts == {"republished": 1, "retried": 1, "reclaimed": 1}
    async with store.read() as conn:
        after = {r.target.rsplit("/", 1)[1]: r for r in await callbacks.for_execution(conn, "e1")}
    for name in ("stale_pending", "failed_early", "stale_running"):
        row = after[name]
        assert (row.state, row.next_attempt_at, row.lease_owner) == ("pending", None, None), name
        assert row.attempts == before[name].attempts  # attempts are never reset
    assert after["stale_running"].fence == before["stale_running"].fence + 1
    for name in ("failed_out", "live_running", "done", "young_pending", "young_running"):
        assert after[name] == before[name], name
    # The lost holder of the reclaimed run cannot record over the attempts that follow.
    assert not await _record(store, before["stale_running"], delivered=True, error=None)
    assert await _requeue(store) == {"republished": 0, "retried": 0, "reclaimed": 0}
    # What was requeued is due now: the next claim takes those three, plus the young pending run
    # and the young running run whose lease expired (a worker never waits for the requeue age).
    names = {r.target.rsplit("/", 1)[1] for r in await _claim(store, "w2")}
    assert names == {
        "stale_pending",
        "failed_early",
        "stale_running",
        "young_pending",
        "young_running",
    }


async def test_requeue_limit_bounds_the_runs_changed_oldest_first(store: Store) -> None:
    ids = []
    for i in range(5):
        [run_id] = await seed_callbacks(store, "e1", [f"http://127.0.0.1:9/{i}"])
        ids.append(run_id)
        store.advance_clock(1)
    store.advance_clock(600)
    mark = store.now_ms()
    assert await _requeue(store, limit=2) == {"republished": 2, "retried": 0, "reclaimed": 0}
    touched = [run_id for run_id in ids if (await _run(store, run_id)).updated_at >= mark]
    assert touched == ids[:2]
    assert (await _requeue(store, limit=2))["republished"] == 2
    assert (await _requeue(store, limit=2))["republished"] == 1


async def test_requeue_age_zero_takes_every_stale_pending_run(store: Store) -> None:
    await seed_callbacks(store, "e1", ["http://127.0.0.1:9/a"])
    assert (await _requeue(store))["republished"] == 0  # younger than 300 s
    store.advance_clock(1)
    assert (await _requeue(store, older_than_ms=0))["republished"] == 1


# -- the worker loop ------------------------------------------------------------------------------


async def test_the_worker_pass_delivers_due_callbacks(store: Store, db_urls: DbUrls) -> None:
    orch = await Orchestrator.open(db_urls.store, providers=[], settings=fast_settings())
    try:
        with receiver([200]) as hook:
            [run_id] = await seed_callbacks(store, "e1", [hook.url])
            stats = await Worker(orch, poll_seconds=0.01).run(once=True)
    finally:
        await orch.close()
    assert stats.callbacks == 1
    assert hook.run_ids == [run_id]
    assert (await _run(store, run_id)).state == "delivered"
