"""Principals, grants and room memberships on both backends, and authorization built on them.

* the repository round-trips rows (0/1 as ``bool``, readable fields as a tuple), upserts grants
  on their unique key, soft-deletes, and keeps membership history across leave / re-join;
* :func:`load_principal` refuses every bad principal with one byte-identical envelope, so a caller
  learns nothing about which check failed;
* caps, readable fields, execution visibility and :func:`recheck_step` work on what was loaded.

The schema comes from the real migrations (``Store.open`` upgrades an empty database).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pytest

from ledger import principals as repo
from ledger.errors import DuplicateKey
from ledger.store import Store
from orchestrator.authz import (
    Caller,
    Principal,
    authenticate_api_key,
    authorize_step,
    can_see_execution,
    check_readable,
    hash_api_key,
    load_principal,
    manages,
    recheck_step,
    require_jwt,
)
from orchestrator.errors import FieldNotReadable, JwtRequired, PrincipalNotAuthorized

if TYPE_CHECKING:
    from tests.conftest import DbUrls

TENANT = "acme"
ROOM = "room-1"


@pytest.fixture
async def store(db_urls: DbUrls) -> AsyncIterator[Store]:
    s = await Store.open(db_urls.store)
    try:
        yield s
    finally:
        await s.close()


async def add(store: Store, principal_id: str, **kw: Any) -> repo.PrincipalRow:
    values: dict[str, Any] = {"tenant": TENANT, "kind": "user", "name": principal_id.title()}
    values.update(kw)
    async with store.transaction() as work:
        return await repo.add_principal(work, principal_id=principal_id, **values)


async def load(store: Store, caller: Caller, scope: tuple[str, str] = ("room", ROOM)) -> Principal:
    async with store.read() as conn:
        return await load_principal(
            conn, caller, tenant=TENANT, scope_kind=scope[0], scope_id=scope[1]
        )


async def refusal(store: Store, caller: Caller, scope: tuple[str, str] = ("room", ROOM)) -> str:
    """The serialized envelope of the refusal (bytes compared, not just the code)."""
    with pytest.raises(PrincipalNotAuthorized) as info:
        await load(store, caller, scope)
    return json.dumps(info.value.envelope(), sort_keys=True)


# -- repository ---------------------------------------------------------------------------------


async def test_principal_round_trip(store: Store) -> None:
    made = await add(store, "u1", api_key_sha256=hash_api_key("k1"))
    await add(store, "c1", kind="client", verified=False, disabled=True)
    await add(store, "z9", tenant="other")
    async with store.read() as conn:
        got = await repo.get_principal(conn, "u1")
        client = await repo.get_principal(conn, "c1")
        by_key = await repo.by_api_key(conn, hash_api_key("k1"))
        missing = await repo.by_api_key(conn, hash_api_key("k2"))
        everyone = await repo.list_principals(conn)
        acme = await repo.list_principals(conn, tenant=TENANT)
    assert got == made == by_key
    assert got is not None and got.verified is True and got.disabled is False and got.alive
    assert client is not None and (client.kind, client.verified, client.disabled) == (
        "client",
        False,
        True,
    )
    assert type(client.verified) is bool and type(client.disabled) is bool
    assert missing is None
    assert [p.principal_id for p in everyone] == ["c1", "u1", "z9"]
    assert [p.principal_id for p in acme] == ["c1", "u1"]


async def test_duplicate_principal_and_bad_kind(store: Store) -> None:
    await add(store, "u1")
    with pytest.raises(DuplicateKey):
        await add(store, "u1")
    with pytest.raises(ValueError, match="kind"):
        await add(store, "u2", kind="robot")


async def test_set_flags_and_soft_delete(store: Store) -> None:
    await add(store, "u1", verified=False)
    async with store.transaction() as work:
        assert await repo.set_flags(work, "u1", verified=True, disabled=True)
        assert not await repo.set_flags(work, "nobody", disabled=True)
        assert await repo.set_flags(work, "u1")  # nothing to change, but it exists
        assert not await repo.set_flags(work, "nobody")
    async with store.read() as conn:
        row = await repo.get_principal(conn, "u1")
    assert row is not None and row.verified and row.disabled and row.alive

    async with store.transaction() as work:
        await repo.set_flags(work, "u1", deleted=True)
        first = work.now_ms
    store.advance_clock(60)
    async with store.transaction() as work:
        await repo.set_flags(work, "u1", deleted=True)  # a second delete keeps the first time
    async with store.read() as conn:
        row = await repo.get_principal(conn, "u1")
    assert row is not None and row.deleted_at == first and not row.alive

    async with store.transaction() as work:
        await repo.set_flags(work, "u1", deleted=False)
    async with store.read() as conn:
        row = await repo.get_principal(conn, "u1")
    assert row is not None and row.deleted_at is None


async def test_grant_is_an_upsert_on_its_key(store: Store) -> None:
    await add(store, "u1")
    async with store.transaction() as work:
        first = await repo.grant(
            work,
            principal_id="u1",
            provider="shop",
            action="charge",
            permission="execute",
            max_amount=100,
            amount_field="cents",
            readable_fields=["id", "amount", "id"],
        )
        read = await repo.grant(
            work, principal_id="u1", provider="shop", action="charge", permission="read"
        )
    async with store.transaction() as work:
        again = await repo.grant(
            work,
            principal_id="u1",
            provider="shop",
            action="charge",
            permission="execute",
            max_amount=500,
        )
        empty = await repo.grant(
            work,
            principal_id="u1",
            provider="mail",
            action="*",
            permission="read",
            readable_fields=[],
        )
    assert again == first and len({first, read, empty}) == 3
    async with store.read() as conn:
        grants = await repo.grants_of(conn, "u1")
    assert [(g.provider, g.action, g.permission) for g in grants] == [
        ("mail", "*", "read"),
        ("shop", "charge", "execute"),
        ("shop", "charge", "read"),
    ]
    mail, execute, _ = grants
    # Re-granting replaced the cap and the fields (no stale amount_field / readable list).
    assert (execute.grant_id, execute.max_amount, execute.amount_field) == (first, 500, None)
    assert execute.readable_fields is None
    assert mail.readable_fields == ()  # "nothing readable" is not "everything"
    with pytest.raises(ValueError, match="permission"):
        async with store.transaction() as work:
            await repo.grant(
                work, principal_id="u1", provider="shop", action="x", permission="admin"
            )


async def test_readable_fields_round_trip_sorted(store: Store) -> None:
    await add(store, "u1")
    async with store.transaction() as work:
        await repo.grant(
            work,
            principal_id="u1",
            provider="shop",
            action="charge",
            permission="read",
            readable_fields=["total", "id"],
        )
    async with store.read() as conn:
        (grant,) = await repo.grants_of(conn, "u1")
    assert grant.readable_fields == ("id", "total")


async def test_revoke(store: Store) -> None:
    await add(store, "u1")
    async with store.transaction() as work:
        await repo.grant(work, principal_id="u1", provider="shop", action="*", permission="execute")
    async with store.transaction() as work:
        assert not await repo.revoke(work, "u1", "shop", "charge", "execute")  # '*' is no glob
        assert not await repo.revoke(work, "u1", "shop", "*", "read")
        assert await repo.revoke(work, "u1", "shop", "*", "execute")
        assert not await repo.revoke(work, "u1", "shop", "*", "execute")
    async with store.read() as conn:
        assert await repo.grants_of(conn, "u1") == []


async def test_membership_history(store: Store) -> None:
    await add(store, "u1")
    async with store.transaction() as work:
        joined = await repo.join_room(work, ROOM, "u1", "zh-TW")
        t0 = work.now_ms
    assert (joined.joined_at, joined.left_at, joined.language, joined.current) == (
        t0,
        None,
        "zh-TW",
        True,
    )
    store.advance_clock(10)
    async with store.transaction() as work:
        still = await repo.join_room(work, ROOM, "u1")  # already in: nothing restarts
    assert (still.joined_at, still.language) == (t0, "zh-TW")

    store.advance_clock(10)
    async with store.transaction() as work:
        assert await repo.leave_room(work, ROOM, "u1")
        t_left = work.now_ms
        assert not await repo.leave_room(work, ROOM, "u1")
        assert not await repo.leave_room(work, "room-2", "u1")
    async with store.read() as conn:
        gone = await repo.membership(conn, ROOM, "u1")
    assert gone is not None and gone.left_at == t_left and not gone.current

    store.advance_clock(10)
    async with store.transaction() as work:
        back = await repo.join_room(work, ROOM, "u1", "en")
        t_back = work.now_ms
    assert (back.joined_at, back.left_at, back.language) == (t_back, None, "en")
    async with store.read() as conn:
        assert await repo.membership(conn, ROOM, "u1") == back
        assert await repo.membership(conn, "room-2", "u1") is None
        assert await repo.memberships_of(conn, "u1") == [back]


# -- load_principal -----------------------------------------------------------------------------


async def member(store: Store, principal_id: str, room: str = ROOM) -> None:
    async with store.transaction() as work:
        await repo.join_room(work, room, principal_id)


async def give(store: Store, principal_id: str, provider: str, action: str, **kw: Any) -> None:
    kw.setdefault("permission", "execute")
    async with store.transaction() as work:
        await repo.grant(work, principal_id=principal_id, provider=provider, action=action, **kw)


async def test_a_cap_is_stored_up_to_the_columns_largest(store: Store) -> None:
    await add(store, "u1")
    await give(store, "u1", "shop", "charge", max_amount=repo.MAX_AMOUNT)
    async with store.read() as conn:
        (grant,) = await repo.grants_of(conn, "u1")
    assert grant.max_amount == 2**63 - 1
    # One more failed in the driver (OverflowError on SQLite, the statement on PostgreSQL).
    for refused in (repo.MAX_AMOUNT + 1, -1):
        with pytest.raises(ValueError, match="max_amount must be from 0 to"):
            await give(store, "u1", "shop", "charge", max_amount=refused)


async def test_load_principal_loads_row_grants_and_membership(store: Store) -> None:
    await add(store, "u1")
    await member(store, "u1")
    await give(store, "u1", "shop", "charge", max_amount=100)
    principal = await load(store, Caller("u1", "user", "jwt"))
    assert principal.principal_id == "u1" and principal.kind == "user"
    assert principal.membership is not None and principal.membership.room_id == ROOM
    assert [(g.provider, g.action, g.max_amount) for g in principal.grants] == [
        ("shop", "charge", 100)
    ]
    company = await load(store, Caller.user("u1"), ("company", TENANT))
    assert company.membership is None


async def test_every_principal_refusal_is_byte_identical(store: Store) -> None:
    await add(store, "ok")
    await add(store, "elsewhere", tenant="other")
    await add(store, "disabled", disabled=True)
    await add(store, "unverified", verified=False)
    await add(store, "deleted")
    await add(store, "outsider")
    await add(store, "former")
    await add(store, "bot", kind="client")
    for pid in ("ok", "elsewhere", "disabled", "unverified", "deleted", "former", "bot"):
        await member(store, pid)
    async with store.transaction() as work:
        await repo.set_flags(work, "deleted", deleted=True)
        await repo.leave_room(work, ROOM, "former")

    await load(store, Caller("ok", "user", "jwt"))  # the control: the setup itself is fine
    await load(store, Caller.client("bot"))
    cases = {
        "unknown id": Caller("ghost", "user", "jwt"),
        "wrong tenant": Caller("elsewhere", "user", "jwt"),
        "disabled": Caller("disabled", "user", "jwt"),
        "unverified": Caller("unverified", "user", "jwt"),
        "deleted": Caller("deleted", "user", "jwt"),
        "not a member": Caller("outsider", "user", "jwt"),
        "left the room": Caller("former", "user", "jwt"),
        "kind mismatch": Caller("bot", "user", "jwt"),
        "token bound to another room": Caller("ok", "user", "jwt", room_id="room-2"),
    }
    envelopes = {name: await refusal(store, caller) for name, caller in cases.items()}
    expected = json.dumps(
        {
            "details": {},
            "error": "principal_not_authorized",
            "message": "Command principal is not authorized",
            "phase": "execute",
            "retryable": False,
        },
        sort_keys=True,
    )
    assert envelopes == dict.fromkeys(cases, expected)


async def test_company_scope_needs_no_membership_unless_the_token_names_a_room(
    store: Store,
) -> None:
    await add(store, "u1")
    await load(store, Caller("u1", "user", "jwt"), ("company", TENANT))
    # A token bound to a room the principal is not in is refused in any scope.
    assert await refusal(store, Caller("u1", "user", "jwt", room_id=ROOM), ("company", TENANT))
    await member(store, "u1")
    bound = await load(store, Caller("u1", "user", "jwt", room_id=ROOM), ("company", TENANT))
    assert bound.membership is not None and bound.membership.room_id == ROOM


async def test_unknown_scope_kind_is_a_programming_error(store: Store) -> None:
    await add(store, "u1")
    with pytest.raises(ValueError, match="scope_kind"):
        await load(store, Caller.user("u1"), ("chatroom", ROOM))


# -- checks on loaded principals ----------------------------------------------------------------


async def test_caps_on_a_loaded_principal(store: Store) -> None:
    await add(store, "u1")
    await member(store, "u1")
    await give(store, "u1", "shop", "charge", max_amount=100)
    await give(store, "u1", "shop", "*")
    await give(store, "u1", "mail", "send", max_amount=5, amount_field="recipients")
    principal = await load(store, Caller("u1", "user", "jwt"))

    authorize_step(principal, provider="shop", action="charge", payload={"amount": 100})
    authorize_step(principal, provider="shop", action="charge", payload=None)
    authorize_step(principal, provider="shop", action="refund", payload={"amount": 10**9})
    authorize_step(principal, provider="mail", action="send", payload={"recipients": 5})
    refusals: list[tuple[str, str, Any]] = [
        ("shop", "charge", {"amount": 101}),
        ("shop", "charge", {"total": 1}),
        ("mail", "send", {"recipients": 6}),
        ("mail", "send", {"amount": 1}),
        ("bank", "transfer", None),
    ]
    for provider, action, payload in refusals:
        with pytest.raises(PrincipalNotAuthorized) as info:
            authorize_step(principal, provider=provider, action=action, payload=payload)
        assert info.value.details == {}, (provider, action, payload)


async def test_readable_fields_on_a_loaded_principal(store: Store) -> None:
    await add(store, "u1")
    await give(store, "u1", "shop", "charge", readable_fields=["id", "status"])
    await give(store, "u1", "shop", "lookup", permission="read")
    principal = await load(store, Caller.user("u1"), ("company", TENANT))
    check_readable(principal, {"shop.charge": {"id", "status"}, "shop.lookup": {"anything"}})
    with pytest.raises(FieldNotReadable) as info:
        check_readable(principal, {"shop.charge": {"id", "card_number"}})
    assert info.value.envelope()["details"] == {"field": "shop.charge.card_number"}
    assert info.value.http_status == 403


async def test_execution_visibility_on_a_loaded_principal(store: Store) -> None:
    await add(store, "boss")
    await add(store, "u1")
    for pid in ("boss", "u1"):
        await member(store, pid)
    await give(store, "boss", "shop", "*", permission="manage")
    await give(store, "boss", "mail", "send", permission="manage")
    boss = await load(store, Caller("boss", "user", "jwt"))
    u1 = await load(store, Caller("u1", "user", "jwt"))
    snapshot = {
        "version": 1,
        "scope": {"kind": "room", "id": ROOM},
        "resource_ids": ["shop.charge", "mail.send"],
    }
    mount = ("room", ROOM)
    seen = {
        name: can_see_execution(
            p, invoker_kind="user", invoker_id="u1", snapshot=snapshot, mounted_scope=mount
        )
        for name, p in {"boss": boss, "u1": u1}.items()
    }
    assert seen == {"boss": True, "u1": True}
    assert manages(boss, ["shop.charge", "mail.send"])
    wider = {**snapshot, "resource_ids": ["shop.charge", "mail.bounce"]}
    assert not can_see_execution(
        boss, invoker_kind="user", invoker_id="u1", snapshot=wider, mounted_scope=mount
    )
    assert not can_see_execution(
        boss,
        invoker_kind="user",
        invoker_id="u1",
        snapshot=snapshot,
        mounted_scope=("company", TENANT),
    )


async def test_recheck_step_sees_changes_made_since_prepare(store: Store) -> None:
    await add(store, "u1")
    await member(store, "u1")
    await give(store, "u1", "shop", "charge", max_amount=100)

    async def recheck(payload: Any = None, **kw: Any) -> bool:
        args: dict[str, Any] = {
            "tenant": TENANT,
            "invoker_kind": "user",
            "invoker_id": "u1",
            "scope_kind": "room",
            "scope_id": ROOM,
            "provider": "shop",
            "action": "charge",
            "payload": payload,
        }
        args.update(kw)
        async with store.read() as conn:
            return await recheck_step(conn, **args)

    assert await recheck({"amount": 100})
    assert not await recheck({"amount": 101})
    assert not await recheck(None, action="refund")
    assert not await recheck(None, invoker_kind="client")
    assert not await recheck(None, invoker_kind="robot")
    assert not await recheck(None, scope_kind="chatroom")
    assert not await recheck(None, tenant="other")

    async with store.transaction() as work:
        await repo.leave_room(work, ROOM, "u1")
    assert not await recheck(None)
    await member(store, "u1")
    assert await recheck(None)
    async with store.transaction() as work:
        await repo.set_flags(work, "u1", disabled=True)
    assert not await recheck(None)
    async with store.transaction() as work:
        await repo.set_flags(work, "u1", disabled=False)
        await repo.revoke(work, "u1", "shop", "charge", "execute")
    assert not await recheck(None)


async def test_api_key_authentication(store: Store) -> None:
    await add(store, "c1", kind="client", api_key_sha256=hash_api_key("atk_secret"))
    await add(store, "gone", api_key_sha256=hash_api_key("atk_gone"))
    async with store.transaction() as work:
        await repo.set_flags(work, "gone", deleted=True)
    async with store.read() as conn:
        caller = await authenticate_api_key(conn, "atk_secret")
        for bad in ("atk_other", "", "atk_gone"):
            with pytest.raises(PrincipalNotAuthorized):
                await authenticate_api_key(conn, bad)
    assert caller == Caller("c1", "client", "api_key")
    with pytest.raises(JwtRequired):
        require_jwt(caller)
