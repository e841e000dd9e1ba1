"""PostgreSQL: the ledger's foreign key to ``transactions`` goes.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03

Why: on PostgreSQL a foreign key is a trigger that, for every row inserted, runs
``SELECT 1 FROM transactions WHERE tx_id = $1 FOR KEY SHARE`` — a query through the executor
and a row lock on the transaction, which the same saga's next statement then updates. A saga
appends thirteen ledger rows, so the server ran thirteen such checks per saga: the foreign
keys' triggers were 13.3 % of the server's CPU at C = 16 (``perf`` on its backends,
``docs/benchmarks-log.md``), and without this one the server spends about an eighth less per saga
(item 44).

What the key guarded still holds without it:

* An entry never loses its transaction. Nothing in agent-txn deletes a transaction; with the
  key, the database refused it too (``DELETE`` by the key, ``TRUNCATE … CASCADE`` by the
  ledger's append-only trigger). Two statement-level triggers on ``transactions`` now refuse
  ``DELETE`` and ``TRUNCATE`` outright, with SQLSTATE 23001 as the ledger's own refusal: once
  per statement, never per row, and no statement of ours fires them.
* Every entry is appended by :meth:`ledger.store.Work.log` to the chain of a transaction that
  the same local transaction inserted, or an earlier one did.
* ``verify`` (:func:`ledger.events.verify`, ``agent-txn ledger verify``) reports any entry
  whose transaction does not exist, which is what the key refused at insert.

SQLite keeps the key: there it is a lookup in the transactions' primary key compiled into the
insert statement, with no query and no lock, and dropping a constraint would mean rebuilding
the append-only table. The effect tables keep theirs here (three checks per saga, and a
compensation step's key to its forward operation says which operation it reverses); 0008
drops their keys to ``transactions`` on PostgreSQL too, for the same reasons.

The downgrade drops the triggers and makes the key again, which checks every stored entry.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FOREIGN_KEY = "fk_ledger_tx_id_transactions"
KEPT = "transactions are kept: the ledger refers to them"
EVENTS = ("delete", "truncate")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        "CREATE FUNCTION agent_txn_transactions_kept() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        "BEGIN\n"
        f"    RAISE EXCEPTION '{KEPT}' USING ERRCODE = 'restrict_violation';\n"
        "END;\n"
        "$$"
    )
    for event in EVENTS:
        op.execute(
            f"CREATE TRIGGER transactions_kept_{event} BEFORE {event.upper()} ON transactions"
            " FOR EACH STATEMENT EXECUTE FUNCTION agent_txn_transactions_kept()"
        )
    op.drop_constraint(op.f(FOREIGN_KEY), "ledger", type_="foreignkey")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_foreign_key(op.f(FOREIGN_KEY), "ledger", "transactions", ["tx_id"], ["tx_id"])
    for event in EVENTS:
        op.execute(f"DROP TRIGGER transactions_kept_{event} ON transactions")
    op.execute("DROP FUNCTION agent_txn_transactions_kept()")
