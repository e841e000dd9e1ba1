"""Commands: JSON form and builder to one stored form, its checks, dependency contract and drift.

Also the read-only query actions of both shops (``inventory.stock``, ``payments.charges``) and
the ``fields`` every shop action now declares.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import traceback
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.canonical import fingerprint
from orchestrator.definitions import (
    Assert,
    Callback,
    Cap,
    Cardinality,
    Command,
    Query,
    Rule,
    StoredCommand,
    build_dependency_contract,
    check_drift,
    check_saga_shape,
    field_refs,
    normalize,
)
from orchestrator.errors import (
    AgentTxnError,
    DefinitionInvalid,
    DefinitionLimitExceeded,
    SchemaDependencyChanged,
    UnknownActionError,
    UnknownProviderError,
)
from orchestrator.expressions import concat, eq, gt, lte, ref
from orchestrator.saga import Check, Compensation, Event, Input, SagaDefinition, Step
from providers.contract import (
    ActionContract,
    ApplyOutcome,
    Confirmed,
    JsonObject,
    LookupOutcome,
    NotFound,
)
from providers.fake.shop import FakeShop
from providers.memory import MemoryShop
from providers.registry import ProviderRegistry

# -- fixtures and helpers ----------------------------------------------------------------------


def registry(shop: MemoryShop | None = None) -> ProviderRegistry:
    return ProviderRegistry((shop or MemoryShop()).providers())


@pytest.fixture
def reg() -> ProviderRegistry:
    return registry()


def R(path: str) -> dict[str, str]:
    return {"$ref": path}


SHIP: dict[str, Any] = {
    "name": "ship_order",
    "version": 2,
    "mode": "execute",
    "description": "Reserve, charge, mail a receipt.",
    "scope": {"kind": "company", "id": "acme"},
    "inputs": {
        "order_id": {"type": "string", "required": True, "max_length": 64},
        "sku": {"type": "string"},
        "amount": {"type": "integer", "minimum": 1},
    },
    "business_key": {"$concat": ["order:", R("inputs.order_id")]},
    "rules": [
        {"name": "sane", "when": {"$lte": [R("inputs.amount"), 100_000]}, "message": "too much"}
    ],
    "caps": [{"name": "amount", "value": R("inputs.amount"), "max": 50_000}],
    "steps": [
        {
            "kind": "query",
            "name": "stock",
            "provider": "inventory",
            "action": "stock",
            "payload": {"sku": R("inputs.sku")},
            "cardinality": {"min": 1},
        },
        {
            "kind": "assert",
            "name": "in_stock",
            "expr": {"$gt": [R("queries.stock.result.available"), 0]},
            "message": "That item is out of stock.",
        },
        {
            "kind": "effect",
            "name": "reserve",
            "provider": "inventory",
            "action": "reserve",
            "payload": {"sku": R("inputs.sku"), "quantity": 1},
            "compensation": {
                "action": "release",
                "payload": {"reservation_id": R("forward.result.reservation_id")},
            },
        },
        {
            "kind": "assert",
            "name": "one_reserved",
            "expr": {"$eq": [R("steps.reserve.result.quantity"), 1]},
            "message": "Reserved the wrong quantity.",
        },
        {
            "kind": "effect",
            "name": "charge",
            "provider": "payments",
            "action": "charge",
            "payload": {
                "amount": R("inputs.amount"),
                "currency": "EUR",
                "order_id": R("inputs.order_id"),
            },
            "compensation": {
                "action": "refund",
                "payload": {
                    "charge_id": R("forward.remote_id"),
                    "amount": R("forward.payload.amount"),
                },
            },
        },
        {
            "kind": "assert",
            "name": "charged_euros",
            "expr": {"$eq": [R("steps.charge.result.currency"), "EUR"]},
            "message": "",
        },
    ],
    "checks": [
        {
            "name": "amount_ok",
            "expr": {"$eq": [R("steps.charge.result.amount"), R("inputs.amount")]},
        }
    ],
    "outbox": [
        {
            "name": "receipt",
            "provider": "email",
            "action": "send",
            "payload": {
                "to": "buyer@example.com",
                "template": "receipt",
                "charge_id": R("steps.charge.remote_id"),
            },
        }
    ],
    "result": {
        "charge_id": R("steps.charge.result.charge_id"),
        "available": R("queries.stock.result.available"),
    },
    "callbacks": [{"url": "https://hooks.example.com/orders", "events": ["succeeded", "failed"]}],
    "delivery_reconciliation_ttl_seconds": 1800,
}

LOOKUP: dict[str, Any] = {
    "name": "stock_level",
    "mode": "query",
    "inputs": {"sku": {"type": "string"}},
    "steps": [
        {
            "kind": "query",
            "name": "stock",
            "provider": "inventory",
            "action": "stock",
            "payload": {"sku": R("inputs.sku")},
        },
        {
            "kind": "assert",
            "name": "known",
            "expr": {"$gt": [{"$len": R("queries.stock.result.items")}, 0]},
        },
    ],
    "result": {"available": R("queries.stock.result.available")},
}


def ship(**changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(SHIP)
    doc.update(changes)
    return doc


def lookup(**changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(LOOKUP)
    doc.update(changes)
    return doc


def with_step(index: int, **changes: Any) -> dict[str, Any]:
    doc = ship()
    doc["steps"][index].update(changes)
    return doc


def invalid(raw: Mapping[str, Any], reg: ProviderRegistry) -> DefinitionInvalid:
    with pytest.raises(DefinitionInvalid) as info:
        normalize(raw, registry=reg)
    error = info.value
    # Never a pydantic traceback: nothing of pydantic is chained, printed or in the envelope.
    printed = "".join(traceback.format_exception(error))
    assert printed.count("Traceback") == 1 and "ValidationError" not in printed
    assert "pydantic" not in printed.lower()
    assert "pydantic" not in json.dumps(error.envelope(phase="author")).lower()
    assert error.envelope(phase="author")["error"] == "saga_definition_invalid"
    return error


def reason(raw: Mapping[str, Any], reg: ProviderRegistry) -> str:
    return str(invalid(raw, reg).details["reason"])


class StubProvider:
    """A provider whose contracts a test can swap (for drift)."""

    def __init__(self, name: str, contracts: Mapping[str, ActionContract]) -> None:
        self._name = name
        self._contracts = dict(contracts)

    @property
    def name(self) -> str:
        return self._name

    def contract(self, action: str) -> ActionContract:
        return self._contracts[action]

    def actions(self) -> Mapping[str, ActionContract]:
        return self._contracts

    async def apply(
        self, action: str, *, key: str, payload: JsonObject, fence: int
    ) -> ApplyOutcome:
        return Confirmed("x")

    async def lookup(
        self, action: str, *, key: str, payload: JsonObject, void_if_missing: bool = False
    ) -> LookupOutcome:
        return NotFound()


def swapped(reg: ProviderRegistry, provider: str, action: str, **changes: Any) -> ProviderRegistry:
    """A registry like ``reg`` with one action's contract edited."""
    out = ProviderRegistry(list(reg))
    base = reg.get(provider)
    contracts = dict(base.actions())
    contracts[action] = dataclasses.replace(contracts[action], **changes)
    out.register(StubProvider(provider, contracts), replace=True)
    return out


