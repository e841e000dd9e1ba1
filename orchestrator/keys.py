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


def tenant_business_key(tenant: str, key: str) -> str:
    """The stored form of ``key`` rendered in ``tenant``: ``{tenant}/{key}``.

    Business keys are unique per tenant, not per database: tenants sharing one database must
    not block one another's orders (nor learn one another's transaction ids from the conflict).
    The tenant goes into the key itself, so the unique index and every lookup by key stay as
    they are. ``%`` and ``/`` in the tenant are escaped (``%25``, ``%2F``), so the first ``/``
    always ends the tenant and two (tenant, key) pairs never share a stored key. Migration 0009
    wrote the keys stored before it in this form with the same escaping. At most 557
    characters (:data:`ledger.schema.STORED_BUSINESS_KEY_LENGTH`): a tenant of 100 characters
    all escaped, the ``/`` and a key of :data:`ledger.schema.BUSINESS_KEY_LENGTH`."""
    escaped = tenant.replace("%", "%25").replace("/", "%2F")
    return f"{escaped}/{key}"


def rendered_business_key(stored: str | None) -> str | None:
    """The key as the command rendered it, from its stored form (:func:`tenant_business_key`):
    what an error's details show the caller, who sent the order id and never saw the tenant
    prefix. Only the caller's own tenant's keys are ever looked up, so nothing is hidden. A
    value without the separator (none is stored so since migration 0009) comes back whole."""
    if stored is None:
        return None
    _, separator, key = stored.partition("/")
    return key if separator else stored


def is_identifier(value: object) -> bool:
    """True for a non-blank id of at most 200 characters from :data:`IDENTIFIER_RE`."""
    return isinstance(value, str) and IDENTIFIER_RE.fullmatch(value) is not None
