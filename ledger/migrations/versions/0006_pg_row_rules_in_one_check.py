"""PostgreSQL: each effect table's row rules, and the transactions table's, are checked by one
``CHECK`` that calls a PL/pgSQL function, instead of five (two) ``CHECK`` expressions.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03

Why: PostgreSQL does not keep a table's ``CHECK`` constraints ready between statements. Each
statement that writes a table reads every one of them back from its stored node text
(``stringToNode``: each byte of each string constant is a token), plans and compiles it
(``ExecRelCheck``). A saga's four statements write an effect table about six times and
``transactions`` twice, so the server did that for some 36 constraints per saga. Counted
with callgrind on the server (``docs/benchmarks-log.md``, item 35): **1.46 M of the server's
5.49 M instructions per saga**, more than all its index maintenance. A function call is a
short node to read back, and PL/pgSQL keeps the function compiled for the session; with one
such ``CHECK`` per table the server's instructions per saga fell by about a fifth.

The rules are those of migration 0001: the function tests ``NOT (<condition>)`` for each of
0001's CHECK conditions, text for text (the test compares the refusals with those of the stored
0001 constraints over every combination of the columns they read). A violation still names the
rule that failed: the function raises ``check_violation`` (SQLSTATE 23514, so the driver still
raises an integrity error) with PostgreSQL's own wording, ``new row for relation "operations"
violates check constraint "ck_operations_executing_has_lease"``, and that name in the error's
constraint field. Unlike PostgreSQL's own refusal (its detail lists the failing row), it echoes
no value from the row. When a row breaks several rules, the first in the order below is named.

The functions are ``IMMUTABLE``: they read only their arguments, as a ``CHECK`` must. They are
created in the schema the tables are in (the migration's ``search_path``); the constraints refer
to them by their object id, so a caller's ``search_path`` does not change which function runs.

SQLite is unchanged: there a ``CHECK`` is compiled once into each statement SQLite keeps
prepared, and migration 0005 already made its ``state`` checks cheap.

Adding the new constraints checks every stored row once (a full read of the four tables under
an exclusive lock, inside the migration's transaction); the rows already satisfy the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

EFFECT_TABLES = ("operations", "compensation_steps", "outbox")
# Literal on purpose: a migration is a fixed point in history, not today's state sets.
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


def _quoted(values: Sequence[str]) -> str:
    return ", ".join(f"'{v}'" for v in values)


#: (rule name, its CHECK condition) as migration 0001 made them; the downgrade makes them again.
EFFECT_RULES_0001 = (
    ("state", f"state IN ({_quoted(EFFECT_STATES)})"),
    (
        "executing_has_lease",
        "state <> 'executing' OR (lease_owner IS NOT NULL AND lease_until IS NOT NULL"
        " AND fence > 0)",
    ),
    ("pending_unowned", "state <> 'pending' OR lease_owner IS NULL"),
    ("confirmed_has_id", "state <> 'confirmed' OR remote_id IS NOT NULL"),
    ("fence", "fence >= 0"),
)
TX_RULES_0001 = (
    ("status", f"status IN ({_quoted(TX_STATES)})"),
    ("fence", "fence >= 0"),
)

# Raised with PostgreSQL's own wording for a CHECK, naming the rule; no value from the row.
_RAISE = """
    RAISE EXCEPTION USING
        ERRCODE = 'check_violation',
        MESSAGE = format('new row for relation %I violates check constraint %I',
                         tbl, 'ck_' || tbl || '_' || rule),
        CONSTRAINT = 'ck_' || tbl || '_' || rule,
        TABLE = tbl;
"""


def _rules_function(name: str, params: str, rules: Sequence[tuple[str, str]]) -> str:
    """A PL/pgSQL function that returns true when a row keeps every rule, and otherwise raises
    naming the first it breaks. Each test is ``NOT (<the rule's CHECK condition>)``, the very
    text of migration 0001 (the parameters carry the columns' names), so SQL's three-valued
    logic is kept: a CHECK passes when its condition is NULL, and so does the rule here."""
    tests = "\n    ".join(
        f"{'IF' if i == 0 else 'ELSIF'} NOT ({condition}) THEN rule := '{rule}';"
        for i, (rule, condition) in enumerate(rules)
    )
    return f"""
CREATE FUNCTION {name}(tbl text, {params})
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $fn$
DECLARE
    rule text;
BEGIN
    {tests}
    ELSE RETURN true;
    END IF;
    {_RAISE}
END
$fn$
"""


EFFECT_FUNCTION = _rules_function(
    "agent_txn_effect_row_ok",
    "state text, lease_owner text, lease_until bigint, fence bigint, remote_id text",
    EFFECT_RULES_0001,
)
TX_FUNCTION = _rules_function(
    "agent_txn_transaction_row_ok", "status text, fence bigint", TX_RULES_0001
)


def effect_rules_check(table: str) -> str:
    """The one CHECK condition of an effect table on PostgreSQL (also in ``ledger.schema``)."""
    return f"agent_txn_effect_row_ok('{table}', state, lease_owner, lease_until, fence, remote_id)"


TX_RULES_CHECK = "agent_txn_transaction_row_ok('transactions', status, fence)"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(sa.text(EFFECT_FUNCTION))
    op.execute(sa.text(TX_FUNCTION))
    for table in EFFECT_TABLES:
        for rule, _condition in EFFECT_RULES_0001:
            op.drop_constraint(op.f(f"ck_{table}_{rule}"), table, type_="check")
        op.create_check_constraint(op.f(f"ck_{table}_rules"), table, effect_rules_check(table))
    for rule, _condition in TX_RULES_0001:
        op.drop_constraint(op.f(f"ck_transactions_{rule}"), "transactions", type_="check")
    op.create_check_constraint(op.f("ck_transactions_rules"), "transactions", TX_RULES_CHECK)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in EFFECT_TABLES:
        op.drop_constraint(op.f(f"ck_{table}_rules"), table, type_="check")
        for rule, condition in EFFECT_RULES_0001:
            op.create_check_constraint(op.f(f"ck_{table}_{rule}"), table, condition)
    op.drop_constraint(op.f("ck_transactions_rules"), "transactions", type_="check")
    for rule, condition in TX_RULES_0001:
        op.create_check_constraint(op.f(f"ck_transactions_{rule}"), "transactions", condition)
    op.execute(
        sa.text("DROP FUNCTION agent_txn_effect_row_ok(text, text, text, bigint, bigint, text)")
    )
    op.execute(sa.text("DROP FUNCTION agent_txn_transaction_row_ok(text, text, bigint)"))