# -- the stored form ---------------------------------------------------------------------------


def test_the_stored_form_has_every_key_and_a_canonical_digest(reg: ProviderRegistry) -> None:
    stored = normalize(ship(), registry=reg)
    data = stored.data
    assert set(data) == {
        "format", "name", "version", "mode", "description", "inputs", "business_key", "rules",
        "caps", "steps", "checks", "outbox", "result", "callbacks",
        "delivery_reconciliation_ttl_seconds", "dependency_contract",
    }  # fmt: skip
    assert data["format"] == "agent-txn/command@1"
    assert "scope" not in data
    kinds = {s["name"]: set(s) for s in data["steps"]}
    assert kinds["stock"] == {"kind", "name", "provider", "action", "payload", "cardinality"}
    assert kinds["in_stock"] == {"kind", "name", "expr", "message"}
    assert kinds["reserve"] == {
        "kind", "name", "provider", "action", "payload", "compensation", "retriable"
    }  # fmt: skip
    assert data["steps"][0]["cardinality"] == {"min": 1, "max": None}
    assert data["steps"][2]["retriable"] is False
    assert data["inputs"]["sku"] == {"type": "string", "required": True}
    assert data["checks"][0]["message"] == ""
    assert data["callbacks"] == [
        {"url": "https://hooks.example.com/orders", "events": ["failed", "succeeded"]}
    ]
    # The digest is the SHA-256 of canonical ASCII JSON, as any client would compute it.
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert stored.digest == hashlib.sha256(text.encode()).hexdigest() == fingerprint(data)
    assert normalize(ship(), registry=reg).digest == stored.digest


def test_null_means_absent_and_defaults_are_filled(reg: ProviderRegistry) -> None:
    bare: dict[str, Any] = {
        "name": "mail",
        "steps": [
            {
                "kind": "effect",
                "name": "send",
                "provider": "email",
                "action": "send",
                "payload": {"to": "a@b.c", "template": "t"},
            }
        ],
    }
    nulls = copy.deepcopy(bare)
    nulls.update(
        version=None, mode=None, description=None, inputs=None, business_key=None, rules=None,
        caps=None, checks=None, outbox=None, result=None, callbacks=None,
        delivery_reconciliation_ttl_seconds=None, scope=None,
    )  # fmt: skip
    nulls["steps"][0].update(compensation=None, retriable=None)
    a, b = normalize(bare, registry=reg), normalize(nulls, registry=reg)
    assert a.data == b.data and a.digest == b.digest
    assert a.version == 1 and a.mode == "execute" and a.ttl_seconds == 900
    assert a.data["description"] == "" and a.data["business_key"] is None
    assert a.data["rules"] == a.data["callbacks"] == []
    assert a.data["steps"][0]["compensation"] is None


def test_the_same_meaning_stores_the_same_bytes(reg: ProviderRegistry) -> None:
    a = with_step(0, cardinality=None)
    b = with_step(0, cardinality={"min": None, "max": None})
    c = ship(
        callbacks=[
            {"url": "https://hooks.example.com/orders", "events": ["failed", "succeeded", "failed"]}
        ]
    )
    assert normalize(a, registry=reg).digest == normalize(b, registry=reg).digest
    assert normalize(a, registry=reg).data["steps"][0]["cardinality"] is None
    assert normalize(c, registry=reg).digest == normalize(ship(), registry=reg).digest
    default_events = ship(callbacks=[{"url": "https://h.example.com/x"}])
    stored = normalize(default_events, registry=reg)
    assert stored.callbacks[0]["events"] == ["failed", "staged", "succeeded"]


def test_scope_is_a_column_not_part_of_the_definition(reg: ProviderRegistry) -> None:
    room = ship(scope={"kind": "room", "id": "r-1"})
    assert normalize(room, registry=reg).digest == normalize(ship(), registry=reg).digest
    del room["scope"]
    assert normalize(room, registry=reg).digest == normalize(ship(), registry=reg).digest


def test_the_builder_gives_the_same_stored_form_as_json(reg: ProviderRegistry) -> None:
    command = Command(
        "ship_order",
        version=2,
        description="Reserve, charge, mail a receipt.",
        inputs={
            "order_id": Input("string", max_length=64),
            "sku": str,
            "amount": Input("integer", minimum=1),
        },
        business_key=concat("order:", ref("inputs.order_id")),
        rules=[Rule("sane", lte(ref("inputs.amount"), 100_000), "too much")],
        caps=[Cap("amount", ref("inputs.amount"), 50_000)],
        steps=[
            Query("stock", "inventory", "stock", {"sku": ref("inputs.sku")}, Cardinality(min=1)),
            Assert(
                "in_stock",
                gt(ref("queries.stock.result.available"), 0),
                "That item is out of stock.",
            ),
            Step(
                "reserve",
                "inventory",
                "reserve",
                {"sku": ref("inputs.sku"), "quantity": 1},
                compensation=Compensation(
                    "release", {"reservation_id": ref("forward.result.reservation_id")}
                ),
            ),
            Assert(
                "one_reserved",
                eq(ref("steps.reserve.result.quantity"), 1),
                "Reserved the wrong quantity.",
            ),
            Step(
                "charge",
                "payments",
                "charge",
                {
                    "amount": ref("inputs.amount"),
                    "currency": "EUR",
                    "order_id": ref("inputs.order_id"),
                },
                compensation=Compensation(
                    "refund",
                    {
                        "charge_id": ref("forward.remote_id"),
                        "amount": ref("forward.payload.amount"),
                    },
                ),
            ),
            Assert("charged_euros", eq(ref("steps.charge.result.currency"), "EUR")),
        ],
        checks=[Check("amount_ok", eq(ref("steps.charge.result.amount"), ref("inputs.amount")))],
        outbox=[
            Event(
                "receipt",
                "email",
                "send",
                {
                    "to": "buyer@example.com",
                    "template": "receipt",
                    "charge_id": ref("steps.charge.remote_id"),
                },
            )
        ],
        result={
            "charge_id": ref("steps.charge.result.charge_id"),
            "available": ref("queries.stock.result.available"),
        },
        callbacks=[Callback("https://hooks.example.com/orders", ("succeeded", "failed"))],
        delivery_reconciliation_ttl_seconds=1800,
    )
    from_builder = normalize(command.definition(), registry=reg)
    from_json = normalize(ship(), registry=reg)
    assert from_builder.data == from_json.data
    assert from_builder.digest == from_json.digest == command.normalized(registry=reg).digest


