"""Authoring budgets: every limit accepted at exactly the limit and refused one past it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.canonical import canonical_json
from orchestrator import budgets
from orchestrator.budgets import (
    check_definition,
    check_expression,
    check_inputs_size,
    expression_figures,
)
from orchestrator.errors import (
    DefinitionInvalid,
    DefinitionLimitExceeded,
    InputInvalid,
    InputLimitExceeded,
)
from orchestrator.expressions import MAX_CASE_BRANCHES, measure


def refused(doc: object) -> dict[str, Any]:
    """The details of the DefinitionLimitExceeded ``doc`` must raise."""
    with pytest.raises(DefinitionLimitExceeded) as info:
        check_definition(doc)
    return info.value.details


def nots(depth: int) -> object:
    """A boolean tree ``depth`` nodes deep: ``$not`` … ``$not`` ``true``."""
    expr: object = True
    for _ in range(depth - 1):
        expr = {"$not": expr}
    return expr


def ands(nodes: int) -> object:
    """A boolean tree of ``nodes`` nodes and depth 2: ``$and`` over ``nodes - 1`` trues."""
    return {"$and": [True] * (nodes - 1)}


def nested_case(levels: int) -> object:
    """``levels`` ``$case`` nodes on one chain (3 nodes each, plus the innermost ``0``)."""
    expr: object = 0
    for _ in range(levels):
        expr = {"$case": {"branches": [{"when": True, "then": expr}], "else": 0}}
    return expr


def case_of_size(nodes: int) -> object:
    """One ``$case`` whose subtree has exactly ``nodes`` nodes (``then`` is a literal list)."""
    return {"$case": {"branches": [{"when": True, "then": [0] * (nodes - 4)}], "else": 0}}


def case_with_branches(count: int) -> object:
    return {"$case": {"branches": [{"when": False, "then": i} for i in range(count)], "else": 0}}


def payload_of_size(nodes: int) -> object:
    """A payload template of exactly ``nodes`` nodes: an object holding one literal list."""
    return {"a": [0] * (nodes - 2)}


def in_assert(expr: object) -> dict[str, Any]:
    return {"name": "c", "steps": [{"kind": "assert", "name": "a", "expr": expr}]}


def in_check(expr: object) -> dict[str, Any]:
    return {"name": "c", "steps": [], "checks": [{"name": "k", "expr": expr}]}


def in_rule(expr: object) -> dict[str, Any]:
    return {"name": "c", "steps": [], "rules": [{"name": "r", "when": expr}]}


def in_payload(expr: object) -> dict[str, Any]:
    return {"name": "c", "steps": [{"kind": "effect", "name": "e", "payload": expr}]}


# -- the whole document ----------------------------------------------------------------------


def test_definition_bytes_is_one_mebibyte_of_canonical_json() -> None:
    assert budgets.MAX_DEFINITION_BYTES == 1_048_576

    def doc(size: int) -> dict[str, Any]:
        overhead = len(canonical_json({"name": "c", "description": ""}))
        return {"name": "c", "description": "x" * (size - overhead)}

    check_definition(doc(budgets.MAX_DEFINITION_BYTES))
    assert refused(doc(budgets.MAX_DEFINITION_BYTES + 1)) == {
        "resource": "definition_bytes",
        "limit": 1_048_576,
        "actual": 1_048_577,
    }


def test_definition_bytes_count_non_ascii_as_its_escapes() -> None:
    # "é" is 6 bytes of canonical JSON (\u00e9): clients measure the same text we hash.
    overhead = len(canonical_json({"description": ""}))
    count = (budgets.MAX_DEFINITION_BYTES - overhead) // 6 + 1
    details = refused({"description": "é" * count})
    assert details["resource"] == "definition_bytes"
    assert details["actual"] == overhead + 6 * count


def test_json_depth() -> None:
    def doc(depth: int) -> dict[str, Any]:
        # The root is depth 1; "scope" is not an expression position, so only JSON counts.
        chain: object = []
        for _ in range(depth - 2):
            chain = [chain]
        return {"scope": chain}

    assert budgets.json_figures(doc(64)).depth == 64
    check_definition(doc(64))
    assert refused(doc(65)) == {"resource": "json_depth", "limit": 64, "actual": 65}


def test_json_depth_of_a_document_too_deep_to_encode_is_still_a_budget() -> None:
    chain: object = 0
    for _ in range(5000):
        chain = [chain]
    details = refused({"scope": chain})
    assert details == {"resource": "json_depth", "limit": 64, "actual": 5002}


def test_json_nodes() -> None:
    def doc(nodes: int) -> dict[str, Any]:
        return {"scope": [0] * (nodes - 2)}  # root + list + members

    assert budgets.json_figures(doc(16_384)).nodes == 16_384
    check_definition(doc(16_384))
    assert refused(doc(16_385)) == {"resource": "json_nodes", "limit": 16_384, "actual": 16_385}


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"scope": {1: "a"}}, "/scope"),
        ({"scope": [float("nan")]}, "/scope/0"),
        ({"scope": {"a": {1, 2}}}, "/scope/a"),
    ],
)
def test_a_document_that_is_not_plain_json_is_invalid_with_its_path(
    value: object, path: str
) -> None:
    with pytest.raises(DefinitionInvalid) as info:
        check_definition(value)
    assert info.value.path == path
    assert "not plain JSON" in info.value.details["reason"]


# -- one expression --------------------------------------------------------------------------

Make = Callable[[object], dict[str, Any]]


@pytest.mark.parametrize("place", [in_assert, in_check], ids=["assert", "check"])
def test_condition_depth(place: Make) -> None:
    check_definition(place(nots(12)))
    details = refused(place(nots(13)))
    assert details == {"resource": "condition_depth", "limit": 12, "actual": 13}


@pytest.mark.parametrize("place", [in_assert, in_check], ids=["assert", "check"])
def test_condition_nodes(place: Make) -> None:
    check_definition(place(ands(128)))
    details = refused(place(ands(129)))
    assert details == {"resource": "condition_nodes", "limit": 128, "actual": 129}


def test_rule_depth() -> None:
    check_definition(in_rule(nots(8)))
    assert refused(in_rule(nots(9))) == {"resource": "rule_depth", "limit": 8, "actual": 9}


def test_rule_nodes() -> None:
    check_definition(in_rule(ands(128)))
    assert refused(in_rule(ands(129))) == {"resource": "rule_nodes", "limit": 128, "actual": 129}


def test_a_condition_deeper_than_a_rule_may_be_is_fine_elsewhere() -> None:
    # The rule limits are the rule's own: the same tree passes as an assert and as a payload.
    check_definition(in_assert(nots(12)))
    check_definition(in_payload({"flag": nots(12)}))
    assert refused(in_rule(nots(12)))["resource"] == "rule_depth"


def test_expression_nodes() -> None:
    check_definition(in_payload(payload_of_size(256)))
    details = refused(in_payload(payload_of_size(257)))
    assert details == {"resource": "expression_nodes", "limit": 256, "actual": 257}


def test_case_depth() -> None:
    assert expression_figures(nested_case(8)).case_depth == 8
    check_definition(in_payload({"v": nested_case(8)}))
    details = refused(in_payload({"v": nested_case(9)}))
    assert details == {"resource": "case_depth", "limit": 8, "actual": 9}


def test_case_nodes() -> None:
    assert expression_figures(case_of_size(64)).nodes == 64
    check_definition(in_payload({"v": case_of_size(64)}))
    details = refused(in_payload({"v": case_of_size(65)}))
    assert details == {"resource": "case_nodes", "limit": 64, "actual": 65}


def test_case_nodes_are_counted_per_case_subtree() -> None:
    # Two sibling $case of 40 nodes each: 80 nodes under a $case in total, 40 per subtree.
    two = {"a": case_of_size(40), "b": case_of_size(40)}
    assert measure(two).case_nodes == 80  # the expressions module's total ...
    assert expression_figures(two).case_nodes == 40  # ... is not the budget's figure
    check_definition(in_payload(two))


def test_case_branches() -> None:
    check_definition(in_payload({"v": case_with_branches(20)}))
    details = refused(in_payload({"v": case_with_branches(21)}))
    assert details == {"resource": "case_branches", "limit": 20, "actual": 21}


def test_case_branches_is_a_budget_even_past_the_languages_own_ceiling() -> None:
    # expressions.measure refuses 21 branches itself (limit_exceeded); the budget must win.
    assert MAX_CASE_BRANCHES == 20
    details = refused(in_rule({"$eq": [case_with_branches(21), 1]}))
    assert details["resource"] == "case_branches"


def test_definition_expression_nodes() -> None:
    steps = [{"payload": payload_of_size(256)} for _ in range(32)]  # 32 x 256 = 8 192
    check_definition({"name": "c", "steps": steps})
    details = refused({"name": "c", "steps": steps, "business_key": 0})  # + 1
    assert details == {"resource": "definition_expression_nodes", "limit": 8192, "actual": 8193}


def test_every_expression_position_counts_towards_the_definition_total() -> None:
    expr = payload_of_size(100)
    doc = {
        "business_key": expr,
        "rules": [{"when": ands(100)}],
        "caps": [{"value": expr}],
        "steps": [
            {"payload": expr, "compensation": {"payload": expr}},
            {"expr": ands(100)},
        ],
        "checks": [{"expr": ands(100)}],
        "outbox": [{"payload": expr}],
        "result": expr,
    }
    found = list(budgets.expressions_of(doc))
    assert len(found) == 9
    assert sum(check_expression(e, kind, path) for e, kind, path in found) == 900


def test_null_where_an_expression_is_optional_is_not_counted() -> None:
    doc = {"business_key": None, "result": None, "steps": [{"payload": None}]}
    assert list(budgets.expressions_of(doc)) == []


def test_limit_errors_carry_the_path_of_the_expression() -> None:
    with pytest.raises(DefinitionLimitExceeded) as info:
        check_definition(in_check(nots(13)))
    assert info.value.path == "/checks/0/expr"
    envelope = info.value.envelope(phase="author")
    assert envelope["error"] == "definition_limit_exceeded"
    assert envelope["details"] == {"resource": "condition_depth", "limit": 12, "actual": 13}
    assert envelope["path"] == "/checks/0/expr"


def test_check_expression_refuses_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind"):
        check_expression(True, "predicate")


# -- counting agrees with expressions.measure ------------------------------------------------

_leaf = st.one_of(
    st.integers(-5, 5),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.just({"$ref": "inputs.a"}),
)
_json = st.recursive(
    st.one_of(st.integers(), st.booleans(), st.none(), st.text(max_size=3)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from("abc"), inner, max_size=3)
    ),
    max_leaves=8,
)


def _extend(inner: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    branch = st.fixed_dictionaries({"when": inner, "then": inner})
    return st.one_of(
        st.builds(lambda a: {"$not": a}, inner),
        st.builds(lambda a: {"$len": a}, st.lists(inner, max_size=3)),
        st.builds(lambda xs: {"$and": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda a, b: {"$add": [a, b]}, inner, inner),
        st.builds(lambda a, b: {"$eq": [a, b]}, inner, inner),
        st.builds(lambda x: {"$literal": x}, _json),
        st.builds(
            lambda bs, e: {"$case": {"branches": bs, "else": e}},
            st.lists(branch, min_size=1, max_size=3),
            inner,
        ),
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["x", "y", "z"]), inner, max_size=3),
    )


_expressions = st.recursive(_leaf, _extend, max_leaves=25)


@settings(max_examples=300, deadline=None)
@given(_expressions)
def test_expression_figures_match_measure(expr: object) -> None:
    ours, theirs = expression_figures(expr), measure(expr)
    assert (ours.nodes, ours.depth) == (theirs.nodes, theirs.depth)
    assert ours.case_depth == theirs.case_depth
    assert ours.case_branches == theirs.case_branches
    assert ours.case_nodes <= theirs.case_nodes  # per subtree <= the total


def test_malformed_expressions_are_measured_not_refused() -> None:
    # Validation comes after the budgets; a malformed operator still costs its nodes.
    assert expression_figures({"$and": 5}).nodes == 2
    assert expression_figures({"$nope": [1, 2]}).nodes == 3
    assert expression_figures({"$case": [1]}).nodes == 3  # the odd argument is a child


# -- inputs ----------------------------------------------------------------------------------


def test_input_bytes() -> None:
    assert budgets.MAX_INPUT_BYTES == 1_048_576
    overhead = len(canonical_json({"s": ""}))
    at_limit = {"s": "x" * (budgets.MAX_INPUT_BYTES - overhead)}
    assert check_inputs_size(at_limit) == budgets.MAX_INPUT_BYTES
    with pytest.raises(InputLimitExceeded) as info:
        check_inputs_size({"s": "x" * (budgets.MAX_INPUT_BYTES - overhead + 1)})
    assert info.value.details == {
        "resource": "input_bytes",
        "limit": 1_048_576,
        "actual": 1_048_577,
    }
    assert info.value.envelope()["error"] == "input_limit_exceeded"


def test_inputs_with_no_json_form_are_input_invalid() -> None:
    with pytest.raises(InputInvalid):
        check_inputs_size({"s": {1, 2}})
    deep: object = 0
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(InputInvalid) as info:
        check_inputs_size({"s": deep})
    assert info.value.details["errors"][0]["problem"] == "nested too deeply"
