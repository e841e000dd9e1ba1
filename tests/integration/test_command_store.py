"""The commands layer's repositories on both backends (``ledger.commands``, ``executions``,
``reservations``, ``action_settings``, ``callbacks``) and migration 0002 that creates their tables.

What could break and is pinned here: compare-and-set edits refuse a moved digest, soft-deleted
commands stay invisible unless asked for, an idempotency key has exactly one holder, release and
replace only act on the holder the caller names, pruning keeps every unfinished or young
execution (and takes its dependents along), the database's CHECK constraints refuse bad states,
callbacks are enqueued once per (execution, event, target), and none of it writes ledger rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import Connection, func, inspect, select

from ledger import (
    action_settings,
    callbacks,
    commands,
    definitions,
    executions,
    migrate,
    reservations,
    schema,
)
from ledger.canonical import canonical_json, jsonb_stable
from ledger.errors import StorageError, ValueNotStorable
from ledger.store import Store

if TYPE_CHECKING:
    from tests.conftest import DbUrls

DIGEST_A = "a" * 64
DIGEST_B = "b" * 64
SAGA_DIGEST = "5" * 64
FROZEN_NOW = 1_700_000_000.0


@pytest.fixture
async def store(db_urls: DbUrls) -> AsyncIterator[Store]:
    """A store on a fresh database; ``Store.open`` builds the schema through ``ledger.migrate``.

    The clock is frozen (tests move it with ``advance_clock``), so rows written one after the
    other can share a millisecond on purpose and orderings are deterministic.
    """
    s = await Store.open(db_urls.store, auto_upgrade="empty", clock=lambda: FROZEN_NOW)
    try:
        yield s
    finally:
        await s.close()


# -- helpers ------------------------------------------------------------------------------------


async def _command(store: Store, command_id: str = "c1", **overrides: Any) -> commands.CommandRow:
    values: dict[str, Any] = {
        "command_id": command_id,
        "tenant": "acme",
        "name": f"refund-{command_id}",
        "scope_kind": "company",
        "scope_id": "acme",
        "tag_id": None,
        "version": 2,
        "mode": "execute",
        "definition": {"format": "agent-txn/command@1", "steps": [{"id": "s1"}]},
        "digest": DIGEST_A,
        "saga_digest": None,
        "created_by": "u1",
    }
    values.update(overrides)
    async with store.transaction() as work:
        return await commands.insert(work, **values)


def _execution_columns(execution_id: str, **overrides: Any) -> dict[str, Any]:
    columns: dict[str, Any] = {
        "execution_id": execution_id,
        "command_id": "c1",
        "command_digest": DIGEST_A,
        "status": "running",
        "invoker_kind": "user",
        "invoker_id": "u1",
        "actor_bucket": "user:u1",
        "origin": "manual",
        "input_snapshot": {"order": 42},
        "authorization_snapshot": {"grants": ["payments.refund"]},
    }
    columns.update(overrides)
    return columns


async def _execution(store: Store, execution_id: str, **overrides: Any) -> None:
    async with store.transaction() as work:
        await executions.insert(work, **_execution_columns(execution_id, **overrides))


async def _get_execution(store: Store, execution_id: str) -> executions.ExecutionRow | None:
    async with store.read() as conn:
        return await executions.get(conn, execution_id)


async def _reservation(store: Store, key: str = "k1") -> reservations.ReservationRow | None:
    async with store.read() as conn:
        return await reservations.get(conn, "c1", "user:u1", key)


def _refused_by(error: BaseException, constraint: str) -> None:
    """The store translated the driver error; the constraint's name is on the original."""
    assert isinstance(error, StorageError)
    assert constraint in str(error.__cause__)


# -- migration 0002 -----------------------------------------------------------------------------


def _columns(connection: Connection, table: str) -> set[str]:
    return {str(c["name"]) for c in inspect(connection).get_columns(table)}


def _table_names(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names())


