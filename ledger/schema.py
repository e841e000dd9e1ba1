"""One SQLAlchemy Core schema for agent-txn's own database, run unchanged on SQLite and PostgreSQL.

Conventions that hold for every table:

* Timestamps are ``BIGINT`` milliseconds since the Unix epoch. Lease expiry compares them with the
  **database** clock (see :func:`ledger.dialects.db_now_ms`), so the type must be one both backends
  do arithmetic on without dialect-specific interval types (DBOS does the same).
* ``operations``, ``compensation_steps`` and ``outbox`` share one effect state machine and therefore
  one set of effect columns (``state``, ``claimed_from``, lease, ``fence``, ...), so one
  repository (:mod:`ledger.effects`) serves all three.
* CHECK constraints make the database refuse impossible shapes too: an ``executing`` row has an
  owner, a lease and a fence; a ``pending`` row has no owner; a ``confirmed`` row has a remote id.
* ``ledger.detail`` is the canonical JSON *text*, not a JSON column: the hash chain is computed over
  exact bytes, and JSONB would re-serialise them.

The Alembic migrations in ``ledger/migrations`` create exactly this; a test compares the two.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from ledger.states import EffectState, TxState

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

#: JSON documents: JSONB on PostgreSQL, JSON text on SQLite; Python ``None`` is SQL NULL.
Json = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
#: Auto-incrementing 64-bit key (SQLite only auto-increments a plain INTEGER PRIMARY KEY).
SeqId = BigInteger().with_variant(Integer(), "sqlite")

_TX_STATES = ", ".join(f"'{s.value}'" for s in TxState)
_EFFECT_STATES = ", ".join(f"'{s.value}'" for s in EffectState)
_RETIRED = f"'{TxState.FAILED.value}', '{TxState.COMPENSATED.value}'"

saga_definitions = Table(
    "saga_definitions",
    metadata,
    Column("digest", String(64), primary_key=True),  # sha256 of the canonical definition
    Column("name", String(200), nullable=False),
    Column("definition", Json, nullable=False),
    Column("created_at", BigInteger, nullable=False),
)

transactions = Table(
    "transactions",
    metadata,
    Column("tx_id", String(64), primary_key=True),
    Column(
        "definition_digest",
        String(64),
        ForeignKey("saga_definitions.digest"),
        nullable=False,
    ),
    Column("saga_name", String(200), nullable=False),
    Column("business_key", String(256), nullable=True),
    Column("inputs", Json, nullable=False),
    Column("status", String(32), nullable=False),
    Column("lease_owner", String(128), nullable=True),
    Column("lease_until", BigInteger, nullable=True),
    Column("fence", BigInteger, nullable=False, server_default=text("0")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("next_attempt_at", BigInteger, nullable=True),
    Column("error", Json, nullable=True),  # {code, message, step?}: safe text only
    Column("execution_id", String(64), nullable=True),  # the audit record (commands layer)
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    CheckConstraint(f"status IN ({_TX_STATES})", name="status"),
    CheckConstraint("fence >= 0", name="fence"),
)
# A business intent has at most one live transaction: two idempotency keys for order 42 cannot
# both charge it. Failed and compensated attempts are retired and no longer hold the key.
Index(
    "uq_transactions_business_key_live",
    transactions.c.business_key,
    unique=True,
    postgresql_where=text(f"business_key IS NOT NULL AND status NOT IN ({_RETIRED})"),
    sqlite_where=text(f"business_key IS NOT NULL AND status NOT IN ({_RETIRED})"),
)
Index("ix_transactions_status_next", transactions.c.status, transactions.c.next_attempt_at)


def _effect_columns() -> list[Column[Any]]:
    """Columns of the shared effect state machine (fresh objects per table)."""
    return [
        Column("provider", String(100), nullable=False),
        Column("action", String(100), nullable=False),
        Column("ordinal", Integer, nullable=False),
        Column("payload", Json, nullable=True),  # canonical payload, rendered before the claim
        Column("payload_sha256", String(64), nullable=True),
        Column("state", String(32), nullable=False),
        Column("claimed_from", String(32), nullable=True),  # state the last claim took it from
        Column("lease_owner", String(128), nullable=True),
        Column("lease_until", BigInteger, nullable=True),
        Column("fence", BigInteger, nullable=False, server_default=text("0")),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("lookups", Integer, nullable=False, server_default=text("0")),
        Column("first_attempt_at", BigInteger, nullable=True),
        Column("next_attempt_at", BigInteger, nullable=True),
        Column("remote_id", String(256), nullable=True),
        Column("result", Json, nullable=True),
        Column("last_error", Text, nullable=True),  # safe, bounded text; never provider bodies
        Column("updated_at", BigInteger, nullable=False),
    ]


def _effect_checks() -> list[CheckConstraint]:
    return [
        CheckConstraint(f"state IN ({_EFFECT_STATES})", name="state"),
        CheckConstraint(
            "state <> 'executing' OR (lease_owner IS NOT NULL AND lease_until IS NOT NULL"
            " AND fence > 0)",
            name="executing_has_lease",
        ),
        CheckConstraint("state <> 'pending' OR lease_owner IS NULL", name="pending_unowned"),
        CheckConstraint("state <> 'confirmed' OR remote_id IS NOT NULL", name="confirmed_has_id"),
        CheckConstraint("fence >= 0", name="fence"),
    ]


operations = Table(
    "operations",
    metadata,
    Column("op_key", String(64), primary_key=True),
    Column("tx_id", String(64), ForeignKey("transactions.tx_id"), nullable=False),
    Column("step", String(100), nullable=False),
    *_effect_columns(),
    *_effect_checks(),
    UniqueConstraint("tx_id", "step"),
)

compensation_steps = Table(
    "compensation_steps",
    metadata,
    Column("op_key", String(64), primary_key=True),
    Column("tx_id", String(64), ForeignKey("transactions.tx_id"), nullable=False),
    Column("forward_op_key", String(64), ForeignKey("operations.op_key"), nullable=False),
    Column("step", String(100), nullable=False),  # the forward step's name
    *_effect_columns(),
    *_effect_checks(),
    UniqueConstraint("forward_op_key"),  # exactly one reversal per forward op
)

outbox = Table(
    "outbox",
    metadata,
    Column("event_key", String(64), primary_key=True),
    Column("tx_id", String(64), ForeignKey("transactions.tx_id"), nullable=False),
    Column("kind", String(100), nullable=False),  # the event's name in the saga definition
    *_effect_columns(),
    *_effect_checks(),
    UniqueConstraint("tx_id", "kind"),
)
# operations and outbox are found by tx through their unique (tx_id, …) keys already.
Index("ix_compensation_steps_tx", compensation_steps.c.tx_id)
for _table in (operations, compensation_steps, outbox):
    Index(f"ix_{_table.name}_state_next", _table.c.state, _table.c.next_attempt_at)

ledger = Table(
    "ledger",
    metadata,
    Column("seq", SeqId, primary_key=True, autoincrement=True),
    Column("tx_id", String(64), ForeignKey("transactions.tx_id"), nullable=False),
    Column("subject", String(64), nullable=True),  # op_key / event_key, or NULL for the tx itself
    Column("action", String(64), nullable=False),
    Column("from_state", String(32), nullable=True),
    Column("to_state", String(32), nullable=True),
    Column("detail", Text, nullable=False),  # canonical JSON text (hashed as is)
    Column("created_at", BigInteger, nullable=False),
    Column("prev_hash", String(64), nullable=False),
    Column("hash", String(64), nullable=False),
    # One successor per link: two writers appending to the same chain cannot fork it.
    UniqueConstraint("tx_id", "prev_hash"),
)
Index("ix_ledger_tx_seq", ledger.c.tx_id, ledger.c.seq)

EFFECT_TABLES = {"operation": operations, "compensation": compensation_steps, "outbox": outbox}
