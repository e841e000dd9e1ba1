"""Business keys are unique per tenant: the stored key is ``{tenant}/{key}``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06

Why: tenants may share one database, and a business key (``order:42``) was unique across all of
them. Another tenant's live transaction for the same order id blocked this tenant's order with
``409 business_key_conflict`` carrying the other tenant's ``tx_id`` (a leak and a denial), and a
mere staged plan of theirs did the same. The engine now stores the key with its tenant in front
(``orchestrator.keys.tenant_business_key``: ``%`` and ``/`` of the tenant escaped as ``%25`` and
``%2F``, so the first ``/`` ends the tenant); the unique index and every lookup by key are
unchanged, they now compare tenant-qualified keys.

What happens to the keys stored before this migration: every one of them (live or retired) is
rewritten here, in this migration's transaction, to the new form with its tenant, so a business
action in flight across the upgrade keeps holding its key and an engine of the new version
executing the same order finds it (and answers its outcome or the conflict) instead of running
it a second time.

* The tenant is the one of the command the transaction was executed through: its execution
  record (``transactions.execution_id``, else the execution naming the transaction) and that
  execution's command (``commands.tenant``).
* A transaction with no execution record was started through the Python API (or ``agent-txn
  demo``), whose tenant is not stored anywhere; it is given ``default``, the tenant every engine
  has unless configured otherwise. An engine that runs Python-API sagas under another tenant
  should let its business-keyed transactions settle before upgrading: a live one would hold
  ``default/…`` and not block the same order under its real tenant.

Engines of the previous version must be stopped before the upgrade (a new one refuses to start
on an older schema, an old one on this): one still running would go on writing keys without a
tenant, which the new engines never compare with.

The unique index is dropped while the keys are rewritten (a key rewritten first could transiently
equal another not rewritten yet, ``x`` of tenant ``default`` and a legacy key ``default/x``) and
made again, as it was, afterwards. The column widens to 557 characters (a tenant of 100, each
character escaped to 3 at most, the ``/`` and a key of 256): an ``ALTER`` on PostgreSQL (a
catalog change, no rewrite), on SQLite the declared type in the stored ``CREATE TABLE`` text, made
as migration 0005 makes its changes (SQLite never enforces a declared length).

The downgrade strips the tenant again. It fails, and changes nothing, while two tenants hold the
same key live: the old schema cannot hold that state.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Literal on purpose: a migration is a fixed point in history, not today's schema.
INDEX = "uq_transactions_business_key_live"
LIVE_KEY = "business_key IS NOT NULL AND status != 'failed' AND status != 'compensated'"
OLD_LENGTH = 256
NEW_LENGTH = 557
#: The tenant of a transaction that names no execution of any command (Python API).
UNKNOWN_TENANT = "default"

transactions = sa.table(
    "transactions",
    sa.column("tx_id", sa.String),
    sa.column("business_key", sa.String),
    sa.column("execution_id", sa.String),
)
executions = sa.table(
    "executions",
    sa.column("execution_id", sa.String),
    sa.column("command_id", sa.String),
    sa.column("tx_id", sa.String),
)
commands = sa.table("commands", sa.column("command_id", sa.String), sa.column("tenant", sa.String))


def _tenant_of(link: sa.ColumnElement[bool]) -> sa.ScalarSelect[str]:
    """The tenant of the command of the first execution ``link`` matches."""
    return (
        sa.select(commands.c.tenant)
        .select_from(executions.join(commands, commands.c.command_id == executions.c.command_id))
        .where(link)
        .order_by(executions.c.execution_id)
        .limit(1)
        .scalar_subquery()
    )


def _escaped(tenant: sa.ColumnElement[str]) -> sa.ColumnElement[str]:
    """``orchestrator.keys.tenant_business_key``'s escaping, in SQL: ``%`` first, then ``/``."""
    inner = sa.func.replace(tenant, "%", "%25", type_=sa.String())
    return sa.func.replace(inner, "/", "%2F", type_=sa.String())


def _qualify_keys() -> None:
    tenant = sa.func.coalesce(
        _tenant_of(executions.c.execution_id == transactions.c.execution_id),
        _tenant_of(executions.c.tx_id == transactions.c.tx_id),
        sa.literal(UNKNOWN_TENANT),
        type_=sa.String(),
    )
    op.execute(
        transactions.update()
        .where(transactions.c.business_key.is_not(None))
        .values(business_key=_escaped(tenant) + "/" + transactions.c.business_key)
    )


def _strip_tenants() -> None:
    # Every stored key has a ``/`` (the upgrade and the engine both write one): the key is what
    # follows the first.
    key = transactions.c.business_key
    if op.get_bind().dialect.name == "postgresql":
        stripped = sa.func.substr(key, sa.func.strpos(key, "/") + 1)
    else:
        stripped = sa.func.substr(key, sa.func.instr(key, "/") + 1)
    op.execute(transactions.update().where(key.is_not(None)).values(business_key=stripped))


def _sqlite_declared_length(old: int, new: int) -> None:
    """Edit the declared length of ``business_key`` in the stored ``CREATE TABLE`` (as 0005
    edits its CHECKs there)."""
    bind = op.get_bind()
    version = int(bind.exec_driver_sql("PRAGMA schema_version").scalar_one())
    bind.exec_driver_sql("PRAGMA writable_schema = ON")
    try:
        stored = bind.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'transactions'"
        ).scalar_one()
        column = f"business_key VARCHAR({old})"
        if stored.count(column) != 1:
            raise RuntimeError("transactions: business_key is not the column this rewrites")
        bind.exec_driver_sql(
            "UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = 'transactions'",
            (stored.replace(column, f"business_key VARCHAR({new})"),),
        )
        bind.exec_driver_sql(f"PRAGMA schema_version = {version + 1}")
    finally:
        bind.exec_driver_sql("PRAGMA writable_schema = OFF")
    problems = [r[0] for r in bind.exec_driver_sql("PRAGMA integrity_check").all()]
    if problems != ["ok"]:
        raise RuntimeError(f"integrity_check after the type rewrite: {problems}")


def _column_length(old: int, new: int) -> None:
    if op.get_bind().dialect.name == "sqlite":
        _sqlite_declared_length(old, new)
    else:
        op.alter_column(
            "transactions",
            "business_key",
            type_=sa.String(new),
            existing_type=sa.String(old),
            existing_nullable=True,
        )


def _index() -> None:
    op.create_index(
        INDEX,
        "transactions",
        ["business_key"],
        unique=True,
        postgresql_where=sa.text(LIVE_KEY),
        sqlite_where=sa.text(LIVE_KEY),
    )


def upgrade() -> None:
    op.drop_index(INDEX, table_name="transactions")
    _column_length(OLD_LENGTH, NEW_LENGTH)
    _qualify_keys()
    _index()


def downgrade() -> None:
    op.drop_index(INDEX, table_name="transactions")
    _strip_tenants()
    _column_length(NEW_LENGTH, OLD_LENGTH)
    _index()