NEW_TABLES = {
    "commands",
    "executions",
    "idempotency_reservations",
    "principals",
    "grants",
    "room_members",
    "action_settings",
    "callback_runs",
}


async def test_migration_0002_round_trip(store: Store) -> None:
    assert migrate.HEAD >= "0002"
    assert await migrate.current_revision(store.engine) == migrate.HEAD
    async with store.engine.connect() as conn:
        assert await conn.run_sync(_table_names) >= NEW_TABLES
        assert "context" in await conn.run_sync(_columns, "transactions")

    await migrate.downgrade(store.engine, "0001")
    assert await migrate.current_revision(store.engine) == "0001"
    async with store.engine.connect() as conn:
        assert not NEW_TABLES & await conn.run_sync(_table_names)
        assert "context" not in await conn.run_sync(_columns, "transactions")
        assert "execution_id" in await conn.run_sync(_columns, "transactions")  # 0001's

    await migrate.upgrade(store.engine)
    assert await migrate.current_revision(store.engine) == migrate.HEAD
    await _command(store)  # the recreated tables work


# -- commands -----------------------------------------------------------------------------------


async def test_command_insert_and_get(store: Store) -> None:
    async with store.transaction() as work:
        await definitions.put(work, digest=SAGA_DIGEST, name="refund", definition={"steps": []})
    row = await _command(store, saga_digest=SAGA_DIGEST, tag_id="t-7")
    assert row.command_id == "c1"
    assert row.definition == {"format": "agent-txn/command@1", "steps": [{"id": "s1"}]}
    assert row.saga_digest == SAGA_DIGEST and row.tag_id == "t-7"
    assert row.created_at == row.updated_at and row.deleted_at is None and not row.deleted
    async with store.read() as conn:
        assert await commands.get(conn, "c1") == row
        assert await commands.get(conn, "nope") is None


async def test_command_refuses_unknown_saga_and_bad_shapes(store: Store) -> None:
    with pytest.raises(StorageError) as excinfo:
        await _command(store, saga_digest="f" * 64)  # no such saga definition
    assert "foreign key" in str(excinfo.value.__cause__).lower()
    bad_shapes: list[tuple[dict[str, Any], str]] = [
        ({"scope_kind": "planet"}, "ck_commands_scope_kind"),
        ({"version": 3}, "ck_commands_version"),
        ({"mode": "dry-run"}, "ck_commands_mode"),
    ]
    for overrides, constraint in bad_shapes:
        with pytest.raises(StorageError) as excinfo:
            await _command(store, **overrides)
        _refused_by(excinfo.value, constraint)
    async with store.read() as conn:
        assert await commands.list_(conn, tenant="acme") == []


async def test_command_list_newest_first_live_only(store: Store) -> None:
    await _command(store, "c1")
    store.advance_clock(1)
    await _command(store, "c3")
    await _command(store, "c2")  # same millisecond as c3: command_id breaks the tie
    store.advance_clock(1)
    await _command(store, "c4")
    await _command(store, "other", tenant="globex")
    async with store.transaction() as work:
        assert await commands.soft_delete(work, "c4")
    async with store.read() as conn:
        listed = await commands.list_(conn, tenant="acme")
        assert [c.command_id for c in listed] == ["c3", "c2", "c1"]
        page = await commands.list_(conn, tenant="acme", skip=1, limit=1)
        assert [c.command_id for c in page] == ["c2"]
        assert [c.command_id for c in await commands.list_(conn, tenant="globex")] == ["other"]


