"""A validly signed token whose ``sub`` names nobody of this tenant is the uniform 403 on every
command route, on both backends — the listing included, which used to answer ``200 []``
(audit: the docs promise ``principal_not_authorized``)."""

from __future__ import annotations

import pytest

from ledger import principals
from orchestrator.errors import envelope
from tests.api.conftest import Api, bearer, order_inputs

DENIED_AUTHOR = {"detail": envelope("principal_not_authorized", phase="author")}
DENIED = {"detail": envelope("principal_not_authorized", phase="execute")}

#: Subjects a signature can vouch for that still name no principal who may act here.
NOBODIES = [
    pytest.param("nobody", id="unknown"),
    pytest.param("elsewhere", id="other-tenant"),
    pytest.param("ali\x00ce", id="nul"),
    pytest.param("ali\ud800ce", id="lone-surrogate"),
    pytest.param("disabled", id="disabled"),
]


async def _setup(api: Api) -> str:
    await api.add_user("alice")
    await api.add_user("disabled", disabled=True)
    async with api.orch.store.transaction() as work:
        await principals.add_principal(
            work, principal_id="elsewhere", tenant="other", kind="user", name="elsewhere"
        )
    command_id: str = (await api.create("alice"))["command_id"]
    return command_id


@pytest.mark.parametrize("sub", NOBODIES)
async def test_listing_commands_refuses_a_token_naming_nobody(api: Api, sub: str) -> None:
    await _setup(api)
    response = await api.client.get("/v1/commands", headers=bearer(sub))
    assert response.status_code == 403, response.text
    assert response.json() == DENIED_AUTHOR


@pytest.mark.parametrize("sub", NOBODIES)
async def test_every_command_route_refuses_it_the_same_way(api: Api, sub: str) -> None:
    command_id = await _setup(api)
    headers = bearer(sub)
    before = await api.counts()
    authoring = [
        await api.client.get(f"/v1/commands/{command_id}", headers=headers),
        await api.client.get("/v1/commands/0123456789abcdef0123456789abcdef", headers=headers),
        await api.client.delete(f"/v1/commands/{command_id}", headers=headers),
    ]
    running = [
        await api.client.post(
            f"/v1/commands/{command_id}/execute",
            json={"inputs": order_inputs()},
            headers=headers,
        ),
        await api.client.get(f"/v1/commands/{command_id}/executions", headers=headers),
    ]
    assert [(r.status_code, r.json()) for r in authoring] == [(403, DENIED_AUTHOR)] * 3
    assert [(r.status_code, r.json()) for r in running] == [(403, DENIED)] * 2
    assert await api.counts() == before  # nothing written, nothing reached the shop


async def test_a_known_principal_without_grants_is_still_served(api: Api) -> None:
    await _setup(api)
    await api.add_user("bob", actions=())
    theirs = await api.client.get("/v1/commands", headers=bearer("bob"))
    mine = await api.client.get("/v1/commands", headers=bearer("alice"))
    assert theirs.status_code == mine.status_code == 200
    assert len(mine.json()) == 1
