"""Canonical JSON: the one serialisation every hash in agent-txn is taken over.

Sorted keys, ``,``/``:`` separators with no spaces, non-ASCII escaped (``ensure_ascii``), no NaN or
infinities (they have no JSON form and would make two equal payloads hash differently). The same
helper fingerprints payloads, chains the ledger and digests command definitions, so a digest a
caller computes with any standard JSON library (``json.dumps(obj, sort_keys=True,
separators=(",", ":"), ensure_ascii=True)``) matches ours.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


class NotCanonicalizable(ValueError):
    """The value has no canonical JSON form (a set, a datetime, NaN, a non-string key ...)."""


#: One encoder for every call: ``json.dumps`` with any non-default option builds a new
#: ``JSONEncoder`` each time, and the ledger encodes about fifty values per saga. The text is
#: the same (``dumps`` is this encoder's ``encode``).
_ENCODER = json.JSONEncoder(
    sort_keys=True,
    separators=(",", ":"),
    ensure_ascii=True,
    allow_nan=False,
)


def canonical_json(value: Any) -> str:
    """The canonical JSON text of ``value``; raises :class:`NotCanonicalizable` if it has none."""
    try:
        return _ENCODER.encode(value)
    except (TypeError, ValueError) as exc:
        raise NotCanonicalizable(str(exc)) from exc


def sha256_hex(text: str) -> str:
    """Hex SHA-256 of ``text`` encoded as UTF-8 (canonical JSON is pure ASCII anyway)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprint(value: Any) -> str:
    """SHA-256 of the canonical JSON of ``value``: the payload fingerprint and definition digest."""
    return sha256_hex(canonical_json(value))


def unstorable_text(value: Any) -> bool:
    """True if ``value`` holds a string no backend stores faithfully: a NUL character
    (PostgreSQL text and JSONB refuse it) or a lone surrogate (not encodable as UTF-8)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False
