"""Commands: the JSON form REST clients send, the Python builder, and the stored form both give.

A *command* is a stored, named saga with more around it: typed inputs, rules and caps over the
inputs, read-only **query** steps that run at prepare (before anything is written), **assert**
steps, the **effect** steps the saga engine runs, validation checks, after-commit outbox events,
a result projection and lifecycle callbacks. It is authored once, normalized, stored under its
digest, and executed many times; every execution pins that digest, so what runs is exactly what
was reviewed.

Two ways in, one stored form::

    normalize(json.loads(body), registry=registry, settings=settings)        # REST
    normalize(Command("ship", steps=[...]).definition(), registry=registry)  # Python

:func:`normalize` checks, in this order: the authoring budgets on the raw document
(:mod:`orchestrator.budgets`, so an oversized document is refused before anything else reads
it), the shape (pydantic models with ``extra="forbid"``; their errors become
:class:`~orchestrator.errors.DefinitionInvalid` with a ``reason`` and a JSON-pointer ``path``,
never a pydantic traceback), the expressions and what each may reference, then the provider
contracts (the saga-shape rules of the engine, read-only actions for queries only), and finally
builds the ``dependency_contract`` and the digest.

**The stored form is stable.** Every key is always present, every step has all the keys of its
kind. One rule for absent values: *a ``null`` for an optional key means the same as leaving the
key out*, and the key is filled with its default — ``version`` 1, ``mode`` ``"execute"``,
``description`` ``""``, lists ``[]``, ``payload`` ``{}``, ``retriable`` ``false``, ``message``
``""``, callback ``events`` all three, ``delivery_reconciliation_ttl_seconds`` 900; where the
default *is* "none" (``business_key``, ``result``, ``compensation``, ``cardinality``, a
cardinality bound) the stored value is ``null``. A cardinality with neither bound is ``null``;
callback events are stored sorted and without repeats; input specs drop their unset constraints
(as :meth:`orchestrator.saga.Input.normalized` does). So two documents that mean the same thing
store the same bytes and have the same digest.

**What an expression may reference** (anything else is refused at authoring):

=============================  =============================================================
business_key                   ``inputs``
rules, caps                    ``inputs``, ``queries.<any query>.result…``
query payload                  ``inputs``, ``queries.<earlier query>.result…``
assert before the 1st effect   ``inputs``, ``queries.<earlier query>.result…``
effect payload, later assert   ``inputs``, ``queries``, ``tx.id``,
                               ``steps.<earlier effect>.{payload,result,remote_id}…``
compensation payload           the effect's scope plus ``forward.{payload,result,remote_id}…``
checks, outbox                 ``inputs``, ``queries``, ``tx.id``, ``steps.<any effect>…``
result                         ``inputs``, ``queries`` (and in execute mode ``tx.id``,
                               ``steps``); a result is read by naming its field
                               (``queries.q.result.available``), never whole, so the
                               fields a caller gets to read are known (:func:`field_refs`)
=============================  =============================================================

``inputs.<name>`` must name a declared input. Query mode has query and assert steps only: no
effects, outbox, checks, business key or callbacks (nothing would ever evaluate or send them).

**Dependency contract and drift.** For every provider action the command uses, the stored form
records its roles, a digest of its :class:`~providers.contract.ActionContract`, a digest of its
approval settings and the fields the command depends on. :func:`check_drift` compares that with
the live registry before an execute: version 2 commands fail closed on *any* difference, version
1 commands only on what would break them (a missing action, a missing field, a query action that
stopped being read-only). The two versions really behave differently; tests pin both with the
same edit.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic import Field as PydField

from ledger.canonical import (
    NotCanonicalizable,
    canonical_json,
    fingerprint,
    jsonb_stable,
    unstorable_text,
)
from ledger.schema import NAME_LENGTH, SAGA_NAME_LENGTH
from orchestrator import budgets, expressions
from orchestrator.errors import (
    DefinitionInvalid,
    SchemaDependencyChanged,
    UnknownActionError,
    UnknownProviderError,
)
from orchestrator.keys import is_identifier
from orchestrator.saga import FORMAT as SAGA_FORMAT
from orchestrator.saga import Check, Event, Input, SagaDefinition, Step
from providers.contract import ActionContract, UnknownAction
from providers.registry import ProviderRegistry, UnknownProvider

__all__ = [
    "CALLBACK_EVENTS",
    "FORMAT",
    "Assert",
    "Callback",
    "Cap",
    "Cardinality",
    "Command",
    "Query",
    "Rule",
    "Settings",
    "StoredCommand",
    "build_dependency_contract",
    "check_drift",
    "check_saga_shape",
    "contract_digest",
    "field_refs",
    "normalize",
    "settings_digest",
]

FORMAT: Final = "agent-txn/command@1"
DEPENDENCY_CONTRACT_VERSION: Final = 1
MODES: Final = ("execute", "query")
CALLBACK_EVENTS: Final = ("failed", "staged", "succeeded")
TTL_DEFAULT: Final = 900
TTL_MIN: Final = 60
TTL_MAX: Final = 604_800
MAX_DESCRIPTION: Final = 2000
MAX_MESSAGE: Final = 500
MAX_URL: Final = 2048
MAX_REASON: Final = 300

#: (provider, action) -> that action's row of the ``action_settings`` table (missing = defaults).
Settings = Mapping[tuple[str, str], Mapping[str, Any]]

_INPUT_TYPES: Final = ("string", "integer", "number", "boolean", "object", "array")
_PY_TYPES: Final[Mapping[type, str]] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    dict: "object",
    list: "array",
}
_CONSTRAINTS: Final = ("minimum", "maximum", "min_length", "max_length", "pattern", "enum")
_STEP_PARTS: Final = frozenset({"payload", "result", "remote_id"})
_BOOLEAN_OPS: Final = frozenset(
    {"$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$and", "$or", "$not", "$in"}
)
_NUMBER_OPS: Final = frozenset({"$add", "$sub", "$mul", "$div", "$mod", "$neg", "$len"})
_UNTYPED_OPS: Final = frozenset({"$ref", "$coalesce", "$case"})


# --------------------------------------------------------------------------------------------
# The Python builder (steps that are effects are plain :class:`orchestrator.saga.Step`).


@dataclass(frozen=True)
class Cardinality:
    """How many ``items`` a query step must return (``None`` = no bound on that side)."""

    min: int | None = None
    max: int | None = None


@dataclass(frozen=True)
class Query:
    """A read-only provider call at prepare; its answer is ``queries.<name>.result``."""

    name: str
    provider: str
    action: str
    payload: Any = field(default_factory=dict)
    cardinality: Cardinality | Mapping[str, int | None] | None = None


@dataclass(frozen=True)
class Assert:
    """A condition that must hold; ``message`` is the author's reason shown when it does not."""

    name: str
    expr: Any
    message: str = ""


