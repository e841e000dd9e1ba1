"""The shop's actions: their contracts, payload checks and business effects.

Each :class:`ActionSpec` pairs an :class:`ActionContract` with a validator (pure, run before
anything is written) and a ``perform`` coroutine that changes business state inside the
caller's transaction and answers ``Confirmed`` or a definite ``Rejected``. Idempotency, fencing
and faults are not handled here; :mod:`providers.fake.provider` wraps every action in them.

Amounts are positive integers in minor units (cents), as Stripe takes them: integer arithmetic
makes over-refund checks exact on both backends.

Two actions are reads (``read_only`` contracts): ``inventory.stock`` and ``payments.charges``.
Commands call them in query steps, at prepare, before anything is written; they change nothing,
so they are neither deduplicated, fenced, looked up nor compensated, and the provider keeps no
idempotency entry for them. Their answers list what they found under ``items`` (the field a
query's cardinality counts).

Every contract declares ``fields``: the payload and result fields the action knows, including
the correlation fields callers pass through (``order_id``/``order`` on a charge, ``charge`` /
``charge_id`` on a receipt, ``for`` on a reservation), which are kept with the effect. A command
that depends on a field outside them is refused at authoring, and a version-1 command checks
before each execute that its fields are still there. ``payments.charges`` filters on the
charge's ``order_id``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from providers.contract import ActionContract, Confirmed, JsonObject, Rejected
from providers.fake import schema

Perform = Callable[[AsyncConnection, str, JsonObject], Awaitable[Confirmed | Rejected]]
Validate = Callable[[JsonObject], str | None]


@dataclass(frozen=True, slots=True)
class ActionSpec:
    """An action's contract, payload validator and business effect."""

    contract: ActionContract
    validate: Validate
    perform: Perform


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def _positive_int(payload: JsonObject, name: str) -> str | None:
    value = payload.get(name)
    # bool is an int subclass; True is not a quantity.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return f"{name} must be a positive integer"
    return None


def _nonempty_str(payload: JsonObject, name: str) -> str | None:
    value = payload.get(name)
    if not isinstance(value, str) or not value:
        return f"{name} must be a non-empty string"
    return None


def _first_problem(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)


# -- inventory --------------------------------------------------------------------------------


def _validate_reserve(payload: JsonObject) -> str | None:
    return _first_problem(_nonempty_str(payload, "sku"), _positive_int(payload, "quantity"))


async def _reserve(conn: AsyncConnection, key: str, payload: JsonObject) -> Confirmed | Rejected:
    s = schema.stock
    sku, quantity = str(payload["sku"]), int(payload["quantity"])
    # One conditional UPDATE: concurrent reservations of one SKU can never oversell.
    taken = await conn.execute(
        update(s)
        .where(s.c.sku == sku, s.c.available >= quantity)
        .values(available=s.c.available - quantity)
    )
    if taken.rowcount == 0:
        known = (await conn.execute(select(s.c.sku).where(s.c.sku == sku))).first()
        return Rejected("out_of_stock" if known else "unknown_sku")
    reservation_id = _new_id("res")
    await conn.execute(
        insert(schema.reservations).values(
            reservation_id=reservation_id, key=key, sku=sku, quantity=quantity, released_by=None
        )
    )
    return Confirmed(
        reservation_id, {"reservation_id": reservation_id, "sku": sku, "quantity": quantity}
    )


def _validate_release(payload: JsonObject) -> str | None:
    return _nonempty_str(payload, "reservation_id")


async def _release(conn: AsyncConnection, key: str, payload: JsonObject) -> Confirmed | Rejected:
    r = schema.reservations
    reservation_id = str(payload["reservation_id"])
    held = (
        await conn.execute(
            select(r.c.sku, r.c.quantity).where(r.c.reservation_id == reservation_id)
        )
    ).first()
    if held is None:
        return Rejected("unknown_reservation")
    release_id = _new_id("rel")
    # Conditional UPDATE: two releases (different keys) of one reservation return stock once.
    claimed = await conn.execute(
        update(r)
        .where(r.c.reservation_id == reservation_id, r.c.released_by.is_(None))
        .values(released_by=release_id)
    )
    if claimed.rowcount == 0:
        return Rejected("already_released")
    s = schema.stock
    await conn.execute(
        update(s).where(s.c.sku == held.sku).values(available=s.c.available + held.quantity)
    )
    return Confirmed(release_id, {"release_id": release_id, "reservation_id": reservation_id})