async def test_command_list_filters_scopes_before_it_pages(store: Store) -> None:
    await _command(store, "co1")
    store.advance_clock(1)
    await _command(store, "ra1", scope_kind="room", scope_id="room-a")
    store.advance_clock(1)
    await _command(store, "rb1", scope_kind="room", scope_id="room-b")
    store.advance_clock(1)
    await _command(store, "ra2", scope_kind="room", scope_id="room-a")
    await _command(store, "rc1", scope_kind="room", scope_id="room-c")
    async with store.transaction() as work:
        assert await commands.soft_delete(work, "rc1")
    async with store.read() as conn:

        async def ids(**kwargs: Any) -> list[str]:
            return [c.command_id for c in await commands.list_(conn, tenant="acme", **kwargs)]

        assert await ids() == ["ra2", "rb1", "ra1", "co1"]
        assert await ids(rooms=["room-a"]) == ["ra2", "ra1", "co1"]
        assert await ids(rooms=["room-a"], skip=1, limit=2) == ["ra1", "co1"]
        assert await ids(rooms=["room-a"], skip=3) == []
        assert await ids(company=False, rooms=["room-b", "room-c"]) == ["rb1"]
        assert await ids(rooms=[]) == ["co1"]
        assert await ids(company=False, rooms=[]) == []
        assert await ids(company=False) == ["ra2", "rb1", "ra1"]
        among = ["room-a", "room-c", "room-z"]
        assert await commands.rooms_in_use(conn, tenant="acme", among=among) == {"room-a"}
        assert await commands.rooms_in_use(conn, tenant="globex", among=among) == set()
        assert await commands.rooms_in_use(conn, tenant="acme", among=[]) == set()


async def test_command_update_is_compare_and_set_on_digest(store: Store) -> None:
    before = await _command(store)
    store.advance_clock(1)
    async with store.transaction() as work:
        updated = await commands.update(
            work,
            "c1",
            expected_digest=DIGEST_A,
            digest=DIGEST_B,
            definition={"steps": []},
            name="refund-v2",
        )
    assert updated is not None
    assert (updated.digest, updated.name, updated.definition) == (
        DIGEST_B,
        "refund-v2",
        {"steps": []},
    )
    assert updated.updated_at > before.updated_at and updated.created_at == before.created_at

    # A second editor who read version A loses: the digest moved.
    async with store.transaction() as work:
        stale = await commands.update(work, "c1", expected_digest=DIGEST_A, name="clobber")
    assert stale is None
    async with store.read() as conn:
        assert await commands.get(conn, "c1") == updated

    async with store.transaction() as work:
        assert await commands.update(work, "nope", expected_digest=DIGEST_A, name="x") is None
        with pytest.raises(ValueError, match="created_by"):
            await commands.update(work, "c1", expected_digest=DIGEST_B, created_by="mallory")


async def test_command_update_refuses_a_deleted_command(store: Store) -> None:
    await _command(store)
    async with store.transaction() as work:
        assert await commands.soft_delete(work, "c1")
        assert await commands.update(work, "c1", expected_digest=DIGEST_A, name="x") is None


async def test_soft_deleted_command_is_invisible_by_default(store: Store) -> None:
    await _command(store)
    store.advance_clock(1)
    async with store.transaction() as work:
        assert await commands.soft_delete(work, "c1")
    async with store.read() as conn:
        assert await commands.get(conn, "c1") is None
        kept = await commands.get(conn, "c1", include_deleted=True)
    assert kept is not None and kept.deleted and kept.deleted_at is not None
    async with store.transaction() as work:
        assert not await commands.soft_delete(work, "c1")  # already deleted: first time is kept
        assert not await commands.soft_delete(work, "nope")
        assert await commands.lock_for_apply(work, "c1") is None
    async with store.read() as conn:
        again = await commands.get(conn, "c1", include_deleted=True)
    assert again is not None and again.deleted_at == kept.deleted_at


async def test_lock_for_apply_reads_the_live_row(store: Store) -> None:
    row = await _command(store)
    async with store.transaction() as work:
        assert await commands.lock_for_apply(work, "c1") == row
        assert await commands.lock_for_apply(work, "nope") is None