@dataclass(frozen=True)
class Rule:
    """A condition over the inputs (and queries) that must hold before anything runs."""

    name: str
    when: Any
    message: str = ""


@dataclass(frozen=True)
class Cap:
    """A numeric ceiling: ``value`` (an expression over inputs and queries) must be ``<= max``."""

    name: str
    value: Any
    max: int | float


@dataclass(frozen=True)
class Callback:
    """An HTTP(S) endpoint told about the execution's lifecycle events."""

    url: str
    events: Sequence[str] = CALLBACK_EVENTS


@dataclass(frozen=True)
class Command:
    """A command built in Python; :meth:`definition` gives its JSON form (what REST would send).

    ``steps`` mixes :class:`Query`, :class:`Assert` and effect steps
    (:class:`orchestrator.saga.Step`) in execution order.
    """

    name: str
    steps: Sequence[Step | Query | Assert]
    inputs: Mapping[str, type | Input] = field(default_factory=dict)
    rules: Sequence[Rule] = ()
    caps: Sequence[Cap] = ()
    checks: Sequence[Check] = ()
    outbox: Sequence[Event] = ()
    result: Mapping[str, Any] | None = None
    callbacks: Sequence[Callback] = ()
    version: int = 1
    mode: str = "execute"
    business_key: Any = None
    delivery_reconciliation_ttl_seconds: int = TTL_DEFAULT
    description: str = ""

    def definition(self) -> dict[str, Any]:
        """The JSON form; give it to :func:`normalize` (nothing is validated here)."""
        inputs: dict[str, Any] = {}
        for key, spec in self.inputs.items():
            if isinstance(spec, Input):
                inputs[key] = spec.normalized()
            elif isinstance(spec, type) and spec in _PY_TYPES:
                inputs[key] = Input(_PY_TYPES[spec]).normalized()
            else:
                raise _invalid(f"input {key!r}: unsupported type", f"/inputs{_seg(key)}")
        return {
            "name": self.name,
            "version": self.version,
            "mode": self.mode,
            "description": self.description,
            "inputs": inputs,
            "business_key": self.business_key,
            "rules": [{"name": r.name, "when": r.when, "message": r.message} for r in self.rules],
            "caps": [{"name": c.name, "value": c.value, "max": c.max} for c in self.caps],
            "steps": [_builder_step(index, step) for index, step in enumerate(self.steps)],
            "checks": [{"name": c.name, "expr": c.expr, "message": c.message} for c in self.checks],
            "outbox": [
                {"name": e.name, "provider": e.provider, "action": e.action, "payload": e.payload}
                for e in self.outbox
            ],
            "result": None if self.result is None else dict(self.result),
            "callbacks": [{"url": c.url, "events": list(c.events)} for c in self.callbacks],
            "delivery_reconciliation_ttl_seconds": self.delivery_reconciliation_ttl_seconds,
        }

    def normalized(
        self, *, registry: ProviderRegistry, settings: Settings | None = None
    ) -> StoredCommand:
        """Shorthand for ``normalize(self.definition(), registry=..., settings=...)``."""
        return normalize(self.definition(), registry=registry, settings=settings)


def _builder_step(index: int, step: object) -> dict[str, Any]:
    if isinstance(step, Query):
        card = step.cardinality
        cardinality: dict[str, Any] | None
        if isinstance(card, Cardinality):
            cardinality = {"min": card.min, "max": card.max}
        else:
            cardinality = None if card is None else dict(card)
        return {
            "kind": "query",
            "name": step.name,
            "provider": step.provider,
            "action": step.action,
            "payload": step.payload,
            "cardinality": cardinality,
        }
    if isinstance(step, Assert):
        return {"kind": "assert", "name": step.name, "expr": step.expr, "message": step.message}
    if isinstance(step, Step):
        comp = step.compensation
        return {
            "kind": "effect",
            "name": step.name,
            "provider": step.provider,
            "action": step.action,
            "payload": step.payload,
            "compensation": None
            if comp is None
            else {"action": comp.action, "payload": comp.payload},
            "retriable": step.retriable,
        }
    raise _invalid(
        f"steps[{index}]: a step is a Query, an Assert or a saga Step", f"/steps/{index}"
    )


# --------------------------------------------------------------------------------------------
# The JSON form, as pydantic models. Optional keys are ``X | None = None`` so that ``null`` and
# an absent key are the same; defaults are filled when the stored form is assembled.

_STRICT = ConfigDict(extra="forbid", strict=True)
_Message = Annotated[str | None, PydField(max_length=MAX_MESSAGE)]


class _InputModel(BaseModel):
    model_config = _STRICT
    type: str
    required: bool | None = None
    minimum: Any = None  # numbers: checked by _number (a union would put its arm in the path)
    maximum: Any = None
    min_length: Annotated[int | None, PydField(ge=0)] = None
    max_length: Annotated[int | None, PydField(ge=0)] = None
    pattern: Annotated[str | None, PydField(max_length=1000)] = None
    enum: Annotated[list[Any] | None, PydField(min_length=1, max_length=256)] = None


class _RuleModel(BaseModel):
    model_config = _STRICT
    name: str
    when: Any
    message: _Message = None


class _CapModel(BaseModel):
    model_config = _STRICT
    name: str
    value: Any
    max: Any  # a number: checked by _number


class _CheckModel(BaseModel):
    model_config = _STRICT
    name: str
    expr: Any
    message: _Message = None


class _EventModel(BaseModel):
    model_config = _STRICT
    name: str
    provider: str
    action: str
    payload: Any = None


class _CallbackModel(BaseModel):
    model_config = _STRICT
    url: Annotated[str, PydField(max_length=MAX_URL)]
    events: Annotated[list[str] | None, PydField(min_length=1)] = None


class _CardinalityModel(BaseModel):
    model_config = _STRICT
    min: Annotated[int | None, PydField(ge=0)] = None
    max: Annotated[int | None, PydField(ge=0)] = None


class _CompensationModel(BaseModel):
    model_config = _STRICT
    action: str
    payload: Any = None


class _QueryModel(BaseModel):
    model_config = _STRICT
    kind: str
    name: str
    provider: str
    action: str
    payload: Any = None
    cardinality: _CardinalityModel | None = None


class _AssertModel(BaseModel):
    model_config = _STRICT
    kind: str
    name: str
    expr: Any
    message: _Message = None


class _EffectModel(BaseModel):
    model_config = _STRICT
    kind: str
    name: str
    provider: str
    action: str
    payload: Any = None
    compensation: _CompensationModel | None = None
    retriable: bool | None = None


_STEP_MODELS: Final[Mapping[str, type[BaseModel]]] = {
    "query": _QueryModel,
    "assert": _AssertModel,
    "effect": _EffectModel,
}


