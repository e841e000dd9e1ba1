"""ledger.store.ledger_hash: the link a ledger row carries is SHA-256 over the canonical JSON of
its eight linked values, as the standard library's encoder writes it. The format must not
drift: every chain already written is verified by recomputing these links."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.canonical import NotCanonicalizable
from ledger.store import ledger_hash


def _reference(*values: Any) -> str:
    """The link as the ledger's format defines it, through the standard library's encoder."""
    text = json.dumps(
        list(values), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


_text = st.text()  # any code point, surrogates, quotes and control characters included
_maybe = st.one_of(st.none(), _text)


#: prev_hash, tx_id, subject, action, from_state, to_state, detail, created_at
_rows = st.tuples(_text, _text, _maybe, _text, _maybe, _maybe, _text, st.integers(-(2**70), 2**70))


@given(values=_rows)
def test_the_link_is_sha256_of_the_canonical_row(values: tuple[Any, ...]) -> None:
    assert ledger_hash(*values) == _reference(*values)


def test_a_known_row_keeps_its_link() -> None:
    # Pinned: a change of the link's text would leave every chain already written failing
    # verification.
    link = ledger_hash(
        "0" * 64, "tx-1", None, "create", None, "running", '{"a":"é"}', 1733300000000
    )
    assert link == "4e9f91e0bf14765728859e9d6599f6e9186f060b561c2dc7362225d74c07c3b4"


@pytest.mark.parametrize("created_at", [True, 1.5, 10**3 + 0.0])
def test_a_time_that_is_not_an_int_is_written_as_json_writes_it(created_at: Any) -> None:
    values = ("0" * 64, "tx-1", "op", "claim", "pending", "executing", "{}", created_at)
    assert ledger_hash(*values) == _reference(*values)


@pytest.mark.parametrize("subject", [7, ["op"], {"k": 1}])
def test_a_value_of_another_type_is_written_as_json_writes_it(subject: Any) -> None:
    values = ("0" * 64, "tx-1", subject, "claim", None, None, "{}", 1)
    assert ledger_hash(*values) == _reference(*values)


def test_a_value_json_cannot_write_is_refused() -> None:
    with pytest.raises(NotCanonicalizable):
        ledger_hash("0" * 64, "tx-1", None, "claim", None, None, "{}", float("nan"))  # type: ignore[arg-type]
