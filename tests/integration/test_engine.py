"""Engine behaviour on both backends: commit economy, bad input, keys, ledger integrity."""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from decimal import Decimal
from typing import Any

import pytest
import structlog
from sqlalchemy import func, select, text

from fault_injection.bench import UNGROUPED_COMMITS_PER_SAGA
from ledger.schema import (
    NAME_LENGTH,
    SAGA_NAME_LENGTH,
    TX_ID_LENGTH,
    operations,
    outbox,
    transactions,
)
from ledger.schema import ledger as ledger_table
from ledger.states import EffectState, TxState
from orchestrator import errors
from orchestrator.expressions import mul, neg, ref
from orchestrator.logging import configure_logging, info_enabled
from orchestrator.saga import Event, Input, Saga, Step
from tests.support.sagas import order, order_saga
from tests.support.world import World


async def _row_counts(world: World) -> dict[str, int]:
    async with world.orch.store.read() as conn:
        out = {}
        for table in (transactions, operations, outbox, ledger_table):
            out[table.name] = (
                await conn.execute(select(func.count()).select_from(table))
            ).scalar_one()
        return out


async def test_happy_path_commits_at_most_n_plus_3(world: World) -> None:
    saga = order_saga()
    await world.orch.register(saga)
    before = world.orch.store.stats.snapshot()
    result = await world.orch.execute(saga, order("42"))
    assert result.status is TxState.COMMITTED
    # The email's record rides on the store's next transaction (ledger/riders.py); a lone saga
    # has none, so its flush commits it alone. Counted once it has.
    await world.orch.store.riders.settle()
    commits = world.orch.store.stats.commits - before.commits
    statements = world.orch.store.stats.statements - before.statements
    # 2 steps + 1 outbox event: prepare+claim, record+claim, record+commit+claim, record.
    assert commits <= 2 + 3
    assert commits == 4
    assert statements <= 16
    assert (await world.shop.counts())["email.send"] == 1
    receipt = (await world.orch.get(result.tx_id)).outbox[0]
    assert receipt.state is EffectState.CONFIRMED