async def test_lock_for_apply_holds_off_a_concurrent_edit(store: Store) -> None:
    # PostgreSQL: the row lock (FOR UPDATE) makes the edit wait; without it the UPDATE would run
    # at once. SQLite: the single write transaction does the same.
    await _command(store)
    edited = asyncio.Event()

    async def edit() -> commands.CommandRow | None:
        async with store.transaction() as work:
            result = await commands.update(work, "c1", expected_digest=DIGEST_A, digest=DIGEST_B)
        edited.set()
        return result

    async with store.transaction() as work:
        locked = await commands.lock_for_apply(work, "c1")
        assert locked is not None and locked.digest == DIGEST_A
        task = asyncio.create_task(edit())
        await asyncio.sleep(0.3)
        assert not edited.is_set(), "an edit ran while the command was locked for apply"
    after = await asyncio.wait_for(task, 10)
    assert after is not None and after.digest == DIGEST_B


# -- executions ---------------------------------------------------------------------------------


async def test_execution_insert_get_and_by_tx(store: Store) -> None:
    await _command(store)
    await _execution(
        store, "e1", tx_id="tx-1", idempotency_key="k1", steps=[{"id": "s1"}], room_id="r1"
    )
    row = await _get_execution(store, "e1")
    assert row is not None
    assert (row.command_id, row.status, row.tx_id, row.idempotency_key) == (
        "c1",
        "running",
        "tx-1",
        "k1",
    )
    assert row.input_snapshot == {"order": 42} and row.steps == [{"id": "s1"}]
    assert row.response is None and row.error is None
    assert row.created_at == row.updated_at
    async with store.read() as conn:
        assert await executions.by_tx(conn, "tx-1") == row
        assert await executions.by_tx(conn, "tx-2") is None
        assert await executions.get(conn, "nope") is None
    async with store.transaction() as work:
        assert await executions.get_for_update(work, "e1") == row
        assert await executions.get_for_update(work, "nope") is None


async def test_execution_insert_checks_its_columns(store: Store) -> None:
    await _command(store)
    async with store.transaction() as work:
        with pytest.raises(TypeError, match="unknown"):
            await executions.insert(work, **_execution_columns("e1", colour="red"))
        with pytest.raises(TypeError, match="created_at"):
            await executions.insert(work, **_execution_columns("e1", created_at=1))
        columns = _execution_columns("e1")
        del columns["origin"]
        with pytest.raises(TypeError, match="origin"):
            await executions.insert(work, **columns)
    with pytest.raises(StorageError) as excinfo:
        await _execution(store, "e1", command_id="no-such-command")
    assert "foreign key" in str(excinfo.value.__cause__).lower()


@pytest.mark.parametrize(
    ("overrides", "constraint"),
    [
        ({"status": "exploded"}, "ck_executions_status"),
        ({"invoker_kind": "robot"}, "ck_executions_invoker_kind"),
        ({"origin": "telepathy"}, "ck_executions_origin"),
    ],
)
async def test_execution_check_constraints(
    store: Store, overrides: dict[str, Any], constraint: str
) -> None:
    await _command(store)
    with pytest.raises(StorageError) as excinfo:
        await _execution(store, "e1", **overrides)
    _refused_by(excinfo.value, constraint)
    assert await _get_execution(store, "e1") is None


async def test_execution_list_newest_first_with_tiebreak(store: Store) -> None:
    await _command(store)
    await _command(store, "c2")
    await _execution(store, "e1")
    store.advance_clock(1)
    await _execution(store, "e2")
    await _execution(store, "e3")  # same millisecond as e2: execution_id desc breaks the tie
    store.advance_clock(1)
    await _execution(store, "e0")
    await _execution(store, "x1", command_id="c2")
    async with store.read() as conn:
        listed = await executions.list_(conn, command_id="c1", skip=0, limit=10)
        assert [e.execution_id for e in listed] == ["e0", "e3", "e2", "e1"]
        page = await executions.list_(conn, command_id="c1", skip=1, limit=2)
        assert [e.execution_id for e in page] == ["e3", "e2"]
        assert await executions.list_(conn, command_id="c1", skip=4, limit=10) == []
        other = await executions.list_(conn, command_id="c2", skip=0, limit=10)
        assert [e.execution_id for e in other] == ["x1"]


