"""Fixtures for the HTTP API: the app over a real engine, on SQLite and on PostgreSQL.

The client talks to the ASGI app in-process (``httpx.ASGITransport``), in the test's own event
loop, so the engine, the fake shop and the app share one loop as they do under uvicorn.
Principals are created through :mod:`ledger.principals` (what ``agent-txn principals`` writes),
and tokens are minted here with the secret the app verifies with.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import httpx
import jwt
import pytest
from sqlalchemy import func, select

from ledger import principals
from ledger import schema as tables
from orchestrator.authz import AuthSettings, hash_api_key
from orchestrator.engine import Orchestrator
from orchestrator.http_api import create_app
from providers.fake.shop import FakeShop
from tests.conftest import DbUrls
from tests.support.commands import ORDER_ACTIONS, order_command
from tests.support.world import fast_settings

SECRET: Final = "test-secret-with-at-least-32-bytes!!"
TENANT: Final = "default"
#: Tables whose row counts prove "nothing was written".
COUNTED_TABLES: Final = ("executions", "idempotency_reservations", "transactions", "ledger")


def order_inputs(
    order_id: str = "o-1", *, sku: str = "sku-1", amount: int = 1200
) -> dict[str, Any]:
    """Inputs of one order of the shared order command (``tests.support.commands``)."""
    return {"order_id": order_id, "sku": sku, "amount": amount}


def token(principal_id: str, *, secret: str = SECRET, **claims: Any) -> str:
    """An HS256 JWT for ``principal_id``, valid for five minutes unless ``claims`` say otherwise."""
    body: dict[str, Any] = {"sub": principal_id, "exp": int(time.time()) + 300}
    body.update(claims)
    return jwt.encode(body, secret, algorithm="HS256")


def bearer(principal_id: str, **claims: Any) -> dict[str, str]:
    """The Authorization header of :func:`token`."""
    return {"Authorization": f"Bearer {token(principal_id, **claims)}"}


@dataclass
class Api:
    """The app under test, its engine and shop, and helpers to set up principals."""

    client: httpx.AsyncClient
    orch: Orchestrator
    shop: FakeShop
    #: The tenant the app serves and its principals belong to.
    tenant: str = TENANT

    async def add_user(
        self,
        principal_id: str,
        *,
        permissions: Iterable[str] = ("manage", "execute"),
        actions: Iterable[tuple[str, str]] = ORDER_ACTIONS,
        verified: bool = True,
        disabled: bool = False,
        api_key: str | None = None,
        kind: str = "user",
        rooms: Iterable[str] = (),
    ) -> str:
        """A principal with ``permissions`` on each of ``actions`` (default: the order's)."""
        async with self.orch.store.transaction() as work:
            await principals.add_principal(
                work,
                principal_id=principal_id,
                tenant=self.tenant,
                kind=kind,
                name=principal_id,
                verified=verified,
                disabled=disabled,
                api_key_sha256=hash_api_key(api_key) if api_key else None,
            )
        async with self.orch.store.transaction() as work:
            for provider, action in actions:
                for permission in permissions:
                    await principals.grant(
                        work,
                        principal_id=principal_id,
                        provider=provider,
                        action=action,
                        permission=permission,
                    )
            for room in rooms:
                await principals.join_room(work, room, principal_id)
        return principal_id

    async def create(
        self, author: str, definition: Mapping[str, Any] | None = None, **body: Any
    ) -> dict[str, Any]:
        """Create a command as ``author``; fails the test unless it answers 201."""
        response = await self.client.post(
            "/v1/commands",
            json={"definition": dict(definition or order_command()), **body},
            headers=bearer(author),
        )
        assert response.status_code == 201, response.text
        created: dict[str, Any] = response.json()
        return created

    async def execute(
        self, who: str, command_id: str, inputs: Mapping[str, Any] | None = None, **body: Any
    ) -> httpx.Response:
        """``POST …/execute`` as ``who``."""
        return await self.client.post(
            f"/v1/commands/{command_id}/execute",
            json={"inputs": dict(inputs if inputs is not None else order_inputs()), **body},
            headers=bearer(who),
        )

    async def counts(self) -> dict[str, int]:
        """Rows in :data:`COUNTED_TABLES`, plus the shop's applied effects."""
        out: dict[str, int] = {}
        async with self.orch.store.read() as conn:
            for name in COUNTED_TABLES:
                table = tables.metadata.tables[name]
                out[name] = int(
                    (await conn.execute(select(func.count()).select_from(table))).scalar_one()
                )
        for name, applied in (await self.shop.counts()).items():
            out[f"shop:{name}"] = applied
        return out


@pytest.fixture
async def api(db_urls: DbUrls) -> AsyncIterator[Api]:
    """The app over a fresh engine and fake shop (sku-1 stocked) on the parametrized backend."""
    shop = await FakeShop.open(db_urls.provider)
    await shop.seed_stock({"sku-1": 100})
    orch = await Orchestrator.open(
        db_urls.store, providers=shop.providers(), settings=fast_settings()
    )
    app = create_app(orch, AuthSettings(jwt_secret=SECRET, tenant=TENANT))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            yield Api(client, orch, shop)
    finally:
        await orch.close()
        await shop.close()