class _CommandModel(BaseModel):
    model_config = _STRICT
    format: str | None = None
    name: str
    version: int | None = None
    mode: str | None = None
    description: Annotated[str | None, PydField(max_length=MAX_DESCRIPTION)] = None
    #: Where the command lives (company or room) is a column of the command row, not part of the
    #: definition: accepted here because REST clients send it in the same body, then dropped.
    scope: Any = None
    inputs: dict[str, _InputModel] | None = None
    business_key: Any = None
    rules: list[_RuleModel] | None = None
    caps: list[_CapModel] | None = None
    steps: list[dict[str, Any]]
    checks: list[_CheckModel] | None = None
    outbox: list[_EventModel] | None = None
    result: dict[str, Any] | None = None
    callbacks: list[_CallbackModel] | None = None
    delivery_reconciliation_ttl_seconds: int | None = None


# --------------------------------------------------------------------------------------------
# Errors.


def _seg(key: str | int) -> str:
    """One JSON-pointer segment (RFC 6901 escaping)."""
    return "/" + str(key).replace("~", "~0").replace("/", "~1")


def _invalid(reason: str, path: str | None = None, step: str | None = None) -> DefinitionInvalid:
    details: dict[str, Any] = {"reason": reason[:MAX_REASON]}
    if step is not None:
        details["step"] = step
    return DefinitionInvalid(details=details, step=step, path=path)


def _from_model_error(exc: ValidationError, base: str) -> DefinitionInvalid:
    """The first problem pydantic found, as our error (its own text, never the input value)."""
    first = exc.errors(include_url=False, include_context=False, include_input=False)[0]
    loc = first["loc"]
    pointer = base + "".join(_seg(part) for part in loc)
    last = str(loc[-1]) if loc else ""
    if first["type"] == "extra_forbidden":
        reason = f"unknown key {last!r}"
        pointer = pointer or "/"
    elif first["type"] == "missing":
        reason = f"missing key {last!r}"
    else:
        reason = str(first["msg"])
    return _invalid(f"{pointer or '/'}: {reason}", pointer or "/")


def _validated(model: type[BaseModel], value: object, base: str) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise _from_model_error(exc, base) from None


def _name(
    value: str, path: str, what: str, *, dots: bool = False, longest: int | None = None
) -> str:
    """A name other parts refer to: an identifier, without dots when it is a reference segment;
    at most ``longest`` characters when it is stored in a column of that width (a step's, an
    event's, a provider's or an action's name: :data:`ledger.schema.NAME_LENGTH`), since
    PostgreSQL refuses a longer value only when an execution first writes it."""
    if (
        not is_identifier(value)
        or (not dots and "." in value)
        or (longest is not None and len(value) > longest)
    ):
        rule = "an identifier" if dots else "an identifier without dots"
        if longest is not None:
            rule += f" of at most {longest} characters"
        raise _invalid(f"{path}: {what} must be {rule}", path)
    return value