async def test_execution_finish(store: Store) -> None:
    await _command(store)
    await _execution(store, "e1")
    before = await _get_execution(store, "e1")
    assert before is not None
    store.advance_clock(1)
    async with store.transaction() as work:
        await executions.finish(
            work,
            "e1",
            status="succeeded",
            tx_id="tx-9",
            response={"refund_id": "r-1"},
            result_refs=[{"step": "s1", "field": "refund_id"}],
            duration_ms=120,
        )
    after = await _get_execution(store, "e1")
    assert after is not None
    assert (after.status, after.tx_id, after.response, after.duration_ms) == (
        "succeeded",
        "tx-9",
        {"refund_id": "r-1"},
        120,
    )
    assert after.updated_at > before.updated_at and after.created_at == before.created_at
    assert after.input_snapshot == before.input_snapshot  # untouched columns stay

    async with store.transaction() as work:
        with pytest.raises(LookupError):
            await executions.finish(work, "nope", status="failed")
        with pytest.raises(TypeError, match="command_id"):
            await executions.finish(work, "e1", status="failed", command_id="c2")
        with pytest.raises(TypeError, match="unknown"):
            await executions.finish(work, "e1", status="failed", colour="red")
    with pytest.raises(StorageError) as excinfo:
        async with store.transaction() as work:
            await executions.finish(work, "e1", status="exploded")
    _refused_by(excinfo.value, "ck_executions_status")
    assert await _get_execution(store, "e1") == after


async def test_prune_deletes_only_old_finished_executions_and_their_dependents(
    store: Store,
) -> None:
    await _command(store)
    old = {
        "old-ok": "succeeded",
        "old-failed": "failed",
        "old-staged": "staged",
        "old-running": "running",
        "old-review": "manual_review",
    }
    for execution_id, status in old.items():
        await _execution(store, execution_id, status=status)
    store.advance_clock(10)
    await _execution(store, "young-ok", status="succeeded")
    young = await _get_execution(store, "young-ok")
    assert young is not None

    async with store.transaction() as work:
        for i, execution_id in enumerate([*old, "young-ok"]):
            await callbacks.enqueue(
                work,
                execution_id=execution_id,
                event="succeeded",
                targets=["https://hooks.example/a", "https://hooks.example/b"],
                payload={"execution_id": execution_id},
            )
            assert await reservations.reserve(
                work,
                command_id="c1",
                bucket="user:u1",
                key=f"k{i}",
                execution_id=execution_id,
                ttl_ms=60_000,
            )

    # The cutoff is the young row's own created_at: "older than" is strict, so it stays.
    async with store.transaction() as work:
        assert await executions.prune(work, cutoff_ms=young.created_at) == 2
    async with store.transaction() as work:
        assert await executions.prune(work, cutoff_ms=young.created_at) == 0  # nothing left

    async with store.read() as conn:
        for i, execution_id in enumerate([*old, "young-ok"]):
            gone = execution_id in ("old-ok", "old-failed")
            assert (await executions.get(conn, execution_id) is None) is gone
            runs = await callbacks.for_execution(conn, execution_id)
            assert len(runs) == (0 if gone else 2)
            held = await reservations.get(conn, "c1", "user:u1", f"k{i}")
            assert (held is None) is gone