def _validate_stock(payload: JsonObject) -> str | None:
    return _nonempty_str(payload, "sku")


def stock_answer(sku: str, available: int | None) -> Confirmed:
    """The answer of ``inventory.stock`` (shared with the in-memory shop): an unknown SKU has no
    items and 0 available, so a cardinality ``min: 1`` is how a command insists it exists."""
    items = [] if available is None else [{"sku": sku, "available": available}]
    return Confirmed(f"stock:{sku}", {"sku": sku, "available": available or 0, "items": items})


async def _stock(conn: AsyncConnection, key: str, payload: JsonObject) -> Confirmed | Rejected:
    s = schema.stock
    sku = str(payload["sku"])
    available = (
        await conn.execute(select(s.c.available).where(s.c.sku == sku))
    ).scalar_one_or_none()
    return stock_answer(sku, None if available is None else int(available))


# -- payments ---------------------------------------------------------------------------------


def _validate_charge(payload: JsonObject) -> str | None:
    return _first_problem(_positive_int(payload, "amount"), _nonempty_str(payload, "currency"))


async def _charge(conn: AsyncConnection, key: str, payload: JsonObject) -> Confirmed | Rejected:
    if payload.get("card") == "declined":
        return Rejected("card_declined")
    charge_id = _new_id("ch")
    amount, currency = int(payload["amount"]), str(payload["currency"])
    await conn.execute(
        insert(schema.charges).values(
            charge_id=charge_id, key=key, amount=amount, currency=currency, refunded=0
        )
    )
    return Confirmed(charge_id, {"charge_id": charge_id, "amount": amount, "currency": currency})


def _validate_refund(payload: JsonObject) -> str | None:
    currency = payload.get("currency")
    return _first_problem(
        _nonempty_str(payload, "charge_id"),
        _positive_int(payload, "amount"),
        None if currency is None else _nonempty_str(payload, "currency"),
    )


async def _refund(conn: AsyncConnection, key: str, payload: JsonObject) -> Confirmed | Rejected:
    c = schema.charges
    charge_id, amount = str(payload["charge_id"]), int(payload["amount"])
    charge = (await conn.execute(select(c.c.currency).where(c.c.charge_id == charge_id))).first()
    if charge is None:
        return Rejected("unknown_charge")
    currency = payload.get("currency")
    if currency is not None and currency != charge.currency:
        return Rejected("currency_mismatch")
    # Conditional UPDATE: concurrent partial refunds can never exceed the charge together.
    refunded = await conn.execute(
        update(c)
        .where(c.c.charge_id == charge_id, c.c.refunded + amount <= c.c.amount)
        .values(refunded=c.c.refunded + amount)
    )
    if refunded.rowcount == 0:
        return Rejected("over_refund")
    refund_id = _new_id("re")
    return Confirmed(refund_id, {"refund_id": refund_id, "charge_id": charge_id, "amount": amount})


def _validate_charges(payload: JsonObject) -> str | None:
    return None if payload.get("order_id") is None else _nonempty_str(payload, "order_id")


def charges_answer(order_id: str | None, items: list[dict[str, Any]]) -> Confirmed:
    """The answer of ``payments.charges`` (shared with the in-memory shop)."""
    return Confirmed(f"charges:{order_id or '*'}", {"items": items})


def charge_item(
    charge_id: str, order_id: object, amount: int, currency: str, refunded: int
) -> dict[str, Any]:
    """One charge as ``payments.charges`` lists it (``order_id`` is null when none was given)."""
    return {
        "charge_id": charge_id,
        "order_id": order_id if isinstance(order_id, str) else None,
        "amount": amount,
        "currency": currency,
        "refunded": refunded,
    }


async def _charges(conn: AsyncConnection, key: str, payload: JsonObject) -> Confirmed | Rejected:
    c, e = schema.charges, schema.effects
    wanted = payload.get("order_id")
    # The order a charge belongs to is in the payload it was made with (the effect row); the
    # charges table has no column for it, so an existing shop database keeps working.
    rows = (
        await conn.execute(
            select(c.c.charge_id, c.c.amount, c.c.currency, c.c.refunded, e.c.payload)
            .join(e, e.c.remote_id == c.c.charge_id)
            .order_by(e.c.seq)
        )
    ).all()
    items = []
    for row in rows:
        order_id = json.loads(row.payload).get("order_id")
        if wanted is None or order_id == wanted:
            items.append(
                charge_item(
                    row.charge_id, order_id, int(row.amount), row.currency, int(row.refunded)
                )
            )
    return charges_answer(None if wanted is None else str(wanted), items)


