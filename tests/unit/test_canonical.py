"""Canonical JSON and the JSON-column serializer give exactly what ``json.dumps`` gives.

What could break: the prebuilt encoders of ``ledger.canonical`` drifting from the standard
library's text (every fingerprint, idempotency key and ledger hash is taken over canonical JSON,
so one different character breaks the chain of every existing ledger and the lookup of every
stored key); an error changing class or message; and an encoder keeping state from one call
into the next (the standard encoder's cycle dict is left dirty by an error).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.canonical import (
    NotCanonicalizable,
    canonical_json,
    fingerprint,
    plain_json,
    sha256_hex,
)

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)  # beyond 64 bits
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()  # non-ASCII, surrogates and control characters included
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


def _reference(value: Any) -> str:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


@given(_values)
def test_canonical_json_is_the_standard_librarys_sorted_compact_ascii_text(value: Any) -> None:
    assert canonical_json(value) == _reference(value)


@given(_values | st.floats())  # NaN and infinities too: a JSON column takes what json.dumps takes
def test_the_json_column_serializer_writes_what_json_dumps_writes(value: Any) -> None:
    assert plain_json(value) == json.dumps(value)


def test_tuples_and_a_top_level_string_encode_as_the_standard_library_does() -> None:
    value = {"b": (1, "é"), "a": ["\u2028", None]}
    assert canonical_json(value) == '{"a":["\\u2028",null],"b":[1,"\\u00e9"]}'
    assert canonical_json("x\ny") == _reference("x\ny")


def test_a_known_fingerprint_does_not_move() -> None:
    # A digest pinned from the standard library's text: stored keys and ledgers depend on it.
    assert fingerprint({"order": "42", "amount": 1999, "items": ["é", 1.5, None, True]}) == (
        "a9cdefe3e452f5404cdcb154e0d9b9c9f34307fe002868d2795ef69a253f2103"
    )


@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",))), max_size=4))
def test_every_digest_starts_from_an_empty_state(texts: list[str]) -> None:
    # The digests copy one shared empty state: one that updated the shared state itself would
    # give the second of two equal inputs another digest.
    for text in texts + texts:
        assert sha256_hex(text) == hashlib.sha256(text.encode("utf-8")).hexdigest()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"x": math.nan}, "Out of range float values are not JSON compliant"),
        ({"x": {1, 2}}, "Object of type set is not JSON serializable"),
        ({1: "a", "b": 2}, "'<' not supported between instances of"),
    ],
    ids=["nan", "set", "mixed-keys"],
)
def test_no_canonical_form_is_the_registrys_error_with_the_standard_message(
    value: Any, message: str
) -> None:
    with pytest.raises(NotCanonicalizable, match=message.replace("(", r"\(")):
        canonical_json(value)
    with pytest.raises((TypeError, ValueError), match=message):
        _reference(value)


def test_a_cycle_is_reported_as_a_cycle_not_as_a_crash() -> None:
    cyclic: dict[str, Any] = {}
    cyclic["self"] = cyclic
    with pytest.raises(NotCanonicalizable, match="Circular reference detected"):
        canonical_json(cyclic)
    with pytest.raises(ValueError, match="Circular reference detected"):
        plain_json(cyclic)


def test_nesting_deeper_than_the_interpreter_allows_raises_as_json_dumps_does() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(RecursionError):
        json.dumps(deep)
    with pytest.raises(RecursionError):
        plain_json(deep)


def test_an_error_leaves_nothing_behind_for_the_next_call() -> None:
    # The standard encoder's cycle dict keeps the ids of the containers it was inside when an
    # error stopped it; an encoder reused with that dict would call this list a cycle next time.
    outer: list[Any] = [[1, 2], {3}]
    with pytest.raises(NotCanonicalizable):
        canonical_json(outer)
    outer[1] = 3
    assert canonical_json(outer) == "[[1,2],3]"
    outer[1] = {3}
    with pytest.raises(TypeError):
        plain_json(outer)
    outer[1] = 3
    assert plain_json(outer) == "[[1, 2], 3]"
