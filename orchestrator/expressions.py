"""A small, safe JSON expression language (never ``eval``): payload templates, checks and rules.

An expression is any JSON value. A JSON object whose **only** key starts with ``$`` is an
*operator node*; every other object or array is a literal structure whose members are themselves
expressions, so templates render recursively; scalars are literals::

    {"amount": {"$ref": "inputs.amount"}, "currency": "EUR"}
    # with scope {"inputs": {"amount": 120}}  ->  {"amount": 120, "currency": "EUR"}

Operators (``a``, ``b`` ... are expressions; "array" means a JSON array written in place):

==========================  ===============================================================
``{"$ref": "a.b.0"}``       look up a dotted path in the scope; a segment is an object key, or
                            a decimal index (``0``, ``12``) into an array. A missing path is
                            ``ref_missing``. The value is copied out (never aliased).
``{"$literal": X}``         ``X`` verbatim, not evaluated (escape hatch for ``$`` keys).
``{"$coalesce": [a, ...]}`` the first operand that evaluates without ``ref_missing`` and is not
                            ``null``; ``null`` if there is none. Other errors propagate.
``$eq $ne``                 array of exactly 2; deep JSON equality. Booleans never equal numbers
                            (``true != 1``); ``1 == 1.0``; objects compare by key set and values.
``$gt $gte $lt $lte``       array of exactly 2; numbers with numbers (booleans excluded) or
                            strings with strings (code-point order), else ``type_mismatch``.
``$and $or``                array of >= 1; short-circuit; every evaluated operand must be a
                            boolean (``not_boolean``).
``{"$not": a}``             ``a`` must be a boolean.
``$add $sub $mul``          array of >= 2 numbers (booleans refused), folded left.
``$div``                    array of 2 numbers; ``/ 0`` is ``division_by_zero``; int/int stays an
                            int when exact, else a float.
``$mod``                    array of 2 integers; Python (floor) semantics: the result has the sign
                            of the divisor.
``{"$neg": a}``             arithmetic negation of a number.
``{"$len": a}``             length of a string (code points), array or object.
``{"$concat": [a, ...]}``   array of >= 1 strings, joined.
``{"$in": [x, xs]}``        whether ``xs`` (must be an array) contains ``x`` (``$eq`` semantics).
``$case``                   ``{"$case": {"branches": [{"when": c, "then": v}, ...], "else": e}}``:
                            the ``then`` of the first branch whose ``when`` is ``true`` (each
                            ``when`` must be a boolean), else ``e``. 1..20 branches; ``else`` is
                            required.
==========================  ===============================================================

Unary operators (``$not $neg $len``) take their operand directly, not wrapped in an array:
``{"$len": [1, 2]}`` is ``2``. An object with several keys of which one is an operator name
(``{"$ref": "a", "default": 1}``) is refused as ``ambiguous_operator`` rather than silently taken
as a literal; other ``$`` keys in multi-key objects (``{"$schema": ..., "id": ...}``) are plain
literal keys. To emit a single-key ``$`` object, wrap it: ``{"$literal": {"$ref": "x"}}``.

Checks (``validate`` does them all, ``evaluate`` re-runs them first): the value is plain JSON
(``dict`` with ``str`` keys, ``list``, ``str``, ``int``, finite ``float``, ``bool``, ``None``);
operators are known, arities and shapes are right, ``$ref`` paths are non-empty strings of
non-empty segments. Hard ceilings (``limit_exceeded``): depth ``MAX_DEPTH`` (64), size
``MAX_NODES`` (16 384), ``MAX_CASE_BRANCHES`` (20) per ``$case``; ``$concat`` results of at most
``MAX_STRING_LENGTH`` characters. Walks are iterative; evaluation recursion is bounded by the depth
ceiling, so deep input raises :class:`ExpressionError`, never ``RecursionError``. Integer results
wider than ``MAX_INT_BITS`` bits and non-finite float results are ``number_overflow``.

Numbers come out as PostgreSQL's JSONB gives them back: a float of magnitude 1e16 or more, from
arithmetic or copied by ``$ref`` (a query's or a step's result), is the integer it equals
(``{"$mul": [1e8, 1e8]}`` is ``10000000000000000``), and ``-0.0`` is ``0.0``
(:func:`ledger.canonical.jsonb_stable`). A rendered payload is fingerprinted before it is
stored; rendered again from reloaded values it must give the same fingerprint.

Counting rule (``measure``, and the ceilings above): every operator node counts 1 (its operand
array, the ``$case`` ``branches``/branch objects and the ``$ref`` path string are part of it); every
literal JSON value counts 1 (a literal array or object counts 1 plus its members, recursively; the
payload of ``$literal`` is counted the same way). ``depth`` is the longest root-to-leaf chain of
counted nodes (a scalar or ``{"$ref": ...}`` alone is 1; ``{"$not": {"$ref": "a"}}`` is 2; the
``when``/``then``/``else`` of a ``$case`` are one level below it).

Errors carry ``code``, ``path`` (a JSON pointer into the expression, e.g. ``/amount/$add/1``; ``""``
is the root) and a message that never contains scope values (only reference paths and type names).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, cast

from ledger.canonical import jsonb_stable

__all__ = [
    "MAX_CASE_BRANCHES",
    "MAX_DEPTH",
    "MAX_INT_BITS",
    "MAX_NODES",
    "MAX_STRING_LENGTH",
    "MAX_VALUE_NODES",
    "OPERATORS",
    "ExpressionError",
    "ExpressionStats",
    "add",
    "and_",
    "case",
    "coalesce",
    "concat",
    "div",
    "eq",
    "evaluate",
    "evaluate_condition",
    "gt",
    "gte",
    "in_",
    "length",
    "lit",
    "lt",
    "lte",
    "measure",
    "mod",
    "mul",
    "ne",
    "neg",
    "not_",
    "or_",
    "ref",
    "refs",
    "render",
    "sub",
    "validate",
]

MAX_DEPTH: Final = 64
"""Deepest expression accepted (counted nodes on one root-to-leaf chain)."""
MAX_NODES: Final = 16_384
"""Largest expression accepted (counted nodes); the whole-definition JSON budget."""
MAX_CASE_BRANCHES: Final = 20
"""Most branches one ``$case`` may have."""
MAX_STRING_LENGTH: Final = 1_048_576
"""Longest string ``$concat`` may build."""
MAX_INT_BITS: Final = 4096
"""Widest integer an arithmetic operator may produce."""
MAX_VALUE_NODES: Final = 1_048_576
"""Most JSON nodes one ``$ref`` may copy out of the scope (guards against cyclic scopes)."""

_BINARY: Final = frozenset({"$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$div", "$mod", "$in"})
_VARIADIC_1: Final = frozenset({"$and", "$or", "$coalesce", "$concat"})
_VARIADIC_2: Final = frozenset({"$add", "$sub", "$mul"})
_UNARY: Final = frozenset({"$not", "$neg", "$len"})
_SPECIAL: Final = frozenset({"$ref", "$literal", "$case"})
OPERATORS: Final = _BINARY | _VARIADIC_1 | _VARIADIC_2 | _UNARY | _SPECIAL
"""Every operator name the language knows."""

_INDEX: Final = re.compile(r"0|[1-9][0-9]{0,17}")
_SHOWN_KEY_CHARS: Final = 64


class ExpressionError(ValueError):
    """An expression is malformed, over a limit, or failed to evaluate.

    ``code`` is machine-readable, ``path`` points into the expression, ``ref`` names the reference
    involved (``ref_missing``, ``not_json`` on a referenced value) and ``message`` is safe to show.
    """

    def __init__(self, code: str, message: str, path: str = "", ref: str | None = None) -> None:
        super().__init__(f"{message} (at {path})" if path else message)
        self.code = code
        self.message = message
        self.path = path
        self.ref = ref


@dataclass(frozen=True)
class ExpressionStats:
    """Size figures of one expression (see the module docstring for the counting rule).

    ``case_depth`` is the most ``$case`` nodes on one chain, ``case_nodes`` the counted nodes lying
    in or under any ``$case`` (each once), ``case_branches`` the most branches of one ``$case`` and
    ``case_count`` the number of ``$case`` nodes.
    """

    nodes: int
    depth: int
    case_depth: int
    case_nodes: int
    case_branches: int
    case_count: int


# --------------------------------------------------------------------------------------------
# Structural walk: validate, measure and refs share it.


def _seg(key: str | int) -> str:
    """One JSON-pointer segment (RFC 6901 escaping)."""
    return "/" + str(key).replace("~", "~0").replace("/", "~1")


def _shown(key: str) -> str:
    """A key from the expression, shortened for messages."""
    if len(key) > _SHOWN_KEY_CHARS:
        return repr(key[:_SHOWN_KEY_CHARS] + "...")
    return repr(key)


def _type_name(value: object) -> str:
    """The JSON type name of ``value`` (never the value itself)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _operator_of(node: dict[str, object]) -> tuple[str, object] | None:
    """``(name, argument)`` when ``node`` is an operator node (single key starting with ``$``)."""
    if len(node) != 1:
        return None
    ((key, arg),) = node.items()
    if key.startswith("$"):
        return key, arg
    return None


