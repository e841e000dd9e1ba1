"""Saga definitions: the Python builder and the normalized stored form it produces.

A saga is data, not code: steps name a provider action and give a payload *template* (a JSON
expression, see :mod:`orchestrator.expressions`), so a worker in another process can re-render
exactly what the original caller would have. The normalized definition is stored under its digest
and every transaction pins that digest::

    order = Saga(
        "order",
        inputs={"order_id": str, "sku": str, "amount": Input("integer", minimum=1)},
        business_key=concat("order:", ref("inputs.order_id")),
        steps=[
            Step("reserve", "inventory", "reserve", {"sku": ref("inputs.sku"), "quantity": 1},
                 compensation=Compensation("release",
                                           {"reservation_id": ref("forward.remote_id")})),
            Step("charge", "payments", "charge",
                 {"amount": ref("inputs.amount"), "currency": "EUR"},
                 compensation=Compensation("refund", {"charge_id": ref("forward.remote_id"),
                                                      "amount": ref("forward.payload.amount")})),
        ],
        outbox=[Event("receipt", "email", "send", {"to": "a@b.c", "template": "receipt"})],
    )

Template scopes: ``inputs``, ``tx.id``, ``steps.<earlier step>.{payload,result,remote_id}``, and
for a compensation ``forward.{payload,result,remote_id}`` of the op it reverses.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Final

from pydantic import ConfigDict, ValidationError, create_model
from pydantic import Field as PydField

from ledger.canonical import (
    NotCanonicalizable,
    canonical_json,
    fingerprint,
    jsonb_stable,
    unstorable_text,
)
from ledger.schema import NAME_LENGTH, SAGA_NAME_LENGTH
from orchestrator import expressions
from orchestrator.errors import DefinitionInvalid, InputInvalid
from orchestrator.keys import is_identifier

FORMAT: Final = "agent-txn/saga@1"
_TYPES: Final[Mapping[str, type]] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "object": dict,
    "array": list,
}
_PY_TYPES: Final[Mapping[type, str]] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    dict: "object",
    list: "array",
}
_CONSTRAINTS: Final = ("minimum", "maximum", "min_length", "max_length", "pattern", "enum")


@dataclass(frozen=True)
class Input:
    """One typed input field."""

    type: str
    required: bool = True
    minimum: float | None = None
    maximum: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    enum: tuple[Any, ...] | None = None

    def normalized(self) -> dict[str, Any]:
        """The stored form (keys with no value are dropped)."""
        out: dict[str, Any] = {"type": self.type, "required": self.required}
        for name in _CONSTRAINTS:
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value) if name == "enum" else value
        return out


@dataclass(frozen=True)
class Compensation:
    """How to reverse a step: the provider's compensation action and its payload template."""

    action: str
    payload: Any


@dataclass(frozen=True)
class Step:
    """A forward step: one provider action with a payload template.

    ``retriable`` marks a step after the pivot: it is never compensated, and a definite rejection
    parks the saga for a person instead of turning it back.
    """

    name: str
    provider: str
    action: str
    payload: Any
    compensation: Compensation | None = None
    retriable: bool = False


@dataclass(frozen=True)
class Check:
    """A post-condition over the step results, evaluated in the validate phase."""

    name: str
    expr: Any
    message: str = ""


@dataclass(frozen=True)
class Event:
    """An after-commit notification, sent from the outbox only once the saga committed."""

    name: str
    provider: str
    action: str
    payload: Any


@dataclass(frozen=True)
class Saga:
    """A saga definition built in Python; :meth:`definition` gives its stored form."""

    name: str
    steps: Sequence[Step]
    inputs: Mapping[str, type | Input] = field(default_factory=dict)
    checks: Sequence[Check] = ()
    outbox: Sequence[Event] = ()
    business_key: Any = None
    version: int = 1

    def definition(self) -> dict[str, Any]:
        """The normalized definition (plain JSON), validated for shape and references."""
        inputs: dict[str, Any] = {}
        for key, spec in self.inputs.items():
            if isinstance(spec, Input):
                inputs[key] = spec.normalized()
            elif spec in _PY_TYPES:
                inputs[key] = Input(_PY_TYPES[spec]).normalized()
            else:
                raise DefinitionInvalid(details={"reason": f"input {key!r}: unsupported type"})
        raw = {
            "format": FORMAT,
            "name": self.name,
            "version": self.version,
            "inputs": inputs,
            "business_key": self.business_key,
            "steps": [
                {
                    "name": s.name,
                    "provider": s.provider,
                    "action": s.action,
                    "payload": s.payload,
                    "retriable": s.retriable,
                    "compensation": (
                        {"action": s.compensation.action, "payload": s.compensation.payload}
                        if s.compensation
                        else None
                    ),
                }
                for s in self.steps
            ],
            "checks": [{"name": c.name, "expr": c.expr, "message": c.message} for c in self.checks],
            "outbox": [
                {"name": e.name, "provider": e.provider, "action": e.action, "payload": e.payload}
                for e in self.outbox
            ],
        }
        return SagaDefinition.parse(raw).data