def _number(value: object, path: str) -> int | float:
    """A JSON number (booleans are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(f"{path}: must be a number", path)
    return value


# --------------------------------------------------------------------------------------------
# Shape: the JSON form to the stored form (no provider involved).


@dataclass(frozen=True)
class _Scope:
    """What the expressions at one place may reference."""

    inputs: frozenset[str]
    queries: frozenset[str] = frozenset()
    steps: frozenset[str] | None = None
    tx: bool = False
    forward: bool = False
    whole_results: bool = True


def _check_expr(
    expr: object,
    where: str,
    path: str,
    scope: _Scope,
    *,
    want: str | None = None,
    step: str | None = None,
) -> None:
    """Validate ``expr``, what it references, and (``want``) whether it can be that type."""
    try:
        found = expressions.refs(expr)
    except expressions.ExpressionError as exc:
        raise _invalid(f"{where}: {exc.code}: {exc.message}", path + exc.path, step) from None
    for ref in sorted(found):
        problem = _ref_problem(ref, scope)
        if problem is not None:
            raise _invalid(f"{where}: reference {ref!r} {problem}", path, step)
    if want is not None and not _can_be(expr, want):
        raise _invalid(f"{where}: must be a {want} expression", path, step)


def _ref_problem(ref: str, scope: _Scope) -> str | None:
    """Why ``ref`` may not be used in ``scope`` (``None`` when it may)."""
    segs = ref.split(".")
    root = segs[0]
    if root == "inputs":
        if len(segs) < 2:
            return "must name an input (inputs.<name>)"
        if segs[1] not in scope.inputs:
            return "names an input that is not declared"
        return None
    if root == "tx":
        if not scope.tx:
            return "is not available here (tx exists once effects run)"
        return None if ref == "tx.id" else "is not defined (only tx.id is)"
    if root == "queries":
        if len(segs) < 3 or segs[2] != "result":
            return "must read a query's result (queries.<query>.result...)"
        if segs[1] not in scope.queries:
            return "names a query that has not run before this point"
        if not scope.whole_results and len(segs) < 4:
            return "must name a result field (the projection reads fields, not whole results)"
        return None
    if root == "steps":
        if scope.steps is None:
            return "is not available here (effects have not run yet)"
        if len(segs) < 3 or segs[2] not in _STEP_PARTS:
            return "must be steps.<effect>.payload, .result or .remote_id"
        if segs[1] not in scope.steps:
            return "names an effect step that has not run before this point"
        if segs[2] == "result" and not scope.whole_results and len(segs) < 4:
            return "must name a result field (the projection reads fields, not whole results)"
        return None
    if root == "forward":
        if not scope.forward:
            return "is only available in a compensation payload"
        if len(segs) < 2 or segs[1] not in _STEP_PARTS:
            return "must be forward.payload, forward.result or forward.remote_id"
        return None
    return "has an unknown root (inputs, queries, steps, forward, tx)"


def _can_be(expr: object, want: str) -> bool:
    """Whether ``expr`` can evaluate to a ``want`` ("boolean" / "number"): a cheap static check
    that refuses ``"expr": 1`` or ``{"$add": ...}`` as a condition at authoring, not at run."""
    stack = [expr]
    while stack:
        node = stack.pop()
        op = _operator(node)
        if op is None:
            if not _literal_is(node, want):
                return False
            continue
        name, arg = op
        if name == "$literal":
            if not _literal_is(arg, want):
                return False
        elif name == "$case" and isinstance(arg, dict):
            stack.append(arg["else"])
            stack.extend(branch["then"] for branch in arg["branches"])
        elif name in _UNTYPED_OPS:
            continue
        elif name not in (_BOOLEAN_OPS if want == "boolean" else _NUMBER_OPS):
            return False
    return True


def _literal_is(value: object, want: str) -> bool:
    if want == "boolean":
        return isinstance(value, bool)
    return isinstance(value, int | float) and not isinstance(value, bool)


def _operator(node: object) -> tuple[str, Any] | None:
    if isinstance(node, dict) and len(node) == 1:
        ((key, arg),) = node.items()
        if isinstance(key, str) and key.startswith("$"):
            return key, arg
    return None


def _payload(value: object) -> Any:
    return {} if value is None else value


def _object_keys(template: object) -> list[str] | None:
    """Top-level keys of a payload template that is a literal object (``None`` otherwise)."""
    if isinstance(template, dict) and _operator(template) is None:
        return [str(key) for key in template]
    return None


def _check_payload_template(template: object, where: str, path: str, step: str | None) -> None:
    """A payload must be an object at run time: refuse literals that can never be one."""
    op = _operator(template)
    if op is None:
        literal: object = template
    elif op[0] == "$literal":
        literal = op[1]
    else:
        return  # computed: only the provider call can tell
    if not isinstance(literal, dict):
        raise _invalid(f"{where}: the payload must be an object template", path, step)


def _input_spec(key: str, model: _InputModel, path: str) -> dict[str, Any]:
    """One input spec, normalized as :meth:`orchestrator.saga.Input.normalized` would."""
    kind = model.type
    if kind not in _INPUT_TYPES:
        raise _invalid(f"{path}/type: must be one of {', '.join(_INPUT_TYPES)}", path + "/type")
    spec: dict[str, Any] = {
        "type": kind,
        "required": True if model.required is None else model.required,
    }
    for name in _CONSTRAINTS:
        value = getattr(model, name)
        if value is not None:
            spec[name] = list(value) if name == "enum" else value
    for name in ("minimum", "maximum"):
        if name in spec:
            _number(spec[name], f"{path}/{name}")
    applies = {
        "minimum": kind in ("integer", "number"),
        "maximum": kind in ("integer", "number"),
        "min_length": kind in ("string", "array", "object"),
        "max_length": kind in ("string", "array", "object"),
        "pattern": kind == "string",
        "enum": kind in ("string", "integer", "number", "boolean"),
    }
    for name in _CONSTRAINTS:
        if name in spec and not applies[name]:
            raise _invalid(f"{path}/{name}: does not apply to type {kind!r}", f"{path}/{name}")
    for low, high in (("minimum", "maximum"), ("min_length", "max_length")):
        if low in spec and high in spec and spec[low] > spec[high]:
            raise _invalid(f"{path}: {low} is greater than {high}", path)
    if "enum" in spec and not all(_enum_value_ok(v, kind) for v in spec["enum"]):
        raise _invalid(f"{path}/enum: every value must be a {kind}", f"{path}/enum")
    if "pattern" in spec:
        try:
            # pydantic enforces patterns with its own regex engine: build that very validator.
            TypeAdapter(Annotated[str, PydField(pattern=spec["pattern"])])
        except Exception:  # pydantic's SchemaError and anything else its build raises
            raise _invalid(
                f"{path}/pattern: not a supported regular expression", f"{path}/pattern"
            ) from None
    return spec


def _enum_value_ok(value: object, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, int | float) and not isinstance(value, bool)


def _callback(index: int, model: _CallbackModel) -> dict[str, Any]:
    path = f"/callbacks/{index}"
    parts = urlsplit(model.url)
    if parts.scheme not in ("http", "https") or not parts.hostname or re.search(r"\s", model.url):
        raise _invalid(f"{path}/url: must be an absolute http(s) URL", f"{path}/url")
    if parts.username is not None or parts.password is not None:
        raise _invalid(
            f"{path}/url: credentials do not belong in a stored definition", f"{path}/url"
        )
    events = list(CALLBACK_EVENTS) if model.events is None else model.events
    unknown = sorted(set(events) - set(CALLBACK_EVENTS))
    if unknown:
        raise _invalid(
            f"{path}/events: unknown event {unknown[0]!r} (events: {', '.join(CALLBACK_EVENTS)})",
            f"{path}/events",
        )
    return {"url": model.url, "events": sorted(set(events))}


def _unique(names: Iterator[tuple[str, str]], what: str) -> None:
    seen: set[str] = set()
    for name, path in names:
        if name in seen:
            raise _invalid(f"{path}: {what} {name!r} appears twice", path)
        seen.add(name)


def _shape(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The stored form of a JSON-form document, without ``dependency_contract``.

    Checks structure, names, ordering, mode rules and every expression with its scope; no
    provider is consulted.
    """
    doc: _CommandModel = _validated(_CommandModel, dict(raw), "")
    if doc.format is not None and doc.format != FORMAT:
        raise _invalid(f"/format: must be {FORMAT!r} (or left out)", "/format")
    name = _name(doc.name, "/name", "the command name", dots=True, longest=SAGA_NAME_LENGTH)
    version = 1 if doc.version is None else doc.version
    if version not in (1, 2):
        raise _invalid("/version: must be 1 or 2", "/version")
    mode = "execute" if doc.mode is None else doc.mode
    if mode not in MODES:
        raise _invalid("/mode: must be 'execute' or 'query'", "/mode")
    ttl = (
        TTL_DEFAULT
        if doc.delivery_reconciliation_ttl_seconds is None
        else (doc.delivery_reconciliation_ttl_seconds)
    )
    if not TTL_MIN <= ttl <= TTL_MAX:
        raise _invalid(
            f"/delivery_reconciliation_ttl_seconds: must be {TTL_MIN} to {TTL_MAX}",
            "/delivery_reconciliation_ttl_seconds",
        )

    inputs: dict[str, Any] = {}
    for key, spec in (doc.inputs or {}).items():
        path = f"/inputs{_seg(key)}"
        inputs[_name(key, path, "an input name")] = _input_spec(key, spec, path)
    input_names = frozenset(inputs)

    steps = [_step(index, value) for index, value in enumerate(doc.steps)]
    _unique(((s["name"], f"/steps/{i}/name") for i, s in enumerate(steps)), "step")
    queries = [s for s in steps if s["kind"] == "query"]
    effects = [s for s in steps if s["kind"] == "effect"]
    all_queries = frozenset(s["name"] for s in queries)
    all_effects = frozenset(s["name"] for s in effects)

    rules = []
    for index, item in enumerate(doc.rules or []):
        path = f"/rules/{index}"
        rules.append(
            {
                "name": _name(item.name, path + "/name", "a rule name", dots=True),
                "when": item.when,
                "message": item.message or "",
            }
        )
    caps = []
    for index, cap_m in enumerate(doc.caps or []):
        path = f"/caps/{index}"
        caps.append(
            {
                "name": _name(cap_m.name, path + "/name", "a cap name", dots=True),
                "value": cap_m.value,
                "max": _number(cap_m.max, path + "/max"),
            }
        )
    checks = []
    for index, check_m in enumerate(doc.checks or []):
        path = f"/checks/{index}"
        checks.append(
            {
                "name": _name(check_m.name, path + "/name", "a check name", dots=True),
                "expr": check_m.expr,
                "message": check_m.message or "",
            }
        )
    outbox = []
    for index, event_m in enumerate(doc.outbox or []):
        path = f"/outbox/{index}"
        outbox.append(
            {
                "name": _name(
                    event_m.name, path + "/name", "an event name", dots=True, longest=NAME_LENGTH
                ),
                "provider": _name(
                    event_m.provider,
                    path + "/provider",
                    "a provider",
                    dots=True,
                    longest=NAME_LENGTH,
                ),
                "action": _name(
                    event_m.action, path + "/action", "an action", dots=True, longest=NAME_LENGTH
                ),
                "payload": _payload(event_m.payload),
            }
        )
    _unique(((r["name"], f"/rules/{i}/name") for i, r in enumerate(rules)), "rule")
    _unique(((c["name"], f"/caps/{i}/name") for i, c in enumerate(caps)), "cap")
    _unique(((c["name"], f"/checks/{i}/name") for i, c in enumerate(checks)), "check")
    _unique(((e["name"], f"/outbox/{i}/name") for i, e in enumerate(outbox)), "outbox event")
    callbacks = [_callback(index, cb) for index, cb in enumerate(doc.callbacks or [])]
    result = None if doc.result is None else dict(doc.result)
    for key in result or {}:
        _name(key, f"/result{_seg(key)}", "a result key")

    # Mode rules.
    if mode == "query":
        refused = (
            ("effects", "/steps", bool(effects)),
            ("outbox", "/outbox", bool(outbox)),
            ("checks", "/checks", bool(checks)),
            ("callbacks", "/callbacks", bool(callbacks)),
            ("business_key", "/business_key", doc.business_key is not None),
        )
        for what, path, present in refused:
            if present:
                raise _invalid(f"{path}: a query-mode command has no {what}", path)
        if not queries:
            raise _invalid("/steps: a query-mode command needs at least one query step", "/steps")
    elif not effects:
        raise _invalid("/steps: an execute-mode command needs at least one effect step", "/steps")

    # Ordering and step expressions, in execution order.
    seen_queries: set[str] = set()
    seen_effects: set[str] = set()
    for index, step in enumerate(steps):
        path, sname = f"/steps/{index}", step["name"]
        kind = step["kind"]
        if kind == "query":
            if seen_effects:
                raise _invalid(
                    f"{path}: query step {sname!r} comes after an effect; queries run at "
                    "prepare, before anything is written",
                    path,
                    sname,
                )
            scope = _Scope(input_names, frozenset(seen_queries))
            _check_payload_template(step["payload"], f"query {sname!r}", path + "/payload", sname)
            _check_expr(step["payload"], f"query {sname!r}", path + "/payload", scope, step=sname)
            seen_queries.add(sname)
        elif kind == "assert":
            if seen_effects:
                scope = _Scope(input_names, all_queries, frozenset(seen_effects), tx=True)
            else:
                scope = _Scope(input_names, frozenset(seen_queries))
            where = f"assert {sname!r}"
            _check_expr(step["expr"], where, path + "/expr", scope, want="boolean", step=sname)
        else:
            scope = _Scope(input_names, all_queries, frozenset(seen_effects), tx=True)
            where = f"step {sname!r}"
            _check_payload_template(step["payload"], where, path + "/payload", sname)
            _check_expr(step["payload"], where, path + "/payload", scope, step=sname)
            comp = step["compensation"]
            if comp is not None:
                where = f"compensation of {sname!r}"
                comp_path = path + "/compensation/payload"
                comp_scope = dataclasses.replace(scope, forward=True)
                _check_payload_template(comp["payload"], where, comp_path, sname)
                _check_expr(comp["payload"], where, comp_path, comp_scope, step=sname)
            seen_effects.add(sname)

    # Everything else.
    if doc.business_key is not None:
        _check_expr(doc.business_key, "business_key", "/business_key", _Scope(input_names))
    before = _Scope(input_names, all_queries)
    for index, rule in enumerate(rules):
        where, path = f"rule {rule['name']!r}", f"/rules/{index}/when"
        _check_expr(rule["when"], where, path, before, want="boolean")
    for index, cap in enumerate(caps):
        where, path = f"cap {cap['name']!r}", f"/caps/{index}/value"
        _check_expr(cap["value"], where, path, before, want="number")
    after = _Scope(input_names, all_queries, all_effects, tx=True)
    for index, check in enumerate(checks):
        where, path = f"check {check['name']!r}", f"/checks/{index}/expr"
        _check_expr(check["expr"], where, path, after, want="boolean")
    for index, event in enumerate(outbox):
        where, path = f"outbox event {event['name']!r}", f"/outbox/{index}/payload"
        _check_payload_template(event["payload"], where, path, None)
        _check_expr(event["payload"], where, path, after)
    if result is not None:
        if mode == "query":
            projection = _Scope(input_names, all_queries, whole_results=False)
        else:
            projection = dataclasses.replace(after, whole_results=False)
        _check_expr(result, "result", "/result", projection)

    data = {
        "format": FORMAT,
        "name": name,
        "version": version,
        "mode": mode,
        "description": doc.description or "",
        "inputs": inputs,
        "business_key": doc.business_key,
        "rules": rules,
        "caps": caps,
        "steps": steps,
        "checks": checks,
        "outbox": outbox,
        "result": result,
        "callbacks": callbacks,
        "delivery_reconciliation_ttl_seconds": ttl,
    }
    try:
        plain: dict[str, Any] = json.loads(canonical_json(data))
    except (NotCanonicalizable, RecursionError):
        raise _invalid("the definition is not plain JSON", "/") from None
    return plain


