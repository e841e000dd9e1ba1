"""SQLite: the ledger's (tx_id, seq) index goes; its (tx_id, prev_hash) unique index serves.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

On SQLite ``seq`` is the rowid, and every index entry already carries the rowid: the unique
``(tx_id, prev_hash)`` index (the chain's fork guard) finds a transaction's rows and their
``seq`` without reading the table, so ``ix_ledger_tx_seq`` was a second copy of it. Every
local transaction appends ledger rows, and each index a commit touches is one more page in
the WAL: dropping it made a saga about 12 % cheaper in client CPU (``docs/benchmarks-log.md``).

PostgreSQL keeps the index: there a btree entry carries no ``seq``, and the index keeps the
"newest row of one transaction" lookups (``ORDER BY seq DESC LIMIT 1``) independent of how the
planner estimates ``tx_id``'s selectivity.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.drop_index("ix_ledger_tx_seq", table_name="ledger")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.create_index("ix_ledger_tx_seq", "ledger", ["tx_id", "seq"])