def _check_ref_path(arg: object, path: str) -> str:
    if not isinstance(arg, str) or not arg:
        raise ExpressionError("bad_ref", "$ref expects a non-empty dotted path string", path)
    if any(not segment for segment in arg.split(".")):
        raise ExpressionError("bad_ref", f"$ref path {arg!r} has an empty segment", path, arg)
    return arg


# A frame of the walk: (value, path, depth, raw, enclosing $case count).
_Frame = tuple[object, str, int, bool, int]


def _walk(expr: object) -> tuple[ExpressionStats, set[str]]:
    """Check ``expr`` structurally; return its stats and the ``$ref`` paths it uses."""
    stack: list[_Frame] = [(expr, "", 1, False, 0)]
    found: set[str] = set()
    nodes = depth_max = case_depth = case_nodes = case_branches = case_count = 0
    while stack:
        value, path, depth, raw, in_case = stack.pop()
        if depth > MAX_DEPTH:
            raise ExpressionError(
                "limit_exceeded", f"expression is nested deeper than {MAX_DEPTH} levels", path
            )
        nodes += 1
        if nodes > MAX_NODES:
            raise ExpressionError(
                "limit_exceeded", f"expression has more than {MAX_NODES} nodes", path
            )
        depth_max = max(depth_max, depth)
        if in_case:
            case_nodes += 1
        if value is None or isinstance(value, bool | int | str):
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ExpressionError("not_json", "numbers must be finite", path)
            continue
        if isinstance(value, list):
            if nodes + len(value) > MAX_NODES:
                raise ExpressionError(
                    "limit_exceeded", f"expression has more than {MAX_NODES} nodes", path
                )
            for index in range(len(value) - 1, -1, -1):
                stack.append((value[index], path + _seg(index), depth + 1, raw, in_case))
            continue
        if not isinstance(value, dict):
            raise ExpressionError("not_json", f"{_type_name(value)} is not a JSON value", path)
        for key in value:
            if not isinstance(key, str):
                raise ExpressionError("not_json", "object keys must be strings", path)
        node = cast(dict[str, object], value)
        operator = None if raw else _operator_of(node)
        if operator is None:
            if not raw and len(node) > 1:
                clash = sorted(key for key in node if key in OPERATORS)
                if clash:
                    raise ExpressionError(
                        "ambiguous_operator",
                        f"operator {clash[0]} must be the only key of its object"
                        " (wrap literal objects in $literal)",
                        path,
                    )
            if nodes + len(node) > MAX_NODES:
                raise ExpressionError(
                    "limit_exceeded", f"expression has more than {MAX_NODES} nodes", path
                )
            for key, member in reversed(node.items()):
                stack.append((member, path + _seg(key), depth + 1, raw, in_case))
            continue
        name, arg = operator
        arg_path = path + _seg(name)
        child = depth + 1
        if name == "$ref":
            found.add(_check_ref_path(arg, arg_path))
        elif name == "$literal":
            stack.append((arg, arg_path, child, True, in_case))
        elif name == "$case":
            branches, default = _case_parts(arg, arg_path)
            case_count += 1
            if not in_case:
                case_nodes += 1
            case_depth = max(case_depth, in_case + 1)
            case_branches = max(case_branches, len(branches))
            stack.append((default, arg_path + "/else", child, False, in_case + 1))
            for index in range(len(branches) - 1, -1, -1):
                branch = branches[index]
                branch_path = f"{arg_path}/branches/{index}"
                stack.append((branch["then"], branch_path + "/then", child, False, in_case + 1))
                stack.append((branch["when"], branch_path + "/when", child, False, in_case + 1))
        elif name in _UNARY:
            stack.append((arg, arg_path, child, False, in_case))
        elif name in OPERATORS:
            operands = _operand_list(name, arg, arg_path)
            for index in range(len(operands) - 1, -1, -1):
                stack.append((operands[index], arg_path + _seg(index), child, False, in_case))
        else:
            raise ExpressionError("unknown_operator", f"unknown operator {_shown(name)}", path)
    stats = ExpressionStats(
        nodes=nodes,
        depth=depth_max,
        case_depth=case_depth,
        case_nodes=case_nodes,
        case_branches=case_branches,
        case_count=case_count,
    )
    return stats, found