def _step(index: int, value: dict[str, Any]) -> dict[str, Any]:
    """One step in its stored form (all keys of its kind, defaults filled)."""
    path = f"/steps/{index}"
    kind = value.get("kind")
    model = _STEP_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise _invalid(f"{path}/kind: must be one of 'query', 'assert', 'effect'", path + "/kind")
    step = _validated(model, value, path)
    sname = _name(step.name, path + "/name", "a step name", longest=NAME_LENGTH)
    if isinstance(step, _AssertModel):
        return {"kind": "assert", "name": sname, "expr": step.expr, "message": step.message or ""}
    provider = _name(
        step.provider, path + "/provider", "a provider", dots=True, longest=NAME_LENGTH
    )
    action = _name(step.action, path + "/action", "an action", dots=True, longest=NAME_LENGTH)
    if isinstance(step, _QueryModel):
        cardinality: dict[str, Any] | None = None
        card = step.cardinality
        if card is not None and (card.min is not None or card.max is not None):
            if card.min is not None and card.max is not None and card.min > card.max:
                raise _invalid(
                    f"{path}/cardinality: min is greater than max", path + "/cardinality"
                )
            cardinality = {"min": card.min, "max": card.max}
        return {
            "kind": "query",
            "name": sname,
            "provider": provider,
            "action": action,
            "payload": _payload(step.payload),
            "cardinality": cardinality,
        }
    assert isinstance(step, _EffectModel)
    compensation: dict[str, Any] | None = None
    if step.compensation is not None:
        comp_action = _name(
            step.compensation.action,
            path + "/compensation/action",
            "an action",
            dots=True,
            longest=NAME_LENGTH,
        )
        compensation = {"action": comp_action, "payload": _payload(step.compensation.payload)}
    return {
        "kind": "effect",
        "name": sname,
        "provider": provider,
        "action": action,
        "payload": _payload(step.payload),
        "compensation": compensation,
        "retriable": bool(step.retriable),
    }


