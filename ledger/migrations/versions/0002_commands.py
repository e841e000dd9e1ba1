"""Commands layer: stored commands, executions, idempotency, principals, settings, callbacks.

Revision ID: 0002
Revises: 0001
Create Date: 2024-07-01

A frozen copy of the "commands layer" section of ``ledger/schema.py`` as of this revision, plus
the nullable ``transactions.context`` column (template scope frozen at prepare). Like 0001 it
never imports the live schema, and every constraint name is spelled out (``op.f``) exactly as the
naming convention of ``ledger.schema`` generates it, so a later schema edit cannot silently
rename what this revision created.

``context`` is added with a plain ``ALTER TABLE … ADD COLUMN`` on both backends: SQLite adds a
nullable column without a default in place, so no batch (copy-and-rename) table rebuild is needed,
and none is wanted: rebuilding ``transactions`` would mean dropping a table that ``operations``,
``outbox`` and ``ledger`` reference. The downgrade's ``DROP COLUMN`` is likewise native (SQLite
3.35+), as the column is in no index or constraint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_EXECUTION_STATUSES = "'running', 'succeeded', 'failed', 'staged', 'manual_review'"
_PRINCIPAL_KINDS = "'user', 'client'"
_PERMISSIONS = "'execute', 'read', 'manage', 'approve'"
_CALLBACK_EVENTS = "'succeeded', 'failed', 'staged'"
_CALLBACK_STATES = "'pending', 'running', 'delivered', 'failed'"

#: Created in this order (foreign keys point backwards), dropped in the reverse.
_TABLES = (
    "commands",
    "executions",
    "idempotency_reservations",
    "principals",
    "grants",
    "room_members",
    "action_settings",
    "callback_runs",
)
#: (index name, table, columns)
_INDEXES = (
    ("ix_commands_tenant_name", "commands", ["tenant", "name"]),
    ("ix_executions_command_created", "executions", ["command_id", "created_at"]),
    ("ix_executions_tx", "executions", ["tx_id"]),
    ("ix_callback_runs_state_next", "callback_runs", ["state", "next_attempt_at"]),
)


def _json() -> sa.types.TypeEngine[Any]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("transactions", sa.Column("context", _json(), nullable=True))

    op.create_table(
        "commands",
        sa.Column("command_id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(100), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("scope_kind", sa.String(16), nullable=False),
        sa.Column("scope_id", sa.String(64), nullable=False),
        sa.Column("tag_id", sa.String(64), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("definition", _json(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("saga_digest", sa.String(64), nullable=True),
        sa.Column("created_by", sa.String(64), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.Column("deleted_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("command_id", name=op.f("pk_commands")),
        sa.ForeignKeyConstraint(
            ["saga_digest"],
            ["saga_definitions.digest"],
            name=op.f("fk_commands_saga_digest_saga_definitions"),
        ),
        sa.CheckConstraint(
            "scope_kind IN ('company', 'room')", name=op.f("ck_commands_scope_kind")
        ),
        sa.CheckConstraint("version IN (1, 2)", name=op.f("ck_commands_version")),
        sa.CheckConstraint("mode IN ('execute', 'query')", name=op.f("ck_commands_mode")),
    )

    op.create_table(
        "executions",
        sa.Column("execution_id", sa.String(64), nullable=False),
        sa.Column("command_id", sa.String(64), nullable=False),
        sa.Column("command_digest", sa.String(64), nullable=False),
        sa.Column("tx_id", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("invoker_kind", sa.String(8), nullable=False),
        sa.Column("invoker_id", sa.String(64), nullable=False),
        sa.Column("actor_bucket", sa.String(80), nullable=False),
        sa.Column("idempotency_key", sa.String(128), nullable=True),
        sa.Column("origin", sa.String(16), nullable=False),
        sa.Column("input_snapshot", _json(), nullable=False),
        sa.Column("authorization_snapshot", _json(), nullable=False),
        sa.Column("steps", _json(), nullable=True),
        sa.Column("result_refs", _json(), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("response", _json(), nullable=True),
        sa.Column("lifecycle_snapshot", _json(), nullable=True),
        sa.Column("staged_change_id", sa.String(64), nullable=True),
        sa.Column("room_id", sa.String(64), nullable=True),
        sa.Column("duration_ms", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("execution_id", name=op.f("pk_executions")),
        sa.ForeignKeyConstraint(
            ["command_id"],
            ["commands.command_id"],
            name=op.f("fk_executions_command_id_commands"),
        ),
        sa.CheckConstraint(f"status IN ({_EXECUTION_STATUSES})", name=op.f("ck_executions_status")),
        sa.CheckConstraint(
            f"invoker_kind IN ({_PRINCIPAL_KINDS})", name=op.f("ck_executions_invoker_kind")
        ),
        sa.CheckConstraint("origin IN ('manual', 'agent')", name=op.f("ck_executions_origin")),
    )

    op.create_table(
        "idempotency_reservations",
        sa.Column("command_id", sa.String(64), nullable=False),
        sa.Column("actor_bucket", sa.String(80), nullable=False),
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("execution_id", sa.String(64), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(
            "command_id", "actor_bucket", "key", name=op.f("pk_idempotency_reservations")
        ),
    )

    op.create_table(
        "principals",
        sa.Column("principal_id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(100), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("verified", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("disabled", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("api_key_sha256", sa.String(64), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("deleted_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("principal_id", name=op.f("pk_principals")),
        sa.UniqueConstraint("api_key_sha256", name=op.f("uq_principals_api_key_sha256")),
        sa.CheckConstraint(f"kind IN ({_PRINCIPAL_KINDS})", name=op.f("ck_principals_kind")),
    )

    op.create_table(
        "grants",
        sa.Column("grant_id", sa.String(64), nullable=False),
        sa.Column("principal_id", sa.String(64), nullable=False),
        sa.Column("provider", sa.String(100), nullable=False),
        sa.Column("action", sa.String(100), nullable=False),
        sa.Column("permission", sa.String(16), nullable=False),
        sa.Column("max_amount", sa.BigInteger(), nullable=True),
        sa.Column("amount_field", sa.String(100), nullable=True),
        sa.Column("readable_fields", _json(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("grant_id", name=op.f("pk_grants")),
        sa.ForeignKeyConstraint(
            ["principal_id"],
            ["principals.principal_id"],
            name=op.f("fk_grants_principal_id_principals"),
        ),
        sa.UniqueConstraint(
            "principal_id",
            "provider",
            "action",
            "permission",
            name=op.f("uq_grants_principal_id_provider_action_permission"),
        ),
        sa.CheckConstraint(f"permission IN ({_PERMISSIONS})", name=op.f("ck_grants_permission")),
    )

    op.create_table(
        "room_members",
        sa.Column("room_id", sa.String(64), nullable=False),
        sa.Column("principal_id", sa.String(64), nullable=False),
        sa.Column("language", sa.String(16), nullable=True),
        sa.Column("joined_at", sa.BigInteger(), nullable=False),
        sa.Column("left_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("room_id", "principal_id", name=op.f("pk_room_members")),
        sa.ForeignKeyConstraint(
            ["principal_id"],
            ["principals.principal_id"],
            name=op.f("fk_room_members_principal_id_principals"),
        ),
    )

    op.create_table(
        "action_settings",
        sa.Column("provider", sa.String(100), nullable=False),
        sa.Column("action", sa.String(100), nullable=False),
        sa.Column("requires_approval", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("approval_policy", _json(), nullable=True),
        sa.Column("locked_for", sa.String(100), nullable=True),
        sa.Column("revision", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("provider", "action", name=op.f("pk_action_settings")),
    )

    op.create_table(
        "callback_runs",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("execution_id", sa.String(64), nullable=False),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("payload", _json(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_until", sa.BigInteger(), nullable=True),
        sa.Column("fence", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("next_attempt_at", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_callback_runs")),
        sa.ForeignKeyConstraint(
            ["execution_id"],
            ["executions.execution_id"],
            name=op.f("fk_callback_runs_execution_id_executions"),
        ),
        sa.UniqueConstraint(
            "execution_id",
            "event",
            "target",
            name=op.f("uq_callback_runs_execution_id_event_target"),
        ),
        sa.CheckConstraint(f"event IN ({_CALLBACK_EVENTS})", name=op.f("ck_callback_runs_event")),
        sa.CheckConstraint(f"state IN ({_CALLBACK_STATES})", name=op.f("ck_callback_runs_state")),
        sa.CheckConstraint("attempts <= 5", name=op.f("ck_callback_runs_attempts")),
    )

    for name, table, columns in _INDEXES:
        op.create_index(op.f(name), table, columns)


def downgrade() -> None:
    for name, table, _columns in reversed(_INDEXES):
        op.drop_index(op.f(name), table_name=table)
    for table in reversed(_TABLES):
        op.drop_table(table)
    op.drop_column("transactions", "context")