async def test_happy_path_never_crosses_sqlalchemys_greenlet_bridge(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each crossing (AsyncConnection.begin/commit/execute, a pool checkout) costs a greenlet
    # spawn and several switches. On the happy path every statement is the hot path's, the
    # SQLite writer writes its own BEGIN/COMMIT (Store._begin_writer), and a PostgreSQL
    # transaction of blind writes is begun and ended on the loop on a kept connection
    # (Store._transaction): a warm saga crosses none. A regression shows up as a count here.
    import sqlalchemy.ext.asyncio.engine as async_engine

    saga = order_saga()
    await world.orch.register(saga)
    await world.orch.execute(saga, order("43"))  # warm: definitions, caches, a connection
    spawned: list[object] = []
    real_spawn = async_engine.greenlet_spawn

    ours = world.orch.store.engine.sync_engine

    def engine_of(fn: Any) -> Any:
        owner = getattr(fn, "__self__", None)
        owner = getattr(owner, "connection", owner)  # a Transaction's, or the Connection
        return getattr(owner, "engine", owner)

    async def counting_spawn(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if engine_of(fn) is ours:  # the provider's own database is not the engine's cost
            spawned.append(fn)
        return await real_spawn(fn, *args, **kwargs)

    monkeypatch.setattr(async_engine, "greenlet_spawn", counting_spawn)
    monkeypatch.setattr("ledger.dialects.PING_BYPASS_SECONDS", 3600.0)  # a slow machine's gap
    result = await world.orch.execute(saga, order("44"))
    assert result.status is TxState.COMMITTED
    assert spawned == []


async def test_happy_path_reads_nothing_back_and_sends_one_statement_per_commit(
    world: World,
) -> None:
    # Every claim on the happy path is of a never-attempted effect, whose outcome the driver
    # knows: a blind write (effects.claim_fresh), not an UPDATE ... RETURNING read back. So no
    # statement takes SQLAlchemy's cursor path, and on PostgreSQL each local transaction is
    # one statement of held-back writes (no BEGIN, no read).
    from sqlalchemy import event

    saga = order_saga()
    await world.orch.register(saga)
    await world.orch.execute(saga, order("41"))  # warm: definitions, statement caches
    read_back: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        read_back.append(statement)

    engine = world.orch.store.engine.sync_engine
    event.listen(engine, "before_cursor_execute", seen)
    try:
        before = world.orch.store.stats.snapshot()
        result = await world.orch.execute(saga, order("42"))
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert result.status is TxState.COMMITTED
    assert read_back == []
    commits = world.orch.store.stats.commits - before.commits
    statements = world.orch.store.stats.statements - before.statements
    # Three, not four: the previous saga's email record rode on this one's prepare, and this
    # one's rides on whatever comes next (ledger/riders.py). The bench's second efficiency
    # reading divides by this count (fault_injection.bench.UNGROUPED_COMMITS_PER_SAGA).
    assert commits == 3 == UNGROUPED_COMMITS_PER_SAGA
    if world.urls.store.startswith("postgresql"):
        assert statements == commits


async def test_same_tx_id_with_different_payload_is_refused_before_any_call(world: World) -> None:
    first = await world.orch.execute(order_saga(), order("42", amount=100), tx_id="order-42")
    assert first.committed
    calls_before = len(await world.shop.calls())
    replay = await world.orch.execute(order_saga(), order("42", amount=100), tx_id="order-42")
    assert replay.tx_id == first.tx_id and replay.committed
    with pytest.raises(errors.IdempotencyPayloadMismatch) as caught:
        await world.orch.execute(order_saga(), order("42", amount=1000), tx_id="order-42")
    assert caught.value.envelope()["error"] == "idempotency_payload_mismatch"
    assert len(await world.shop.calls()) == calls_before  # the provider was never called
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_tampered_payload_is_parked_not_sent(world: World) -> None:
    world.orch.crashpoints.arm("prepare.after_commit")
    from orchestrator.crashpoints import SimulatedCrash

    with pytest.raises(SimulatedCrash):
        await world.orch.execute(order_saga(), order("42"))
    await world.orch.abandon()
    async with world.orch.store.engine.begin() as conn:
        # Someone edits the stored fingerprint of the pending charge: same key, other payload.
        await conn.execute(
            operations.update().where(operations.c.step == "charge").values(payload_sha256="0" * 64)
        )
    worker = await world.engine()
    worker.store.advance_clock(60)
    await worker.drain(timeout_seconds=5)
    counts = await world.shop.counts()
    assert counts["payments.charge"] == 0
    async with worker.store.read() as conn:
        status = (await conn.execute(select(transactions.c.status))).scalar_one()
    assert status == TxState.MANUAL_REVIEW.value


async def test_business_key_gives_the_first_outcome(world: World) -> None:
    first = await world.orch.execute(order_saga(), order("42"))
    second = await world.orch.execute(order_saga(), order("42"))
    assert second.tx_id == first.tx_id and second.committed
    assert (await world.shop.counts())["payments.charge"] == 1


async def test_business_keys_are_per_tenant_on_a_shared_database(world: World) -> None:
    other = await world.engine(tenant="other")
    theirs = await other.execute(order_saga(), order("42"))
    ours = await world.orch.execute(order_saga(), order("42"))
    assert theirs.committed and ours.committed and ours.tx_id != theirs.tx_id
    assert (await world.shop.counts())["payments.charge"] == 2
    # Within one tenant the key still holds: the first outcome, no second charge.
    assert (await other.execute(order_saga(), order("42"))).tx_id == theirs.tx_id
    assert (await world.shop.counts())["payments.charge"] == 2


async def test_failed_attempt_releases_the_business_key(world: World) -> None:
    from providers.fake.faults import FaultKind, FaultRule

    world.shop.faults.add(FaultRule(FaultKind.REJECT, provider="payments", action="charge"))
    first = await world.orch.execute(order_saga(), order("42"))
    assert first.status is TxState.COMPENSATED
    second = await world.orch.execute(order_saga(), order("42"))
    assert second.committed and second.tx_id != first.tx_id
    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["inventory.release"]) == (1, 1)


BAD_INPUTS: list[tuple[str, Any, dict[str, Any], type[errors.AgentTxnError]]] = [
    ("missing field", None, {"order_id": "1", "sku": "sku-1"}, errors.InputInvalid),
    ("wrong type", None, {"order_id": "1", "sku": "sku-1", "amount": "12"}, errors.InputInvalid),
    ("below minimum", None, {"order_id": "1", "sku": "sku-1", "amount": 0}, errors.InputInvalid),
    ("extra field", None, {**order("1"), "x": 1}, errors.InputInvalid),
    ("not an object", None, ["x"], errors.InputInvalid),
    ("empty tx id", "", order("1"), errors.IdentifierInvalid),
    ("blank tx id", "   ", order("1"), errors.IdentifierInvalid),
    # transactions.tx_id is 64 wide: PostgreSQL refused a longer id mid-write (SQLite kept it)
    ("tx id longer than its column", "t" * 65, order("1"), errors.IdentifierInvalid),
    (
        "blank business key",
        None,
        {"order_id": " ", "sku": "sku-1", "amount": 5},
        errors.IdentifierInvalid,
    ),
]


@pytest.mark.parametrize(
    ("case", "tx_id", "inputs", "error"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
async def test_bad_input_is_refused_before_anything_is_written(
    world: World, case: str, tx_id: Any, inputs: Any, error: type[errors.AgentTxnError]
) -> None:
    saga = order_saga()
    await world.orch.register(saga)
    if case == "blank business key":
        saga = Saga(
            "order_by_sku",
            inputs={"order_id": str, "sku": str, "amount": int},
            business_key=ref("inputs.order_id"),
            steps=saga.steps,
        )
    before = await _row_counts(world)
    with pytest.raises(error) as caught:
        await world.orch.execute(saga, inputs, tx_id=tx_id)
    env = caught.value.envelope()
    assert env["error"] == error.code and set(env) >= {
        "error",
        "phase",
        "message",
        "retryable",
        "details",
    }
    assert await _row_counts(world) == before
    assert await world.shop.calls() == []


def _saga(**step: Any) -> Saga:
    base: dict[str, Any] = {
        "name": "s",
        "provider": "email",
        "action": "send",
        "payload": {"to": "a@b.c", "template": "t"},
    }
    base.update(step)
    return Saga("bad", steps=[Step(**base)])


@pytest.mark.parametrize(
    ("saga", "error"),
    [
        (lambda: _saga(provider="nope"), errors.UnknownProviderError),
        (lambda: _saga(action="nope"), errors.UnknownActionError),
        (lambda: _saga(name=""), errors.DefinitionInvalid),
        (lambda: _saga(provider=" "), errors.DefinitionInvalid),
        # names wider than the columns that hold them (operations.step, provider, action)
        (lambda: _saga(name="s" * 101), errors.DefinitionInvalid),
        (lambda: _saga(provider="p" * 101), errors.DefinitionInvalid),
        (lambda: _saga(action="a" * 101), errors.DefinitionInvalid),
        (
            lambda: Saga(
                "bad",
                steps=_saga().steps,
                outbox=[Event("e" * 101, "email", "send", {"to": "a@b.c", "template": "t"})],
            ),
            errors.DefinitionInvalid,
        ),
        (lambda: _saga(payload={"$nope": 1}), errors.DefinitionInvalid),
        (lambda: _saga(payload={"to": ref("steps.later.remote_id")}), errors.DefinitionInvalid),
        (lambda: _saga(payload={"x": float("nan")}), errors.DefinitionInvalid),
        (lambda: Saga("bad", steps=[]), errors.DefinitionInvalid),
        # charge is reversible: a step that does not say how to refund is refused
        (
            lambda: _saga(
                provider="payments", action="charge", payload={"amount": 1, "currency": "EUR"}
            ),
            errors.DefinitionInvalid,
        ),
    ],
)
async def test_bad_saga_is_refused_at_registration(world: World, saga: Any, error: type) -> None:
    with pytest.raises(error):
        await world.orch.register(saga())
    assert await world.shop.calls() == []


async def test_names_and_ids_as_wide_as_their_columns_run_on_both_backends(
    world: World,
) -> None:
    """The authoring limits are the columns' widths: the longest names and tx id they let
    through are stored and run to the end on PostgreSQL too, which refuses anything wider."""
    step, event = "s" * NAME_LENGTH, "e" * NAME_LENGTH
    saga = Saga(
        "w" * SAGA_NAME_LENGTH,
        steps=[Step(step, "email", "send", {"to": "a@b.c", "template": "t"})],
        outbox=[Event(event, "email", "send", {"to": "a@b.c", "template": "r"})],
    )
    tx_id = "t" * TX_ID_LENGTH
    result = await world.orch.execute(saga, {}, tx_id=tx_id)
    assert result.status == TxState.COMMITTED
    async with world.orch.store.read() as conn:
        steps = (await conn.execute(select(operations.c.step))).scalars().all()
        kinds = (await conn.execute(select(outbox.c.kind))).scalars().all()
    assert steps == [step] and kinds == [event]


async def test_an_id_wider_than_its_column_that_slips_past_the_check_is_a_clean_refusal(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The safety net under the checks: were the tx id check looser than the column,
    PostgreSQL's refusal of the write reaches the caller as ``value_not_storable``, with
    nothing written and no effect sent (SQLite stores the id: it ignores VARCHAR widths)."""
    monkeypatch.setattr("orchestrator.engine.TX_ID_LENGTH", 200)
    before = await _row_counts(world)
    tx_id = "t" * (TX_ID_LENGTH + 1)
    if world.orch.store.dialect != "postgresql":
        result = await world.orch.execute(order_saga(), order("1"), tx_id=tx_id)
        assert result.status is TxState.COMMITTED
        return
    with pytest.raises(errors.ValueNotStorableError) as refused:
        await world.orch.execute(order_saga(), order("1"), tx_id=tx_id)
    assert refused.value.envelope()["error"] == "value_not_storable"
    assert await _row_counts(world) == before
    assert await world.shop.calls() == []


async def test_payload_that_is_not_json_is_refused(world: World) -> None:
    saga = Saga(
        "obj",
        inputs={"meta": dict},
        steps=[
            Step("s", "email", "send", {"to": "a@b.c", "template": "t", "meta": ref("inputs.meta")})
        ],
    )
    before = await _row_counts(world)
    with pytest.raises(errors.InputInvalid):
        await world.orch.execute(saga, {"meta": {"x": float("inf")}})
    assert await _row_counts(world) == before


async def test_ledger_is_append_only_and_tamper_evident(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("42"))
    assert await world.orch.verify_ledger() == []
    with pytest.raises(Exception, match="append-only"):
        async with world.orch.store.engine.begin() as conn:
            await conn.execute(ledger_table.update().values(action="forged"))
    with pytest.raises(Exception, match="append-only"):
        async with world.orch.store.engine.begin() as conn:
            await conn.execute(ledger_table.delete())
    # An attacker with DDL rights drops the triggers and edits a row: verify names it.
    async with world.orch.store.engine.begin() as conn:
        if world.orch.store.dialect == "sqlite":
            await conn.execute(text("DROP TRIGGER ledger_append_only_update"))
        else:
            await conn.execute(text("DROP TRIGGER ledger_append_only_update ON ledger"))
        seq = (
            await conn.execute(
                select(ledger_table.c.seq).where(ledger_table.c.to_state == "confirmed").limit(1)
            )
        ).scalar_one()
        await conn.execute(
            ledger_table.update().where(ledger_table.c.seq == seq).values(to_state="failed")
        )
    problems = await world.orch.verify_ledger(result.tx_id)
    assert any(p.seq == seq and "hash" in p.problem for p in problems)
    assert any("replay" in p.problem for p in problems)


async def test_transaction_ids_are_uuid7_and_grow_with_time(world: World) -> None:
    # Time-ordered ids keep a saga's index entries beside those of the sagas before it
    # (ledger/ids.py; docs/benchmarks-log.md item 40).
    saga = order_saga()
    await world.orch.register(saga)
    tx_ids = []
    for i in range(3):
        tx_ids.append((await world.orch.execute(saga, order(f"ids-{i}"))).tx_id)
        await asyncio.sleep(0.002)  # the next one is minted in a later millisecond
    assert tx_ids == sorted(tx_ids)
    async with world.orch.store.read() as conn:
        created = dict(
            (await conn.execute(select(transactions.c.tx_id, transactions.c.created_at))).all()
        )
    for tx_id in tx_ids:
        parsed = uuid.UUID(hex=tx_id)
        assert parsed.version == 7
        assert abs((parsed.int >> 80) - created[tx_id]) < 1_000  # minted just before its row


async def test_every_state_change_has_its_ledger_row(world: World) -> None:
    result = await world.orch.execute(order_saga(), order("42"))
    view = await world.orch.get(result.tx_id)
    entries = await world.orch.ledger(result.tx_id)
    by_subject: dict[str | None, list[str | None]] = {}
    for e in entries:
        by_subject.setdefault(e.subject, []).append(e.to_state)
    assert by_subject[None] == ["prepared", "executing", "validating", "committed"]
    for op in [*view.operations, *view.outbox]:
        assert by_subject[op.key] == ["pending", "executing", "confirmed"]
        assert op.state is EffectState.CONFIRMED


async def test_final_lookup_voids_a_key_the_provider_never_saw(world: World) -> None:
    from providers.contract import Rejected
    from providers.fake.faults import FaultKind, FaultRule

    # Every charge attempt fails before the effect: the op stays in doubt until its budget is
    # spent; the last lookup voids the key, which proves it never happened and never will.
    world.shop.faults.add(
        FaultRule(FaultKind.FAIL_BEFORE, provider="payments", action="charge", times=None)
    )
    result = await world.orch.execute(order_saga(), order("42"), budget_seconds=10)
    await world.orch.drain(timeout_seconds=10)
    final = await world.orch.result(result.tx_id)
    assert final.status is TxState.COMPENSATED
    counts = await world.shop.counts()
    assert (counts["payments.charge"], counts["inventory.release"]) == (0, 1)

    view = await world.orch.get(result.tx_id)
    charge = next(o for o in view.operations if o.name == "charge")
    assert charge.state is EffectState.FAILED and charge.last_error == "voided"
    world.shop.faults.clear()
    late = await world.shop.payments.apply(
        "charge", key=charge.key, payload=charge.payload, fence=1
    )
    assert isinstance(late, Rejected) and late.reason == "voided"  # the late original is refused
    assert (await world.shop.counts())["payments.charge"] == 0


@pytest.mark.parametrize(("level", "expected"), [("INFO", ["apply"] * 3), ("WARNING", [])])
async def test_per_effect_events_are_logged_with_their_context_only_when_info_is_on(
    world: World, level: str, expected: list[str]
) -> None:
    saved = structlog.get_config()
    out = io.StringIO()
    configure_logging(level, stream=out)
    try:
        assert info_enabled() is (level == "INFO")
        result = await world.orch.execute(order_saga(), order("log-1"))
    finally:
        structlog.configure(**saved)
    assert result.status is TxState.COMMITTED
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    applies = [e for e in events if e.get("event") == "apply"]
    assert [e["event"] for e in applies] == expected
    for e in applies:
        assert e["tx_id"] == result.tx_id and e["op_key"] and e["outcome"] == "Confirmed"


# -- numbers JSONB rewrites ---------------------------------------------------------------------


def _weighed() -> Saga:
    """A saga whose payload carries a number input as sent and a product of floats."""
    weight = ref("inputs.weight")
    return Saga(
        "weighed",
        inputs={"weight": Input("number")},
        steps=[
            Step(
                "note",
                "email",
                "send",
                {
                    "to": "a@b.c",
                    "template": "t",
                    "charge": {"as_sent": weight, "product": mul(weight, 1e8), "neg": neg(0.0)},
                },
            )
        ],
    )


@pytest.mark.parametrize("weight", [1e16, 1e8, -2.5e200, -0.0])
async def test_a_number_jsonb_rewrites_runs_a_staged_plan_and_replays_on_both_backends(
    world: World, weight: float
) -> None:
    """PostgreSQL's JSONB gives a float of 1e16 or more back as an integer (and -0.0 as 0.0);
    the inputs and every rendered payload are taken in that form before they are fingerprinted,
    so a staged plan runs after its reload instead of parking as a payload mismatch, and the
    same tx id with the same inputs is the same intent."""
    tx_id = await world.orch.stage(_weighed(), {"weight": weight})
    staged = await world.orch.execute_staged(tx_id)
    assert staged.status is TxState.COMMITTED, staged
    first = await world.orch.execute(_weighed(), {"weight": weight}, tx_id="weighed-1")
    assert first.status is TxState.COMMITTED
    again = await world.orch.execute(_weighed(), {"weight": weight}, tx_id="weighed-1")
    assert again.status is TxState.COMMITTED
    assert len(await world.shop.calls()) == 2  # one send per intent, none for the replay
    async with world.orch.store.read() as conn:
        payloads = (await conn.execute(select(operations.c.payload))).scalars().all()
    for payload in payloads:
        sent = payload["charge"]
        assert sent["neg"] == 0.0 and str(sent["neg"]) == "0.0"
        if abs(weight) >= 1e16:
            # the integer the float is written as (what JSONB keeps): the same double
            assert type(sent["as_sent"]) is int and float(sent["as_sent"]) == weight
            assert sent["as_sent"] == int(Decimal(repr(weight)))
        if abs(weight) * 1e8 >= 1e16:
            assert type(sent["product"]) is int
