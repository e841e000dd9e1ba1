"""Saga definitions shared by the tests (the seed's order, and variants)."""

from __future__ import annotations

from orchestrator.expressions import concat, lt, ref
from orchestrator.saga import Check, Compensation, Event, Input, Saga, Step


def order_saga(*, max_amount: int | None = None, name: str = "order") -> Saga:
    """reserve + charge, receipt email from the outbox; optional post-condition on the amount."""
    checks = []
    if max_amount is not None:
        checks.append(
            Check(
                "amount_under_limit",
                lt(ref("steps.charge.result.amount"), max_amount),
                "charged amount over the limit",
            )
        )
    return Saga(
        name,
        inputs={
            "order_id": str,
            "sku": str,
            "amount": Input("integer", minimum=1),
        },
        business_key=concat("order:", ref("inputs.order_id")),
        steps=[
            Step(
                "reserve",
                "inventory",
                "reserve",
                {"sku": ref("inputs.sku"), "quantity": 1},
                compensation=Compensation("release", {"reservation_id": ref("forward.remote_id")}),
            ),
            Step(
                "charge",
                "payments",
                "charge",
                {
                    "amount": ref("inputs.amount"),
                    "currency": "EUR",
                    "order": ref("inputs.order_id"),
                },
                compensation=Compensation(
                    "refund",
                    {
                        "charge_id": ref("forward.remote_id"),
                        "amount": ref("forward.payload.amount"),
                    },
                ),
            ),
        ],
        checks=checks,
        outbox=[
            Event(
                "receipt",
                "email",
                "send",
                {
                    "to": "buyer@example.com",
                    "template": "receipt",
                    "charge": ref("steps.charge.remote_id"),
                },
            )
        ],
    )


def order(order_id: str, amount: int = 1200) -> dict[str, object]:
    """Inputs of one order."""
    return {"order_id": order_id, "sku": "sku-1", "amount": amount}