async def test_prune_removes_reservations_only_while_they_name_the_pruned_row(
    store: Store,
) -> None:
    await _command(store)
    await _execution(store, "e-old", status="failed")
    store.advance_clock(10)
    await _execution(store, "e-new")
    async with store.transaction() as work:
        assert await reservations.reserve(
            work, command_id="c1", bucket="user:u1", key="k1", execution_id="e-old", ttl_ms=1
        )
        # The failed run's key was taken over by a newer execution before the prune.
        assert await reservations.replace(
            work,
            command_id="c1",
            bucket="user:u1",
            key="k1",
            old_execution_id="e-old",
            execution_id="e-new",
            ttl_ms=60_000,
        )
    async with store.transaction() as work:
        assert await executions.prune(work, cutoff_ms=work.now_ms) == 1
    held = await _reservation(store)
    assert held is not None and held.execution_id == "e-new"


# -- reservations -------------------------------------------------------------------------------


async def _reserve(store: Store, execution_id: str, key: str = "k1", **kw: Any) -> bool:
    params: dict[str, Any] = {"command_id": "c1", "bucket": "user:u1", "ttl_ms": 60_000}
    params.update(kw)
    async with store.transaction() as work:
        return await reservations.reserve(work, key=key, execution_id=execution_id, **params)


async def test_reserve_twice_second_loses(store: Store) -> None:
    assert await _reserve(store, "e1")
    assert not await _reserve(store, "e2")
    assert not await _reserve(store, "e1")  # not even the holder reserves twice
    held = await _reservation(store)
    assert held is not None
    assert held.execution_id == "e1"
    assert held.expires_at == held.created_at + 60_000
    assert not held.expired(held.created_at) and held.expired(held.expires_at)
    # The key is scoped by command and actor bucket.
    assert await _reserve(store, "e3", bucket="client:bot")
    assert await _reserve(store, "e4", command_id="c2")
    assert await _reserve(store, "e5", key="k2")


async def test_concurrent_reservations_have_one_winner(store: Store) -> None:
    results = await asyncio.gather(*(_reserve(store, f"e{i}") for i in range(6)))
    assert sorted(results) == [False] * 5 + [True]
    held = await _reservation(store)
    assert held is not None and held.execution_id == f"e{results.index(True)}"


async def test_release_only_for_the_holder(store: Store) -> None:
    assert await _reserve(store, "e1")
    async with store.transaction() as work:
        await reservations.release(
            work, command_id="c1", bucket="user:u1", key="k1", execution_id="e2"
        )
    held = await _reservation(store)
    assert held is not None and held.execution_id == "e1"
    async with store.transaction() as work:
        await reservations.release(
            work, command_id="c1", bucket="user:u1", key="k1", execution_id="e1"
        )
    assert await _reservation(store) is None
    assert await _reserve(store, "e2")


async def _replace(store: Store, old: str, new: str, ttl_ms: int = 30_000) -> bool:
    async with store.transaction() as work:
        return await reservations.replace(
            work,
            command_id="c1",
            bucket="user:u1",
            key="k1",
            old_execution_id=old,
            execution_id=new,
            ttl_ms=ttl_ms,
        )


async def test_replace_is_compare_and_set_on_the_holder(store: Store) -> None:
    assert await _reserve(store, "e1", ttl_ms=10)
    first = await _reservation(store)
    assert first is not None
    store.advance_clock(1)

    assert not await _replace(store, "e-wrong", "e2")  # the caller saw a different holder
    assert await _reservation(store) == first

    assert await _replace(store, "e1", "e2")
    taken = await _reservation(store)
    assert taken is not None and taken.execution_id == "e2"
    assert taken.expires_at == taken.created_at + 30_000 and taken.created_at > first.created_at

    assert not await _replace(store, "e1", "e3")  # a second taker of the same stale key loses
    held = await _reservation(store)
    assert held is not None and held.execution_id == "e2"


async def test_replace_after_release_reserves_afresh(store: Store) -> None:
    assert await _reserve(store, "e1")
    async with store.transaction() as work:
        await reservations.release(
            work, command_id="c1", bucket="user:u1", key="k1", execution_id="e1"
        )
    assert await _replace(store, "e1", "e2")
    held = await _reservation(store)
    assert held is not None and held.execution_id == "e2"


