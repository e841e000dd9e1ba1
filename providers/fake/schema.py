"""The fake shop's own tables: a database of its own, never agent-txn's.

Two kinds of state live here, on purpose:

* protocol state — ``effects`` (the idempotency cache, one live entry per provider + key),
  ``fences`` and the ``calls`` request log;
* business state — ``stock``, ``reservations``, ``charges``, ``emails`` — so a compensation that
  answers success but changes nothing shows up as wrong stock or an unrefunded charge.

Times are provider-clock seconds (floats). Created with ``metadata.create_all``: it is a fake,
so there are no migrations.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(column_0_label)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "pk": "pk_%(table_name)s",
    }
)

#: Auto-incrementing key (SQLite only auto-increments a plain INTEGER PRIMARY KEY).
SeqId = BigInteger().with_variant(Integer(), "sqlite")

#: Entry statuses: an effect, a tombstone written by lookup(void_if_missing), or a remembered
#: definite rejection (so the same key keeps answering Rejected, as the contract promises).
EFFECT_STATUSES = ("applied", "voided", "rejected")

effects = Table(
    "effects",
    metadata,
    # A surrogate key, not the idempotency key: after FORGET_KEYS prunes an entry, the same key
    # can name a second, real effect (the double-charge hazard), and both rows must survive.
    Column("seq", SeqId, primary_key=True, autoincrement=True),
    Column("provider", String(64), nullable=False),
    Column("key", String(512), nullable=False),
    Column("action", String(64), nullable=False),
    Column("payload", Text, nullable=False),
    Column("payload_sha256", String(64), nullable=False),
    Column("remote_id", String(64), nullable=True, unique=True),
    Column("result", Text, nullable=True),
    Column("status", String(16), nullable=False),
    Column("reason", Text, nullable=True),
    Column("created_at", Float, nullable=False),
    # Set when the idempotency cache forgot this entry; the effect itself stays real.
    Column("forgotten_at", Float, nullable=True),
    CheckConstraint(
        "status IN (" + ", ".join(f"'{s}'" for s in EFFECT_STATUSES) + ")", name="status"
    ),
    CheckConstraint("status <> 'applied' OR remote_id IS NOT NULL", name="applied_has_remote_id"),
)

#: At most one live (not forgotten) entry per provider + key: the database itself refuses a
#: second effect for one key even if the locking were wrong.
Index(
    "uq_effects_live_key",
    effects.c.provider,
    effects.c.key,
    unique=True,
    sqlite_where=effects.c.forgotten_at.is_(None),
    postgresql_where=effects.c.forgotten_at.is_(None),
)

fences = Table(
    "fences",
    metadata,
    Column("provider", String(64), primary_key=True),
    Column("key", String(512), primary_key=True),
    Column("highest", BigInteger, nullable=False),
)

calls = Table(
    "calls",
    metadata,
    Column("seq", SeqId, primary_key=True, autoincrement=True),
    Column("call", String(8), nullable=False),
    Column("provider", String(64), nullable=False),
    Column("action", String(64), nullable=False),
    Column("key", String(512), nullable=False),
    Column("fence", BigInteger, nullable=True),
    Column("outcome", Text, nullable=False),
    Column("fault", String(32), nullable=True),
    Column("created_effect", Boolean, nullable=False, default=False),
    Column("at", Float, nullable=False),
    CheckConstraint("call IN ('apply', 'lookup')", name="call"),
)
Index("ix_calls_key", calls.c.key)

#: The most units of a SKU the ``stock`` table holds: ``available`` is an INTEGER, 32 bits on
#: PostgreSQL (SQLite's 64 would take more, but one bound keeps the backends alike).
MAX_STOCK = 2**31 - 1
#: The longest SKU, as ``stock.sku`` is declared (PostgreSQL refuses a longer one).
MAX_SKU_LENGTH = 128

stock = Table(
    "stock",
    metadata,
    Column("sku", String(MAX_SKU_LENGTH), primary_key=True),
    Column("available", Integer, nullable=False),
    CheckConstraint("available >= 0", name="available_non_negative"),
)

reservations = Table(
    "reservations",
    metadata,
    Column("reservation_id", String(64), primary_key=True),
    Column("key", String(512), nullable=False),
    Column("sku", String(128), nullable=False),
    Column("quantity", Integer, nullable=False),
    # The release that returned the stock; NULL while the reservation holds it.
    Column("released_by", String(64), nullable=True),
)

charges = Table(
    "charges",
    metadata,
    Column("charge_id", String(64), primary_key=True),
    Column("key", String(512), nullable=False),
    Column("amount", BigInteger, nullable=False),
    Column("currency", String(16), nullable=False),
    Column("refunded", BigInteger, nullable=False),
    CheckConstraint("refunded >= 0 AND refunded <= amount", name="refund_bounds"),
)

emails = Table(
    "emails",
    metadata,
    Column("message_id", String(64), primary_key=True),
    Column("key", String(512), nullable=False),
    Column("to", Text, nullable=False),
    Column("template", Text, nullable=False),
)

__all__ = [
    "EFFECT_STATUSES",
    "MAX_SKU_LENGTH",
    "MAX_STOCK",
    "calls",
    "charges",
    "effects",
    "emails",
    "fences",
    "metadata",
    "reservations",
    "stock",
]