def test_the_builder_refuses_what_is_not_a_step_or_a_type() -> None:
    with pytest.raises(DefinitionInvalid):
        Command("c", steps=[Check("x", True)]).definition()  # type: ignore[list-item]
    with pytest.raises(DefinitionInvalid):
        Command("c", steps=[], inputs={"when": object}).definition()


# -- shape errors ------------------------------------------------------------------------------


def _add(doc: dict[str, Any], *where: str | int, key: str = "surprise") -> dict[str, Any]:
    target: Any = doc
    for part in where:
        target = target[part]
    target[key] = 1
    return doc


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        (_add(ship()), "/surprise"),
        (_add(ship(), "steps", 0), "/steps/0/surprise"),
        (_add(ship(), "steps", 0, "cardinality"), "/steps/0/cardinality/surprise"),
        (_add(ship(), "steps", 1), "/steps/1/surprise"),
        (_add(ship(), "steps", 2, "compensation"), "/steps/2/compensation/surprise"),
        (_add(ship(), "inputs", "sku"), "/inputs/sku/surprise"),
        (_add(ship(), "rules", 0), "/rules/0/surprise"),
        (_add(ship(), "caps", 0), "/caps/0/surprise"),
        (_add(ship(), "checks", 0), "/checks/0/surprise"),
        (_add(ship(), "outbox", 0), "/outbox/0/surprise"),
        (_add(ship(), "callbacks", 0), "/callbacks/0/surprise"),
    ],
)
def test_unknown_keys_anywhere_are_refused_with_their_path(
    doc: dict[str, Any], path: str, reg: ProviderRegistry
) -> None:
    error = invalid(doc, reg)
    assert error.path == path
    assert "unknown key 'surprise'" in error.details["reason"]


def test_the_server_builds_the_dependency_contract(reg: ProviderRegistry) -> None:
    error = invalid(ship(dependency_contract={"version": 1, "actions": {}}), reg)
    assert "server builds it" in error.details["reason"]


@pytest.mark.parametrize(
    ("changes", "path"),
    [
        ({"version": "1"}, "/version"),
        ({"version": True}, "/version"),
        ({"version": 3}, "/version"),
        ({"mode": "write"}, "/mode"),
        ({"name": "has space"}, "/name"),
        ({"name": 7}, "/name"),
        ({"format": "agent-txn/saga@1"}, "/format"),
        ({"description": "x" * 2001}, "/description"),
        ({"delivery_reconciliation_ttl_seconds": 59}, "/delivery_reconciliation_ttl_seconds"),
        ({"delivery_reconciliation_ttl_seconds": 604_801}, "/delivery_reconciliation_ttl_seconds"),
        ({"delivery_reconciliation_ttl_seconds": 900.0}, "/delivery_reconciliation_ttl_seconds"),
        ({"steps": "reserve"}, "/steps"),
        ({"result": [1]}, "/result"),
        ({"caps": [{"name": "c", "value": 1, "max": True}]}, "/caps/0/max"),
        ({"caps": [{"name": "c", "value": 1, "max": "9"}]}, "/caps/0/max"),
        ({"inputs": {"n": {"type": "integer", "minimum": "1"}}}, "/inputs/n/minimum"),
    ],
)
def test_wrong_types_and_ranges(changes: dict[str, Any], path: str, reg: ProviderRegistry) -> None:
    assert invalid(ship(**changes), reg).path == path


@pytest.mark.parametrize(
    "changes",
    [
        {"description": "x" * 2000},
        {"delivery_reconciliation_ttl_seconds": 60},
        {"delivery_reconciliation_ttl_seconds": 604_800},
        {"version": 1},
        {"format": "agent-txn/command@1"},
    ],
)
def test_values_at_their_bounds_are_accepted(
    changes: dict[str, Any], reg: ProviderRegistry
) -> None:
    normalize(ship(**changes), registry=reg)


def test_assert_messages_are_at_most_500_characters(reg: ProviderRegistry) -> None:
    normalize(with_step(1, message="m" * 500), registry=reg)
    assert invalid(with_step(1, message="m" * 501), reg).path == "/steps/1/message"


def test_a_missing_key_is_named(reg: ProviderRegistry) -> None:
    doc = ship()
    del doc["steps"][2]["provider"]
    error = invalid(doc, reg)
    assert error.path == "/steps/2/provider" and "missing key 'provider'" in error.details["reason"]


@pytest.mark.parametrize("kind", [None, "lookup", 3])
def test_every_step_has_a_known_kind(kind: object, reg: ProviderRegistry) -> None:
    doc = ship()
    if kind is None:
        del doc["steps"][0]["kind"]
    else:
        doc["steps"][0]["kind"] = kind
    assert invalid(doc, reg).path == "/steps/0/kind"


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"name": "re.serve"}, "without dots"),
        ({"name": "stock"}, "appears twice"),
    ],
)
def test_step_names(changes: dict[str, Any], fragment: str, reg: ProviderRegistry) -> None:
    assert fragment in reason(with_step(2, **changes), reg)


def test_other_names_are_unique_in_their_list(reg: ProviderRegistry) -> None:
    twice = ship(rules=[SHIP["rules"][0], SHIP["rules"][0]])
    assert "rule 'sane' appears twice" in reason(twice, reg)