def _operand_list(name: str, arg: object, path: str) -> list[object]:
    """The operand array of an array operator, checked against its arity."""
    if name in _BINARY:
        low, high, wanted = 2, 2, "exactly 2"
    elif name in _VARIADIC_2:
        low, high, wanted = 2, None, "at least 2"
    else:
        low, high, wanted = 1, None, "at least 1"
    if not isinstance(arg, list):
        raise ExpressionError("bad_arity", f"{name} expects an array of {wanted} operands", path)
    operands = cast(list[object], arg)
    if len(operands) < low or (high is not None and len(operands) > high):
        raise ExpressionError(
            "bad_arity", f"{name} expects {wanted} operands, got {len(operands)}", path
        )
    return operands


def _case_parts(arg: object, path: str) -> tuple[list[dict[str, object]], object]:
    """``(branches, else)`` of a ``$case`` argument, shape-checked."""
    if not isinstance(arg, dict) or set(arg) != {"branches", "else"}:
        raise ExpressionError(
            "bad_shape", '$case expects an object with exactly "branches" and "else"', path
        )
    case_arg = cast(dict[str, object], arg)
    branches = case_arg["branches"]
    if not isinstance(branches, list) or not branches:
        raise ExpressionError(
            "bad_shape", '$case "branches" must be a non-empty array', path + "/branches"
        )
    if len(branches) > MAX_CASE_BRANCHES:
        raise ExpressionError(
            "limit_exceeded",
            f"$case has {len(branches)} branches, at most {MAX_CASE_BRANCHES} are allowed",
            path + "/branches",
        )
    for index, branch in enumerate(branches):
        if not isinstance(branch, dict) or set(branch) != {"when", "then"}:
            raise ExpressionError(
                "bad_shape",
                '$case branch must be an object with exactly "when" and "then"',
                f"{path}/branches/{index}",
            )
    return cast(list[dict[str, object]], branches), case_arg["else"]


