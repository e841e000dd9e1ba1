"""Authoring budgets of a command definition (seed 000), checked before anything else looks at it.

A definition is data a REST client sends, so its size is bounded before it is parsed into models,
validated or hashed: an oversized or pathological document must cost a bounded amount of work and
be refused with a machine-readable ``{resource, limit, actual}`` rather than a stack overflow, a
slow regex or a confusing validation message. The limits are the seed's, one constant each:

==================================  ==========================================================
``definition_bytes``   1 MiB        canonical JSON of the raw document (sorted keys, ``,``/``:``,
                                    ASCII escapes), so every client measures the same bytes. The
                                    seed says "1 MB"; we read it as 1 MiB = 1 048 576 bytes.
``input_bytes``        1 MiB        canonical JSON of a request's ``inputs`` (same reading).
``json_depth``         64           the whole document: the root is depth 1, each value inside a
                                    container one deeper than the container.
``json_nodes``         16 384       the whole document: every JSON value counts 1 (object keys do
                                    not count).
``condition_depth`` / ``_nodes``    12 / 128   an assert step's or a check's ``expr``.
``rule_depth`` / ``rule_nodes``     8 / 128    a rule's ``when``.
``case_depth``         8            most ``$case`` nodes on one root-to-leaf chain.
``case_nodes``         64           nodes of one ``$case`` subtree (the ``$case`` included); the
                                    largest subtree is the outermost one, so that is what counts.
``case_branches``      20           branches of one ``$case``.
``expression_nodes``   256          any one expression (payload template, condition, cap value,
                                    business key, result projection).
``definition_expression_nodes``     8 192      all expressions of the definition together.
==================================  ==========================================================

Expressions are measured with the counting rule of :mod:`orchestrator.expressions` (``measure``
gives the same ``nodes`` and ``depth`` for every well-formed expression; the tests pin that), but
with a walk of our own: ``measure`` validates as it counts and raises its own hard ceilings (more
than 20 ``$case`` branches is its ``limit_exceeded``), whereas a budget must be reported as a
budget, for malformed expressions too. Every walk here is iterative.

A ``null`` where an expression is optional (``business_key``, ``result``, a ``payload``) is the
same as leaving the key out (the stored form's rule, see :mod:`orchestrator.definitions`), so it
is not counted: the Python builder and the JSON form measure the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from ledger.canonical import NotCanonicalizable, canonical_json
from orchestrator.errors import (
    DefinitionInvalid,
    DefinitionLimitExceeded,
    InputInvalid,
    InputLimitExceeded,
)

__all__ = [
    "MAX_CASE_BRANCHES",
    "MAX_CASE_DEPTH",
    "MAX_CASE_NODES",
    "MAX_CONDITION_DEPTH",
    "MAX_CONDITION_NODES",
    "MAX_DEFINITION_BYTES",
    "MAX_DEFINITION_EXPRESSION_NODES",
    "MAX_EXPRESSION_NODES",
    "MAX_INPUT_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_JSON_NODES",
    "MAX_RULE_DEPTH",
    "MAX_RULE_NODES",
    "ExpressionFigures",
    "JsonFigures",
    "check_definition",
    "check_expression",
    "check_inputs_size",
    "expression_figures",
    "json_figures",
]

MAX_DEFINITION_BYTES: Final = 1_048_576
MAX_INPUT_BYTES: Final = 1_048_576
MAX_JSON_DEPTH: Final = 64
MAX_JSON_NODES: Final = 16_384
MAX_CONDITION_DEPTH: Final = 12
MAX_CONDITION_NODES: Final = 128
MAX_CASE_DEPTH: Final = 8
MAX_CASE_NODES: Final = 64
MAX_CASE_BRANCHES: Final = 20
MAX_RULE_DEPTH: Final = 8
MAX_RULE_NODES: Final = 128
MAX_EXPRESSION_NODES: Final = 256
MAX_DEFINITION_EXPRESSION_NODES: Final = 8_192


def _exceeded(resource: str, limit: int, actual: int, path: str | None) -> DefinitionLimitExceeded:
    return DefinitionLimitExceeded(
        details={"resource": resource, "limit": limit, "actual": actual}, path=path
    )


def _seg(key: str | int) -> str:
    """One JSON-pointer segment (RFC 6901 escaping)."""
    return "/" + str(key).replace("~", "~0").replace("/", "~1")


# --------------------------------------------------------------------------------------------
# The whole document.


@dataclass(frozen=True)
class JsonFigures:
    """Size of a JSON document: ``depth`` (root = 1) and ``nodes`` (every value counts 1)."""

    depth: int
    nodes: int


def json_figures(doc: object) -> JsonFigures:
    """Depth and node count of ``doc``, refusing anything that is not plain JSON.

    Tuples count as arrays (Python callers build definitions with them). A value with no JSON
    form (a set, a non-string key, NaN, a datetime ...) is :class:`DefinitionInvalid` with the
    JSON pointer of the offending value, found here because this is the first walk over the
    raw document.
    """
    stack: list[tuple[object, int, str]] = [(doc, 1, "")]
    nodes = depth = 0
    while stack:
        value, level, path = stack.pop()
        nodes += 1
        depth = max(depth, level)
        if value is None or isinstance(value, bool | int | str):
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _not_json("numbers must be finite", path)
            continue
        if isinstance(value, list | tuple):
            for index, member in enumerate(value):
                stack.append((member, level + 1, path + _seg(index)))
            continue
        if isinstance(value, dict):
            for key, member in value.items():
                if not isinstance(key, str):
                    raise _not_json("object keys must be strings", path)
                stack.append((member, level + 1, path + _seg(key)))
            continue
        raise _not_json(f"{type(value).__name__} is not a JSON value", path)
    return JsonFigures(depth=depth, nodes=nodes)


def _not_json(why: str, path: str) -> DefinitionInvalid:
    return DefinitionInvalid(
        details={"reason": f"the definition is not plain JSON: {why}"}, path=path or "/"
    )


def _canonical_size(value: object) -> int | None:
    """Bytes of the canonical JSON of ``value``; ``None`` when it nests too deep to encode."""
    try:
        return len(canonical_json(value).encode("ascii"))
    except RecursionError:
        return None


# --------------------------------------------------------------------------------------------
# One expression.


@dataclass(frozen=True)
class ExpressionFigures:
    """Size of one expression under the :mod:`orchestrator.expressions` counting rule.

    ``nodes`` and ``depth`` equal :func:`orchestrator.expressions.measure`'s for a well-formed
    expression. ``case_depth`` is the most ``$case`` nodes on one chain, ``case_nodes`` the node
    count of the largest ``$case`` subtree (``measure``'s ``case_nodes`` is the total over all of
    them: a different figure on purpose, the budget is per subtree) and ``case_branches`` the most
    branches of one ``$case``.
    """

    nodes: int
    depth: int
    case_depth: int
    case_nodes: int
    case_branches: int


#: Operators whose argument is their one operand (an array there is a literal array).
_UNARY: Final = frozenset({"$not", "$neg", "$len"})

# A frame: (value, depth, literal?, $case nesting count, index of the outermost $case or -1).
_Frame = tuple[object, int, bool, int, int]


def expression_figures(expr: object) -> ExpressionFigures:
    """Count ``expr`` without validating it (a malformed operator still costs its nodes).

    Operator arguments that do not have the expected shape are counted as if they were operands,
    so a malformed expression is measured rather than refused here; validation refuses it later,
    once it is known to be within budget.
    """
    stack: list[_Frame] = [(expr, 1, False, 0, -1)]
    case_sizes: list[int] = []
    nodes = depth = case_depth = case_branches = 0
    while stack:
        value, level, raw, in_case, outer = stack.pop()
        nodes += 1
        depth = max(depth, level)
        if outer >= 0:
            case_sizes[outer] += 1
        if isinstance(value, list | tuple):
            stack.extend((member, level + 1, raw, in_case, outer) for member in value)
            continue
        if not isinstance(value, dict):
            continue
        operator = None if raw else _operator(value)
        if operator is None:
            stack.extend((member, level + 1, raw, in_case, outer) for member in value.values())
            continue
        name, arg = operator
        child = level + 1
        if name == "$ref":
            continue
        if name == "$literal":
            stack.append((arg, child, True, in_case, outer))
            continue
        if name == "$case":
            if outer < 0:
                outer = len(case_sizes)
                case_sizes.append(1)
            case_depth = max(case_depth, in_case + 1)
            parts = list(_case_members(arg))
            case_branches = max(case_branches, _branch_count(arg))
            stack.extend((part, child, False, in_case + 1, outer) for part in parts)
            continue
        if name not in _UNARY and isinstance(arg, list | tuple):
            stack.extend((operand, child, False, in_case, outer) for operand in arg)
        else:
            stack.append((arg, child, False, in_case, outer))
    return ExpressionFigures(
        nodes=nodes,
        depth=depth,
        case_depth=case_depth,
        case_nodes=max(case_sizes, default=0),
        case_branches=case_branches,
    )


def _operator(node: dict[Any, Any]) -> tuple[str, object] | None:
    """``(name, argument)`` of an operator node: a single key starting with ``$``."""
    if len(node) != 1:
        return None
    ((key, arg),) = node.items()
    if isinstance(key, str) and key.startswith("$"):
        return key, arg
    return None


def _branch_count(arg: object) -> int:
    if isinstance(arg, dict):
        branches = arg.get("branches")
        if isinstance(branches, list | tuple):
            return len(branches)
    return 0


def _case_members(arg: object) -> Iterator[object]:
    """The counted children of a ``$case``: each branch's ``when`` and ``then``, and ``else``.

    The argument object, the ``branches`` array and the branch objects are part of the ``$case``
    node (the expressions module's rule); anything else found there is counted as a child.
    """
    if not isinstance(arg, dict):
        yield arg
        return
    for key, member in arg.items():
        if key == "branches" and isinstance(member, list | tuple):
            for branch in member:
                if isinstance(branch, dict):
                    yield from branch.values()
                else:
                    yield branch
        else:
            yield member


#: Per kind of expression: (depth resource, depth limit, nodes resource, nodes limit).
_KIND_LIMITS: Final[Mapping[str, tuple[str, int, str, int]]] = {
    "condition": ("condition_depth", MAX_CONDITION_DEPTH, "condition_nodes", MAX_CONDITION_NODES),
    "rule": ("rule_depth", MAX_RULE_DEPTH, "rule_nodes", MAX_RULE_NODES),
}


def check_expression(expr: object, kind: str = "expression", path: str | None = None) -> int:
    """Refuse ``expr`` if it is over a budget; return its node count.

    ``kind`` is ``"expression"`` (payloads, cap values, the business key, the result), or
    ``"condition"`` (assert and check ``expr``) or ``"rule"`` (rule ``when``), which add their own
    depth and node limits. The tree-specific limits are checked first, then the one-expression
    limit, then the ``$case`` limits.
    """
    figures = expression_figures(expr)
    if kind in _KIND_LIMITS:
        depth_name, depth_limit, nodes_name, nodes_limit = _KIND_LIMITS[kind]
        if figures.depth > depth_limit:
            raise _exceeded(depth_name, depth_limit, figures.depth, path)
        if figures.nodes > nodes_limit:
            raise _exceeded(nodes_name, nodes_limit, figures.nodes, path)
    elif kind != "expression":
        raise ValueError(f"unknown expression kind {kind!r}")
    if figures.nodes > MAX_EXPRESSION_NODES:
        raise _exceeded("expression_nodes", MAX_EXPRESSION_NODES, figures.nodes, path)
    if figures.case_depth > MAX_CASE_DEPTH:
        raise _exceeded("case_depth", MAX_CASE_DEPTH, figures.case_depth, path)
    if figures.case_nodes > MAX_CASE_NODES:
        raise _exceeded("case_nodes", MAX_CASE_NODES, figures.case_nodes, path)
    if figures.case_branches > MAX_CASE_BRANCHES:
        raise _exceeded("case_branches", MAX_CASE_BRANCHES, figures.case_branches, path)
    return figures.nodes


# --------------------------------------------------------------------------------------------
# Where the expressions of a (not yet validated) definition are.


def _items(doc: Mapping[str, Any], key: str) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """The object members of ``doc[key]`` when it is an array; shape errors come later."""
    members = doc.get(key)
    if isinstance(members, list | tuple):
        for index, member in enumerate(members):
            if isinstance(member, Mapping):
                yield index, member


def expressions_of(doc: Mapping[str, Any]) -> Iterator[tuple[object, str, str]]:
    """Every expression of a raw definition as ``(expr, kind, JSON pointer)``, in document order.

    Tolerant of a malformed document: whatever is not where an expression would be is skipped
    (the shape check refuses it afterwards).
    """
    if doc.get("business_key") is not None:
        yield doc["business_key"], "expression", "/business_key"
    for index, rule in _items(doc, "rules"):
        if "when" in rule:
            yield rule["when"], "rule", f"/rules/{index}/when"
    for index, cap in _items(doc, "caps"):
        if "value" in cap:
            yield cap["value"], "expression", f"/caps/{index}/value"
    for index, step in _items(doc, "steps"):
        if step.get("payload") is not None:
            yield step["payload"], "expression", f"/steps/{index}/payload"
        if "expr" in step:
            yield step["expr"], "condition", f"/steps/{index}/expr"
        compensation = step.get("compensation")
        if isinstance(compensation, Mapping) and compensation.get("payload") is not None:
            path = f"/steps/{index}/compensation/payload"
            yield compensation["payload"], "expression", path
    for index, check in _items(doc, "checks"):
        if "expr" in check:
            yield check["expr"], "condition", f"/checks/{index}/expr"
    for index, event in _items(doc, "outbox"):
        if event.get("payload") is not None:
            yield event["payload"], "expression", f"/outbox/{index}/payload"
    if doc.get("result") is not None:
        yield doc["result"], "expression", "/result"


# --------------------------------------------------------------------------------------------
# Entry points.


def check_definition(raw: object) -> None:
    """Apply every authoring budget to a raw definition document, before anything else reads it.

    Order: bytes (one C-speed encode; a document too deep to encode is necessarily over the depth
    limit and falls through to the walk), then depth and nodes of the whole document (exact
    figures: the walk is bounded because the document is at most 1 MiB), then each expression,
    then all expressions together.
    """
    size = _canonical_size_or_locate(raw)
    if size is not None and size > MAX_DEFINITION_BYTES:
        raise _exceeded("definition_bytes", MAX_DEFINITION_BYTES, size, None)
    figures = json_figures(raw)
    if figures.depth > MAX_JSON_DEPTH:
        raise _exceeded("json_depth", MAX_JSON_DEPTH, figures.depth, None)
    if figures.nodes > MAX_JSON_NODES:
        raise _exceeded("json_nodes", MAX_JSON_NODES, figures.nodes, None)
    if not isinstance(raw, Mapping):
        return
    total = 0
    for expr, kind, path in expressions_of(raw):
        total += check_expression(expr, kind, path)
    if total > MAX_DEFINITION_EXPRESSION_NODES:
        raise _exceeded("definition_expression_nodes", MAX_DEFINITION_EXPRESSION_NODES, total, None)


def _canonical_size_or_locate(raw: object) -> int | None:
    try:
        return _canonical_size(raw)
    except NotCanonicalizable:
        json_figures(raw)  # names the offending value and its path
        raise _not_json("it has no canonical JSON form", "") from None


def check_inputs_size(inputs: object) -> int:
    """Refuse request inputs over :data:`MAX_INPUT_BYTES`; return their canonical size.

    Checked before the inputs are validated against the command's schema, so a huge body costs
    one encode. Inputs with no JSON form are :class:`InputInvalid`, as the schema check would say.
    """
    try:
        size = _canonical_size(inputs)
    except NotCanonicalizable:
        size = -1
    if size is None or size < 0:
        problem = "nested too deeply" if size is None else "not plain JSON"
        raise InputInvalid(details={"errors": [{"field": "", "problem": problem}]})
    if size > MAX_INPUT_BYTES:
        raise InputLimitExceeded(
            details={"resource": "input_bytes", "limit": MAX_INPUT_BYTES, "actual": size}
        )
    return size