def test_queries_come_before_every_effect(reg: ProviderRegistry) -> None:
    doc = ship()
    doc["steps"].append(copy.deepcopy(doc["steps"][0]) | {"name": "late"})
    error = invalid(doc, reg)
    assert error.path == "/steps/6" and "before anything is written" in error.details["reason"]


def test_query_steps_name_read_only_actions_and_effects_the_others(reg: ProviderRegistry) -> None:
    writes = with_step(0, action="reserve", payload={"sku": "a", "quantity": 1})
    assert "not read-only" in reason(writes, reg)
    reads = with_step(2, action="stock", payload={"sku": "a"}, compensation=None)
    assert "read-only" in reason(reads, reg)
    event = ship(
        outbox=[{"name": "e", "provider": "inventory", "action": "stock", "payload": {"sku": "a"}}]
    )
    assert "read-only" in reason(event, reg)


def test_execute_mode_needs_an_effect(reg: ProviderRegistry) -> None:
    doc = lookup(mode="execute")
    assert "at least one effect step" in reason(doc, reg)


def test_query_mode(reg: ProviderRegistry) -> None:
    stored = normalize(lookup(), registry=reg)
    assert stored.mode == "query" and [q["name"] for q in stored.queries] == ["stock"]
    assert [a["name"] for a in stored.asserts_pre] == ["known"]
    assert stored.effect_steps == []
    with pytest.raises(DefinitionInvalid):
        stored.saga_part()
    effect = copy.deepcopy(SHIP["steps"][2])
    refused = {
        "effects": lookup(steps=[*LOOKUP["steps"], effect]),
        "outbox": lookup(outbox=SHIP["outbox"]),
        "checks": lookup(checks=[{"name": "c", "expr": True}]),
        "callbacks": lookup(callbacks=SHIP["callbacks"]),
        "business_key": lookup(business_key="k"),
    }
    for what, doc in refused.items():
        assert f"has no {what}" in reason(doc, reg), what
    assert "at least one query" in reason(lookup(steps=[LOOKUP["steps"][1] | {"expr": True}]), reg)


# -- references --------------------------------------------------------------------------------


def _place(doc: dict[str, Any], where: str, expr: object) -> dict[str, Any]:
    """Put ``expr`` at one expression position of the ship command."""
    steps = doc["steps"]
    if where == "rule":
        doc["rules"][0]["when"] = {"$eq": [expr, 1]}
    elif where == "cap":
        doc["caps"][0]["value"] = {"$add": [expr, 1]}
    elif where == "business_key":
        doc["business_key"] = expr
    elif where == "query":
        steps[0]["payload"]["extra"] = expr
    elif where == "assert_pre":
        steps[1]["expr"] = {"$eq": [expr, 1]}
    elif where == "effect":
        steps[2]["payload"]["order_id"] = expr
    elif where == "compensation":
        steps[2]["compensation"]["payload"]["reservation_id"] = expr
    elif where == "assert_post":
        steps[3]["expr"] = {"$eq": [expr, 1]}
    elif where == "check":
        doc["checks"][0]["expr"] = {"$eq": [expr, 1]}
    elif where == "outbox":
        doc["outbox"][0]["payload"]["order_id"] = expr
    elif where == "result":
        doc["result"]["extra"] = expr
    else:  # pragma: no cover - a typo in the table below
        raise AssertionError(where)
    return doc


ACCEPTED = [
    ("rule", "queries.stock.result.available"),
    ("cap", "inputs.amount"),
    ("assert_pre", "queries.stock.result.items"),
    ("effect", "queries.stock.result.sku"),
    ("effect", "tx.id"),
    ("compensation", "forward.payload.sku"),
    ("compensation", "forward.remote_id"),
    ("assert_post", "steps.reserve.remote_id"),
    ("check", "steps.charge.payload.amount"),
    ("outbox", "steps.reserve.result.reservation_id"),
    ("result", "steps.reserve.remote_id"),
    ("result", "inputs.sku"),
]
REFUSED = [
    ("rule", "steps.reserve.remote_id", "effects have not run"),
    ("cap", "tx.id", "not available here"),
    ("business_key", "queries.stock.result.sku", "names a query that has not run"),
    ("query", "queries.stock.result.sku", "names a query that has not run"),
    ("assert_pre", "steps.reserve.result.quantity", "effects have not run"),
    ("effect", "steps.charge.result.amount", "effect step that has not run"),
    ("effect", "steps.reserve.result.quantity", "effect step that has not run"),
    ("effect", "forward.remote_id", "only available in a compensation"),
    ("effect", "inputs.nope", "not declared"),
    ("effect", "inputs", "must name an input"),
    ("effect", "tx.started", "only tx.id"),
    ("effect", "queries.stock.available", "must read a query's result"),
    ("effect", "stepz.reserve", "unknown root"),
    ("assert_post", "steps.reserve.items", "must be steps.<effect>.payload"),
    ("compensation", "forward.items", "must be forward.payload"),
    ("result", "queries.stock.result", "must name a result field"),
    ("result", "steps.charge.result", "must name a result field"),
]


@pytest.mark.parametrize(("where", "path"), ACCEPTED)
def test_references_allowed_where_they_are_available(
    where: str, path: str, reg: ProviderRegistry
) -> None:
    normalize(_place(ship(), where, R(path)), registry=reg)


@pytest.mark.parametrize(("where", "path", "fragment"), REFUSED)
def test_references_refused_where_they_are_not(
    where: str, path: str, fragment: str, reg: ProviderRegistry
) -> None:
    text = reason(_place(ship(), where, R(path)), reg)
    assert fragment in text and repr(path) in text


def test_malformed_expressions_are_refused_with_their_path(reg: ProviderRegistry) -> None:
    error = invalid(_place(ship(), "effect", {"$add": [1]}), reg)
    assert error.path == "/steps/2/payload/order_id/$add"
    assert "bad_arity" in error.details["reason"] and error.details["step"] == "reserve"


