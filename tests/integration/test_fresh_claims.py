"""The blind claim of a never-attempted effect (``effects.claim_fresh``), on both backends.

What could break: the blind claim leaving a row other than the general ``UPDATE … RETURNING``
claim would (a later holder then misjudges what was sent), or claiming a row that moved under
its holder — another holder took the transaction, claimed the effect, or stored a payload —
instead of writing nothing and reporting the lost lease.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, update

from ledger import effects, events
from ledger.canonical import fingerprint
from ledger.effects import Effect, EffectKind
from ledger.errors import LeaseLost
from ledger.schema import ledger as ledger_table
from ledger.schema import operations, transactions
from ledger.states import EffectState
from orchestrator.crashpoints import SimulatedCrash
from tests.support.sagas import order, order_saga
from tests.support.world import World

LEASE_MS = 30_000
#: Columns that name the row or come from a clock; the rest must match claim for claim.
_OWN = {"op_key", "tx_id", "payload", "payload_sha256", "lease_until", "first_attempt_at"}
_CLOCK = {"updated_at", "created_at"}


async def _planned(world: World, name: str, step: str = "charge") -> tuple[Effect, int]:
    """A three-step order left right after its prepare commit: its pending ``step`` (charge:
    payload stored at prepare; wrap: rendered at claim) and its transaction's fence."""
    query = select(transactions.c.tx_id, transactions.c.fence)
    async with world.orch.store.read() as conn:
        before = {row.tx_id for row in await conn.execute(query)}
    world.orch.crashpoints.arm("prepare.after_commit")
    with pytest.raises(SimulatedCrash):
        await world.orch.execute(order_saga(three_steps=True), order(name))
    async with world.orch.store.read() as conn:
        ((tx_id, fence),) = [r for r in await conn.execute(query) if r.tx_id not in before]
        pending = next(
            e for e in await effects.for_tx(conn, EffectKind.OPERATION, tx_id) if e.name == step
        )
    assert effects.is_fresh(pending), pending
    return pending, int(fence)


async def _row(world: World, key: str) -> dict[str, Any]:
    async with world.orch.store.read() as conn:
        row = (await conn.execute(select(operations).where(operations.c.op_key == key))).one()
    return dict(row._mapping)


async def _ledger_tail(world: World, tx_id: str) -> tuple[str, str | None, str | None, str]:
    async with world.orch.store.read() as conn:
        row = (
            await conn.execute(
                select(
                    ledger_table.c.action,
                    ledger_table.c.from_state,
                    ledger_table.c.to_state,
                    ledger_table.c.detail,
                )
                .where(ledger_table.c.tx_id == tx_id)
                .order_by(ledger_table.c.seq.desc())
                .limit(1)
            )
        ).one()
    return tuple(row)  # type: ignore[return-value]