def is_name(value: object, longest: int = NAME_LENGTH) -> bool:
    """An identifier that fits the column it is stored in: a step's, an event's, a provider's
    or an action's name (``longest`` another column's width). Checked here, when the definition
    is authored, because PostgreSQL refuses a longer value only when the saga first writes it,
    after effects may have been sent; SQLite stores it anyway."""
    return isinstance(value, str) and is_identifier(value) and len(value) <= longest


def _invalid(reason: str, step: str | None = None) -> DefinitionInvalid:
    details: dict[str, Any] = {"reason": reason}
    if step is not None:
        details["step"] = step
    return DefinitionInvalid(details=details, step=step)


#: Template roots: inputs, the tx id, earlier steps, and query results frozen at prepare.
_ROOTS: Final = frozenset({"inputs", "tx", "steps", "queries"})


def _parse_asserts(raw: Any, step_names: list[str]) -> list[dict[str, Any]]:
    """Asserts guard the effect named by ``before``: they see only the steps before it."""
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise _invalid("asserts must be a list")
    out: list[dict[str, Any]] = []
    for a in raw:
        if not isinstance(a, Mapping) or not is_identifier(a.get("name")):
            raise _invalid("each assert needs a name")
        before = a.get("before")
        if before is not None and before not in step_names:
            raise _invalid(f"assert {a['name']!r}: 'before' names no step")
        earlier = set(step_names[: step_names.index(before)] if before else step_names)
        _check_refs(a.get("expr"), _ROOTS, earlier, f"assert {a['name']!r}")
        message = a.get("message", "")
        if not isinstance(message, str):
            raise _invalid(f"assert {a['name']!r}: message must be text")
        out.append({"name": a["name"], "expr": a.get("expr"), "message": message, "before": before})
    return out


def _check_refs(
    expr: Any, allowed_roots: AbstractSet[str], earlier: AbstractSet[str], where: str
) -> None:
    try:
        expressions.validate(expr)
    except expressions.ExpressionError as exc:
        raise _invalid(f"{where}: {exc.code} at {exc.path or '/'}") from exc
    for path in expressions.refs(expr):
        root, _, rest = path.partition(".")
        if root not in allowed_roots:
            raise _invalid(f"{where}: reference {path!r} is outside {sorted(allowed_roots)}")
        if root == "steps":
            step = rest.partition(".")[0]
            if step not in earlier:
                raise _invalid(f"{where}: {path!r} refers to a step that has not run before it")


