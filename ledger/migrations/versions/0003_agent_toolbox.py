"""Agent toolbox: staged actions (private confirmation state) and staged changes (approvals).

Revision ID: 0003
Revises: 0002
Create Date: 2024-08-01

A frozen copy of the "agent toolbox" section of ``ledger/schema.py`` as of this revision, plus an
index on ``executions (room_id, created_at)`` for the delivery window's per-room scan.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "staged_actions",
        sa.Column("token_sha256", sa.String(64), nullable=False),
        sa.Column("execution_id", sa.String(64), nullable=False),
        sa.Column("command_id", sa.String(64), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("room_id", sa.String(64), nullable=True),
        sa.Column("language", sa.String(16), nullable=False),
        sa.Column("invoker_kind", sa.String(8), nullable=False),
        sa.Column("invoker_id", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("token_sha256", name=op.f("pk_staged_actions")),
        sa.ForeignKeyConstraint(
            ["execution_id"],
            ["executions.execution_id"],
            name=op.f("fk_staged_actions_execution_id_executions"),
        ),
        sa.UniqueConstraint("execution_id", name=op.f("uq_staged_actions_execution_id")),
        sa.CheckConstraint(
            "state IN ('pending', 'executed', 'released', 'expired')",
            name=op.f("ck_staged_actions_state"),
        ),
    )
    op.create_table(
        "staged_changes",
        sa.Column("staged_change_id", sa.String(64), nullable=False),
        sa.Column("execution_id", sa.String(64), nullable=False),
        sa.Column("command_id", sa.String(64), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("requested_by", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("decided_by", sa.String(64), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("decided_at", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("staged_change_id", name=op.f("pk_staged_changes")),
        sa.ForeignKeyConstraint(
            ["execution_id"],
            ["executions.execution_id"],
            name=op.f("fk_staged_changes_execution_id_executions"),
        ),
        sa.UniqueConstraint("execution_id", name=op.f("uq_staged_changes_execution_id")),
        sa.CheckConstraint(
            "state IN ('pending', 'approved', 'rejected')",
            name=op.f("ck_staged_changes_state"),
        ),
    )
    op.create_index(op.f("ix_executions_room_created"), "executions", ["room_id", "created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_executions_room_created"), table_name="executions")
    op.drop_table("staged_changes")
    op.drop_table("staged_actions")