# -- action settings ----------------------------------------------------------------------------


async def test_action_settings_put_bumps_revision(store: Store) -> None:
    async with store.read() as conn:
        assert await action_settings.get(conn, "payments", "refund") is None
        assert await action_settings.all_(conn) == []
    async with store.transaction() as work:
        first = await action_settings.put(
            work,
            "payments",
            "refund",
            requires_approval=True,
            approval_policy={"approvers": 1},
        )
    assert first.revision == 1 and first.requires_approval is True
    assert first.approval_policy == {"approvers": 1} and first.locked_for is None
    store.advance_clock(1)
    async with store.transaction() as work:
        second = await action_settings.put(
            work, "payments", "refund", requires_approval=False, approval_policy=None
        )
        await action_settings.put(
            work, "email", "send", requires_approval=False, approval_policy=None
        )
    assert second.revision == 2 and second.requires_approval is False
    assert second.approval_policy is None and second.updated_at > first.updated_at
    async with store.read() as conn:
        assert await action_settings.get(conn, "payments", "refund") == second
        listed = await action_settings.all_(conn)
    assert [(s.provider, s.action) for s in listed] == [("email", "send"), ("payments", "refund")]
    assert all(isinstance(s.requires_approval, bool) for s in listed)


async def test_action_settings_lock_is_exclusive(store: Store) -> None:
    async with store.transaction() as work:
        # No settings row yet: the lock creates one with the defaults.
        assert await action_settings.lock(work, "payments", "refund", "op-1")
        assert await action_settings.lock(work, "payments", "refund", "op-1")  # idempotent
        assert not await action_settings.lock(work, "payments", "refund", "op-2")
        assert not await action_settings.unlock(work, "payments", "refund", "op-2")
    async with store.read() as conn:
        row = await action_settings.get(conn, "payments", "refund")
    assert row is not None
    assert (row.locked_for, row.requires_approval, row.revision) == ("op-1", False, 1)

    async with store.transaction() as work:
        updated = await action_settings.put(
            work, "payments", "refund", requires_approval=True, approval_policy=None
        )
    assert updated.locked_for == "op-1" and updated.revision == 2  # put keeps the lock

    async with store.transaction() as work:
        assert await action_settings.unlock(work, "payments", "refund", "op-1")
        assert not await action_settings.unlock(work, "payments", "refund", "op-1")
        assert await action_settings.lock(work, "payments", "refund", "op-2")
    async with store.read() as conn:
        row = await action_settings.get(conn, "payments", "refund")
    assert row is not None and row.locked_for == "op-2" and row.revision == 2


# -- callbacks ----------------------------------------------------------------------------------


async def test_callback_enqueue_is_idempotent_per_execution_event_target(store: Store) -> None:
    await _command(store)
    await _execution(store, "e1", status="succeeded")
    targets = ["https://hooks.example/a", "https://hooks.example/b"]
    async with store.transaction() as work:
        created = await callbacks.enqueue(
            work, execution_id="e1", event="succeeded", targets=targets, payload={"ok": True}
        )
    assert len(created) == 2 and len(set(created)) == 2
    async with store.transaction() as work:
        again = await callbacks.enqueue(
            work,
            execution_id="e1",
            event="succeeded",
            targets=[*targets, "https://hooks.example/c", "https://hooks.example/c"],
            payload={"ok": True},
        )
        other_event = await callbacks.enqueue(
            work, execution_id="e1", event="failed", targets=targets[:1], payload={}
        )
    assert len(again) == 1 and len(other_event) == 1
    async with store.read() as conn:
        runs = await callbacks.for_execution(conn, "e1")
    assert len(runs) == 4
    assert {r.run_id for r in runs} == {*created, *again, *other_event}
    assert all(r.state == "pending" and r.attempts == 0 and r.fence == 0 for r in runs)
    assert all(r.next_attempt_at is None and r.lease_owner is None for r in runs)
    by_target = {(r.event, r.target): r for r in runs}
    assert by_target[("succeeded", targets[0])].payload == {"ok": True}
    assert by_target[("succeeded", "https://hooks.example/c")].run_id == again[0]

    with pytest.raises(StorageError) as excinfo:
        async with store.transaction() as work:
            await callbacks.enqueue(
                work, execution_id="e1", event="exploded", targets=targets, payload={}
            )
    _refused_by(excinfo.value, "ck_callback_runs_event")
    with pytest.raises(StorageError) as excinfo:
        async with store.transaction() as work:
            await callbacks.enqueue(
                work, execution_id="no-such", event="failed", targets=targets, payload={}
            )
    assert "foreign key" in str(excinfo.value.__cause__).lower()


