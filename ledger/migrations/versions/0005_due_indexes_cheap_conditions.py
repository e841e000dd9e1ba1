"""Due effects are found through partial indexes that hold only unsettled effects; the
business-key index's condition is written with inequalities.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03

* ``ix_<effects>_due (next_attempt_at, tx_id) WHERE state = 'executing' OR … 'pending' OR …
  'unknown'`` replaces ``ix_<effects>_state_next (state, next_attempt_at)`` for operations,
  compensation steps and the outbox. A recovery pass reads due effects in that order; a settled
  effect leaves the index (the happy path's last update of an effect removes its entry instead
  of moving it), so the index is the size of the work in hand, not of the history. The queries
  write the same condition literally (``ledger.schema.one_of_literals``), which is what lets
  SQLite, and PostgreSQL's generic plans, prove the index applies.
* ``uq_transactions_business_key_live`` is made again with ``status != 'failed' AND status !=
  'compensated'`` in place of ``status NOT IN ('failed', 'compensated')``. SQLite evaluates a
  partial index's condition on every write of the row, and a constant ``IN`` list there builds a
  temporary b-tree each time: about 10 µs per insert-and-update here, against 4 µs for the row
  itself (``docs/benchmarks-log.md``, item 34). The new indexes are written with equalities for
  the same reason.

* SQLite: the ``CHECK`` constraints on ``transactions.status`` and on the effects' ``state``
  are rewritten from ``IN (…)`` to ``OR``-ed equalities, the same set. They are evaluated on
  every write of those rows, about a dozen per saga, and the ``IN`` list cost a temporary
  b-tree each time: 7 % of a saga's instructions (``docs/benchmarks-log.md``, item 34). SQLite
  cannot alter a constraint, and rebuilding these tables would mean dropping ``transactions``
  under the foreign keys that point at it; the change leaves every stored byte as it is and
  accepts exactly the rows it accepted before, so it is made the way SQLite documents for such
  changes (``ALTER TABLE``, "Making Other Kinds Of Table Schema Changes"): the tables' stored
  definitions are edited under ``writable_schema`` in this migration's transaction, the schema
  version is bumped, and ``integrity_check`` must pass. PostgreSQL keeps ``IN`` (there it is one
  array comparison, and a longer expression is more for every statement to read back).

Transactions keep ``ix_transactions_status_next``: the claim pass reads the four in-flight
statuses through it, and the review list reads parked ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

EFFECT_TABLES = ("operations", "compensation_steps", "outbox")
# Literal on purpose: a migration is a fixed point in history, not today's state sets. Written
# as the schema writes them (``ledger.schema.one_of_literals``): equalities, not ``IN (…)``.
UNSETTLED = "state = 'executing' OR state = 'pending' OR state = 'unknown'"
LIVE_KEY = "business_key IS NOT NULL AND status != 'failed' AND status != 'compensated'"
LIVE_KEY_0001 = "business_key IS NOT NULL AND status NOT IN ('failed', 'compensated')"
TX_STATES = (
    "staged",
    "prepared",
    "executing",
    "validating",
    "committed",
    "compensating",
    "compensated",
    "failed",
    "manual_review",
)
EFFECT_STATES = (
    "pending",
    "executing",
    "unknown",
    "confirmed",
    "failed",
    "manual_review",
    "skipped",
)


def _as_in(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _as_equalities(column: str, values: Sequence[str]) -> str:
    return " OR ".join(f"{column} = {v!r}" for v in values)


#: (table, the CHECK's condition as migration 0001 wrote it, as equalities).
SQLITE_CHECKS = [
    ("transactions", _as_in("status", TX_STATES), _as_equalities("status", TX_STATES)),
    *(
        (table, _as_in("state", EFFECT_STATES), _as_equalities("state", EFFECT_STATES))
        for table in EFFECT_TABLES
    ),
]


def _rewrite_sqlite_checks(*, forward: bool) -> None:
    """Edit the stored ``CREATE TABLE`` text of each table, CHECK condition only (see above)."""
    bind = op.get_bind()
    version = int(bind.exec_driver_sql("PRAGMA schema_version").scalar_one())
    bind.exec_driver_sql("PRAGMA writable_schema = ON")
    try:
        for table, as_in, as_equalities in SQLITE_CHECKS:
            old, new = (as_in, as_equalities) if forward else (as_equalities, as_in)
            stored = bind.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
            ).scalar_one()
            clause = f"CHECK ({old})"
            if stored.count(clause) != 1:
                raise RuntimeError(f"{table}: its CHECK is not the one this migration rewrites")
            bind.exec_driver_sql(
                "UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = ?",
                (stored.replace(clause, f"CHECK ({new})"), table),
            )
        bind.exec_driver_sql(f"PRAGMA schema_version = {version + 1}")
    finally:
        bind.exec_driver_sql("PRAGMA writable_schema = OFF")
    problems = [r[0] for r in bind.exec_driver_sql("PRAGMA integrity_check").all()]
    if problems != ["ok"]:
        raise RuntimeError(f"integrity_check after the CHECK rewrite: {problems}")


def _index(name: str, table: str, columns: list[str], where: str, *, unique: bool = False) -> None:
    op.create_index(
        name,
        table,
        columns,
        unique=unique,
        postgresql_where=sa.text(where),
        sqlite_where=sa.text(where),
    )


def _business_key_index(where: str) -> None:
    op.drop_index("uq_transactions_business_key_live", table_name="transactions")
    _index(
        "uq_transactions_business_key_live", "transactions", ["business_key"], where, unique=True
    )


def upgrade() -> None:
    for table in EFFECT_TABLES:
        _index(f"ix_{table}_due", table, ["next_attempt_at", "tx_id"], UNSETTLED)
        op.drop_index(f"ix_{table}_state_next", table_name=table)
    _business_key_index(LIVE_KEY)
    if op.get_bind().dialect.name == "sqlite":
        _rewrite_sqlite_checks(forward=True)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _rewrite_sqlite_checks(forward=False)
    _business_key_index(LIVE_KEY_0001)
    for table in EFFECT_TABLES:
        op.create_index(f"ix_{table}_state_next", table, ["state", "next_attempt_at"])
        op.drop_index(f"ix_{table}_due", table_name=table)
