"""Stable idempotency keys: one per intent, derived once at prepare and persisted.

``op_key`` hashes the canonical tuple (tenant, environment, provider, tx_id, step, definition
version). It is computed and stored before any provider call; recovery reads it back and never
derives a new one (a restarted process with a fresh UUID would look like a new request to the
provider). Compensation and outbox keys derive from the same inputs plus a role, so they are just
as stable. 32 hex characters (128 bits) leave collisions out of reach.
"""

from __future__ import annotations

import re

from ledger.canonical import canonical_json, sha256_hex

KEY_HEX_LENGTH = 32
#: Caller-chosen ids (tx ids, business keys) use this alphabet; blank or empty is refused.
IDENTIFIER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,199}$")


def _derive(*parts: object) -> str:
    return sha256_hex(canonical_json(list(parts)))[:KEY_HEX_LENGTH]


def op_key(
    *, tenant: str, environment: str, provider: str, tx_id: str, step: str, version: int
) -> str:
    """The idempotency key of a forward step."""
    return _derive("op", tenant, environment, provider, tx_id, step, version)


def compensation_key(forward_op_key: str) -> str:
    """The idempotency key of the reversal of ``forward_op_key`` (one reversal per op)."""
    return _derive("compensate", forward_op_key)


def event_key(
    *, tenant: str, environment: str, provider: str, tx_id: str, event: str, version: int
) -> str:
    """The idempotency key of an after-commit outbox event."""
    return _derive("outbox", tenant, environment, provider, tx_id, event, version)


def is_identifier(value: object) -> bool:
    """True for a non-blank id of at most 200 characters from :data:`IDENTIFIER_RE`."""
    return isinstance(value, str) and IDENTIFIER_RE.fullmatch(value) is not None
