"""PostgreSQL: the hot path's last foreign keys go (effects → transactions → definitions).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04

Why: the same as 0007's, for the keys 0007 left. Each is a trigger that, per row inserted,
runs ``SELECT 1 FROM <parent> WHERE <key> = $1 FOR KEY SHARE``: a query through the executor
and a row lock. A happy-path saga inserts one transaction (its key to ``saga_definitions``),
two operations and one outbox event (their keys to ``transactions``): four such checks per
saga, after 0007 removed the ledger's thirteen.

What the keys guarded still holds without them:

* No parent is ever deleted. Nothing in agent-txn deletes a transaction (0007's statement
  triggers refuse ``DELETE`` and ``TRUNCATE`` of ``transactions``), nor a saga definition: two
  statement triggers on ``saga_definitions`` now refuse both, with SQLSTATE 23001, once per
  statement and never per row.
* Every effect is inserted by the engine into a transaction that the same local transaction
  inserted, or an earlier one did, and every transaction with the digest of a definition the
  engine registered first.
* ``verify`` (:func:`ledger.events.verify`, ``agent-txn ledger verify``) reports effects whose
  transaction does not exist and transactions whose definition does not, which is what the
  keys refused at insert.

Kept: a compensation step's key to the operation it reverses (compensations only, never on
the happy path, and it says which operation a step undoes), and every key on SQLite, where a
key is a primary-key probe compiled into the insert (``ledger.schema._sqlite_key``).

The downgrade drops the triggers and makes the keys again, which checks every stored row.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: (table, column, referred table, referred column) of every key dropped.
KEYS = (
    ("transactions", "definition_digest", "saga_definitions", "digest"),
    ("operations", "tx_id", "transactions", "tx_id"),
    ("compensation_steps", "tx_id", "transactions", "tx_id"),
    ("outbox", "tx_id", "transactions", "tx_id"),
)
KEPT = "saga definitions are kept: transactions refer to them"
EVENTS = ("delete", "truncate")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        "CREATE FUNCTION agent_txn_definitions_kept() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        "BEGIN\n"
        f"    RAISE EXCEPTION '{KEPT}' USING ERRCODE = 'restrict_violation';\n"
        "END;\n"
        "$$"
    )
    for event in EVENTS:
        op.execute(
            f"CREATE TRIGGER saga_definitions_kept_{event} BEFORE {event.upper()}"
            " ON saga_definitions FOR EACH STATEMENT EXECUTE FUNCTION agent_txn_definitions_kept()"
        )
    for table, column, referred, _ in KEYS:
        op.drop_constraint(op.f(f"fk_{table}_{column}_{referred}"), table, type_="foreignkey")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column, referred, referred_column in KEYS:
        op.create_foreign_key(
            op.f(f"fk_{table}_{column}_{referred}"), table, referred, [column], [referred_column]
        )
    for event in EVENTS:
        op.execute(f"DROP TRIGGER saga_definitions_kept_{event} ON saga_definitions")
    op.execute("DROP FUNCTION agent_txn_definitions_kept()")