@dataclass(frozen=True)
class SagaDefinition:
    """A validated stored definition and its digest (the one form recovery works from)."""

    data: dict[str, Any]
    digest: str

    @property
    def name(self) -> str:
        """The saga's name."""
        return str(self.data["name"])

    @property
    def version(self) -> int:
        """Definition version (part of every idempotency key)."""
        return int(self.data["version"])

    @property
    def steps(self) -> list[dict[str, Any]]:
        """Forward steps in order."""
        return list(self.data["steps"])

    @property
    def outbox(self) -> list[dict[str, Any]]:
        """After-commit events in order."""
        return list(self.data["outbox"])

    @property
    def asserts(self) -> list[dict[str, Any]]:
        """Author asserts placed between effects: ``before`` names the effect they guard
        (``None``: after the last effect, evaluated in the validate phase)."""
        return list(self.data.get("asserts", []))

    def asserts_before(self, step: str | None) -> list[dict[str, Any]]:
        """The asserts that must hold before ``step`` is sent (``None``: before commit)."""
        return [a for a in self.data.get("asserts", []) if a.get("before") == step]

    @property
    def result_template(self) -> Any:
        """The result projection template, or ``None``."""
        return self.data.get("result")

    @property
    def checks(self) -> list[dict[str, Any]]:
        """Post-conditions."""
        return list(self.data["checks"])

    def step(self, name: str) -> dict[str, Any]:
        """One forward step by name."""
        for s in self.data["steps"]:
            if s["name"] == name:
                return dict(s)
        raise KeyError(name)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> SagaDefinition:
        """Validate a definition's structure and references (not yet its providers)."""
        if not isinstance(raw, Mapping) or raw.get("format") != FORMAT:
            raise _invalid(f"format must be {FORMAT!r}")
        name = raw.get("name")
        if not is_name(name, SAGA_NAME_LENGTH):
            raise _invalid(
                f"name must be a non-blank identifier of at most {SAGA_NAME_LENGTH} characters"
            )
        version = raw.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise _invalid("version must be a positive integer")
        inputs = raw.get("inputs", {})
        if not isinstance(inputs, Mapping):
            raise _invalid("inputs must be an object")
        for key, spec in inputs.items():
            if not is_identifier(key) or not isinstance(spec, Mapping):
                raise _invalid(f"input {key!r} is malformed")
            if spec.get("type") not in _TYPES:
                raise _invalid(f"input {key!r}: type must be one of {sorted(_TYPES)}")
        steps = raw.get("steps")
        if not isinstance(steps, Sequence) or isinstance(steps, str) or not steps:
            raise _invalid("a saga needs at least one step")
        seen: set[str] = set()
        for s in steps:
            if not isinstance(s, Mapping):
                raise _invalid("each step must be an object")
            sname = s.get("name")
            if not is_name(sname) or "." in str(sname):
                raise _invalid(
                    "step names must be non-blank identifiers without dots"
                    f" of at most {NAME_LENGTH} characters"
                )
            if sname in seen:
                raise _invalid(f"step {sname!r} appears twice", str(sname))
            for attr in ("provider", "action"):
                if not is_name(s.get(attr)):
                    raise _invalid(
                        f"step {sname!r}: {attr} must be a non-blank name"
                        f" of at most {NAME_LENGTH} characters",
                        str(sname),
                    )
            _check_refs(s.get("payload"), _ROOTS, seen, f"step {sname!r}")
            comp = s.get("compensation")
            if comp is not None:
                if not isinstance(comp, Mapping) or not is_name(comp.get("action")):
                    raise _invalid(
                        f"step {sname!r}: compensation needs an action"
                        f" of at most {NAME_LENGTH} characters",
                        str(sname),
                    )
                _check_refs(
                    comp.get("payload"),
                    _ROOTS | {"forward"},
                    seen,
                    f"compensation of {sname!r}",
                )
            seen.add(str(sname))
        for c in raw.get("checks", []):
            if not isinstance(c, Mapping) or not is_identifier(c.get("name")):
                raise _invalid("each check needs a name")
            _check_refs(c.get("expr"), _ROOTS, seen, f"check {c['name']!r}")
        events: set[str] = set()
        for e in raw.get("outbox", []):
            if not isinstance(e, Mapping) or not is_name(e.get("name")):
                raise _invalid(
                    f"each outbox event needs a name of at most {NAME_LENGTH} characters"
                )
            if e["name"] in events:
                raise _invalid(f"outbox event {e['name']!r} appears twice")
            events.add(str(e["name"]))
            for attr in ("provider", "action"):
                if not is_name(e.get(attr)):
                    raise _invalid(
                        f"outbox event {e['name']!r}: {attr} must be a non-blank name"
                        f" of at most {NAME_LENGTH} characters"
                    )
            _check_refs(e.get("payload"), _ROOTS, seen, f"event {e['name']!r}")
        asserts = _parse_asserts(raw.get("asserts", []), [str(s["name"]) for s in steps])
        if raw.get("result") is not None:
            _check_refs(raw["result"], _ROOTS, seen, "result")
        if raw.get("business_key") is not None:
            _check_refs(raw["business_key"], {"inputs"}, set(), "business_key")
        data = {
            "format": FORMAT,
            "name": name,
            "version": version,
            "inputs": {k: dict(v) for k, v in inputs.items()},
            "business_key": raw.get("business_key"),
            "steps": [dict(s) for s in steps],
            "checks": [dict(c) for c in raw.get("checks", [])],
            "outbox": [dict(e) for e in raw.get("outbox", [])],
        }
        # Optional keys stay absent when unused, so plain sagas keep the digests they had.
        if asserts:
            data["asserts"] = asserts
        if raw.get("result") is not None:
            data["result"] = raw["result"]
        try:
            data = _round_trip(data)
        except NotCanonicalizable as exc:
            raise _invalid("the definition is not plain JSON") from exc
        return cls(data=data, digest=fingerprint(data))

    def payload_needs_results(self, ordinal: int) -> bool:
        """Whether step ``ordinal``'s payload refers to earlier steps' results (then it is
        rendered when the step is reached, not at prepare)."""
        return self._needs_results[ordinal]

    @functools.cached_property
    def _needs_results(self) -> tuple[bool, ...]:
        return tuple(
            any(r.startswith("steps.") for r in expressions.refs(step["payload"]))
            for step in self.data["steps"]
        )

    @functools.cached_property
    def _input_model(self) -> Any:
        # Per definition object: the schema's canonical text, the cache's key, costs a walk.
        return _cached_input_model(self.name, canonical_json(self.data["inputs"]))

    def validate_inputs(self, inputs: Any) -> dict[str, Any]:
        """Inputs checked against the typed schema (strict: ``"42"`` is not an integer)."""
        if not isinstance(inputs, Mapping):
            raise InputInvalid(details={"errors": [{"field": "", "problem": "must be an object"}]})
        model = self._input_model
        try:
            validated = model.model_validate(dict(inputs))
        except ValidationError as exc:
            problems = [
                {"field": ".".join(str(p) for p in err["loc"]), "problem": err["type"]}
                for err in exc.errors()[:20]
            ]
            raise InputInvalid(details={"errors": problems}) from None
        out: dict[str, Any] = validated.model_dump(exclude_unset=True)
        if unstorable_text(out):
            raise InputInvalid(
                details={"errors": [{"field": "", "problem": "NUL or unpaired surrogate"}]}
            )
        try:
            text = canonical_json(out)
        except NotCanonicalizable:
            raise InputInvalid(
                details={"errors": [{"field": "", "problem": "not plain JSON"}]}
            ) from None
        # Numbers as PostgreSQL's JSONB gives them back (a float of 1e16 or more as the integer
        # it is, -0.0 as 0.0), before the inputs are fingerprinted or stored: otherwise a replay
        # or a confirmed plan compares the float with its reloaded integer and finds them apart.
        return jsonb_stable(out) if _may_be_unstable(text) else out


