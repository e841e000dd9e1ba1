"""Concurrent local transactions sharing commits, on both backends: each keeps its own outcome.

On PostgreSQL, blind transactions of one shape that end together are sent as one execution
of the statement's batch form per half of the open transactions (ledger/grouped.py,
ledger/batched.py); on SQLite, transactions in
flight together share one physical transaction (the commit group, test_group_commit.py). What
could break: a member's writes committed only in part, or not at all while it was told they
were; one member's stale fence or duplicate key failing the others, or being reported to the
wrong one; the commits not actually shared (a cost: counted, on PostgreSQL, where the test
holds every transaction at its end so that they meet).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from ledger import events, transactions
from ledger.errors import DuplicateKey, LeaseLost
from ledger.states import TxState
from ledger.store import Store, Work
from tests.conftest import DbUrls
from tests.support.bare_store import bare_store, insert_tx

MEMBERS = 8


@pytest.fixture
async def store(db_urls: DbUrls) -> AsyncIterator[Store]:
    async with bare_store(db_urls.store) as store:
        yield store


async def _together(
    store: Store,
    backend: str,
    bodies: list[Callable[[Work], Awaitable[None]]],
    open_at_end: list[int] | None = None,
) -> list[BaseException | None]:
    """Run one local transaction per body at once; each one's error (or ``None``).
    ``open_at_end`` collects :attr:`Store.open_writes` as each body ends."""
    # PostgreSQL: every transaction waits at its end until all are there, so they end together
    # (SQLite's commit group runs its members' bodies one at a time: no barrier there).
    at_end = asyncio.Barrier(len(bodies)) if backend == "postgres" else None

    async def one(body: Callable[[Work], Awaitable[None]]) -> None:
        async with store.transaction() as work:
            await body(work)
            if at_end is not None:
                await at_end.wait()
            if open_at_end is not None:
                open_at_end.append(store.open_writes)

    outcomes = await asyncio.gather(*(one(b) for b in bodies), return_exceptions=True)
    return [o if isinstance(o, BaseException) else None for o in outcomes]


async def _status(store: Store, tx_id: str) -> TxState | None:
    async with store.read() as conn:
        record = await transactions.get(conn, tx_id)
    return None if record is None else record.status


def _inserting(tx_id: str) -> Callable[[Work], Awaitable[None]]:
    async def body(work: Work) -> None:
        await insert_tx(work, tx_id)

    return body


async def test_transactions_ending_together_share_commits_and_all_land(
    store: Store, backend: str
) -> None:
    before = store.stats.snapshot()
    outcomes = await _together(store, backend, [_inserting(f"tx-{n}") for n in range(MEMBERS)])
    commits = store.stats.commits - before.commits
    statements = store.stats.statements - before.statements
    assert outcomes == [None] * MEMBERS
    for n in range(MEMBERS):
        assert await _status(store, f"tx-{n}") is TxState.EXECUTING
        async with store.read() as conn:
            assert await events.verify(conn, f"tx-{n}") == []
    if backend == "postgres":
        # A fresh shape: the first leaves alone, the queue behind it in cohorts of half the
        # open transactions (four, then the three left). The rounds after it are checked in
        # test_grouped_commits_leave_in_two_cohorts_or_one_convoy.
        assert commits == 3
        assert statements == MEMBERS
    else:
        assert commits < MEMBERS


async def test_a_stale_member_loses_its_lease_alone(store: Store, backend: str) -> None:
    claims = []
    async with store.transaction() as work:
        for n in range(MEMBERS):
            claims.append(await insert_tx(work, f"tx-{n}"))
    async with store.read() as conn:
        chains = [await events.chain_of(conn, f"tx-{n}") for n in range(MEMBERS)]
    # Member 3 holds a fence another holder has since replaced.
    claims[3] = transactions.TxClaim("tx-3", claims[3].fence + 1, claims[3].status, "w1")

    def failing(n: int) -> Callable[[Work], Awaitable[None]]:
        async def body(work: Work) -> None:  # blind, and the same shape for every member
            await transactions.transition(work, chains[n], claims[n], TxState.FAILED, action="f")

        return body

    open_at_end: list[int] = []
    outcomes = await _together(store, backend, [failing(n) for n in range(MEMBERS)], open_at_end)

    assert isinstance(outcomes[3], LeaseLost) and "tx-3" in str(outcomes[3])
    # The group sender splits by this count. PostgreSQL: all members were open at once (the
    # stale one learns of its fence only when its writes are sent, after its body). SQLite:
    # the commit group runs the bodies in turn, each while the earlier ones wait for the
    # group's commit, and the stale one fails inside its body. With the writer process the
    # writes are held back as on PostgreSQL, and an earlier member leaves the count when the
    # writer's answer comes, which the loop reads between two bodies as its I/O allows.
    # Refused or committed, every member left the count.
    if backend == "postgres":
        assert open_at_end == [MEMBERS] * MEMBERS
    elif store.writer_process is None:
        assert open_at_end == list(range(1, MEMBERS))
    else:
        assert len(open_at_end) == MEMBERS and all(1 <= n <= MEMBERS for n in open_at_end)
    assert store.open_writes == 0
    assert [o for i, o in enumerate(outcomes) if i != 3] == [None] * (MEMBERS - 1)
    assert await _status(store, "tx-3") is TxState.EXECUTING
    for n in set(range(MEMBERS)) - {3}:
        assert await _status(store, f"tx-{n}") is TxState.FAILED
        async with store.read() as conn:
            assert await events.verify(conn, f"tx-{n}") == []


async def test_a_duplicate_member_is_refused_alone(store: Store, backend: str) -> None:
    async with store.transaction() as work:
        await insert_tx(work, "tx-dup")
    bodies = [_inserting(f"tx-{n}") for n in range(MEMBERS - 1)]
    bodies.insert(5, _inserting("tx-dup"))  # same shape as the others: same batch
    outcomes = await _together(store, backend, bodies)

    assert isinstance(outcomes[5], DuplicateKey)
    assert [o for i, o in enumerate(outcomes) if i != 5] == [None] * (MEMBERS - 1)
    for n in range(MEMBERS - 1):
        assert await _status(store, f"tx-{n}") is TxState.EXECUTING
    async with store.read() as conn:
        assert [e.action for e in await events.read(conn, "tx-dup")] == ["prepare", "start"]


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
@pytest.mark.parametrize(
    ("cohorts", "batches"),
    [
        # The shape's first round: nothing has come in company yet, so the first leaves alone
        # either way. With cohorts the queue behind it leaves at half the open transactions
        # (4, then the 3 left); then, in company, eight leave as two cohorts of four.
        (True, [[4, 3], [4, 4]]),
        (False, [[7], [7]]),
    ],
)
async def test_grouped_commits_leave_in_two_cohorts_or_one_convoy(
    db_urls: DbUrls,
    backend: str,
    cohorts: bool,
    batches: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Spied at the driver: which batches went to the server, round by round. With cohorts (the
    # default), eight transactions ending in one turn leave as two batches of four once their
    # shape has come in company; without (a worker's setting, orchestrator/workerproc.py), the
    # first leaves alone and the seven queued behind it follow as one batch. Every batch is
    # one execution of its batch statement (ledger/batched.py), whose JSON argument holds one
    # element per member; none goes as an ``executemany``.
    sent: list[int] = []
    execute = asyncpg.Connection.execute

    async def spy(self: asyncpg.Connection, query: str, *args: Any, **kw: Any) -> Any:
        if "jsonb_array_elements(" in query:
            sent.append(len(json.loads(args[0])))  # one element per member
        return await execute(self, query, *args, **kw)

    async def refused(self: asyncpg.Connection, command: str, args: Any, **kw: Any) -> Any:
        raise AssertionError(f"a batch went as executemany: {command[:60]}")

    monkeypatch.setattr(asyncpg.Connection, "execute", spy)
    monkeypatch.setattr(asyncpg.Connection, "executemany", refused)
    async with bare_store(db_urls.store, commit_cohorts=cohorts) as store:
        rounds = []
        for round_ in range(len(batches)):
            ids = [f"tx-{round_}-{n}" for n in range(MEMBERS)]
            sent.clear()
            outcomes = await _together(store, backend, [_inserting(i) for i in ids])
            assert outcomes == [None] * MEMBERS
            rounds.append(list(sent))
            for tx_id in ids:
                assert await _status(store, tx_id) is TxState.EXECUTING
        assert rounds == batches