@pytest.mark.parametrize(
    ("where", "expr"),
    [
        ("assert", 1),
        ("assert", {"$add": [1, 2]}),
        ("assert", {"$literal": "yes"}),
        ("assert", {"$case": {"branches": [{"when": True, "then": 1}], "else": False}}),
        ("rule", "yes"),
        ("check", [True]),
        ("cap", {"$eq": [1, 1]}),
        ("cap", "5"),
    ],
)
def test_conditions_must_be_able_to_be_booleans_and_caps_numbers(
    where: str, expr: object, reg: ProviderRegistry
) -> None:
    doc = ship()
    if where == "assert":
        doc["steps"][1]["expr"] = expr
    elif where == "rule":
        doc["rules"][0]["when"] = expr
    elif where == "check":
        doc["checks"][0]["expr"] = expr
    else:
        doc["caps"][0]["value"] = expr
    assert "must be a" in reason(doc, reg)


def test_typed_expressions_that_may_fit_are_accepted(reg: ProviderRegistry) -> None:
    doc = ship()
    doc["steps"][1]["expr"] = {"$coalesce": [R("queries.stock.result.items"), False]}
    doc["caps"][0]["value"] = {
        "$case": {"branches": [{"when": True, "then": 1}], "else": R("inputs.amount")}
    }
    doc["rules"][0]["when"] = {"$literal": True}
    normalize(doc, registry=reg)


@pytest.mark.parametrize("payload", [5, "x", [1], True, {"$literal": [1]}])
def test_payloads_are_object_templates(payload: object, reg: ProviderRegistry) -> None:
    assert "object template" in reason(with_step(2, payload=payload), reg)


def test_a_payload_may_be_computed(reg: ProviderRegistry) -> None:
    doc = with_step(0, payload={"$coalesce": [{"$literal": {"sku": "a"}}]})
    normalize(doc, registry=reg)


def test_object_payloads_carry_the_contracts_required_fields(reg: ProviderRegistry) -> None:
    assert "required field(s) quantity" in reason(with_step(2, payload={"sku": "a"}), reg)
    doc = ship()
    doc["steps"][4]["compensation"]["payload"] = {"charge_id": R("forward.remote_id")}
    assert "required field(s) amount" in reason(doc, reg)


# -- inputs, cardinality, callbacks --------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"type": "date"}, "must be one of"),
        ({"type": "string", "minimum": 1}, "does not apply"),
        ({"type": "integer", "pattern": "a"}, "does not apply"),
        ({"type": "boolean", "max_length": 1}, "does not apply"),
        ({"type": "object", "enum": [{}]}, "does not apply"),
        ({"type": "integer", "enum": [1, True]}, "every value must be"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "greater than"),
        ({"type": "string", "pattern": "(?<=a)b"}, "not a supported regular expression"),
        ({"type": "string", "pattern": "("}, "not a supported regular expression"),
        ({"type": "string", "min_length": -1}, "greater than or equal to 0"),
    ],
)
def test_input_specs(spec: dict[str, Any], fragment: str, reg: ProviderRegistry) -> None:
    doc = ship()
    doc["inputs"]["extra"] = spec
    assert fragment in reason(doc, reg)


def test_input_names_are_reference_segments(reg: ProviderRegistry) -> None:
    doc = ship()
    doc["inputs"]["a.b"] = {"type": "string"}
    assert "without dots" in reason(doc, reg)


@pytest.mark.parametrize(
    "cardinality", [{"min": 2, "max": 1}, {"min": -1}, {"max": 1.5}, {"min": True}]
)
def test_cardinality_bounds(cardinality: dict[str, Any], reg: ProviderRegistry) -> None:
    path = invalid(with_step(0, cardinality=cardinality), reg).path
    assert path is not None and path.startswith("/steps/0/cardinality")


@pytest.mark.parametrize(
    ("callback", "fragment"),
    [
        ({"url": "ftp://h.example.com/x"}, "http(s) URL"),
        ({"url": "/relative"}, "http(s) URL"),
        ({"url": "https://user:secret@h.example.com/x"}, "credentials"),
        ({"url": "https://h.example.com/x", "events": ["done"]}, "unknown event 'done'"),
        ({"url": "https://h.example.com/x", "events": []}, "at least 1"),
    ],
)
def test_callbacks(callback: dict[str, Any], fragment: str, reg: ProviderRegistry) -> None:
    assert fragment in reason(ship(callbacks=[callback]), reg)


# -- providers and the saga shape ------------------------------------------------------------------


def test_unknown_providers_and_actions(reg: ProviderRegistry) -> None:
    with pytest.raises(UnknownProviderError) as provider:
        normalize(with_step(2, provider="warehouse"), registry=reg)
    assert provider.value.details == {"provider": "warehouse"}
    with pytest.raises(UnknownActionError) as action:
        normalize(with_step(0, action="stocks"), registry=reg)
    assert action.value.details == {"provider": "inventory", "action": "stocks"}


@pytest.mark.parametrize(
    ("index", "changes", "fragment"),
    [
        (2, {"compensation": None}, "the action is reversible"),
        (2, {"compensation": {"action": "refund", "payload": {}}}, "compensate with 'release'"),
        (2, {"retriable": True}, "saga shape must be"),
    ],
)
def test_saga_shape_rules(
    index: int, changes: dict[str, Any], fragment: str, reg: ProviderRegistry
) -> None:
    assert fragment in reason(with_step(index, **changes), reg)


def test_a_pivot_then_retriable_steps(reg: ProviderRegistry) -> None:
    pivot = {
        "kind": "effect",
        "name": "notify",
        "provider": "email",
        "action": "send",
        "payload": {"to": "a@b.c", "template": "t"},
    }
    retry = pivot | {"name": "again", "retriable": True}
    normalize(ship(steps=[*SHIP["steps"], pivot, retry]), registry=reg)
    compensated_after_pivot = [*SHIP["steps"][:2], pivot, *SHIP["steps"][2:]]
    assert "saga shape" in reason(ship(steps=compensated_after_pivot), reg)
    irreversible = pivot | {"compensation": {"action": "refund", "payload": {}}}
    assert "irreversible" in reason(ship(steps=[*SHIP["steps"], irreversible]), reg)


def test_check_saga_shape_is_the_engines_rule_on_saga_steps(reg: ProviderRegistry) -> None:
    steps = normalize(ship(), registry=reg).saga_part()["steps"]
    check_saga_shape(steps, reg)
    mail = {"name": "m", "provider": "email", "action": "send", "payload": {}, "retriable": False,
            "compensation": None}  # fmt: skip
    with pytest.raises(DefinitionInvalid) as shape:
        check_saga_shape([mail, steps[0]], reg)  # a pivot, then a compensatable step
    assert "saga shape" in shape.value.details["reason"]
    no_dedup = swapped(reg, "email", "send", dedups_by_key=False)
    with pytest.raises(DefinitionInvalid) as dedup:
        check_saga_shape([mail | {"retriable": True}], no_dedup)
    assert "need key dedup" in dedup.value.details["reason"]