# -- email ------------------------------------------------------------------------------------


def _validate_send(payload: JsonObject) -> str | None:
    return _first_problem(_nonempty_str(payload, "to"), _nonempty_str(payload, "template"))


async def _send(conn: AsyncConnection, key: str, payload: JsonObject) -> Confirmed | Rejected:
    message_id = _new_id("msg")
    await conn.execute(
        insert(schema.emails).values(
            message_id=message_id, key=key, to=str(payload["to"]), template=str(payload["template"])
        )
    )
    return Confirmed(message_id, {"message_id": message_id})


# -- the catalogue ----------------------------------------------------------------------------


def build_specs(dedup_window_seconds: float) -> dict[str, dict[str, ActionSpec]]:
    """Every provider's actions, keyed by provider then action name."""
    common: dict[str, Any] = {
        "dedups_by_key": True,
        "dedup_window_seconds": dedup_window_seconds,
        "supports_lookup": True,
        "lookup_authoritative": True,
        "supports_fencing": True,
    }

    # A read: no dedup, no lookup, no fencing, nothing to compensate, nothing remembered.
    read: dict[str, Any] = {
        "read_only": True,
        "compensation": None,
        "dedups_by_key": False,
        "dedup_window_seconds": 0.0,
        "supports_lookup": False,
        "lookup_authoritative": False,
        "supports_fencing": False,
    }

    def spec(contract: ActionContract, validate: Validate, perform: Perform) -> ActionSpec:
        return ActionSpec(contract, validate, perform)

    return {
        "inventory": {
            "reserve": spec(
                ActionContract(
                    "reserve",
                    compensation="release",
                    supports_void=True,
                    echo_fields=("sku", "quantity"),
                    required_fields=("sku", "quantity"),
                    fields=("for", "order_id", "quantity", "reservation_id", "sku"),
                    **common,
                ),
                _validate_reserve,
                _reserve,
            ),
            "release": spec(
                ActionContract(
                    "release",
                    is_compensation=True,
                    required_fields=("reservation_id",),
                    fields=("release_id", "reservation_id"),
                    **common,
                ),
                _validate_release,
                _release,
            ),
            "stock": spec(
                ActionContract(
                    "stock",
                    required_fields=("sku",),
                    fields=("available", "items", "sku"),
                    **read,
                ),
                _validate_stock,
                _stock,
            ),
        },
        "payments": {
            "charge": spec(
                ActionContract(
                    "charge",
                    compensation="refund",
                    supports_void=True,
                    echo_fields=("amount", "currency"),
                    required_fields=("amount", "currency"),
                    fields=("amount", "card", "charge_id", "currency", "order", "order_id"),
                    **common,
                ),
                _validate_charge,
                _charge,
            ),
            "refund": spec(
                ActionContract(
                    "refund",
                    is_compensation=True,
                    echo_fields=("charge_id", "amount"),
                    required_fields=("charge_id", "amount"),
                    fields=("amount", "charge_id", "currency", "refund_id"),
                    **common,
                ),
                _validate_refund,
                _refund,
            ),
            "charges": spec(
                ActionContract("charges", fields=("items", "order_id"), **read),
                _validate_charges,
                _charges,
            ),
        },
        "email": {
            "send": spec(
                ActionContract(
                    "send",
                    supports_void=True,
                    required_fields=("to", "template"),
                    fields=("charge", "charge_id", "message_id", "order_id", "template", "to"),
                    **common,
                ),
                _validate_send,
                _send,
            ),
        },
    }


def required_problem(contract: ActionContract, payload: Mapping[str, Any]) -> str | None:
    """The contract-level check: every required field is present."""
    missing = [name for name in contract.required_fields if name not in payload]
    return f"missing required fields: {', '.join(missing)}" if missing else None


__all__ = [
    "ActionSpec",
    "build_specs",
    "charge_item",
    "charges_answer",
    "required_problem",
    "stock_answer",
]
