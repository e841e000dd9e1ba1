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
import math
from collections.abc import Callable
from decimal import Decimal
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any, Final


class NotCanonicalizable(ValueError):
    """The value has no canonical JSON form (a set, a datetime, NaN, a non-string key ...)."""


def _prebuilt(
    *, sort_keys: bool, separators: tuple[str, str], allow_nan: bool
) -> Callable[[Any], str]:
    """A function that gives exactly ``json.dumps(value, ensure_ascii=True, ...)`` with these
    options, for less client CPU.

    ``json.dumps`` (and ``JSONEncoder.encode``) builds a fresh C encoder on every call, with a
    dict for cycle detection; for the small values the engine encodes (about fifty per saga:
    ledger details and chain links, fingerprints, JSON columns) that set-up was most of the
    cost (``docs/benchmarks-log.md``, item 28). This one builds the C encoder once, without the
    cycle dict, so it holds no state between calls and may be shared by threads. A value the
    C encoder recurses on without end (a cycle, or nesting deeper than the interpreter's limit)
    is handed to the reference encoder, which raises what ``json.dumps`` raises for it."""
    item_separator, key_separator = separators
    reference = json.JSONEncoder(
        sort_keys=sort_keys, separators=separators, ensure_ascii=True, allow_nan=allow_nan
    )
    if c_make_encoder is None:  # pragma: no cover  (no C accelerator: not CPython)
        return reference.encode
    chunks = c_make_encoder(
        None,  # no cycle dict: see above
        reference.default,  # raises TypeError("Object of type ... is not JSON serializable")
        encode_basestring_ascii,
        None,  # no indent
        key_separator,
        item_separator,
        sort_keys,
        False,  # skipkeys
        allow_nan,
    )

    def encode(value: Any) -> str:
        try:
            return "".join(chunks(value, 0))
        except RecursionError:
            return reference.encode(value)

    return encode


_canonical = _prebuilt(sort_keys=True, separators=(",", ":"), allow_nan=False)

#: ``json.dumps(value)`` with its defaults, prebuilt: the stores' JSON-column serializer
#: (``ledger.dialects.create_engine``), so the text written is what SQLAlchemy's default wrote.
plain_json = _prebuilt(sort_keys=False, separators=(", ", ": "), allow_nan=True)


def canonical_json(value: Any) -> str:
    """The canonical JSON text of ``value``; raises :class:`NotCanonicalizable` if it has none."""
    try:
        return _canonical(value)
    except (TypeError, ValueError) as exc:
        raise NotCanonicalizable(str(exc)) from exc


#: An empty SHA-256 state that every digest starts from as a copy. Why: on Python 3.11,
#: ``hashlib.sha256()`` looks the digest up in OpenSSL 3's provider registry on every call
#: (a global lock and a name lookup); copying a state skips that. A saga takes about twenty
#: digests (its ledger rows' links, its keys and fingerprints): 1.8 µs each measured inside
#: the bench's run, 1.4 to 1.5 µs from a copy (``docs/benchmarks-log.md``, item 49). ``copy()``
#: holds the object's own lock, so threads may share it.
_SHA256 = hashlib.sha256()


def sha256_hex(text: str) -> str:
    """Hex SHA-256 of ``text`` encoded as UTF-8 (canonical JSON is pure ASCII anyway)."""
    digest = _SHA256.copy()
    digest.update(text.encode("utf-8"))
    return digest.hexdigest()


def fingerprint(value: Any) -> str:
    """SHA-256 of the canonical JSON of ``value``: the payload fingerprint and definition digest."""
    return sha256_hex(canonical_json(value))


#: From this magnitude on, Python writes a float with an exponent (``1e+16``), and PostgreSQL's
#: JSONB keeps it as the decimal integer it denotes and gives it back as one
#: (``10000000000000000``): a fingerprint taken over the float then misses the one taken over the
#: reloaded value. Every float this large is an integer already (a double has 53 bits of
#: mantissa), so :func:`jsonb_stable` writes it as one before anything is fingerprinted.
JSONB_INTEGRAL_FROM: Final = 1e16


def _stable_float(value: float) -> int | float:
    """The number PostgreSQL's JSONB gives back for ``value``: the integer its shortest
    decimal form denotes from :data:`JSONB_INTEGRAL_FROM` on (JSONB keeps that decimal, not
    the binary value: ``int(1.5e300)`` is not ``15`` followed by zeros), and ``0.0`` for
    ``-0.0`` (JSONB's numeric has no negative zero)."""
    if _negative_zero(value):
        return 0.0
    if math.isfinite(value) and abs(value) >= JSONB_INTEGRAL_FROM:
        return int(Decimal(repr(value)))
    return value


def _negative_zero(value: float) -> bool:
    return value == 0.0 and math.copysign(1.0, value) < 0


def _needs_stable(value: float) -> bool:
    return _negative_zero(value) or (math.isfinite(value) and abs(value) >= JSONB_INTEGRAL_FROM)


def jsonb_stable(value: Any) -> Any:
    """``value`` as PostgreSQL's JSONB stores and returns it, so that a fingerprint taken now
    equals one taken over the value read back, on both backends alike: floats of magnitude
    1e16 or more become the integers they denote, ``-0.0`` becomes ``0.0`` (see
    :func:`_stable_float`). Every other value is unchanged; ``value`` itself is returned when
    nothing in it changes, and otherwise a copy of its dicts and lists with the numbers
    replaced. The same number either way: JSON does not tell ``1e16`` from
    ``10000000000000000``.

    Applied where numbers enter (inputs, definitions) and where expressions make or copy them
    (:mod:`orchestrator.expressions`), before any fingerprint; never inside
    :func:`canonical_json`, whose text must stay what ``json.dumps`` gives for the digest
    recipe callers follow."""
    if type(value) is float:
        return _stable_float(value)
    if not _holds_unstable(value):
        return value
    holder: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(value, holder, 0)]
    while stack:
        source, parent, slot = stack.pop()
        if isinstance(source, float) and not isinstance(source, bool):
            result: Any = _stable_float(source)
        elif isinstance(source, dict):
            result = dict.fromkeys(source)
            stack.extend((member, result, key) for key, member in source.items())
        elif isinstance(source, (list, tuple)):
            result = [None] * len(source)
            stack.extend((member, result, index) for index, member in enumerate(source))
        else:
            result = source
        parent[slot] = result
    return holder[0]


def _holds_unstable(value: Any) -> bool:
    """Whether ``value`` holds a float that :func:`jsonb_stable` would change."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is float:
            if _needs_stable(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


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