# -- saga part ---------------------------------------------------------------------------------


def test_saga_part_is_the_effects_with_the_later_asserts(reg: ProviderRegistry) -> None:
    stored = normalize(ship(), registry=reg)
    part = stored.saga_part()
    assert part["format"] == "agent-txn/saga@1" and part["name"] == "ship_order"
    assert [s["name"] for s in part["steps"]] == ["reserve", "charge"]
    assert set(part["steps"][0]) == {
        "name",
        "provider",
        "action",
        "payload",
        "retriable",
        "compensation",
    }
    assert part["asserts"] == [
        {
            "name": "one_reserved",
            "expr": {"$eq": [R("steps.reserve.result.quantity"), 1]},
            "message": "Reserved the wrong quantity.",
            "before": "charge",
        },
        {
            "name": "charged_euros",
            "expr": {"$eq": [R("steps.charge.result.currency"), "EUR"]},
            "message": "",
            "before": None,
        },
    ]
    assert [a["name"] for a in stored.asserts_pre] == ["in_stock"]
    assert part["result"] == stored.result and part["checks"] == stored.checks
    assert part["outbox"] == stored.outbox and part["business_key"] == stored.data["business_key"]


def test_saga_part_of_a_plain_command_parses_as_a_saga(reg: ProviderRegistry) -> None:
    doc = ship(rules=[], caps=[], result={"charge": R("steps.charge.remote_id")})
    doc["steps"] = [s for s in doc["steps"] if s["kind"] == "effect"]
    stored = normalize(doc, registry=reg)
    saga = SagaDefinition.parse(stored.saga_part())
    assert [s["name"] for s in saga.steps] == ["reserve", "charge"]
    assert saga.name == stored.name and saga.version == stored.version
    assert stored.saga_definition().digest == saga.digest


def test_stored_properties(reg: ProviderRegistry) -> None:
    stored = normalize(ship(), registry=reg)
    assert stored.name == "ship_order" and stored.version == 2 and stored.ttl_seconds == 1800
    assert [s["name"] for s in stored.effect_steps] == ["reserve", "charge"]
    assert [s["name"] for s in stored.steps][:2] == ["stock", "in_stock"]
    assert stored.rules[0]["name"] == "sane" and stored.caps[0]["max"] == 50_000
    assert stored.callbacks[0]["url"].startswith("https://")
    assert set(stored.dependency_contract["actions"]) == {
        "email.send", "inventory.release", "inventory.reserve", "inventory.stock",
        "payments.charge", "payments.refund",
    }  # fmt: skip


# -- from_stored ---------------------------------------------------------------------------------


def test_from_stored_recreates_the_same_command(reg: ProviderRegistry) -> None:
    stored = normalize(ship(), registry=reg)
    again = StoredCommand.from_stored(json.loads(json.dumps(stored.data)))
    assert again == stored


def test_from_stored_hashes_what_was_stored(reg: ProviderRegistry) -> None:
    data = copy.deepcopy(normalize(ship(), registry=reg).data)
    data["description"] = "edited by hand"
    again = StoredCommand.from_stored(data)
    assert again.digest == fingerprint(data) != normalize(ship(), registry=reg).digest


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data.update(format="agent-txn/saga@1"),
        lambda data: data.pop("dependency_contract"),
        lambda data: data.update(dependency_contract={"version": 9, "actions": {}}),
        lambda data: data["steps"][0].update(kind="lookup"),
    ],
)
def test_from_stored_refuses_what_is_not_a_stored_command(
    damage: Any, reg: ProviderRegistry
) -> None:
    data = copy.deepcopy(normalize(ship(), registry=reg).data)
    damage(data)
    with pytest.raises(DefinitionInvalid):
        StoredCommand.from_stored(data)


# -- dependency contract -------------------------------------------------------------------------


def test_the_dependency_contract(reg: ProviderRegistry) -> None:
    stored = normalize(ship(), registry=reg)
    actions = stored.dependency_contract["actions"]
    assert stored.dependency_contract["version"] == 1
    assert actions["inventory.stock"]["roles"] == ["query"]
    # Payload keys, "items" for the cardinality, and the result field read by assert and result.
    assert actions["inventory.stock"]["fields"] == ["available", "items", "sku"]
    assert actions["inventory.reserve"] == {
        "provider": "inventory",
        "action": "reserve",
        "roles": ["effect"],
        "contract_digest": actions["inventory.reserve"]["contract_digest"],
        "settings_digest": actions["inventory.reserve"]["settings_digest"],
        # forward.result.reservation_id (from the release) is a field of reserve's result.
        "fields": ["quantity", "reservation_id", "sku"],
    }
    assert actions["inventory.release"]["roles"] == ["compensation"]
    assert actions["inventory.release"]["fields"] == ["reservation_id"]
    assert actions["payments.charge"]["fields"] == [
        "amount", "charge_id", "currency", "order_id"
    ]  # fmt: skip
    assert actions["email.send"]["roles"] == ["outbox"]
    contract = reg.contract("inventory", "reserve")
    plain = {
        k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(contract).items()
    }
    assert actions["inventory.reserve"]["contract_digest"] == fingerprint(plain)
    defaults = {"requires_approval": False, "approval_policy": None}
    assert actions["inventory.reserve"]["settings_digest"] == fingerprint(defaults)


def test_settings_enter_the_settings_digest(reg: ProviderRegistry) -> None:
    policy = {("payments", "charge"): {"requires_approval": True, "approval_policy": {"over": 100}}}
    plain = normalize(ship(), registry=reg).dependency_contract["actions"]
    gated = normalize(ship(), registry=reg, settings=policy).dependency_contract["actions"]
    assert (
        gated["payments.charge"]["settings_digest"] != plain["payments.charge"]["settings_digest"]
    )
    assert gated["payments.refund"] == plain["payments.refund"]
    # Bookkeeping columns of a settings row are not a dependency.
    noisy = {("payments", "charge"): {"requires_approval": False, "revision": 7}}
    assert (
        normalize(ship(), registry=reg, settings=noisy).digest
        == normalize(ship(), registry=reg).digest
    )


