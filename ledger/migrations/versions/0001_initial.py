"""Initial schema: sagas, transactions, effects (operations, compensation steps, outbox), ledger.

Revision ID: 0001
Revises:
Create Date: 2024-06-01

A frozen copy of ``ledger/schema.py`` as of this revision. It must never import the live schema:
later schema edits ship as new revisions and must not rewrite this one. Constraint names are
spelled out (``op.f``) exactly as the naming convention of ``ledger.schema`` generates them.

The ``ledger`` table is append-only, enforced by the database: triggers refuse UPDATE and DELETE
on both backends, and TRUNCATE on PostgreSQL (SQLite has no TRUNCATE; ``DELETE`` is its only way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TX_STATES = (
    "'staged', 'prepared', 'executing', 'validating', 'committed', 'compensating', "
    "'compensated', 'failed', 'manual_review'"
)
_EFFECT_STATES = (
    "'pending', 'executing', 'unknown', 'confirmed', 'failed', 'manual_review', 'skipped'"
)
_BUSINESS_KEY_LIVE = "business_key IS NOT NULL AND status NOT IN ('failed', 'compensated')"
_APPEND_ONLY = "ledger is append-only"

_EFFECT_TABLES = ("operations", "compensation_steps", "outbox")


def _json() -> sa.types.TypeEngine[Any]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _effect_columns() -> list[sa.Column[Any]]:
    """The shared effect state machine's columns (fresh objects per table)."""
    return [
        sa.Column("provider", sa.String(100), nullable=False),
        sa.Column("action", sa.String(100), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("payload", _json(), nullable=True),
        sa.Column("payload_sha256", sa.String(64), nullable=True),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("claimed_from", sa.String(32), nullable=True),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_until", sa.BigInteger(), nullable=True),
        sa.Column("fence", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("lookups", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("first_attempt_at", sa.BigInteger(), nullable=True),
        sa.Column("next_attempt_at", sa.BigInteger(), nullable=True),
        sa.Column("remote_id", sa.String(256), nullable=True),
        sa.Column("result", _json(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
    ]


def _effect_checks(table: str) -> list[sa.CheckConstraint]:
    return [
        sa.CheckConstraint(f"state IN ({_EFFECT_STATES})", name=op.f(f"ck_{table}_state")),
        sa.CheckConstraint(
            "state <> 'executing' OR (lease_owner IS NOT NULL AND lease_until IS NOT NULL"
            " AND fence > 0)",
            name=op.f(f"ck_{table}_executing_has_lease"),
        ),
        sa.CheckConstraint(
            "state <> 'pending' OR lease_owner IS NULL", name=op.f(f"ck_{table}_pending_unowned")
        ),
        sa.CheckConstraint(
            "state <> 'confirmed' OR remote_id IS NOT NULL",
            name=op.f(f"ck_{table}_confirmed_has_id"),
        ),
        sa.CheckConstraint("fence >= 0", name=op.f(f"ck_{table}_fence")),
    ]


def upgrade() -> None:
    op.create_table(
        "saga_definitions",
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("definition", _json(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_saga_definitions")),
    )

    op.create_table(
        "transactions",
        sa.Column("tx_id", sa.String(64), nullable=False),
        sa.Column("definition_digest", sa.String(64), nullable=False),
        sa.Column("saga_name", sa.String(200), nullable=False),
        sa.Column("business_key", sa.String(256), nullable=True),
        sa.Column("inputs", _json(), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_until", sa.BigInteger(), nullable=True),
        sa.Column("fence", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("next_attempt_at", sa.BigInteger(), nullable=True),
        sa.Column("error", _json(), nullable=True),
        sa.Column("execution_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("tx_id", name=op.f("pk_transactions")),
        sa.ForeignKeyConstraint(
            ["definition_digest"],
            ["saga_definitions.digest"],
            name=op.f("fk_transactions_definition_digest_saga_definitions"),
        ),
        sa.CheckConstraint(f"status IN ({_TX_STATES})", name=op.f("ck_transactions_status")),
        sa.CheckConstraint("fence >= 0", name=op.f("ck_transactions_fence")),
    )
    op.create_index(
        op.f("uq_transactions_business_key_live"),
        "transactions",
        ["business_key"],
        unique=True,
        postgresql_where=sa.text(_BUSINESS_KEY_LIVE),
        sqlite_where=sa.text(_BUSINESS_KEY_LIVE),
    )
    op.create_index(
        op.f("ix_transactions_status_next"), "transactions", ["status", "next_attempt_at"]
    )

    op.create_table(
        "operations",
        sa.Column("op_key", sa.String(64), nullable=False),
        sa.Column("tx_id", sa.String(64), nullable=False),
        sa.Column("step", sa.String(100), nullable=False),
        *_effect_columns(),
        sa.PrimaryKeyConstraint("op_key", name=op.f("pk_operations")),
        sa.ForeignKeyConstraint(
            ["tx_id"], ["transactions.tx_id"], name=op.f("fk_operations_tx_id_transactions")
        ),
        sa.UniqueConstraint("tx_id", "step", name=op.f("uq_operations_tx_id_step")),
        *_effect_checks("operations"),
    )

    op.create_table(
        "compensation_steps",
        sa.Column("op_key", sa.String(64), nullable=False),
        sa.Column("tx_id", sa.String(64), nullable=False),
        sa.Column("forward_op_key", sa.String(64), nullable=False),
        sa.Column("step", sa.String(100), nullable=False),
        *_effect_columns(),
        sa.PrimaryKeyConstraint("op_key", name=op.f("pk_compensation_steps")),
        sa.ForeignKeyConstraint(
            ["tx_id"],
            ["transactions.tx_id"],
            name=op.f("fk_compensation_steps_tx_id_transactions"),
        ),
        sa.ForeignKeyConstraint(
            ["forward_op_key"],
            ["operations.op_key"],
            name=op.f("fk_compensation_steps_forward_op_key_operations"),
        ),
        sa.UniqueConstraint("forward_op_key", name=op.f("uq_compensation_steps_forward_op_key")),
        *_effect_checks("compensation_steps"),
    )

    op.create_table(
        "outbox",
        sa.Column("event_key", sa.String(64), nullable=False),
        sa.Column("tx_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(100), nullable=False),
        *_effect_columns(),
        sa.PrimaryKeyConstraint("event_key", name=op.f("pk_outbox")),
        sa.ForeignKeyConstraint(
            ["tx_id"], ["transactions.tx_id"], name=op.f("fk_outbox_tx_id_transactions")
        ),
        sa.UniqueConstraint("tx_id", "kind", name=op.f("uq_outbox_tx_id_kind")),
        *_effect_checks("outbox"),
    )

    for table in _EFFECT_TABLES:
        if table == "compensation_steps":  # the others lead their unique key with tx_id
            op.create_index(op.f(f"ix_{table}_tx"), table, ["tx_id"])
        op.create_index(op.f(f"ix_{table}_state_next"), table, ["state", "next_attempt_at"])

    op.create_table(
        "ledger",
        # BIGSERIAL on PostgreSQL; INTEGER PRIMARY KEY (the rowid) on SQLite.
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("tx_id", sa.String(64), nullable=False),
        sa.Column("subject", sa.String(64), nullable=True),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("from_state", sa.String(32), nullable=True),
        sa.Column("to_state", sa.String(32), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_ledger")),
        sa.ForeignKeyConstraint(
            ["tx_id"], ["transactions.tx_id"], name=op.f("fk_ledger_tx_id_transactions")
        ),
        sa.UniqueConstraint("tx_id", "prev_hash", name=op.f("uq_ledger_tx_id_prev_hash")),
    )
    op.create_index(op.f("ix_ledger_tx_seq"), "ledger", ["tx_id", "seq"])

    _create_append_only_triggers()


def downgrade() -> None:
    _drop_append_only_triggers()

    op.drop_index(op.f("ix_ledger_tx_seq"), table_name="ledger")
    op.drop_table("ledger")
    for table in reversed(_EFFECT_TABLES):
        op.drop_index(op.f(f"ix_{table}_state_next"), table_name=table)
        if table == "compensation_steps":
            op.drop_index(op.f(f"ix_{table}_tx"), table_name=table)
    op.drop_table("outbox")
    op.drop_table("compensation_steps")
    op.drop_table("operations")
    op.drop_index(op.f("ix_transactions_status_next"), table_name="transactions")
    op.drop_index(op.f("uq_transactions_business_key_live"), table_name="transactions")
    op.drop_table("transactions")
    op.drop_table("saga_definitions")


def _dialect() -> str:
    # The migration context's dialect also works offline (``alembic upgrade --sql``).
    return str(op.get_context().dialect.name)


def _create_append_only_triggers() -> None:
    dialect = _dialect()
    if dialect == "postgresql":
        op.execute(
            "CREATE FUNCTION ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$\n"
            "BEGIN\n"
            # SQLSTATE 23001 (restrict_violation): an integrity error, as SQLite's RAISE(ABORT)
            # is, so drivers map both backends' refusal to the same IntegrityError.
            f"    RAISE EXCEPTION '{_APPEND_ONLY}' USING ERRCODE = 'restrict_violation';\n"
            "END;\n"
            "$$"
        )
        op.execute(
            "CREATE TRIGGER ledger_append_only_update BEFORE UPDATE ON ledger"
            " FOR EACH ROW EXECUTE FUNCTION ledger_append_only()"
        )
        op.execute(
            "CREATE TRIGGER ledger_append_only_delete BEFORE DELETE ON ledger"
            " FOR EACH ROW EXECUTE FUNCTION ledger_append_only()"
        )
        op.execute(
            "CREATE TRIGGER ledger_append_only_truncate BEFORE TRUNCATE ON ledger"
            " FOR EACH STATEMENT EXECUTE FUNCTION ledger_append_only()"
        )
    elif dialect == "sqlite":
        for event in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER ledger_append_only_{event.lower()} BEFORE {event} ON ledger"
                f" BEGIN SELECT RAISE(ABORT, '{_APPEND_ONLY}'); END"
            )
    else:
        raise NotImplementedError(f"agent-txn does not support the {dialect!r} database")


def _drop_append_only_triggers() -> None:
    dialect = _dialect()
    if dialect == "postgresql":
        for event in ("truncate", "delete", "update"):
            op.execute(f"DROP TRIGGER IF EXISTS ledger_append_only_{event} ON ledger")
        op.execute("DROP FUNCTION IF EXISTS ledger_append_only()")
    elif dialect == "sqlite":
        for event in ("delete", "update"):
            op.execute(f"DROP TRIGGER IF EXISTS ledger_append_only_{event}")
