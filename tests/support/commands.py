"""Commands-layer test helpers: the order command as JSON, principals with grants."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from ledger import principals
from orchestrator.authz import Caller
from orchestrator.engine import Orchestrator

#: Every action the order command touches (reserve/release, charge/refund, the receipt mail).
ORDER_ACTIONS: tuple[tuple[str, str], ...] = (
    ("inventory", "reserve"),
    ("inventory", "release"),
    ("payments", "charge"),
    ("payments", "refund"),
    ("email", "send"),
)

ORDER_COMMAND: dict[str, Any] = {
    "name": "order",
    "version": 1,
    "inputs": {
        "order_id": {"type": "string", "max_length": 64},
        "sku": {"type": "string"},
        "amount": {"type": "integer", "minimum": 1},
    },
    "steps": [
        {
            "kind": "effect",
            "name": "reserve",
            "provider": "inventory",
            "action": "reserve",
            "payload": {"sku": {"$ref": "inputs.sku"}, "quantity": 1},
            "compensation": {
                "action": "release",
                "payload": {"reservation_id": {"$ref": "forward.remote_id"}},
            },
        },
        {
            "kind": "effect",
            "name": "charge",
            "provider": "payments",
            "action": "charge",
            "payload": {
                "amount": {"$ref": "inputs.amount"},
                "currency": "EUR",
                "order": {"$ref": "inputs.order_id"},
            },
            "compensation": {
                "action": "refund",
                "payload": {
                    "charge_id": {"$ref": "forward.remote_id"},
                    "amount": {"$ref": "forward.payload.amount"},
                },
            },
        },
    ],
    "outbox": [
        {
            "name": "receipt",
            "provider": "email",
            "action": "send",
            "payload": {
                "to": "buyer@example.com",
                "template": "receipt",
                "charge": {"$ref": "steps.charge.remote_id"},
            },
        }
    ],
    "result": {"charge": {"$ref": "steps.charge.remote_id"}},
}


def order_command(**changes: Any) -> dict[str, Any]:
    """A fresh copy of the order command with top-level ``changes``."""
    data = copy.deepcopy(ORDER_COMMAND)
    data.update(changes)
    return data


async def add_user(
    orch: Orchestrator,
    principal_id: str,
    *,
    permissions: Iterable[str] = ("manage", "execute", "read"),
    actions: Iterable[tuple[str, str]] = ORDER_ACTIONS,
    max_amount: int | None = None,
    tenant: str | None = None,
    verified: bool = True,
    kind: str = "user",
) -> Caller:
    """A principal with grants on ``actions``; returns a JWT-authenticated caller for it."""
    async with orch.store.transaction() as work:
        await principals.add_principal(
            work,
            principal_id=principal_id,
            tenant=tenant or orch.settings.tenant,
            kind=kind,
            name=principal_id,
            verified=verified,
        )
        for provider, action in actions:
            for permission in permissions:
                await principals.grant(
                    work,
                    principal_id=principal_id,
                    provider=provider,
                    action=action,
                    permission=permission,
                    # The cap is on the charge's amount; other actions carry no amount.
                    max_amount=(
                        max_amount
                        if permission == "execute" and (provider, action) == ("payments", "charge")
                        else None
                    ),
                )
    return Caller(principal_id=principal_id, kind=kind, auth="jwt")