@pytest.mark.parametrize(
    ("where", "doc"),
    [
        ("payload", with_step(4, payload={"amount": 1, "currency": "EUR", "tip": 2})),
        ("result", ship(result={"x": R("steps.charge.result.tip")})),
        ("query result", _place(ship(), "rule", R("queries.stock.result.colour"))),
        ("forward result", _place(ship(), "compensation", R("forward.result.colour"))),
    ],
)
def test_fields_outside_the_declared_ones_are_refused(
    where: str, doc: dict[str, Any], reg: ProviderRegistry
) -> None:
    assert "not among the action's declared fields" in reason(doc, reg), where


def test_an_action_that_declares_no_fields_is_not_field_checked(reg: ProviderRegistry) -> None:
    open_schema = swapped(reg, "payments", "charge", fields=())
    doc = with_step(4, payload={"amount": 1, "currency": "EUR", "tip": 2})
    stored = normalize(doc, registry=open_schema)
    assert "tip" in stored.dependency_contract["actions"]["payments.charge"]["fields"]


def test_build_dependency_contract_is_what_normalize_stores(reg: ProviderRegistry) -> None:
    stored = normalize(ship(), registry=reg)
    assert build_dependency_contract(stored.data, reg) == stored.dependency_contract


# -- drift ---------------------------------------------------------------------------------------


@pytest.fixture
def pair(reg: ProviderRegistry) -> tuple[StoredCommand, StoredCommand]:
    return normalize(ship(version=1), registry=reg), normalize(ship(version=2), registry=reg)


def test_nothing_changed_passes_both_versions(
    pair: tuple[StoredCommand, StoredCommand], reg: ProviderRegistry
) -> None:
    v1, v2 = pair
    check_drift(v1, reg)
    check_drift(v2, reg, {})
    check_drift(v2, registry())  # another shop of the same kind: same contracts


def test_an_unrelated_contract_edit_passes_v1_and_fails_v2(
    pair: tuple[StoredCommand, StoredCommand],
) -> None:
    v1, v2 = pair
    edited = registry(MemoryShop(dedup_window_seconds=3600.0))  # the dedup window changed
    check_drift(v1, edited)
    with pytest.raises(SchemaDependencyChanged) as info:
        check_drift(v2, edited)
    envelope = info.value.envelope()
    assert envelope["error"] == "schema_dependency_changed" and envelope["details"] == {}
    assert envelope["message"] == "Command schema dependencies changed"
    assert any("payments.charge" in note for note in info.value.__notes__)


def test_an_approval_settings_edit_passes_v1_and_fails_v2(
    pair: tuple[StoredCommand, StoredCommand], reg: ProviderRegistry
) -> None:
    v1, v2 = pair
    edited = {("payments", "charge"): {"requires_approval": True, "approval_policy": None}}
    check_drift(v1, reg, edited)
    with pytest.raises(SchemaDependencyChanged):
        check_drift(v2, reg, edited)


def test_an_edit_to_an_unused_action_passes_both(
    pair: tuple[StoredCommand, StoredCommand], reg: ProviderRegistry
) -> None:
    v1, v2 = pair
    unused = swapped(reg, "payments", "charges", dedup_window_seconds=5.0)
    check_drift(v1, unused)
    check_drift(v2, unused)


@pytest.mark.parametrize(
    "edit",
    [
        "unregistered",
        "action removed",
        "field removed",
        "query writes now",
    ],
)
def test_what_would_break_the_command_fails_both_versions(
    edit: str, pair: tuple[StoredCommand, StoredCommand], reg: ProviderRegistry
) -> None:
    if edit == "unregistered":
        edited = ProviderRegistry([p for p in reg if p.name != "email"])
    elif edit == "action removed":
        edited = ProviderRegistry(list(reg))
        contracts = {k: v for k, v in reg.get("payments").actions().items() if k != "refund"}
        edited.register(StubProvider("payments", contracts), replace=True)
    elif edit == "field removed":
        edited = swapped(reg, "inventory", "stock", fields=("items", "sku"))
    else:
        edited = swapped(reg, "inventory", "stock", read_only=False)
    for stored in pair:
        with pytest.raises(SchemaDependencyChanged):
            check_drift(stored, edited)


def test_adding_a_field_passes_v1(
    pair: tuple[StoredCommand, StoredCommand], reg: ProviderRegistry
) -> None:
    v1, v2 = pair
    wider = swapped(
        reg, "payments", "charge", fields=("amount", "charge_id", "currency", "order_id", "tip")
    )
    check_drift(v1, wider)
    with pytest.raises(SchemaDependencyChanged):
        check_drift(v2, wider)


# -- field_refs ----------------------------------------------------------------------------------


def test_field_refs_are_the_result_fields_the_projection_reads(reg: ProviderRegistry) -> None:
    doc = ship(
        result={
            "charge": R("steps.charge.result.charge_id"),
            "also": {"$coalesce": [R("steps.charge.result.amount"), R("steps.reserve.remote_id")]},
            "left": R("queries.stock.result.items.0.available"),
            "who": R("inputs.order_id"),
        }
    )
    assert field_refs(normalize(doc, registry=reg)) == {
        "payments.charge": {"charge_id", "amount"},
        "inventory.stock": {"items"},
    }
    assert field_refs(normalize(ship(result=None), registry=reg)) == {}


# -- budgets come first ----------------------------------------------------------------------------


def test_budgets_are_checked_before_validation(reg: ProviderRegistry) -> None:
    branches = [{"when": False, "then": i} for i in range(21)]
    doc = _place(ship(), "effect", {"$case": {"branches": branches, "else": 0}})
    with pytest.raises(DefinitionLimitExceeded) as info:
        normalize(doc, registry=reg)
    assert info.value.details == {"resource": "case_branches", "limit": 20, "actual": 21}
    with pytest.raises(DefinitionLimitExceeded):
        normalize({"name": "x", "surprise": "y" * 1_048_576}, registry=reg)


def test_any_mapping_is_a_document(reg: ProviderRegistry) -> None:
    view = normalize(MappingProxyType(ship()), registry=reg)
    assert view.digest == normalize(ship(), registry=reg).digest


