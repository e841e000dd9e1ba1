"""Two tenants sharing one database, each served by its own app, on SQLite and PostgreSQL.

Pinned here: a business key is unique per tenant, so another tenant's order with the same id
(executed, or only staged by its agent) neither blocks this tenant's order nor shows it the other
tenant's ids, while the same tenant's second attempt still answers its own first outcome; and an
operator's prune and requeue act on the operator's own tenant only. Charges are counted in the
fake shop's own database.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final

import httpx
import pytest
from sqlalchemy import select

from ledger.schema import callback_runs, executions
from orchestrator.authz import AuthSettings
from orchestrator.engine import Orchestrator
from orchestrator.http_api import create_app
from providers.fake.shop import FakeShop
from tests.api.conftest import SECRET, Api, bearer, order_inputs
from tests.conftest import DbUrls
from tests.support.audit_rows import count, seed_callbacks
from tests.support.commands import order_command
from tests.support.world import fast_settings

ROOM: Final = "room-1"
OPERATOR: Final = (("agent-txn", "ops"),)
ORDER_KEY: Final = {"$concat": ["order:", {"$ref": "inputs.order_id"}]}
DAY_S: Final = 86_400


@pytest.fixture
async def tenants(db_urls: DbUrls) -> AsyncIterator[tuple[Api, Api]]:
    """Two apps on one store and one shop: tenant ``default`` (alice) and ``other`` (mallory)."""
    shop = await FakeShop.open(db_urls.provider)
    await shop.seed_stock({"sku-1": 100})
    opened: list[Orchestrator] = []
    apis: list[Api] = []
    try:
        for tenant in ("default", "other"):
            orch = await Orchestrator.open(
                db_urls.store, providers=shop.providers(), settings=fast_settings(tenant=tenant)
            )
            opened.append(orch)
            app = create_app(orch, AuthSettings(jwt_secret=SECRET, tenant=tenant))
            client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://testserver"
            )
            apis.append(Api(client, orch, shop, tenant=tenant))
        yield apis[0], apis[1]
    finally:
        for api in apis:
            await api.client.aclose()
        for orch in opened:
            await orch.close()
        await shop.close()


async def _order_command(api: Api, author: str) -> str:
    await api.add_user(author, rooms=[ROOM])
    return str((await api.create(author, order_command(business_key=ORDER_KEY)))["command_id"])


async def _records(api: Api, command_id: str) -> list[tuple[str, str | None]]:
    """(execution_id, tx_id) of every execution of ``command_id``."""
    async with api.orch.store.read() as conn:
        rows = await conn.execute(
            select(executions.c.execution_id, executions.c.tx_id).where(
                executions.c.command_id == command_id
            )
        )
        return [(str(r.execution_id), r.tx_id) for r in rows]


def _shows_none_of(response: httpx.Response, ids: list[tuple[str, str | None]]) -> None:
    for execution_id, tx_id in ids:
        assert execution_id not in response.text
        assert tx_id is None or tx_id not in response.text


async def test_another_tenants_order_neither_blocks_nor_shows_its_ids(
    tenants: tuple[Api, Api],
) -> None:
    alice, mallory = tenants
    theirs = await _order_command(mallory, "mallory")
    ours = await _order_command(alice, "alice")
    inputs = order_inputs("shared-1")

    first = await mallory.execute("mallory", theirs, inputs, idempotency_key="m-1")
    assert first.status_code == 200, first.text
    mallorys = await _records(mallory, theirs)
    assert [tx for _, tx in mallorys if tx is not None]  # a transaction that holds the key

    executed = await alice.execute("alice", ours, inputs, idempotency_key="a-1")
    assert executed.status_code == 200, executed.text
    assert executed.json()["status"] == "succeeded"
    _shows_none_of(executed, mallorys)
    assert (await alice.shop.counts())["payments.charge"] == 2  # one order in each tenant

    # The same tenant's second attempt at the order is held by the first, which ran: its own
    # ids, and the key as alice's command rendered it.
    again = await alice.execute("alice", ours, inputs, idempotency_key="a-2")
    assert again.status_code == 409, again.text
    assert again.json()["detail"]["error"] == "business_key_committed"
    assert again.json()["detail"]["details"]["business_key"] == "order:" + inputs["order_id"]
    alices_tx = {tx for _, tx in await _records(alice, ours) if tx is not None}
    assert again.json()["detail"]["details"]["tx_id"] in alices_tx
    _shows_none_of(again, mallorys)
    assert (await alice.shop.counts())["payments.charge"] == 2


async def test_another_tenants_staged_plan_does_not_block_the_order(
    tenants: tuple[Api, Api],
) -> None:
    alice, mallory = tenants
    theirs = await _order_command(mallory, "mallory")
    ours = await _order_command(alice, "alice")
    inputs = order_inputs("shared-2")

    staged = await mallory.client.post(
        f"/v1/commands/{theirs}/prepare",
        json={"inputs": inputs},
        headers=bearer("mallory", room=ROOM, ai=True),
    )
    assert staged.status_code == 200, staged.text
    mallorys = await _records(mallory, theirs)
    assert [tx for _, tx in mallorys if tx is not None]  # a staged plan holding the key

    executed = await alice.execute("alice", ours, inputs, idempotency_key="a-1")
    assert executed.status_code == 200, executed.text
    assert executed.json()["status"] == "succeeded"
    _shows_none_of(executed, mallorys)
    assert (await alice.shop.counts())["payments.charge"] == 1


async def test_an_operator_prunes_and_requeues_its_own_tenant_only(
    tenants: tuple[Api, Api],
) -> None:
    alice, mallory = tenants
    done: dict[str, str] = {}
    for api, who in ((alice, "alice"), (mallory, "mallory")):
        command_id = await _order_command(api, who)
        executed = await api.execute(who, command_id, order_inputs(f"o-{who}"))
        assert executed.status_code == 200, executed.text
        done[who] = str(executed.json()["execution_id"])
        await seed_callbacks(api.orch.store, done[who], ["http://127.0.0.1:9/hook"])
        await api.add_user(f"ops-{who}", actions=OPERATOR, permissions=("manage",))
    for api in (alice, mallory):  # every record and run is old and stale, in both tenants
        api.orch.store.advance_clock(181 * DAY_S)

    requeued = await alice.client.post(
        "/v1/ops/callbacks/requeue", json={}, headers=bearer("ops-alice")
    )
    assert requeued.status_code == 200, requeued.text
    assert requeued.json() == {"republished": 1, "retried": 0, "reclaimed": 0}
    pruned = await alice.client.post("/v1/ops/executions/prune", headers=bearer("ops-alice"))
    assert pruned.status_code == 200, pruned.text
    assert pruned.json()["pruned"] == 1

    store = mallory.orch.store
    assert await count(store, executions, executions.c.execution_id == done["alice"]) == 0
    assert await count(store, executions, executions.c.execution_id == done["mallory"]) == 1
    assert await count(store, callback_runs, callback_runs.c.execution_id == done["mallory"]) == 1
    # mallory's run was left stale: her own operator still finds it to requeue.
    theirs = await mallory.client.post(
        "/v1/ops/callbacks/requeue", json={}, headers=bearer("ops-mallory")
    )
    assert theirs.json() == {"republished": 1, "retried": 0, "reclaimed": 0}