# --------------------------------------------------------------------------------------------
# Providers: contracts, saga shape, dependency contract.


def _contract(registry: ProviderRegistry, provider: str, action: str, where: str) -> ActionContract:
    """The contract, or the engine's author-phase errors for an unknown provider / action."""
    try:
        return registry.contract(provider, action)
    except UnknownProvider:
        raise UnknownProviderError(
            f"{where}: provider {provider!r} is not registered", details={"provider": provider}
        ) from None
    except UnknownAction:
        raise UnknownActionError(
            f"{where}: provider {provider!r} has no action {action!r}",
            details={"provider": provider, "action": action},
        ) from None


def check_saga_shape(steps: Sequence[Mapping[str, Any]], registry: ProviderRegistry) -> None:
    """The engine's saga-shape rules, on saga-form effect steps (a copy of
    ``Orchestrator._check_against_providers``, which stays the engine's own).

    Every reversible action says how it is compensated, and with the contract's compensation;
    irreversible actions are not compensated; retriable steps need key dedup; and the order is
    compensatable steps, at most one irreversible pivot, then only retriable steps — so a
    failure before the pivot can always be turned back, and nothing after it ever has to be.
    """
    shape: list[str] = []
    for step in steps:
        where = f"step {step['name']!r}"
        contract = _contract(registry, step["provider"], step["action"], where)
        comp = step.get("compensation")
        if contract.compensation is not None and comp is None:
            raise _invalid(
                f"{where}: the action is reversible; say how ({contract.compensation!r} payload)",
                step=step["name"],
            )
        if comp is not None:
            if contract.compensation is None:
                raise _invalid(f"{where}: the action is irreversible", step=step["name"])
            if comp["action"] != contract.compensation:
                raise _invalid(
                    f"{where}: compensate with {contract.compensation!r}", step=step["name"]
                )
            _contract(registry, step["provider"], comp["action"], f"compensation of {where}")
        if step.get("retriable"):
            if not contract.dedups_by_key:
                raise _invalid(f"{where}: retriable steps need key dedup", step=step["name"])
            shape.append("R")
        else:
            shape.append("C" if comp is not None else "P")
    text = "".join(shape)
    stripped = text.lstrip("C")
    if stripped.startswith("P"):
        stripped = stripped[1:]
    if stripped.strip("R"):
        raise _invalid(
            "saga shape must be: compensatable steps, at most one irreversible pivot, then "
            "only retriable steps"
        )


def _check_required(
    contract: ActionContract, template: object, where: str, path: str, step: str | None
) -> None:
    """A literal object payload must carry every field the contract requires."""
    keys = _object_keys(template)
    if keys is None:
        return
    missing = [name for name in contract.required_fields if name not in keys]
    if missing:
        raise _invalid(
            f"{where}: the payload lacks required field(s) {', '.join(missing)}", path, step
        )


def _check_providers(data: Mapping[str, Any], registry: ProviderRegistry) -> None:
    """Queries name read-only actions, effects and events the others; the saga shape holds."""
    for index, step in enumerate(data["steps"]):
        if step["kind"] == "assert":
            continue
        path, sname = f"/steps/{index}", step["name"]
        where = f"{step['kind']} step {sname!r}"
        contract = _contract(registry, step["provider"], step["action"], where)
        target = f"{step['provider']}.{step['action']}"
        if step["kind"] == "query" and not contract.read_only:
            raise _invalid(
                f"{where}: {target} is not read-only; writes belong in effect steps", path, sname
            )
        if step["kind"] == "effect" and contract.read_only:
            raise _invalid(
                f"{where}: {target} is read-only; reads belong in query steps", path, sname
            )
        _check_required(contract, step["payload"], where, path + "/payload", sname)
        comp = step.get("compensation")
        if comp is not None and comp["action"] == contract.compensation:
            comp_contract = _contract(
                registry, step["provider"], comp["action"], f"compensation of {where}"
            )
            comp_path = path + "/compensation/payload"
            _check_required(
                comp_contract, comp["payload"], f"compensation of {where}", comp_path, sname
            )
    check_saga_shape(_saga_steps(data), registry)
    for index, event in enumerate(data["outbox"]):
        path, where = f"/outbox/{index}", f"outbox event {event['name']!r}"
        contract = _contract(registry, event["provider"], event["action"], where)
        if contract.read_only:
            raise _invalid(f"{where}: a read-only action sends nothing", path)
        _check_required(contract, event["payload"], where, path + "/payload", None)


@dataclass
class _Use:
    roles: set[str] = field(default_factory=set)
    fields: set[str] = field(default_factory=set)


def _expressions(data: Mapping[str, Any]) -> Iterator[tuple[object, tuple[str, str] | None]]:
    """Every expression of a stored form, with the forward action for compensation payloads."""
    if data["business_key"] is not None:
        yield data["business_key"], None
    for rule in data["rules"]:
        yield rule["when"], None
    for cap in data["caps"]:
        yield cap["value"], None
    for step in data["steps"]:
        if step["kind"] == "assert":
            yield step["expr"], None
            continue
        yield step["payload"], None
        comp = step.get("compensation")
        if comp is not None:
            yield comp["payload"], (step["provider"], step["action"])
    for check in data["checks"]:
        yield check["expr"], None
    for event in data["outbox"]:
        yield event["payload"], None
    if data["result"] is not None:
        yield data["result"], None


def _result_field(
    ref: str,
    queries: Mapping[str, tuple[str, str]],
    effects: Mapping[str, tuple[str, str]],
    forward: tuple[str, str] | None,
) -> tuple[tuple[str, str], str] | None:
    """``((provider, action), field)`` when ``ref`` reads a named field of a provider result."""
    segs = ref.split(".")
    if segs[0] in ("queries", "steps") and len(segs) >= 4 and segs[2] == "result":
        owner = (queries if segs[0] == "queries" else effects).get(segs[1])
        return None if owner is None else (owner, segs[3])
    if segs[0] == "forward" and forward is not None and len(segs) >= 3 and segs[1] == "result":
        return forward, segs[2]
    return None


def _owners(
    data: Mapping[str, Any],
) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    queries = {
        s["name"]: (s["provider"], s["action"]) for s in data["steps"] if s["kind"] == "query"
    }
    effects = {
        s["name"]: (s["provider"], s["action"]) for s in data["steps"] if s["kind"] == "effect"
    }
    return queries, effects


