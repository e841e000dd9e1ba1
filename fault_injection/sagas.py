"""The sagas the suite runs: the seed's order, a three-step variant, and failing variants."""

from __future__ import annotations

from typing import Any

from orchestrator.expressions import concat, lt, ref
from orchestrator.saga import Check, Compensation, Event, Input, Saga, Step

RESERVE = Step(
    "reserve",
    "inventory",
    "reserve",
    {"sku": ref("inputs.sku"), "quantity": 1},
    compensation=Compensation("release", {"reservation_id": ref("forward.remote_id")}),
)
CHARGE = Step(
    "charge",
    "payments",
    "charge",
    {"amount": ref("inputs.amount"), "currency": "EUR", "order": ref("inputs.order_id")},
    compensation=Compensation(
        "refund", {"charge_id": ref("forward.remote_id"), "amount": ref("forward.payload.amount")}
    ),
)
# A third step that needs an earlier result (rendered at claim time, not at prepare).
GIFT_WRAP = Step(
    "wrap",
    "inventory",
    "reserve",
    {"sku": "wrap-1", "quantity": 1, "for": ref("steps.reserve.remote_id")},
    compensation=Compensation("release", {"reservation_id": ref("forward.remote_id")}),
)
RECEIPT = Event(
    "receipt",
    "email",
    "send",
    {"to": "buyer@example.com", "template": "receipt", "charge": ref("steps.charge.remote_id")},
)

#: SKUs the suite's shop is stocked with.
STOCK = {"sku-1": 1_000_000, "wrap-1": 1_000_000}


def order_saga(*, max_amount: int | None = None, three_steps: bool = False) -> Saga:
    """reserve + charge (+ wrap), receipt from the outbox; ``max_amount`` adds a post-condition
    that fails above it, so the saga turns back after every step was confirmed."""
    checks = []
    if max_amount is not None:
        checks.append(
            Check(
                "amount_under_limit",
                lt(ref("steps.charge.result.amount"), max_amount),
                "charged amount over the limit",
            )
        )
    steps = [RESERVE, CHARGE, GIFT_WRAP] if three_steps else [RESERVE, CHARGE]
    return Saga(
        "order3" if three_steps else "order",
        inputs={"order_id": str, "sku": str, "amount": Input("integer", minimum=1)},
        business_key=concat("order:", ref("inputs.order_id")),
        steps=steps,
        checks=checks,
        outbox=[RECEIPT],
    )


def order(order_id: str, amount: int = 1200) -> dict[str, Any]:
    """Inputs of one order."""
    return {"order_id": order_id, "sku": "sku-1", "amount": amount}
