"""``CommandService.list``: the caller's visible commands, filtered and paged by the database,
newest first, on SQLite and PostgreSQL.

The oracle is the rule itself, applied to every live command in Python: company commands for
any valid principal, room commands for current members of that room (a room-bound caller: its
own room only). Every page must be that list's slice, at and around each boundary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ledger import commands, principals
from orchestrator import errors
from orchestrator.authz import Caller
from orchestrator.commands import CommandService
from tests.support.commands import add_user, order_command
from tests.support.world import World


async def _world_of_commands(world: World) -> tuple[CommandService, Caller, dict[str, str]]:
    """Commands mounted in the company and in rooms A (alice in), B (alice never), C (alice
    left), one of them deleted; ``{command_id: scope}`` of the live ones."""
    svc = world.orch.commands
    bob = await add_user(world.orch, "bob")
    alice = await add_user(world.orch, "alice")
    async with world.orch.store.transaction() as work:
        for room in ("room-a", "room-b", "room-c"):
            await principals.join_room(work, room, "bob")
        await principals.join_room(work, "room-a", "alice")
        await principals.join_room(work, "room-c", "alice")
    scopes: dict[str, str] = {}
    plan = [("company", None), ("room", "room-a"), ("room", "room-b"), ("room", "room-c")] * 3
    for n, (kind, room) in enumerate(plan):
        info = await svc.create(
            bob, order_command(name=f"order_{n}"), scope_kind=kind, scope_id=room
        )
        scopes[info["command_id"]] = room or "company"
    doomed = next(cid for cid, scope in scopes.items() if scope == "room-a")
    await svc.delete(bob, doomed)
    del scopes[doomed]
    async with world.orch.store.transaction() as work:
        await principals.leave_room(work, "room-c", "alice")
    return svc, alice, scopes


async def _expected(world: World, scopes: dict[str, str], visible: set[str]) -> list[str]:
    async with world.orch.store.read() as conn:
        rows = await commands.list_(conn, tenant=world.orch.settings.tenant, limit=1000)
    return [r.command_id for r in rows if scopes[r.command_id] in visible]


async def test_every_page_is_the_slice_of_the_visible_commands(world: World) -> None:
    svc, alice, scopes = await _world_of_commands(world)
    expected = await _expected(world, scopes, {"company", "room-a"})
    assert len(expected) == 5  # 3 company + 3 in room A - 1 deleted
    everything = await svc.list(alice)
    assert [c["command_id"] for c in everything] == expected
    assert everything == [await svc.get(alice, cid) for cid in expected]  # the same views
    total = len(expected)
    for skip in (0, 1, total - 1, total, total + 1, 200):
        for limit in (1, 2, total - 1, total, total + 1, 200):
            page = await svc.list(alice, skip=skip, limit=limit)
            assert [c["command_id"] for c in page] == expected[skip : skip + limit], (skip, limit)


async def test_the_database_cuts_the_page(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    svc, alice, _scopes = await _world_of_commands(world)
    calls: list[dict[str, Any]] = []
    original = commands.list_

    async def spy(conn: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return await original(conn, **kwargs)

    monkeypatch.setattr(commands, "list_", spy)
    page = await svc.list(alice, skip=2, limit=2)
    assert len(page) == 2
    [call] = calls  # one query for the page, not a scan in batches
    assert (call["skip"], call["limit"], call["company"], call["rooms"]) == (2, 2, True, ["room-a"])


async def test_a_room_bound_caller_sees_the_company_and_its_room_only(world: World) -> None:
    svc, alice, scopes = await _world_of_commands(world)
    in_room_a = dataclasses.replace(alice, room_id="room-a")
    expected = await _expected(world, scopes, {"company", "room-a"})
    assert [c["command_id"] for c in await svc.list(in_room_a)] == expected
    bob_in_b = Caller(principal_id="bob", kind="user", auth="jwt", room_id="room-b")
    expected_b = await _expected(world, scopes, {"company", "room-b"})
    assert [c["command_id"] for c in await svc.list(bob_in_b, skip=1, limit=3)] == expected_b[1:4]
    # Bound to a room it left: no scope passes, not even the company.
    assert await svc.list(dataclasses.replace(alice, room_id="room-c")) == []


async def test_a_member_of_every_room_pages_across_all_of_them(world: World) -> None:
    svc, _alice, scopes = await _world_of_commands(world)
    bob = Caller(principal_id="bob", kind="user", auth="jwt")
    expected = await _expected(world, scopes, {"company", "room-a", "room-b", "room-c"})
    assert len(expected) == 11
    pages: list[Any] = []
    for skip in range(0, 12, 4):
        pages.extend(c["command_id"] for c in await svc.list(bob, skip=skip, limit=4))
    assert pages == expected


async def test_a_refused_principal_is_refused_not_shown_an_empty_list(world: World) -> None:
    # As over REST (tests/api/test_unknown_principal.py): the Python API decides the same.
    svc, alice, _scopes = await _world_of_commands(world)
    async with world.orch.store.transaction() as work:
        await principals.set_flags(work, "alice", disabled=True)
    with pytest.raises(errors.PrincipalNotAuthorized):
        await svc.list(alice)
    with pytest.raises(errors.PrincipalNotAuthorized):
        await svc.list(Caller(principal_id="nobody", kind="user", auth="jwt"))


async def test_page_parameters_out_of_range_are_refused(world: World) -> None:
    svc, alice, _scopes = await _world_of_commands(world)
    for skip, limit in ((-1, 50), (0, 0), (0, 201)):
        with pytest.raises(errors.RequestInvalid):
            await svc.list(alice, skip=skip, limit=limit)