# -- no ledger rows -----------------------------------------------------------------------------


async def test_repositories_write_no_ledger_rows(store: Store) -> None:
    await _command(store)
    await _execution(store, "e1", tx_id="tx-1")
    async with store.transaction() as work:
        await commands.update(work, "c1", expected_digest=DIGEST_A, digest=DIGEST_B)
        await commands.lock_for_apply(work, "c1")
        await reservations.reserve(
            work, command_id="c1", bucket="user:u1", key="k", execution_id="e1", ttl_ms=1
        )
        await executions.finish(work, "e1", status="succeeded")
        await callbacks.enqueue(
            work, execution_id="e1", event="succeeded", targets=["https://x"], payload={}
        )
        await action_settings.put(work, "p", "a", requires_approval=True, approval_policy=None)
        await action_settings.lock(work, "p", "a", "op")
        await executions.prune(work, cutoff_ms=work.now_ms + 1)
        await commands.soft_delete(work, "c1")
    async with store.read() as conn:
        assert await conn.scalar(select(func.count()).select_from(schema.ledger)) == 0


# -- values the database refuses ----------------------------------------------------------------


async def test_a_value_the_database_refuses_is_value_not_storable(store: Store) -> None:
    """The safety net under the checks where values enter: a string wider than its column
    (PostgreSQL refuses it, SQLite stores it) or an integer past 64 bits (both refuse it) is
    a ``ValueNotStorable`` that quotes no value, never the driver's own error."""
    wide = "a" * (schema.NAME_LENGTH + 1)
    if store.dialect == "postgresql":
        with pytest.raises(ValueNotStorable) as refused:
            async with store.transaction() as work:
                await action_settings.put(
                    work, "p", wide, requires_approval=True, approval_policy=None
                )
        assert str(refused.value) == (
            "database refused a value (22001: string too long for its column)"
        )
        assert wide not in str(refused.value)
    with pytest.raises(ValueNotStorable):
        async with store.read() as conn:
            await executions.list_(conn, command_id="c1", skip=2**63)


_NUMBERS = [1e16, -1e16, 1.5e300, 1.2345678901234567e20, 9.5e15, 1e15, 0.1 + 0.2, 1e-7, -0.0, 0.0]


async def test_jsonb_stable_numbers_read_back_as_they_were_written(store: Store) -> None:
    """What :func:`ledger.canonical.jsonb_stable` makes of a number is what a JSON column gives
    back for it, on both backends: fingerprints taken before a write match those taken after
    a read. Unchanged, PostgreSQL's JSONB gives a float of 1e16 or more back as an integer and
    -0.0 as 0.0, so those fingerprints differ."""
    value = {"numbers": _NUMBERS}
    async with store.transaction() as work:
        await action_settings.put(
            work, "p", "a", requires_approval=True, approval_policy=jsonb_stable(value)
        )
    async with store.read() as conn:
        row = await action_settings.get(conn, "p", "a")
    assert row is not None
    assert canonical_json(row.approval_policy) == canonical_json(jsonb_stable(value))
    if store.dialect == "postgresql":
        assert canonical_json(row.approval_policy) != canonical_json(value)