def validate(expr: object) -> None:
    """Check ``expr`` at authoring time (JSON-ness, operators, arities, shapes, hard ceilings).

    Raises :class:`ExpressionError`; returns nothing when the expression is well formed.
    """
    _walk(expr)


def measure(expr: object) -> ExpressionStats:
    """Validate ``expr`` and return its size figures, for budget checks by the caller."""
    return _walk(expr)[0]


def refs(expr: object) -> set[str]:
    """Validate ``expr`` and return every ``$ref`` path it uses (``$literal`` content excluded)."""
    return _walk(expr)[1]


# --------------------------------------------------------------------------------------------
# Values: copying out of the scope, equality.


def _to_json(value: object, ref_path: str, path: str) -> object:
    """A plain-JSON deep copy of ``value`` (iterative); ``not_json`` if it has no JSON form."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value  # an immutable JSON scalar of the exact type is its own copy (most refs)
    holder: list[object] = [None]
    stack: list[tuple[object, list[object] | dict[str, object], int | str]] = [(value, holder, 0)]
    copied = 0

    def refuse(kind: str) -> ExpressionError:
        return ExpressionError(
            "not_json",
            f"value at reference {ref_path!r} is not JSON-compatible ({kind})",
            path,
            ref_path,
        )

    while stack:
        source, parent, slot = stack.pop()
        copied += 1
        if copied > MAX_VALUE_NODES:
            raise ExpressionError(
                "limit_exceeded",
                f"value at reference {ref_path!r} has more than {MAX_VALUE_NODES} nodes",
                path,
                ref_path,
            )
        result: object
        if source is None or type(source) is bool:
            result = source
        elif isinstance(source, str):
            result = str.__str__(source)
        elif isinstance(source, int) and not isinstance(source, bool):
            result = int(source)
        elif isinstance(source, float):
            if not math.isfinite(source):
                raise refuse("non-finite number")
            result = jsonb_stable(float(source))
        elif isinstance(source, Mapping):
            mapping = cast(Mapping[object, object], source)
            new_dict: dict[str, object] = {}
            for key, member in mapping.items():
                if not isinstance(key, str):
                    raise refuse("non-string object key")
                new_dict[str.__str__(key)] = None
                stack.append((member, new_dict, str.__str__(key)))
            result = new_dict
        elif isinstance(source, list | tuple):
            items = cast(list[object] | tuple[object, ...], source)
            new_list: list[object] = [None] * len(items)
            for index, member in enumerate(items):
                stack.append((member, new_list, index))
            result = new_list
        else:
            raise refuse(type(source).__name__)
        if isinstance(parent, list):
            parent[cast(int, slot)] = result
        else:
            parent[cast(str, slot)] = result
    return holder[0]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _json_equal(left: object, right: object) -> bool:
    """Deep JSON equality where booleans never equal numbers (iterative)."""
    stack: list[tuple[object, object]] = [(left, right)]
    while stack:
        a, b = stack.pop()
        if isinstance(a, bool) or isinstance(b, bool):
            if not (isinstance(a, bool) and isinstance(b, bool) and a is b):
                return False
        elif (_is_number(a) and _is_number(b)) or (isinstance(a, str) and isinstance(b, str)):
            if a != b:
                return False
        elif a is None and b is None:
            continue
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                return False
            stack.extend(zip(cast(list[object], a), cast(list[object], b), strict=True))
        elif isinstance(a, dict) and isinstance(b, dict):
            da, db = cast(dict[str, object], a), cast(dict[str, object], b)
            if da.keys() != db.keys():
                return False
            stack.extend((da[key], db[key]) for key in da)
        else:
            return False
    return True


# --------------------------------------------------------------------------------------------
# Evaluation (bounded recursion: `_walk` has already refused anything deeper than MAX_DEPTH).

_Scope = Mapping[str, object]
# handler(argument, path of the argument, path of the operator node, scope) -> value
_Handler = Callable[[object, str, str, _Scope], object]


def _eval(node: object, path: str, scope: _Scope) -> object:
    if isinstance(node, dict):
        members = cast(dict[str, object], node)
        operator = _operator_of(members)
        if operator is not None:
            name, arg = operator
            return _HANDLERS[name](arg, path + _seg(name), path, scope)
        return {key: _eval(member, path + _seg(key), scope) for key, member in members.items()}
    if isinstance(node, list):
        items = cast(list[object], node)
        return [_eval(item, path + _seg(index), scope) for index, item in enumerate(items)]
    return node


def _operands(arg: object) -> list[object]:
    return cast(list[object], arg)


def _op_ref(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    ref_path = cast(str, arg)
    segments = ref_path.split(".")
    current: object = scope
    for count, segment in enumerate(segments, start=1):
        found = False
        if isinstance(current, Mapping):
            mapping = cast(Mapping[object, object], current)
            if segment in mapping:
                current, found = mapping[segment], True
        elif isinstance(current, list | tuple) and _INDEX.fullmatch(segment):
            items = cast(list[object] | tuple[object, ...], current)
            index = int(segment)
            if index < len(items):
                current, found = items[index], True
        if not found:
            missing = ".".join(segments[:count])
            detail = "" if count == len(segments) else f" ({missing!r} is missing)"
            raise ExpressionError(
                "ref_missing", f"reference {ref_path!r} is not defined{detail}", path, ref_path
            )
    return _to_json(current, ref_path, path)


def _op_literal(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    return _to_json(arg, "$literal", arg_path)


def _op_coalesce(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    for index, operand in enumerate(_operands(arg)):
        try:
            value = _eval(operand, arg_path + _seg(index), scope)
        except ExpressionError as exc:
            if exc.code == "ref_missing":
                continue
            raise
        if value is not None:
            return value
    return None


def _two(arg: object, arg_path: str, scope: _Scope) -> tuple[object, object]:
    left, right = _operands(arg)
    return _eval(left, arg_path + "/0", scope), _eval(right, arg_path + "/1", scope)


def _op_eq(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    return _json_equal(*_two(arg, arg_path, scope))


def _op_ne(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    return not _json_equal(*_two(arg, arg_path, scope))


def _ordering(name: str, compare: Callable[[object, object], bool]) -> _Handler:
    def handler(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
        left, right = _two(arg, arg_path, scope)
        if not (_is_number(left) or isinstance(left, str)):
            raise ExpressionError(
                "type_mismatch",
                f"{name} compares numbers or strings, got {_type_name(left)}",
                arg_path + "/0",
            )
        if not (
            (_is_number(left) and _is_number(right))
            or (isinstance(left, str) and isinstance(right, str))
        ):
            raise ExpressionError(
                "type_mismatch",
                f"{name} cannot compare {_type_name(left)} with {_type_name(right)}",
                arg_path + "/1",
            )
        return compare(left, right)

    return handler


def _lt(a: object, b: object) -> bool:
    return cast(float, a) < cast(float, b)


def _lte(a: object, b: object) -> bool:
    return cast(float, a) <= cast(float, b)


def _boolean(value: object, name: str, path: str) -> bool:
    if not isinstance(value, bool):
        raise ExpressionError(
            "not_boolean", f"{name} expects a boolean, got {_type_name(value)}", path
        )
    return value


def _op_and(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    for index, operand in enumerate(_operands(arg)):
        operand_path = arg_path + _seg(index)
        if not _boolean(_eval(operand, operand_path, scope), "$and", operand_path):
            return False
    return True


def _op_or(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    for index, operand in enumerate(_operands(arg)):
        operand_path = arg_path + _seg(index)
        if _boolean(_eval(operand, operand_path, scope), "$or", operand_path):
            return True
    return False


def _op_not(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    return not _boolean(_eval(arg, arg_path, scope), "$not", arg_path)


def _number(value: object, name: str, path: str) -> int | float:
    if not _is_number(value):
        raise ExpressionError(
            "type_mismatch", f"{name} expects a number, got {_type_name(value)}", path
        )
    return cast(int | float, value)


_Arith = Callable[[int | float, int | float], int | float]


def _checked(name: str, step: _Arith, a: int | float, b: int | float, path: str) -> int | float:
    """``step(a, b)``; refuse overflowing or non-finite results."""
    try:
        result = step(a, b)
    except OverflowError:
        result = math.inf
    if isinstance(result, float):
        if not math.isfinite(result):
            raise ExpressionError("number_overflow", f"{name} result is out of range", path)
        result = jsonb_stable(result)
    if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
        raise ExpressionError(
            "number_overflow", f"{name} result is wider than {MAX_INT_BITS} bits", path
        )
    return result


def _fold(name: str, step: _Arith) -> _Handler:
    def handler(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
        total: int | float = 0
        for index, operand in enumerate(_operands(arg)):
            operand_path = arg_path + _seg(index)
            value = _number(_eval(operand, operand_path, scope), name, operand_path)
            total = value if index == 0 else _checked(name, step, total, value, arg_path)
        return total

    return handler


def _op_div(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    left, right = _two(arg, arg_path, scope)
    dividend = _number(left, "$div", arg_path + "/0")
    divisor = _number(right, "$div", arg_path + "/1")
    if divisor == 0:
        raise ExpressionError("division_by_zero", "$div by zero", arg_path + "/1")
    if isinstance(dividend, int) and isinstance(divisor, int):
        quotient, remainder = divmod(dividend, divisor)
        if remainder == 0:
            return quotient
    return _checked("$div", _truediv, dividend, divisor, arg_path)


def _integer(value: object, name: str, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ExpressionError(
            "type_mismatch", f"{name} expects an integer, got {_type_name(value)}", path
        )
    return value


def _op_mod(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    left, right = _two(arg, arg_path, scope)
    dividend = _integer(left, "$mod", arg_path + "/0")
    divisor = _integer(right, "$mod", arg_path + "/1")
    if divisor == 0:
        raise ExpressionError("division_by_zero", "$mod by zero", arg_path + "/1")
    return dividend % divisor


def _op_neg(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    negated = -_number(_eval(arg, arg_path, scope), "$neg", arg_path)
    return jsonb_stable(negated) if isinstance(negated, float) else negated  # -0.0 is 0.0


def _op_len(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    value = _eval(arg, arg_path, scope)
    if isinstance(value, str | list | dict):
        return len(cast(str | list[object] | dict[str, object], value))
    raise ExpressionError(
        "type_mismatch",
        f"$len expects a string, array or object, got {_type_name(value)}",
        arg_path,
    )


def _op_concat(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    parts: list[str] = []
    size = 0
    for index, operand in enumerate(_operands(arg)):
        operand_path = arg_path + _seg(index)
        value = _eval(operand, operand_path, scope)
        if not isinstance(value, str):
            raise ExpressionError(
                "type_mismatch", f"$concat expects strings, got {_type_name(value)}", operand_path
            )
        size += len(value)
        if size > MAX_STRING_LENGTH:
            raise ExpressionError(
                "limit_exceeded",
                f"$concat result is longer than {MAX_STRING_LENGTH} characters",
                arg_path,
            )
        parts.append(value)
    return "".join(parts)


def _op_in(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    needle, haystack = _two(arg, arg_path, scope)
    if not isinstance(haystack, list):
        raise ExpressionError(
            "type_mismatch", f"$in expects an array, got {_type_name(haystack)}", arg_path + "/1"
        )
    return any(_json_equal(needle, item) for item in cast(list[object], haystack))


def _op_case(arg: object, arg_path: str, path: str, scope: _Scope) -> object:
    case_arg = cast(dict[str, object], arg)
    for index, branch in enumerate(cast(list[dict[str, object]], case_arg["branches"])):
        branch_path = f"{arg_path}/branches/{index}"
        condition = _eval(branch["when"], branch_path + "/when", scope)
        if _boolean(condition, "$case when", branch_path + "/when"):
            return _eval(branch["then"], branch_path + "/then", scope)
    return _eval(case_arg["else"], arg_path + "/else", scope)


def _add(a: int | float, b: int | float) -> int | float:
    return a + b


def _sub(a: int | float, b: int | float) -> int | float:
    return a - b


def _mul(a: int | float, b: int | float) -> int | float:
    return a * b


def _truediv(a: int | float, b: int | float) -> int | float:
    return a / b


_HANDLERS: Final[dict[str, _Handler]] = {
    "$ref": _op_ref,
    "$literal": _op_literal,
    "$coalesce": _op_coalesce,
    "$eq": _op_eq,
    "$ne": _op_ne,
    "$gt": _ordering("$gt", lambda a, b: _lt(b, a)),
    "$gte": _ordering("$gte", lambda a, b: _lte(b, a)),
    "$lt": _ordering("$lt", _lt),
    "$lte": _ordering("$lte", _lte),
    "$and": _op_and,
    "$or": _op_or,
    "$not": _op_not,
    "$add": _fold("$add", _add),
    "$sub": _fold("$sub", _sub),
    "$mul": _fold("$mul", _mul),
    "$div": _op_div,
    "$mod": _op_mod,
    "$neg": _op_neg,
    "$len": _op_len,
    "$concat": _op_concat,
    "$in": _op_in,
    "$case": _op_case,
}
assert _HANDLERS.keys() == OPERATORS


_Compiled = Callable[[_Scope], object]
#: Compiled forms of prevalidated expressions, by the id of the expression object (held in the
#: entry, so that its id is not reused while the entry lives). Bounded: emptied when full, as a
#: caller that parses definitions afresh brings new objects each time.
_COMPILED: dict[int, tuple[object, _Compiled]] = {}
_COMPILED_MAX: Final = 4096


def _compiled(expr: object) -> _Compiled:
    entry = _COMPILED.get(id(expr))
    if entry is None or entry[0] is not expr:
        if len(_COMPILED) >= _COMPILED_MAX:
            _COMPILED.clear()
        entry = _COMPILED[id(expr)] = (expr, _compile(expr, ""))
    return entry[1]


def _compile(node: object, path: str) -> _Compiled:
    """``node`` as a function of the scope that returns what ``_eval(node, path, scope)``
    returns, errors and their paths included.

    The structure (which nodes are plain objects, lists, operators or constants) and every
    path are settled here once, instead of on every evaluation: a saga renders each payload
    template of its definition at least once, and that walk was most of a render's cost. An
    operator node calls its handler as ``_eval`` does, so its operands are evaluated the same
    way."""
    if isinstance(node, dict):
        members = cast(dict[str, object], node)
        operator = _operator_of(members)
        if operator is not None:
            name, arg = operator
            handler, arg_path = _HANDLERS[name], path + _seg(name)
            if name == "$ref":
                return _compiled_ref(cast(str, arg), arg_path, path)
            return lambda scope: handler(arg, arg_path, path, scope)
        parts = tuple((key, _compile(member, path + _seg(key))) for key, member in members.items())
        return lambda scope: {key: part(scope) for key, part in parts}
    if isinstance(node, list):
        items = tuple(_compile(item, path + _seg(i)) for i, item in enumerate(node))
        return lambda scope: [item(scope) for item in items]
    return lambda _scope: node


def _compiled_ref(ref_path: str, arg_path: str, path: str) -> _Compiled:
    """A ``$ref`` with its path split once. It walks plain dicts itself and hands anything
    else — a list index, another mapping type, a missing segment, so every error too — to
    :func:`_op_ref`, which answers exactly as before.

    Why: a saga resolves about seven references, and ``_op_ref`` split the path and asked
    ``isinstance(…, Mapping)`` (an ABC check) per segment: 1.7 % of a saga's samples on SQLite
    (``docs/benchmarks-log.md``, item 43)."""
    segments = tuple(ref_path.split("."))

    def resolve(scope: _Scope) -> object:
        current: object = scope
        for segment in segments:
            if type(current) is not dict or segment not in current:
                return _op_ref(ref_path, arg_path, path, scope)
            current = current[segment]
        return _to_json(current, ref_path, path)

    return resolve


def evaluate(expr: object, scope: Mapping[str, object], *, prevalidated: bool = False) -> object:
    """Validate, then evaluate ``expr`` against ``scope``; the result is a fresh plain-JSON value.

    ``prevalidated=True`` skips the structural walk and runs the expression's compiled form
    (built at its first use, :func:`_compile`): only for expressions of a parsed, immutable
    saga definition, which :func:`validate` checked at parse time (re-walking every template on
    every saga was a measurable share of the hot path). Mutating such an expression afterwards
    is not seen by its compiled form.

    Raises :class:`ExpressionError` for malformed expressions and evaluation failures alike.
    """
    if not isinstance(scope, Mapping):
        raise TypeError("scope must be a mapping")
    if not prevalidated:
        _walk(expr)
        return _eval(expr, "", scope)
    return _compiled(expr)(scope)


def render(template: object, scope: Mapping[str, object], *, prevalidated: bool = False) -> object:
    """Render a payload template: the same as :func:`evaluate`, named for templates."""
    return evaluate(template, scope, prevalidated=prevalidated)


def evaluate_condition(
    expr: object, scope: Mapping[str, object], *, prevalidated: bool = False
) -> bool:
    """Evaluate a condition (a validation check, a rule); ``not_boolean`` unless it is a boolean."""
    return _boolean(evaluate(expr, scope, prevalidated=prevalidated), "condition", "")


# --------------------------------------------------------------------------------------------
# Builders for Python users (they build the JSON form; nothing is evaluated).


def ref(path: str) -> dict[str, object]:
    """``{"$ref": path}``; raises :class:`ExpressionError` (``bad_ref``) on a malformed path."""
    _check_ref_path(path, "/$ref")
    return {"$ref": path}


def lit(value: object) -> dict[str, object]:
    """``{"$literal": value}``: ``value`` is emitted verbatim, never evaluated."""
    return {"$literal": value}


def _node(name: str, *operands: object) -> dict[str, object]:
    return {name: list(operands)}


def eq(a: object, b: object) -> dict[str, object]:
    """``{"$eq": [a, b]}``."""
    return _node("$eq", a, b)


def ne(a: object, b: object) -> dict[str, object]:
    """``{"$ne": [a, b]}``."""
    return _node("$ne", a, b)


def gt(a: object, b: object) -> dict[str, object]:
    """``{"$gt": [a, b]}``."""
    return _node("$gt", a, b)


def gte(a: object, b: object) -> dict[str, object]:
    """``{"$gte": [a, b]}``."""
    return _node("$gte", a, b)


def lt(a: object, b: object) -> dict[str, object]:
    """``{"$lt": [a, b]}``."""
    return _node("$lt", a, b)


def lte(a: object, b: object) -> dict[str, object]:
    """``{"$lte": [a, b]}``."""
    return _node("$lte", a, b)


def and_(*operands: object) -> dict[str, object]:
    """``{"$and": [...]}``."""
    return _node("$and", *operands)


def or_(*operands: object) -> dict[str, object]:
    """``{"$or": [...]}``."""
    return _node("$or", *operands)


def not_(operand: object) -> dict[str, object]:
    """``{"$not": operand}``."""
    return {"$not": operand}


def add(*operands: object) -> dict[str, object]:
    """``{"$add": [...]}``."""
    return _node("$add", *operands)


def sub(*operands: object) -> dict[str, object]:
    """``{"$sub": [...]}``."""
    return _node("$sub", *operands)


def mul(*operands: object) -> dict[str, object]:
    """``{"$mul": [...]}``."""
    return _node("$mul", *operands)


def div(a: object, b: object) -> dict[str, object]:
    """``{"$div": [a, b]}``."""
    return _node("$div", a, b)


def mod(a: object, b: object) -> dict[str, object]:
    """``{"$mod": [a, b]}``."""
    return _node("$mod", a, b)


def neg(operand: object) -> dict[str, object]:
    """``{"$neg": operand}``."""
    return {"$neg": operand}


def length(operand: object) -> dict[str, object]:
    """``{"$len": operand}``."""
    return {"$len": operand}


def concat(*operands: object) -> dict[str, object]:
    """``{"$concat": [...]}``."""
    return _node("$concat", *operands)


def in_(needle: object, haystack: object) -> dict[str, object]:
    """``{"$in": [needle, haystack]}``."""
    return _node("$in", needle, haystack)


def coalesce(*operands: object) -> dict[str, object]:
    """``{"$coalesce": [...]}``."""
    return _node("$coalesce", *operands)


def case(*branches: tuple[object, object], else_: object) -> dict[str, object]:
    """``{"$case": {"branches": [{"when": w, "then": t}, ...], "else": else_}}``."""
    return {
        "$case": {
            "branches": [{"when": when, "then": then} for when, then in branches],
            "else": else_,
        }
    }