def test_a_definition_must_be_an_object(reg: ProviderRegistry) -> None:
    with pytest.raises(DefinitionInvalid):
        normalize([1, 2], registry=reg)  # type: ignore[arg-type]


# -- the shops' read-only actions and declared fields ----------------------------------------------


def test_every_shop_action_declares_its_fields() -> None:
    for provider in MemoryShop().providers():
        for name, contract in provider.actions().items():
            assert contract.fields, f"{provider.name}.{name}"
            assert set(contract.required_fields) <= set(contract.fields)
            assert set(contract.echo_fields) <= set(contract.fields)
    for qualified in ("inventory.stock", "payments.charges"):
        provider_name, action = qualified.split(".")
        contract = registry().contract(provider_name, action)
        assert contract.read_only and contract.compensation is None
        assert not (contract.dedups_by_key or contract.supports_lookup or contract.supports_fencing)


async def test_memory_shop_reads() -> None:
    shop = MemoryShop()
    shop.seed_stock({"sku-1": 3})
    inv, pay = shop.inventory, shop.payments
    known = await inv.apply("stock", key="q1", payload={"sku": "sku-1"}, fence=0)
    assert known == Confirmed(
        "stock:sku-1",
        {"sku": "sku-1", "available": 3, "items": [{"sku": "sku-1", "available": 3}]},
    )
    unknown = await inv.apply("stock", key="q2", payload={"sku": "nope"}, fence=0)
    assert unknown == Confirmed("stock:nope", {"sku": "nope", "available": 0, "items": []})
    await inv.apply("reserve", key="r1", payload={"sku": "sku-1", "quantity": 1}, fence=1)
    again = await inv.apply("stock", key="q1", payload={"sku": "sku-1"}, fence=0)
    assert isinstance(again, Confirmed) and again.result["available"] == 2  # read afresh
    await pay.apply(
        "charge", key="c1", payload={"amount": 5, "currency": "EUR", "order_id": "o1"}, fence=1
    )
    await pay.apply("charge", key="c2", payload={"amount": 7, "currency": "EUR"}, fence=1)
    mine = await pay.apply("charges", key="q3", payload={"order_id": "o1"}, fence=0)
    assert isinstance(mine, Confirmed) and mine.remote_id == "charges:o1"
    assert [(c["amount"], c["order_id"], c["refunded"]) for c in mine.result["items"]] == [
        (5, "o1", 0)
    ]
    every = await pay.apply("charges", key="q4", payload={}, fence=0)
    assert isinstance(every, Confirmed) and [c["amount"] for c in every.result["items"]] == [5, 7]
    bad = await inv.apply("stock", key="q5", payload={}, fence=0)
    assert not isinstance(bad, Confirmed)
    counts = shop.counts()
    assert counts["inventory.reserve"] == 1 and counts["payments.charge"] == 2
    assert "inventory.stock" not in counts and shop.duplicate_keys() == []


async def test_fake_shop_reads(tmp_path: Path) -> None:
    async with await FakeShop.open(f"sqlite:///{tmp_path / 'shop.db'}") as shop:
        await shop.seed_stock({"sku-1": 4})
        inv, pay = shop.inventory, shop.payments
        first = await inv.apply("stock", key="q", payload={"sku": "sku-1"}, fence=0)
        assert first == Confirmed(
            "stock:sku-1",
            {"sku": "sku-1", "available": 4, "items": [{"sku": "sku-1", "available": 4}]},
        )
        await inv.apply("reserve", key="r1", payload={"sku": "sku-1", "quantity": 3}, fence=1)
        second = await inv.apply("stock", key="q", payload={"sku": "sku-1"}, fence=0)
        assert isinstance(second, Confirmed) and second.result["available"] == 1
        unknown = await inv.apply("stock", key="q2", payload={"sku": "nope"}, fence=0)
        assert isinstance(unknown, Confirmed) and unknown.result["items"] == []
        charge = {"amount": 5, "currency": "EUR", "order_id": "o1"}
        made = await pay.apply("charge", key="c1", payload=charge, fence=1)
        assert isinstance(made, Confirmed)
        await pay.apply(
            "refund", key="f1", payload={"charge_id": made.remote_id, "amount": 2}, fence=1
        )
        await pay.apply("charge", key="c2", payload={"amount": 9, "currency": "EUR"}, fence=1)
        listed = await pay.apply("charges", key="q3", payload={"order_id": "o1"}, fence=0)
        assert isinstance(listed, Confirmed)
        assert listed.result == {
            "items": [
                {
                    "charge_id": made.remote_id,
                    "order_id": "o1",
                    "amount": 5,
                    "currency": "EUR",
                    "refunded": 2,
                }
            ]
        }
        every = await pay.apply("charges", key="q4", payload={}, fence=0)
        assert isinstance(every, Confirmed) and len(every.result["items"]) == 2
        # Reads leave no effect entry, and the log says what they were.
        effects = await shop.effects()
        assert {e.action for e in effects} == {"reserve", "charge", "refund"}
        reads = [c for c in await shop.calls() if c.action in ("stock", "charges")]
        assert {c.outcome for c in reads} == {"confirmed"} and not any(
            c.created_effect for c in reads
        )
        counts = await shop.counts()
        assert counts["payments.charge"] == 2 and "payments.charges" not in counts


# -- robustness ----------------------------------------------------------------------------------

_any_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 3),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from(["", "x", "$ref", "inputs.sku", "effect", "query", "assert", "a.b"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(["$ref", "$and", "$case", "kind", "name", "payload", "min", "x"]),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=6,
)


def _paths(value: object, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for key, member in value.items():
            out.extend(_paths(member, (*prefix, key)))
    elif isinstance(value, list):
        for index, member in enumerate(value):
            out.extend(_paths(member, (*prefix, index)))
    return out


_SHIP_PATHS = _paths(SHIP)[1:]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(_SHIP_PATHS), _any_json)
def test_normalize_only_ever_raises_our_errors(path: tuple[Any, ...], value: object) -> None:
    doc = ship()
    target: Any = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    try:
        stored = normalize(doc, registry=registry())
    except AgentTxnError as exc:
        envelope = exc.envelope(phase="author")
        assert envelope["error"] != "command_execution_failed", envelope  # a registered error
        return
    assert StoredCommand.from_stored(stored.data) == stored