@pytest.mark.parametrize("step", ["charge", "wrap"])
async def test_a_fresh_claim_leaves_the_row_and_ledger_the_general_claim_would(
    world: World, step: str
) -> None:
    blind, blind_fence = await _planned(world, "1", step)
    await world.orch.abandon()
    general, general_fence = await _planned(world, "2", step)
    await world.orch.abandon()
    assert (blind.payload_sha256 is None) == (step == "wrap")

    def rendered(e: Effect) -> dict[str, Any]:
        # What the driver passes: the stored payload re-rendered, or the first rendering.
        return e.payload if e.payload is not None else {"sku": "wrap-1", "for": "r-1"}

    async with world.orch.store.transaction() as work:
        chain = await events.chain_of(work.conn, blind.tx_id)
        claimed = await effects.claim_fresh(
            work,
            chain,
            blind,
            owner="w",
            lease_ms=LEASE_MS,
            tx_fence=blind_fence,
            payload=rendered(blind),
            payload_sha256=fingerprint(rendered(blind)),
        )
    async with world.orch.store.transaction() as work:
        chain = await events.chain_of(work.conn, general.tx_id)
        expected = await effects.claim(
            work,
            chain,
            EffectKind.OPERATION,
            general.key,
            owner="w",
            lease_ms=LEASE_MS,
            payload=rendered(general),
            payload_sha256=fingerprint(rendered(general)),
            tx_fence=general_fence,
        )
    assert expected is not None

    # The claim the driver acts on: the same but for what only the database clock knows.
    for name in ("fence", "previous", "attempts", "lookups", "owner", "name", "action"):
        assert getattr(claimed, name) == getattr(expected, name), name
    assert claimed.payload == rendered(blind) and expected.payload == rendered(general)
    assert claimed.payload_sha256 == fingerprint(rendered(blind))
    assert claimed.first_attempt_at is None and claimed.claimed_at_ms is None

    blind_row, general_row = await _row(world, blind.key), await _row(world, general.key)
    assert {k: v for k, v in blind_row.items() if k not in _OWN | _CLOCK} == {
        k: v for k, v in general_row.items() if k not in _OWN | _CLOCK
    }
    assert blind_row["state"] == EffectState.EXECUTING.value and blind_row["fence"] == 1
    assert blind_row["payload"] == rendered(blind)
    assert blind_row["payload_sha256"] == fingerprint(rendered(blind))
    assert blind_row["lease_until"] is not None and blind_row["first_attempt_at"] is not None
    assert await _ledger_tail(world, blind.tx_id) == await _ledger_tail(world, general.tx_id)
    assert await world.orch.verify_ledger() == []


async def _take_the_transaction(world: World, e: Effect) -> None:
    async with world.orch.store.engine.begin() as conn:
        await conn.execute(
            update(transactions)
            .where(transactions.c.tx_id == e.tx_id)
            .values(fence=transactions.c.fence + 1)
        )


async def _claim_elsewhere(world: World, e: Effect) -> None:
    async with world.orch.store.engine.begin() as conn:
        await conn.execute(
            update(operations)
            .where(operations.c.op_key == e.key)
            .values(
                state=EffectState.EXECUTING.value,
                claimed_from=EffectState.PENDING.value,
                fence=1,
                attempts=1,
                lease_owner="other",
                lease_until=2**62,
            )
        )


async def _skip_it(world: World, e: Effect) -> None:
    # What turning back does to a step never started: no claim, no fence, only the state.
    async with world.orch.store.engine.begin() as conn:
        await conn.execute(
            update(operations)
            .where(operations.c.op_key == e.key)
            .values(state=EffectState.SKIPPED.value)
        )


async def _store_a_payload(world: World, e: Effect) -> None:
    async with world.orch.store.engine.begin() as conn:
        other = {"amount": 1}
        await conn.execute(
            update(operations)
            .where(operations.c.op_key == e.key)
            .values(payload=other, payload_sha256=fingerprint(other))
        )


@pytest.mark.parametrize(
    "move",
    [_take_the_transaction, _claim_elsewhere, _skip_it, _store_a_payload],
    ids=lambda f: f.__name__,
)
async def test_a_fresh_claim_of_a_row_that_moved_writes_nothing(world: World, move: Any) -> None:
    known, fence = await _planned(world, "1")
    await world.orch.abandon()
    await move(world, known)
    before_row = await _row(world, known.key)
    before_tail = await _ledger_tail(world, known.tx_id)

    with pytest.raises(LeaseLost):
        async with world.orch.store.transaction() as work:
            chain = await events.chain_of(work.conn, known.tx_id)
            work.log(chain, action="note", detail={"written": "with the claim or not at all"})
            await effects.claim_fresh(
                work,
                chain,
                known,
                owner="w",
                lease_ms=LEASE_MS,
                tx_fence=fence,
                payload={"amount": 7},
                payload_sha256=fingerprint({"amount": 7}),
            )

    # Nothing of the transaction stayed: not the claim, not the ledger row written before it.
    assert await _row(world, known.key) == before_row
    assert await _ledger_tail(world, known.tx_id) == before_tail