def _may_be_unstable(text: str) -> bool:
    """Whether canonical JSON ``text`` may hold a number :func:`jsonb_stable` changes: Python
    writes a float of 1e16 or more with ``e+`` and a negative zero as ``-0.0`` (a string that
    holds either only costs the walk)."""
    return "e+" in text or "-0.0" in text


def _round_trip(data: Any) -> Any:
    """``data`` as plain JSON, its numbers as JSONB gives them back (the definition is stored
    in a JSONB column, and its digest must match the reloaded definition's)."""
    import json

    text = canonical_json(data)
    plain = json.loads(text)
    return jsonb_stable(plain) if _may_be_unstable(text) else plain


@functools.lru_cache(maxsize=256)
def _cached_input_model(name: str, spec_json: str) -> Any:
    """One pydantic model per input schema: building it costs more than validating with it
    (the bench's profile showed ~0.25 ms per execute), and schemas are immutable."""
    import json

    return _input_model(name, json.loads(spec_json))


def _input_model(name: str, spec: Mapping[str, Mapping[str, Any]]) -> Any:
    fields: dict[str, Any] = {}
    for key, field_spec in spec.items():
        py_type: Any = _TYPES[field_spec["type"]]
        if field_spec["type"] == "number":
            py_type = float | int
        constraints: dict[str, Any] = {}
        if "minimum" in field_spec:
            constraints["ge"] = field_spec["minimum"]
        if "maximum" in field_spec:
            constraints["le"] = field_spec["maximum"]
        if "min_length" in field_spec:
            constraints["min_length"] = field_spec["min_length"]
        if "max_length" in field_spec:
            constraints["max_length"] = field_spec["max_length"]
        if "pattern" in field_spec:
            constraints["pattern"] = field_spec["pattern"]
        if "enum" in field_spec:
            from typing import Literal

            py_type = Literal[tuple(field_spec["enum"])]
        required = field_spec.get("required", True)
        default = ... if required else None
        annotated = py_type if required else py_type | None
        fields[key] = (annotated, PydField(default, **constraints))
    return create_model(
        f"{name}_inputs",
        __config__=ConfigDict(extra="forbid", strict=True),
        **fields,
    )