def _uses(data: Mapping[str, Any]) -> dict[tuple[str, str], _Use]:
    """Per provider action: the roles it plays in the command and the fields it depends on."""
    uses: dict[tuple[str, str], _Use] = {}

    def use(provider: str, action: str, role: str | None, template: object = None) -> _Use:
        entry = uses.setdefault((provider, action), _Use())
        if role is not None:
            entry.roles.add(role)
        entry.fields.update(_object_keys(template) or ())
        return entry

    for step in data["steps"]:
        if step["kind"] == "query":
            entry = use(step["provider"], step["action"], "query", step["payload"])
            if step["cardinality"] is not None:
                entry.fields.add("items")  # the cardinality counts result.items
        elif step["kind"] == "effect":
            use(step["provider"], step["action"], "effect", step["payload"])
            comp = step["compensation"]
            if comp is not None:
                use(step["provider"], comp["action"], "compensation", comp["payload"])
    for event in data["outbox"]:
        use(event["provider"], event["action"], "outbox", event["payload"])
    queries, effects = _owners(data)
    for expr, forward in _expressions(data):
        for ref in expressions.refs(expr):
            found = _result_field(ref, queries, effects, forward)
            if found is not None:
                use(*found[0], None).fields.add(found[1])
    return uses


def contract_digest(contract: ActionContract) -> str:
    """Fingerprint of an action contract as a JSON object (every field, tuples as lists)."""
    plain = {
        key: list(value) if isinstance(value, tuple) else value
        for key, value in dataclasses.asdict(contract).items()
    }
    return fingerprint(plain)


def _settings_of(settings: Settings | None, provider: str, action: str) -> dict[str, Any]:
    entry = (settings or {}).get((provider, action)) or {}
    return {
        "requires_approval": bool(entry.get("requires_approval", False)),
        "approval_policy": entry.get("approval_policy"),
    }


def settings_digest(settings: Settings | None, provider: str, action: str) -> str:
    """Fingerprint of the approval settings of one action (missing row = the defaults).

    Only ``requires_approval`` and ``approval_policy`` are digested: a row's bookkeeping
    (revision, timestamps, a migration lock) is not a dependency.
    """
    try:
        return fingerprint(_settings_of(settings, provider, action))
    except NotCanonicalizable:
        raise _invalid(f"the approval settings of {provider}.{action} are not plain JSON") from None


def build_dependency_contract(
    data: Mapping[str, Any], registry: ProviderRegistry, settings: Settings | None = None
) -> dict[str, Any]:
    """The server-built record of what the command depends on, per provider action.

    Fields are the top-level keys of object payload templates, ``items`` for a query with a
    cardinality, and each result field read through ``steps.<s>.result.<f>``,
    ``queries.<q>.result.<f>`` or ``forward.result.<f>``. Where the contract declares ``fields``,
    a dependent field outside them is :class:`DefinitionInvalid`.
    """
    actions: dict[str, Any] = {}
    for (provider, action), use in sorted(_uses(data).items()):
        qualified = f"{provider}.{action}"
        contract = _contract(registry, provider, action, qualified)
        if contract.fields:
            missing = sorted(use.fields - set(contract.fields))
            if missing:
                raise _invalid(
                    f"{qualified}: field(s) {', '.join(missing)} are not among the action's "
                    f"declared fields ({', '.join(contract.fields)})"
                )
        actions[qualified] = {
            "provider": provider,
            "action": action,
            "roles": sorted(use.roles),
            "contract_digest": contract_digest(contract),
            "settings_digest": settings_digest(settings, provider, action),
            "fields": sorted(use.fields),
        }
    return {"version": DEPENDENCY_CONTRACT_VERSION, "actions": actions}


# --------------------------------------------------------------------------------------------
# The stored command.


def _saga_steps(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "name": s["name"],
            "provider": s["provider"],
            "action": s["action"],
            "payload": s["payload"],
            "retriable": s["retriable"],
            "compensation": s["compensation"],
        }
        for s in data["steps"]
        if s["kind"] == "effect"
    ]


@dataclass(frozen=True)
class StoredCommand:
    """A normalized command (``data``, plain JSON) and its digest (``fingerprint(data)``).

    ``data`` is what is stored and what ``expected_contract_digest`` hashes; treat it as
    read-only (the properties hand out copies of its lists).
    """

    data: dict[str, Any]
    digest: str

    @classmethod
    def from_stored(cls, data: Mapping[str, Any]) -> StoredCommand:
        """Re-create from the stored dict: the format is checked, the shape re-validated and the
        digest recomputed from the data as stored (never re-normalized: the digest is of what
        was stored)."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise _invalid(f"a stored command has format {FORMAT!r}", "/format")
        contract = data.get("dependency_contract")
        if not (
            isinstance(contract, Mapping)
            and contract.get("version") == DEPENDENCY_CONTRACT_VERSION
            and isinstance(contract.get("actions"), Mapping)
        ):
            raise _invalid(
                "a stored command carries its dependency_contract", "/dependency_contract"
            )
        _shape({k: v for k, v in data.items() if k != "dependency_contract"})
        try:
            plain: dict[str, Any] = json.loads(canonical_json(dict(data)))
        except NotCanonicalizable:
            raise _invalid("the stored command is not plain JSON", "/") from None
        return cls(data=plain, digest=fingerprint(plain))

    @property
    def name(self) -> str:
        """The command's name."""
        return str(self.data["name"])

    @property
    def version(self) -> int:
        """1 or 2: how drift is checked (see :func:`check_drift`)."""
        return int(self.data["version"])

    @property
    def mode(self) -> str:
        """``"execute"`` or ``"query"``."""
        return str(self.data["mode"])

    @property
    def ttl_seconds(self) -> int:
        """``delivery_reconciliation_ttl_seconds``."""
        return int(self.data["delivery_reconciliation_ttl_seconds"])

    @property
    def inputs(self) -> dict[str, Any]:
        """Input specs by name."""
        return dict(self.data["inputs"])

    @property
    def steps(self) -> list[dict[str, Any]]:
        """Every step in order (query, assert and effect)."""
        return list(self.data["steps"])

    @property
    def queries(self) -> list[dict[str, Any]]:
        """Query steps in order (they all come before the first effect)."""
        return [s for s in self.data["steps"] if s["kind"] == "query"]

    @property
    def asserts_pre(self) -> list[dict[str, Any]]:
        """Assert steps before the first effect (evaluated at prepare, over inputs and queries)."""
        out = []
        for step in self.data["steps"]:
            if step["kind"] == "effect":
                break
            if step["kind"] == "assert":
                out.append(step)
        return out

    @property
    def effect_steps(self) -> list[dict[str, Any]]:
        """Effect steps in order (the saga the engine runs)."""
        return [s for s in self.data["steps"] if s["kind"] == "effect"]

    @property
    def rules(self) -> list[dict[str, Any]]:
        """Rules."""
        return list(self.data["rules"])

    @property
    def caps(self) -> list[dict[str, Any]]:
        """Caps."""
        return list(self.data["caps"])

    @property
    def checks(self) -> list[dict[str, Any]]:
        """Validation checks (the saga's validate phase)."""
        return list(self.data["checks"])

    @property
    def outbox(self) -> list[dict[str, Any]]:
        """After-commit events."""
        return list(self.data["outbox"])

    @property
    def result(self) -> dict[str, Any] | None:
        """The result projection template, or ``None``."""
        result = self.data["result"]
        return None if result is None else dict(result)

    @property
    def callbacks(self) -> list[dict[str, Any]]:
        """Lifecycle callbacks."""
        return list(self.data["callbacks"])

    @property
    def dependency_contract(self) -> dict[str, Any]:
        """The stored dependency contract."""
        return dict(self.data["dependency_contract"])

    def saga_part(self) -> dict[str, Any]:
        """The saga-format dict :meth:`SagaDefinition.parse` takes.

        Effect steps only; asserts after the first effect go to ``asserts`` with ``before``
        naming the effect they precede (``None``: after the last one, in the validate phase).
        Asserts before the first effect are not part of the saga: they run at prepare. A
        query-mode command has no saga.
        """
        if self.mode != "execute":
            raise _invalid("a query-mode command has no saga part", "/mode")
        asserts: list[dict[str, Any]] = []
        pending: list[dict[str, Any]] = []
        started = False
        for step in self.data["steps"]:
            if step["kind"] == "effect":
                started = True
                for item in pending:
                    item["before"] = step["name"]
                pending = []
            elif step["kind"] == "assert" and started:
                item = {"name": step["name"], "expr": step["expr"], "message": step["message"]}
                item["before"] = None
                pending.append(item)
                asserts.append(item)
        return {
            "format": SAGA_FORMAT,
            "name": self.name,
            "version": self.version,
            "inputs": self.inputs,
            "business_key": self.data["business_key"],
            "steps": _saga_steps(self.data),
            "checks": self.checks,
            "outbox": self.outbox,
            "asserts": asserts,
            "result": self.result,
        }

    def saga_definition(self) -> SagaDefinition:
        """``SagaDefinition.parse(self.saga_part())``."""
        return SagaDefinition.parse(self.saga_part())


