"""The proposal shows payload values taken from query results: they are fixed at prepare, and
the person must see the amount they confirm (audit: a queried charge amount was hidden)."""

from __future__ import annotations

from typing import Any

from orchestrator.definitions import normalize
from orchestrator.guidance import proposal_text
from providers.memory import MemoryShop
from providers.registry import ProviderRegistry

REGISTRY = ProviderRegistry(MemoryShop().providers())

RESTOCK_FEE: dict[str, Any] = {
    "name": "restock_fee",
    "version": 1,
    "description": "Charge the restocking fee",
    "inputs": {"sku": {"type": "string"}},
    "steps": [
        {
            "kind": "query",
            "name": "stock",
            "provider": "inventory",
            "action": "stock",
            "payload": {"sku": {"$ref": "inputs.sku"}},
        },
        {
            "kind": "effect",
            "name": "charge",
            "provider": "payments",
            "action": "charge",
            "payload": {
                "amount": {"$ref": "queries.stock.result.available"},
                "currency": "EUR",
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
}

QUERIES = {"stock": {"result": {"sku": "sku-1", "available": 99990, "items": []}}}


def test_a_queried_amount_is_shown_in_the_proposal() -> None:
    stored = normalize(RESTOCK_FEE, registry=REGISTRY)
    for language in ("en", "zh-TW"):
        text = proposal_text(
            stored, {"sku": "sku-1"}, language, needs_approval=False, queries=QUERIES
        )
        assert "amount: 99990" in text and "currency: EUR" in text
        assert "$ref" not in text and "queries." not in text
