"""The JSON expression language: operators, errors and their paths, refs, measure, templates."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.canonical import canonical_json, jsonb_stable
from orchestrator import expressions as ex
from orchestrator.expressions import (
    MAX_CASE_BRANCHES,
    MAX_DEPTH,
    ExpressionError,
    ExpressionStats,
    evaluate,
    evaluate_condition,
    lit,
    measure,
    ref,
    refs,
    render,
    validate,
)

SCOPE: dict[str, object] = {
    "inputs": {"amount": 120, "currency": "EUR", "note": None, "flag": True, "ratio": 0.5},
    "steps": {"reserve": {"result": {"items": [{"sku": "a-1"}, {"sku": "b-2"}], "ok": True}}},
}


def err(expr: object, scope: Mapping[str, object] | None = None) -> ExpressionError:
    """Evaluate ``expr`` and return the ExpressionError it must raise."""
    with pytest.raises(ExpressionError) as info:
        evaluate(expr, SCOPE if scope is None else scope)
    return info.value


def verr(expr: object) -> ExpressionError:
    """Validate ``expr`` and return the ExpressionError it must raise."""
    with pytest.raises(ExpressionError) as info:
        validate(expr)
    return info.value


def nested(levels: int, leaf: object = True, op: str = "$not") -> object:
    """``levels`` unary operator nodes around ``leaf``, built without recursion."""
    node = leaf
    for _ in range(levels):
        node = {op: node}
    return node


# --------------------------------------------------------------------------------------------
# Templates, $ref, $literal, $coalesce


def test_template_renders_nested_structures() -> None:
    template = {
        "amount": {"$ref": "inputs.amount"},
        "currency": "EUR",
        "lines": [{"sku": {"$ref": "steps.reserve.result.items.1.sku"}, "qty": 2}, "x", None],
        "meta": {"total": {"$mul": [{"$ref": "inputs.amount"}, 2]}, "deep": {"a": [[1.5]]}},
    }
    assert render(template, SCOPE) == {
        "amount": 120,
        "currency": "EUR",
        "lines": [{"sku": "b-2", "qty": 2}, "x", None],
        "meta": {"total": 240, "deep": {"a": [[1.5]]}},
    }


def test_render_is_evaluate() -> None:
    expr = {"x": {"$ref": "inputs.currency"}}
    assert render(expr, SCOPE) == evaluate(expr, SCOPE) == {"x": "EUR"}


def test_ref_returns_whole_subtrees_as_copies() -> None:
    scope: dict[str, object] = {"a": {"b": [1, {"c": (2, 3)}]}}
    result = evaluate({"$ref": "a"}, scope)
    assert result == {"b": [1, {"c": [2, 3]}]}  # tuples become lists
    assert isinstance(result, dict)
    result["b"].append("mutated")
    assert scope == {"a": {"b": [1, {"c": (2, 3)}]}}


def test_ref_null_value_is_not_missing() -> None:
    assert evaluate({"$ref": "inputs.note"}, SCOPE) is None


@pytest.mark.parametrize(
    "path",
    [
        "nope",
        "inputs.nope",
        "steps.reserve.result.items.2",
        "steps.reserve.result.items.-1",
        "steps.reserve.result.items.01",
        "steps.reserve.result.items.sku",
        "inputs.amount.x",
        "inputs.currency.0",
        "steps.reserve.result.items." + "9" * 40,
    ],
)
def test_ref_missing(path: str) -> None:
    e = err({"total": {"$add": [1, {"$ref": path}]}})
    assert e.code == "ref_missing"
    assert e.path == "/total/$add/1"
    assert e.ref == path
    assert path in e.message


def test_ref_missing_message_names_missing_prefix_not_values() -> None:
    e = err({"$ref": "inputs.nope.deeper"})
    assert e.message == "reference 'inputs.nope.deeper' is not defined ('inputs.nope' is missing)"
    assert "120" not in str(e) and "EUR" not in str(e)


def test_ref_digit_keys_in_objects() -> None:
    assert evaluate({"$ref": "m.0"}, {"m": {"0": "zero"}}) == "zero"


@pytest.mark.parametrize("bad", ["", ".", "a.", ".a", "a..b", 3, None, ["a"], {"a": 1}])
def test_ref_bad_path(bad: object) -> None:
    e = verr({"x": {"$ref": bad}})
    assert e.code == "bad_ref"
    assert e.path == "/x/$ref"


def test_ref_builder_checks_path() -> None:
    assert ref("a.b") == {"$ref": "a.b"}
    with pytest.raises(ExpressionError) as info:
        ref("a..b")
    assert info.value.code == "bad_ref"


def test_ref_value_must_be_json() -> None:
    e = err({"x": {"$ref": "v"}}, {"v": {"when": object()}})
    assert e.code == "not_json"
    assert e.path == "/x"
    assert e.ref == "v"
    for value in (math.nan, math.inf, {1: "a"}, {1, 2}, b"x"):
        assert err({"$ref": "v"}, {"v": value}).code == "not_json"


def test_ref_cyclic_scope_value_is_refused() -> None:
    cycle: list[object] = []
    cycle.append(cycle)
    assert err({"$ref": "v"}, {"v": cycle}).code == "limit_exceeded"


def test_literal_escape() -> None:
    escaped = {"$ref": "inputs.amount", "x": [{"$add": [1, 2]}]}
    assert evaluate({"payload": lit(escaped)}, SCOPE) == {"payload": escaped}
    assert evaluate({"$literal": {"$ref": "x"}}, {}) == {"$ref": "x"}
    assert refs({"$literal": {"$ref": "x"}}) == set()


def test_literal_result_is_a_copy() -> None:
    inner = {"a": [1]}
    result = evaluate(lit(inner), {})
    assert result == inner and result is not inner


def test_literal_content_must_still_be_json() -> None:
    assert verr(lit({"a": math.nan})).code == "not_json"


def test_coalesce() -> None:
    assert evaluate({"$coalesce": [{"$ref": "nope"}, {"$ref": "inputs.note"}, 7]}, SCOPE) == 7
    assert evaluate({"$coalesce": [{"$ref": "inputs.amount"}, 7]}, SCOPE) == 120
    assert evaluate({"$coalesce": [{"$add": [{"$ref": "nope"}, 1]}, "d"]}, SCOPE) == "d"
    assert evaluate({"$coalesce": [{"$ref": "nope"}]}, SCOPE) is None
    assert evaluate({"$coalesce": [False, 1]}, SCOPE) is False  # only null is skipped
    # other errors propagate
    e = err({"$coalesce": [{"$add": [1, "x"]}, 0]})
    assert (e.code, e.path) == ("type_mismatch", "/$coalesce/0/$add/1")


# --------------------------------------------------------------------------------------------
# Comparison


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        (1, 1, True),
        (1, 1.0, True),
        (True, 1, False),
        (False, 0, False),
        (True, True, True),
        (None, None, True),
        (None, False, False),
        ("a", "a", True),
        ("1", 1, False),
        ([1, [True]], [1, [True]], True),
        ([1, [True]], [1, [1]], False),
        ([1, 2], [2, 1], False),
        ([1], [1, 1], False),
        ({"a": 1, "b": [2]}, {"b": [2], "a": 1}, True),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        ({"a": True}, {"a": 1}, False),
        ({}, [], False),
    ],
)
def test_eq_ne(a: object, b: object, equal: bool) -> None:
    assert evaluate({"$eq": [lit(a), lit(b)]}, {}) is equal
    assert evaluate({"$ne": [lit(a), lit(b)]}, {}) is (not equal)
    assert evaluate(ex.eq(ref("a"), ref("b")), {"a": a, "b": b}) is equal


@pytest.mark.parametrize(
    ("op", "a", "b", "expected"),
    [
        ("$gt", 2, 1, True),
        ("$gt", 1, 1, False),
        ("$gte", 1, 1, True),
        ("$gte", 0.5, 1, False),
        ("$lt", 1, 1.5, True),
        ("$lt", 2, 1, False),
        ("$lte", 1, 1, True),
        ("$lte", 2, 1, False),
        ("$lt", "abc", "abd", True),
        ("$gt", "b", "abc", True),
        ("$gte", "a", "a", True),
    ],
)
def test_ordering(op: str, a: object, b: object, expected: bool) -> None:
    assert evaluate({op: [a, b]}, {}) is expected


@pytest.mark.parametrize(
    ("a", "b", "bad_index"),
    [
        (True, 1, 0),
        (1, True, 1),
        (1, "1", 1),
        ("1", 1, 1),
        (None, 1, 0),
        (1, None, 1),
        ([1], [1], 0),
        ({"$literal": {}}, 1, 0),
    ],
)
@pytest.mark.parametrize("op", ["$gt", "$gte", "$lt", "$lte"])
def test_ordering_type_mismatch(op: str, a: object, b: object, bad_index: int) -> None:
    e = err({"check": {op: [a, b]}})
    assert e.code == "type_mismatch"
    assert e.path == f"/check/{op}/{bad_index}"


@pytest.mark.parametrize("op", ["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$div", "$mod", "$in"])
@pytest.mark.parametrize("operands", [[], [1], [1, 2, 3], "x", {"$ref": "pair"}])
def test_binary_arity(op: str, operands: object) -> None:
    e = verr({"a": [{op: operands}]})
    assert e.code == "bad_arity"
    assert e.path == f"/a/0/{op}"


# --------------------------------------------------------------------------------------------
# Boolean


def test_and_or_not() -> None:
    assert evaluate({"$and": [True, True]}, {}) is True
    assert evaluate({"$and": [True, False]}, {}) is False
    assert evaluate({"$and": [True]}, {}) is True
    assert evaluate({"$or": [False, True]}, {}) is True
    assert evaluate({"$or": [False]}, {}) is False
    assert evaluate({"$not": False}, {}) is True
    assert evaluate({"$not": {"$ref": "inputs.flag"}}, SCOPE) is False


def test_and_or_short_circuit() -> None:
    # the second operand would fail (missing ref, non-boolean) if it were evaluated
    assert evaluate({"$and": [False, {"$ref": "nope"}]}, {}) is False
    assert evaluate({"$or": [True, {"$ref": "nope"}]}, {}) is True
    assert evaluate({"$and": [False, 1]}, {}) is False


@pytest.mark.parametrize(
    ("expr", "path"),
    [
        ({"$and": [True, 1]}, "/$and/1"),
        ({"$and": [None]}, "/$and/0"),
        ({"$or": [False, "true"]}, "/$or/1"),
        ({"$not": 0}, "/$not"),
        ({"$not": [True]}, "/$not"),
        ({"$and": [{"$ref": "inputs.amount"}]}, "/$and/0"),
    ],
)
def test_not_boolean(expr: object, path: str) -> None:
    e = err(expr)
    assert (e.code, e.path) == ("not_boolean", path)
    assert "120" not in str(e)


@pytest.mark.parametrize("op", ["$and", "$or", "$coalesce", "$concat"])
def test_variadic_needs_one(op: str) -> None:
    assert verr({op: []}).code == "bad_arity"
    assert verr({op: True}).code == "bad_arity"


def test_evaluate_condition() -> None:
    assert evaluate_condition({"$gt": [{"$ref": "inputs.amount"}, 100]}, SCOPE) is True
    with pytest.raises(ExpressionError) as info:
        evaluate_condition({"$ref": "inputs.amount"}, SCOPE)
    assert (info.value.code, info.value.path) == ("not_boolean", "")


# --------------------------------------------------------------------------------------------
# Arithmetic


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ({"$add": [1, 2]}, 3),
        ({"$add": [1, 2, 3.5]}, 6.5),
        ({"$sub": [10, 3, 2]}, 5),
        ({"$sub": [1, 1.5]}, -0.5),
        ({"$mul": [2, 3, 4]}, 24),
        ({"$mul": [{"$ref": "inputs.ratio"}, 4]}, 2.0),
        ({"$div": [6, 3]}, 2),
        ({"$div": [7, 2]}, 3.5),
        ({"$div": [-6, 4]}, -1.5),
        ({"$div": [6.0, 3]}, 2.0),
        ({"$mod": [7, 3]}, 1),
        ({"$mod": [-7, 3]}, 2),
        ({"$mod": [7, -3]}, -2),
        ({"$neg": 5}, -5),
        ({"$neg": -1.5}, 1.5),
        ({"$neg": {"$ref": "inputs.amount"}}, -120),
    ],
)
def test_arithmetic(expr: object, expected: object) -> None:
    result = evaluate(expr, SCOPE)
    assert result == expected
    assert type(result) is type(expected)


def test_exact_int_division_stays_int() -> None:
    result = evaluate({"$div": [10**30, 10**10]}, {})
    assert result == 10**20 and type(result) is int


@pytest.mark.parametrize("op", ["$add", "$sub", "$mul"])
@pytest.mark.parametrize(("operands", "bad"), [([1, True], 1), ([False, 1], 0), ([1, "2"], 1)])
def test_arithmetic_refuses_non_numbers(op: str, operands: list[object], bad: int) -> None:
    e = err({"amount": {op: operands}})
    assert (e.code, e.path) == ("type_mismatch", f"/amount/{op}/{bad}")


@pytest.mark.parametrize("op", ["$add", "$sub", "$mul"])
def test_arithmetic_needs_two(op: str) -> None:
    e = verr({op: [1]})
    assert (e.code, e.path) == ("bad_arity", f"/{op}")


def test_division_by_zero() -> None:
    for expr in ({"$div": [1, 0]}, {"$div": [1.5, 0.0]}, {"$div": [1, -0.0]}, {"$mod": [1, 0]}):
        e = err({"x": expr})
        name = next(iter(expr))
        assert (e.code, e.path) == ("division_by_zero", f"/x/{name}/1")


def test_div_and_mod_types() -> None:
    assert err({"$div": [True, 1]}).path == "/$div/0"
    assert err({"$div": [1, "2"]}).path == "/$div/1"
    e = err({"$mod": [7.5, 2]})
    assert (e.code, e.path) == ("type_mismatch", "/$mod/0")
    assert err({"$mod": [7, True]}).path == "/$mod/1"
    assert err({"$neg": True}).code == "type_mismatch"
    assert err({"$neg": "1"}).path == "/$neg"


def test_number_overflow() -> None:
    assert err({"$mul": [1e308, 10]}).code == "number_overflow"
    assert err({"$add": [1e308, 1e308]}).code == "number_overflow"
    assert err({"$div": [1e308, 1e-308]}).code == "number_overflow"
    big = 2**4000
    assert err({"$mul": [{"$ref": "b"}, {"$ref": "b"}]}, {"b": big}).code == "number_overflow"
    huge = 10**1000
    assert err({"$add": [{"$ref": "h"}, 0.5]}, {"h": huge}).code == "number_overflow"
    assert err({"$div": [{"$ref": "h"}, 3]}, {"h": huge}).code == "number_overflow"
    e = err({"x": {"$mul": [1e200, 1e200]}})
    assert e.path == "/x/$mul"


@pytest.mark.parametrize("prevalidated", [False, True])
def test_numbers_come_out_as_jsonb_gives_them_back(prevalidated: bool) -> None:
    """A float of 1e16 or more, made by arithmetic or copied by a reference, is the integer it
    is written as, and -0.0 is 0.0: PostgreSQL's JSONB gives them back so, and a payload is
    fingerprinted before it is stored and again after it is read."""
    scope = {"w": 1e16, "z": -0.0, "r": {"deep": [2.5e20, 1.5]}}
    template = {
        "product": {"$mul": [1e8, 1e8]},
        "sum": {"$add": [9e15, 9e15]},
        "quotient": {"$div": [1e17, 2.0]},
        "negated": {"$neg": 0.0},
        "copied": {"$ref": "w"},
        "zero": {"$ref": "z"},
        "whole": {"$ref": "r"},
        "small": {"$mul": [1e7, 1e8]},
    }
    out = cast(dict[str, Any], evaluate(template, scope, prevalidated=prevalidated))
    assert out == {
        "product": 10**16,
        "sum": 18 * 10**15,
        "quotient": 5 * 10**16,
        "negated": 0.0,
        "copied": 10**16,
        "zero": 0.0,
        "whole": {"deep": [25 * 10**19, 1.5]},
        "small": 1e15,
    }
    assert canonical_json(out) == (
        '{"copied":10000000000000000,"negated":0.0,"product":10000000000000000,'
        '"quotient":50000000000000000,"small":1000000000000000.0,"sum":18000000000000000,'
        '"whole":{"deep":[250000000000000000000,1.5]},"zero":0.0}'
    )


# --------------------------------------------------------------------------------------------
# $len, $concat, $in


def test_len() -> None:
    assert evaluate({"$len": "héllo"}, {}) == 5
    assert evaluate({"$len": [1, 2, 3]}, {}) == 3  # unary operand is given directly
    assert evaluate({"$len": {"a": 1, "b": 2}}, {}) == 2
    assert evaluate({"$len": {"$ref": "steps.reserve.result.items"}}, SCOPE) == 2
    for bad in (1, True, None):
        e = err({"n": {"$len": bad}})
        assert (e.code, e.path) == ("type_mismatch", "/n/$len")


def test_concat() -> None:
    assert evaluate({"$concat": ["a", {"$ref": "inputs.currency"}, ""]}, SCOPE) == "aEUR"
    assert evaluate({"$concat": ["only"]}, {}) == "only"
    e = err({"$concat": ["a", 1]})
    assert (e.code, e.path) == ("type_mismatch", "/$concat/1")


def test_concat_length_limit() -> None:
    half = "x" * (ex.MAX_STRING_LENGTH // 2 + 1)
    e = err({"$concat": [{"$ref": "s"}, {"$ref": "s"}]}, {"s": half})
    assert (e.code, e.path) == ("limit_exceeded", "/$concat")


def test_in() -> None:
    assert evaluate({"$in": ["b-2", ["a-1", "b-2"]]}, {}) is True
    assert evaluate({"$in": [{"$ref": "inputs.currency"}, ["USD"]]}, SCOPE) is False
    assert evaluate({"$in": [1, [True]]}, {}) is False
    assert evaluate({"$in": [True, [1, True]]}, {}) is True
    assert evaluate({"$in": [lit({"sku": "a-1"}), {"$ref": "steps.reserve.result.items"}]}, SCOPE)
    e = err({"$in": [1, "123"]})
    assert (e.code, e.path) == ("type_mismatch", "/$in/1")


# --------------------------------------------------------------------------------------------
# $case


def tier_expr() -> object:
    amount = ref("inputs.amount")
    return ex.case(
        (ex.gte(amount, 1000), "gold"),
        (ex.gte(amount, 100), "silver"),
        else_="bronze",
    )


@pytest.mark.parametrize(("amount", "tier"), [(5000, "gold"), (120, "silver"), (3, "bronze")])
def test_case(amount: int, tier: str) -> None:
    assert evaluate(tier_expr(), {"inputs": {"amount": amount}}) == tier


def test_case_short_circuits_branches() -> None:
    expr = ex.case((True, "first"), ({"$ref": "nope"}, {"$ref": "nope"}), else_={"$ref": "nope"})
    assert evaluate(expr, {}) == "first"


def test_case_when_must_be_boolean() -> None:
    e = err({"t": ex.case((False, 1), (1, 2), else_=3)})
    assert (e.code, e.path) == ("not_boolean", "/t/$case/branches/1/when")


def test_case_errors_in_then_and_else_have_paths() -> None:
    assert err(ex.case((True, {"$ref": "x"}), else_=0), {}).path == "/$case/branches/0/then"
    assert err(ex.case((False, 0), else_={"$ref": "x"}), {}).path == "/$case/else"


@pytest.mark.parametrize(
    ("arg", "path"),
    [
        ([], "/$case"),
        ({"branches": [{"when": True, "then": 1}]}, "/$case"),  # else is required
        ({"branches": [], "else": 1}, "/$case/branches"),
        ({"branches": {"when": True}, "else": 1}, "/$case/branches"),
        ({"branches": [{"when": True}], "else": 1}, "/$case/branches/0"),
        ({"branches": [{"when": True, "then": 1, "x": 2}], "else": 1}, "/$case/branches/0"),
        ({"branches": [[True, 1]], "else": 1}, "/$case/branches/0"),
        ({"branches": [{"when": True, "then": 1}], "else": 1, "extra": 0}, "/$case"),
    ],
)
def test_case_shape(arg: object, path: str) -> None:
    e = verr({"$case": arg})
    assert (e.code, e.path) == ("bad_shape", path)


def test_case_branch_limit() -> None:
    ok = ex.case(*[(False, i) for i in range(MAX_CASE_BRANCHES)], else_=-1)
    assert evaluate(ok, {}) == -1
    too_many = ex.case(*[(False, i) for i in range(MAX_CASE_BRANCHES + 1)], else_=-1)
    e = verr(too_many)
    assert (e.code, e.path) == ("limit_exceeded", "/$case/branches")


# --------------------------------------------------------------------------------------------
# Structural errors


def test_unknown_operator() -> None:
    e = verr({"a": {"b": [0, {"$nope": 1}]}})
    assert (e.code, e.path) == ("unknown_operator", "/a/b/1")
    assert "$nope" in e.message
    long_name = "$" + "x" * 10_000
    assert len(verr({long_name: 1}).message) < 200


def test_ambiguous_operator_object() -> None:
    e = verr({"x": {"$ref": "inputs.amount", "default": 0}})
    assert (e.code, e.path) == ("ambiguous_operator", "/x")
    # non-operator `$` keys in multi-key objects are ordinary literal keys
    template = {"$schema": "v1", "amount": {"$ref": "inputs.amount"}}
    assert render(template, SCOPE) == {"$schema": "v1", "amount": 120}
    # and anything may be emitted through $literal
    assert evaluate(lit({"$ref": "a", "default": 0}), {}) == {"$ref": "a", "default": 0}


@pytest.mark.parametrize(
    ("expr", "path"),
    [
        ({"a": math.nan}, "/a"),
        ({"a": [math.inf]}, "/a/0"),
        ({"a": (1, 2)}, "/a"),
        ({"a": {1: 2}}, "/a"),
        ({"a": {1, 2}}, "/a"),
        ({"a": object()}, "/a"),
        ({"$add": [1, b"2"]}, "/$add/1"),
    ],
)
def test_not_json(expr: object, path: str) -> None:
    e = verr(expr)
    assert (e.code, e.path) == ("not_json", path)


def test_validate_accepts_good_expressions() -> None:
    validate(tier_expr())
    validate({"a": [1, 2.5, None, True, "s", {"$ref": "x.0.y"}], "b": {}})
    validate(42)


def test_evaluate_validates_first() -> None:
    # an invalid node behind a short circuit is still refused
    assert err({"$or": [True, {"$nope": 1}]}).code == "unknown_operator"


def test_error_paths_escape_pointer_characters() -> None:
    e = err({"a/b": {"c~d": {"$ref": "nope"}}})
    assert e.path == "/a~1b/c~0d"


def test_error_is_value_error_with_location() -> None:
    e = err({"amount": {"$add": [1, "x"]}})
    assert isinstance(e, ValueError)
    assert str(e) == "$add expects a number, got string (at /amount/$add/1)"


def test_scope_must_be_mapping() -> None:
    with pytest.raises(TypeError):
        evaluate(1, [])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Limits


def test_depth_limit_boundary() -> None:
    assert evaluate(nested(MAX_DEPTH - 1), {}) is (MAX_DEPTH % 2 == 1)
    assert measure(nested(MAX_DEPTH - 1)).depth == MAX_DEPTH
    e = verr(nested(MAX_DEPTH))
    assert e.code == "limit_exceeded"
    assert e.path == "/$not" * MAX_DEPTH


def test_deep_literal_structures_hit_the_limit() -> None:
    deep: object = 1
    for _ in range(100_000):
        deep = [deep]
    for fn in (validate, measure, refs):
        with pytest.raises(ExpressionError) as info:
            fn(deep)
        assert info.value.code == "limit_exceeded"
    assert err({"$literal": deep}).code == "limit_exceeded"


def test_node_limit() -> None:
    assert err(list(range(ex.MAX_NODES))).code == "limit_exceeded"
    assert measure(list(range(ex.MAX_NODES - 1))).nodes == ex.MAX_NODES
    assert err({"$add": [{"$neg": i} for i in range(ex.MAX_NODES // 2)]}).code == "limit_exceeded"


def test_cyclic_expression_is_refused() -> None:
    cyclic: dict[str, Any] = {"$not": None}
    cyclic["$not"] = cyclic
    assert verr(cyclic).code == "limit_exceeded"
    wide: list[object] = []
    wide.extend([wide] * 3)
    assert verr(wide).code == "limit_exceeded"


def test_deep_scope_values_are_handled_iteratively() -> None:
    deep: object = "leaf"
    for _ in range(50_000):
        deep = {"k": [deep]}
    scope = {"a": deep, "b": deep}
    assert evaluate({"$eq": [{"$ref": "a"}, {"$ref": "b"}]}, scope) is True
    assert evaluate({"$len": {"$ref": "a"}}, scope) == 1


# --------------------------------------------------------------------------------------------
# refs() and measure()


def test_refs() -> None:
    expr = {
        "amount": {"$add": [{"$ref": "inputs.amount"}, {"$ref": "inputs.fee"}]},
        "sku": {"$coalesce": [{"$ref": "steps.reserve.result.items.0.sku"}, "none"]},
        "raw": lit({"$ref": "not.counted"}),
        "tier": ex.case((ex.gt(ref("inputs.amount"), 1), ref("inputs.tier")), else_=ref("x")),
    }
    assert refs(expr) == {
        "inputs.amount",
        "inputs.fee",
        "steps.reserve.result.items.0.sku",
        "inputs.tier",
        "x",
    }
    assert refs({"a": 1}) == set()
    assert verr({"$ref": ""}).code == "bad_ref"
    with pytest.raises(ExpressionError):
        refs({"$nope": 1})


def test_measure_scalars_and_templates() -> None:
    assert measure(5) == ExpressionStats(
        nodes=1, depth=1, case_depth=0, case_nodes=0, case_branches=0, case_count=0
    )
    assert measure({"$ref": "a.b"}).nodes == 1
    # object(1) + $add(1) + $ref(1) + 2(1) + "EUR"(1)
    stats = measure({"amount": {"$add": [{"$ref": "a"}, 2]}, "currency": "EUR"})
    assert (stats.nodes, stats.depth) == (5, 3)
    # $literal(1) + object(1) + list(1) + 2 scalars
    assert measure(lit({"a": [1, 2]})).nodes == 5
    assert measure(lit({"a": [1, 2]})).depth == 4


def test_measure_case() -> None:
    inner = ex.case((ex.eq(ref("b"), 1), "x"), else_="y")  # case, eq, ref, 1, x, y = 6
    outer = ex.case((True, inner), (False, 2), (False, 3), else_=0)  # case + 7 scalars + inner
    stats = measure({"t": outer, "n": {"$not": True}})
    assert stats.case_count == 2
    assert stats.case_depth == 2
    assert stats.case_branches == 3
    assert stats.case_nodes == 1 + 6 + 6  # outer node, its 6 scalars, the inner case's 6 nodes
    assert stats.nodes == 1 + stats.case_nodes + 2  # object, case subtree, $not + True
    assert stats.depth == 5  # object > case > inner case > eq > ref
    siblings = measure([ex.case((True, 1), else_=2), ex.case((True, 1), else_=2)])
    assert (siblings.case_nodes, siblings.case_depth, siblings.case_count) == (8, 1, 2)


def test_measure_case_depth_chain() -> None:
    expr: object = 0
    for _ in range(10):
        expr = ex.case((True, expr), else_=1)
    stats = measure(expr)
    assert stats.case_depth == 10
    assert stats.case_branches == 1


# --------------------------------------------------------------------------------------------
# Builders


def test_builders_produce_the_json_form() -> None:
    assert ex.and_(True, ex.not_(False)) == {"$and": [True, {"$not": False}]}
    assert ex.or_(False) == {"$or": [False]}
    assert ex.add(1, 2, 3) == {"$add": [1, 2, 3]}
    assert ex.in_(1, [1]) == {"$in": [1, [1]]}
    assert ex.length("ab") == {"$len": "ab"}
    assert ex.case((True, 1), else_=2) == {
        "$case": {"branches": [{"when": True, "then": 1}], "else": 2}
    }
    expr = ex.div(ex.sub(ex.mul(ref("n"), 3), 1), ex.neg(-2))
    assert evaluate(expr, {"n": 3}) == 4
    assert evaluate(ex.mod(ex.length(ex.concat("ab", "c")), 2), {}) == 1
    assert evaluate(ex.coalesce(ref("missing"), lit({"$x": 1})), {}) == {"$x": 1}
    assert evaluate(ex.and_(ex.ne(1, 2), ex.lt(1, 2), ex.lte(2, 2), ex.gte(2, 2)), {}) is True


def test_operator_table_is_complete() -> None:
    assert {
        "$ref",
        "$literal",
        "$coalesce",
        "$eq",
        "$ne",
        "$gt",
        "$gte",
        "$lt",
        "$lte",
        "$and",
        "$or",
        "$not",
        "$add",
        "$sub",
        "$mul",
        "$div",
        "$mod",
        "$neg",
        "$len",
        "$concat",
        "$in",
        "$case",
    } == ex.OPERATORS


# --------------------------------------------------------------------------------------------
# Properties

plain_keys = st.text(max_size=6).filter(lambda k: not k.startswith("$"))
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=25,
)
expression_free = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(plain_keys, children, max_size=4)
    ),
    max_leaves=25,
)
exact_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=12,
)


@given(expression_free)
def test_rendering_expression_free_json_is_identity(value: object) -> None:
    rendered = render(value, {})
    assert canonical_json(rendered) == canonical_json(value)
    assert refs(value) == set()
    assert measure(value).case_count == 0


@given(json_values)
def test_literal_and_ref_round_trip_any_json(value: object) -> None:
    # Numbers come out as JSONB gives them back (test_numbers_come_out_as_jsonb_gives_them_back).
    stable = canonical_json(jsonb_stable(value))
    assert canonical_json(evaluate(lit(value), {})) == stable
    assert canonical_json(evaluate(ref("v"), {"v": value})) == stable


@given(json_values)
def test_eq_is_reflexive(value: object) -> None:
    assert evaluate(ex.eq(lit(value), lit(value)), {}) is True
    assert evaluate(ex.eq(ref("a"), ref("a")), {"a": value}) is True
    assert evaluate(ex.ne(ref("a"), ref("a")), {"a": value}) is False
    assert evaluate(ex.in_(ref("a"), [ref("a")]), {"a": value}) is True


@given(exact_values, exact_values)
def test_eq_matches_canonical_json_without_floats(a: object, b: object) -> None:
    same = canonical_json(a) == canonical_json(b)
    assert evaluate(ex.eq(ref("a"), ref("b")), {"a": a, "b": b}) is same
    assert evaluate(ex.eq(ref("b"), ref("a")), {"a": a, "b": b}) is same


@given(
    st.integers(min_value=MAX_DEPTH, max_value=20_000), st.sampled_from(["$not", "$neg", "$len"])
)
def test_depth_limit_raises_expression_error_not_recursion_error(levels: int, op: str) -> None:
    expr = nested(levels, leaf=1, op=op)
    with pytest.raises(ExpressionError) as info:
        evaluate(expr, {})
    assert info.value.code == "limit_exceeded"


@given(st.integers(min_value=-(10**6), max_value=10**6), st.integers(min_value=1, max_value=999))
def test_div_mod_agree(a: int, b: int) -> None:
    quotient = evaluate(ex.div(a, b), {})
    remainder = evaluate(ex.mod(a, b), {})
    assert isinstance(remainder, int)
    if remainder == 0:
        assert quotient == a // b and isinstance(quotient, int)
    else:
        assert isinstance(quotient, float)
        assert math.isclose(quotient, a / b)


# -- prevalidated expressions run compiled (expressions._compile) -----------------------------

_keys = st.sampled_from(["a", "b", "x/y", "t~1", "0", "amount"])
_refs = st.sampled_from(
    [
        "inputs.amount",
        "inputs.sku",
        "inputs.missing",
        "steps.reserve.result",
        "a.0",
        "nums.9",
        "a.1.x",
        "view.k",
        "view.k.deeper",
        "inputs.amount.x",
    ]
)
_templates = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(_keys, inner, max_size=3)
        | st.builds(lambda path: {"$ref": path}, _refs)
        | st.builds(lambda v: {"$literal": v}, inner)
        | st.builds(lambda xs: {"$coalesce": xs}, st.lists(inner, min_size=1, max_size=3))
        | st.builds(lambda a, b: {"$add": [a, b]}, inner, inner)
        | st.builds(lambda a, b: {"$eq": [a, b]}, inner, inner)
        | st.builds(lambda xs: {"$concat": xs}, st.lists(inner, min_size=1, max_size=3))
    ),
    max_leaves=12,
)
_SCOPE = {
    "inputs": {"amount": 3, "sku": "A-1"},
    "steps": {"reserve": {"result": {"id": "r1"}}},
    "a": [7, "b"],
    "nums": [1, 2],
    # Not a dict: the compiled ``$ref`` hands it to the interpreter's walk (item 43).
    "view": MappingProxyType({"k": {"v": [1]}}),
}


def _outcome(expr: object, *, prevalidated: bool) -> object:
    try:
        return ("value", evaluate(expr, _SCOPE, prevalidated=prevalidated))
    except ExpressionError as exc:
        return ("error", exc.code, exc.path, str(exc))


@given(_templates)
def test_a_prevalidated_expression_evaluates_as_the_interpreter_does(expr: object) -> None:
    # The compiled form must give the same value, or the same error at the same path.
    try:
        validate(expr)
    except ExpressionError:
        return  # only a parsed definition's (validated) expressions run prevalidated
    first = _outcome(expr, prevalidated=True)
    assert first == _outcome(expr, prevalidated=False)
    assert _outcome(expr, prevalidated=True) == first  # and again, from the cache


def test_compiled_results_are_fresh_copies() -> None:
    template = {"order": {"items": [{"$ref": "inputs.sku"}]}, "n": {"$literal": [1]}}
    one = render(template, _SCOPE, prevalidated=True)
    assert isinstance(one, dict)
    one["order"]["items"].append("mutated")
    one["n"].append(2)
    assert render(template, _SCOPE, prevalidated=True) == {"order": {"items": ["A-1"]}, "n": [1]}


def test_the_compiled_cache_is_bounded_and_keyed_by_the_object() -> None:
    for i in range(ex._COMPILED_MAX + 10):
        assert render({"v": i}, _SCOPE, prevalidated=True) == {"v": i}
        assert len(ex._COMPILED) <= ex._COMPILED_MAX
    # A new object at an old object's address is compiled afresh, never served the old form.
    for i in range(200):
        assert render([i, {"$ref": "inputs.amount"}], _SCOPE, prevalidated=True) == [i, 3]


def test_a_ref_to_a_str_or_int_subclass_gives_the_plain_json_type() -> None:
    # Exact str/int/bool/None are returned as they are (their own copy); a subclass (an enum
    # member, say) is still converted to the plain type.
    from enum import IntEnum, StrEnum

    class Colour(StrEnum):
        RED = "red"

    class Size(IntEnum):
        L = 3

    scope = {"inputs": {"c": Colour.RED, "s": Size.L}}
    for prevalidated in (False, True):
        out = render({"c": ref("inputs.c"), "s": ref("inputs.s")}, scope, prevalidated=prevalidated)
        assert isinstance(out, dict)
        assert type(out["c"]) is str and out["c"] == "red"
        assert type(out["s"]) is int and out["s"] == 3