def normalize(
    raw: Mapping[str, Any],
    *,
    registry: ProviderRegistry,
    settings: Settings | None = None,
) -> StoredCommand:
    """Budgets, shape, expressions, provider contracts; then the dependency contract and digest.

    Raises :class:`~orchestrator.errors.DefinitionLimitExceeded` (a budget),
    :class:`~orchestrator.errors.DefinitionInvalid` (shape, references, contracts, fields),
    :class:`~orchestrator.errors.UnknownProviderError` or
    :class:`~orchestrator.errors.UnknownActionError`.
    """
    if isinstance(raw, Mapping) and not isinstance(raw, dict):
        raw = dict(raw)  # a read-only view of a document is still the document
    budgets.check_definition(raw)
    if not isinstance(raw, Mapping):
        raise _invalid("a command definition is a JSON object", "/")
    if unstorable_text(raw):
        raise _invalid("a string holds a NUL character or an unpaired surrogate", "/")
    if "dependency_contract" in raw:
        raise _invalid(
            "/: unknown key 'dependency_contract' (the server builds it)", "/dependency_contract"
        )
    # Numbers as PostgreSQL's JSONB stores them (a float of 1e16 or more as the integer it is,
    # -0.0 as 0.0): the stored definition, its digest and what GET returns then agree on both
    # backends, so sha256 of the GET definition is the digest (docs/commands.md).
    data = _shape(jsonb_stable(raw))
    _check_providers(data, registry)
    data["dependency_contract"] = build_dependency_contract(data, registry, settings)
    return StoredCommand(data=data, digest=fingerprint(data))


# --------------------------------------------------------------------------------------------
# Drift and readable fields.


def _changed(why: str) -> SchemaDependencyChanged:
    """The fixed-message error; the reason goes to a note for logs, never into the envelope."""
    error = SchemaDependencyChanged()
    error.add_note(why)
    return error


def check_drift(
    stored: StoredCommand, registry: ProviderRegistry, settings: Settings | None = None
) -> None:
    """Refuse to run ``stored`` when what it depends on changed (``SchemaDependencyChanged``).

    Version 2 rebuilds the whole dependency contract and requires it to be identical: any edit
    to a used action's contract or approval settings fails closed. Version 1 tolerates unrelated
    edits and only checks what would break the command: every action is still registered, its
    declared fields (where it declares any) still hold every dependent field, and an action used
    as a query is still read-only (a query runs at prepare and must never write).
    """
    recorded = stored.data.get("dependency_contract")
    if not isinstance(recorded, Mapping) or not isinstance(recorded.get("actions"), Mapping):
        raise _changed("the stored command has no dependency contract")
    if stored.version >= 2:
        try:
            current = build_dependency_contract(stored.data, registry, settings)
        except (DefinitionInvalid, UnknownProviderError, UnknownActionError) as exc:
            raise _changed(f"the dependency contract cannot be rebuilt: {exc.message}") from None
        if current != dict(recorded):
            changed = sorted(
                name
                for name in set(current["actions"]) | set(recorded["actions"])
                if current["actions"].get(name) != recorded["actions"].get(name)
            )
            raise _changed(f"dependencies changed: {', '.join(changed) or 'contract version'}")
        return
    for qualified, entry in sorted(recorded["actions"].items()):
        try:
            contract = registry.contract(entry["provider"], entry["action"])
        except (UnknownProvider, UnknownAction):
            raise _changed(f"{qualified} is no longer registered") from None
        if contract.fields:
            missing = sorted(set(entry["fields"]) - set(contract.fields))
            if missing:
                raise _changed(f"{qualified} no longer has field(s) {', '.join(missing)}")
        if "query" in entry["roles"] and not contract.read_only:
            raise _changed(f"{qualified} is no longer read-only")


def field_refs(stored: StoredCommand) -> dict[str, set[str]]:
    """``"<provider>.<action>"`` -> the result fields the ``result`` projection reads.

    What a caller gets to read of each provider's answers (for ``field_not_readable``). Exact:
    the projection may only read results by naming their fields.
    """
    result = stored.data["result"]
    if result is None:
        return {}
    queries, effects = _owners(stored.data)
    out: dict[str, set[str]] = {}
    for ref in expressions.refs(result):
        found = _result_field(ref, queries, effects, None)
        if found is not None:
            (provider, action), name = found
            out.setdefault(f"{provider}.{action}", set()).add(name)
    return out
