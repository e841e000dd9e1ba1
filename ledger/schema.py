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
  SQLite has one CHECK per rule; PostgreSQL one per table, calling a PL/pgSQL function that
  checks the same rules and names the one a row breaks (migration 0006 says why).
* ``ledger.detail`` is the canonical JSON *text*, not a JSON column: the hash chain is computed over
  exact bytes, and JSONB would re-serialise them.

The Alembic migrations in ``ledger/migrations`` create exactly this; a test compares the two.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any, Final

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    literal_column,
    or_,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.elements import ColumnElement

from ledger.states import CLAIMABLE, RESUMABLE, EffectState, TxState

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

# -- widths of the columns that hold what callers and authors choose ---------------------------
# PostgreSQL refuses a longer value when it is written (SQLite stores it anyway), and a write
# can come late: a step's name is first written when the saga starts, after the command was
# stored, so authoring and the engine check against these same constants, never their own copy
# (the migrations spell the numbers out, and a test compares them with this schema).

#: A step's, an outbox event's, a provider's or an action's name: ``operations.step``,
#: ``compensation_steps.step``, ``outbox.kind``, the effects' ``provider``/``action``, grants
#: and approval settings.
NAME_LENGTH: Final = 100
#: A saga's or a command's name (``saga_definitions.name``, ``transactions.saga_name``,
#: ``commands.name``, ``principals.name``).
SAGA_NAME_LENGTH: Final = 200
#: A transaction id (``transactions.tx_id`` and every table that refers to one).
TX_ID_LENGTH: Final = 64
#: A business key as its command renders it; stored tenant first, in
#: :data:`STORED_BUSINESS_KEY_LENGTH`.
BUSINESS_KEY_LENGTH: Final = 256
#: An idempotency key of an execute (``executions.idempotency_key``, the reservations' ``key``).
IDEMPOTENCY_KEY_LENGTH: Final = 128
#: A tenant's name (``commands.tenant``, ``principals.tenant``).
TENANT_LENGTH: Final = 100

#: JSON documents: JSONB on PostgreSQL, JSON text on SQLite; Python ``None`` is SQL NULL.
Json = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
#: Auto-incrementing 64-bit key (SQLite only auto-increments a plain INTEGER PRIMARY KEY).
SeqId = BigInteger().with_variant(Integer(), "sqlite")

_TX_STATES = ", ".join(f"'{s.value}'" for s in TxState)
_EFFECT_STATES = ", ".join(f"'{s.value}'" for s in EffectState)
#: Failed and compensated transactions are retired: they no longer hold their business key.
RETIRED = (TxState.FAILED, TxState.COMPENSATED)


def one_of_literals(column: ColumnElement[str], values: Iterable[StrEnum]) -> ColumnElement[bool]:
    """``column = 'a' OR column = 'b' …``: membership in a fixed set of states, with the values
    written into the SQL (sorted), not bound, and as equalities, not ``IN (…)``.

    Written into the SQL: a partial index is usable only where the planner can prove that the
    query's condition implies the index's. With bound values PostgreSQL can for a plan made for
    those values, but not for the *generic* plan a prepared statement settles on, and SQLite
    matches the index's terms against the query's as written. The due-work indexes below and the
    queries that look for due work both use this, so the two texts are the same.

    Equalities: SQLite evaluates a partial index's condition on every write of the table, and
    an ``IN`` list of constants there builds a temporary b-tree each time — about 10 µs per
    insert-and-update of a row here, three times the row's own cost (``docs/benchmarks-log.md``,
    item 34); the same set as ``OR``-ed equalities costs next to nothing. PostgreSQL plans both
    alike."""
    ordered = sorted(values)
    terms = [column == literal_column(f"'{v.value}'") for v in ordered]
    return terms[0] if len(terms) == 1 else or_(*terms)


def _live(column: ColumnElement[str]) -> ColumnElement[bool]:
    """Neither failed nor compensated: the transaction still holds its business key. As
    inequalities, not ``NOT IN``, for the reason :func:`one_of_literals` gives."""
    return and_(*(column != literal_column(f"'{s.value}'") for s in RETIRED))


saga_definitions = Table(
    "saga_definitions",
    metadata,
    Column("digest", String(64), primary_key=True),  # sha256 of the canonical definition
    Column("name", String(SAGA_NAME_LENGTH), nullable=False),
    Column("definition", Json, nullable=False),
    Column("created_at", BigInteger, nullable=False),
)

#: Objects of :data:`metadata` that exist on one backend only, by name (each is also marked with
#: ``ddl_if``, which neither Alembic's comparison nor the schema tests read; :func:`exists_on`
#: does). Filled as the tables below are defined.
_ONLY_ON: dict[str, set[str]] = {"sqlite": set(), "postgresql": set()}


def _row_rules(table: str, rules: list[CheckConstraint], postgresql: str) -> list[CheckConstraint]:
    """``rules`` as separate CHECKs on SQLite, and ``postgresql`` (a function call that checks
    them all) as the one CHECK ``ck_<table>_rules`` on PostgreSQL: migration 0006 made it so,
    because PostgreSQL reads every CHECK back from its stored text for each statement that
    writes the table."""
    for rule in rules:
        rule.ddl_if(dialect="sqlite")
        _ONLY_ON["sqlite"].add(f"ck_{table}_{rule.name}")
    _ONLY_ON["postgresql"].add(f"ck_{table}_rules")
    return [*rules, CheckConstraint(postgresql, name="rules").ddl_if(dialect="postgresql")]


def _sqlite_key(table: str, column: str, target: str) -> ForeignKeyConstraint:
    """A foreign key made on SQLite only.

    Why: on PostgreSQL a foreign key is a trigger that runs ``SELECT 1 … FOR KEY SHARE`` on the
    referred row for every row inserted, a query and a row lock; the hot path's keys to
    ``transactions`` and ``saga_definitions`` ran 13 + 4 of them per saga (migrations 0007 and
    0008 say what that cost). What they guarded holds without them there: nothing in
    agent-txn deletes a transaction or a definition, statement triggers refuse ``DELETE`` and
    ``TRUNCATE`` of both tables, and ``agent-txn ledger verify`` reports a row whose parent
    does not exist. On SQLite a key is a primary-key probe compiled into the insert, with no
    query and no lock, so it stays."""
    referred = target.split(".")[0]
    _ONLY_ON["sqlite"].add(
        NAMING_CONVENTION["fk"]
        % {"table_name": table, "column_0_name": column, "referred_table_name": referred}
    )
    return ForeignKeyConstraint([column], [target]).ddl_if(dialect="sqlite")


#: The stored business key, tenant first (``orchestrator.keys.tenant_business_key``): a tenant
#: whose characters are each escaped to 3 at most, the ``/``, and a rendered key (557 in all).
STORED_BUSINESS_KEY_LENGTH: Final = 3 * TENANT_LENGTH + 1 + BUSINESS_KEY_LENGTH

transactions = Table(
    "transactions",
    metadata,
    Column("tx_id", String(TX_ID_LENGTH), primary_key=True),
    Column("definition_digest", String(64), nullable=False),
    Column("saga_name", String(SAGA_NAME_LENGTH), nullable=False),
    # ``{tenant}/{key}`` (``orchestrator.keys.tenant_business_key``, migration 0009).
    Column("business_key", String(STORED_BUSINESS_KEY_LENGTH), nullable=True),
    Column("inputs", Json, nullable=False),
    Column("status", String(32), nullable=False),
    Column("lease_owner", String(128), nullable=True),
    Column("lease_until", BigInteger, nullable=True),
    Column("fence", BigInteger, nullable=False, server_default=text("0")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("next_attempt_at", BigInteger, nullable=True),
    Column("error", Json, nullable=True),  # {code, message, step?}: safe text only
    Column("execution_id", String(64), nullable=True),  # the audit record (commands layer)
    # Extra template scope frozen at prepare (query-step results), so recovery re-renders alike.
    Column("context", Json, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    *_row_rules(
        "transactions",
        # On SQLite, migration 0005 stores this (and the effects' ``state`` check) as ``OR``-ed
        # equalities, the same set: an ``IN`` list cost a temporary b-tree on every write.
        [
            CheckConstraint(f"status IN ({_TX_STATES})", name="status"),
            CheckConstraint("fence >= 0", name="fence"),
        ],
        "agent_txn_transaction_row_ok('transactions', status, fence)",
    ),
    _sqlite_key("transactions", "definition_digest", "saga_definitions.digest"),
)
# A business intent has at most one live transaction: two idempotency keys for order 42 cannot
# both charge it. Failed and compensated attempts are retired and no longer hold the key.
Index(
    "uq_transactions_business_key_live",
    transactions.c.business_key,
    unique=True,
    postgresql_where=and_(transactions.c.business_key.is_not(None), _live(transactions.c.status)),
    sqlite_where=and_(transactions.c.business_key.is_not(None), _live(transactions.c.status)),
)
Index("ix_transactions_status_next", transactions.c.status, transactions.c.next_attempt_at)


def transactions_live() -> ColumnElement[bool]:
    """The status condition of ``uq_transactions_business_key_live``, as it is written there."""
    return _live(transactions.c.status)


def transactions_due() -> ColumnElement[bool]:
    """A transaction a recovery pass may pick up (in flight), as the queries for due work write
    it: literal equalities, read through ``ix_transactions_status_next``."""
    return one_of_literals(transactions.c.status, RESUMABLE)


def _effect_columns() -> list[Column[Any]]:
    """Columns of the shared effect state machine (fresh objects per table)."""
    return [
        Column("provider", String(NAME_LENGTH), nullable=False),
        Column("action", String(NAME_LENGTH), nullable=False),
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


def _effect_checks(table: str) -> list[CheckConstraint]:
    return _row_rules(
        table,
        [
            CheckConstraint(f"state IN ({_EFFECT_STATES})", name="state"),
            CheckConstraint(
                "state <> 'executing' OR (lease_owner IS NOT NULL AND lease_until IS NOT NULL"
                " AND fence > 0)",
                name="executing_has_lease",
            ),
            CheckConstraint("state <> 'pending' OR lease_owner IS NULL", name="pending_unowned"),
            CheckConstraint(
                "state <> 'confirmed' OR remote_id IS NOT NULL", name="confirmed_has_id"
            ),
            CheckConstraint("fence >= 0", name="fence"),
        ],
        f"agent_txn_effect_row_ok('{table}', state, lease_owner, lease_until, fence, remote_id)",
    )


operations = Table(
    "operations",
    metadata,
    Column("op_key", String(64), primary_key=True),
    Column("tx_id", String(TX_ID_LENGTH), nullable=False),
    Column("step", String(NAME_LENGTH), nullable=False),
    *_effect_columns(),
    *_effect_checks("operations"),
    _sqlite_key("operations", "tx_id", "transactions.tx_id"),
    UniqueConstraint("tx_id", "step"),
)

compensation_steps = Table(
    "compensation_steps",
    metadata,
    Column("op_key", String(64), primary_key=True),
    Column("tx_id", String(TX_ID_LENGTH), nullable=False),
    Column("forward_op_key", String(64), ForeignKey("operations.op_key"), nullable=False),
    Column("step", String(NAME_LENGTH), nullable=False),  # the forward step's name
    *_effect_columns(),
    *_effect_checks("compensation_steps"),
    _sqlite_key("compensation_steps", "tx_id", "transactions.tx_id"),
    UniqueConstraint("forward_op_key"),  # exactly one reversal per forward op
)

outbox = Table(
    "outbox",
    metadata,
    Column("event_key", String(64), primary_key=True),
    Column("tx_id", String(TX_ID_LENGTH), nullable=False),
    Column("kind", String(NAME_LENGTH), nullable=False),  # the event's name in the saga definition
    *_effect_columns(),
    *_effect_checks("outbox"),
    _sqlite_key("outbox", "tx_id", "transactions.tx_id"),
    UniqueConstraint("tx_id", "kind"),
)
# operations and outbox are found by tx through their unique (tx_id, …) keys already.
Index("ix_compensation_steps_tx", compensation_steps.c.tx_id)


def effects_unsettled(table: Table) -> ColumnElement[bool]:
    """The condition of ``ix_<table>_due``: an effect not yet settled (pending, executing or in
    doubt), i.e. one a recovery pass may claim."""
    return one_of_literals(table.c.state, CLAIMABLE)


# Due effects in the order a recovery pass reads them, holding only unsettled ones (settled
# rows leave the index: the happy path's last update of each effect removes its entry).
for _table in (operations, compensation_steps, outbox):
    Index(
        f"ix_{_table.name}_due",
        _table.c.next_attempt_at,
        _table.c.tx_id,
        postgresql_where=effects_unsettled(_table),
        sqlite_where=effects_unsettled(_table),
    )

ledger = Table(
    "ledger",
    metadata,
    Column("seq", SeqId, primary_key=True, autoincrement=True),
    Column("tx_id", String(TX_ID_LENGTH), nullable=False),
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
    # SQLite only: on PostgreSQL each inserted row ran the key's check as a locking query, and
    # no transaction is ever deleted (migration 0007 says why it was dropped there).
    _sqlite_key("ledger", "tx_id", "transactions.tx_id"),
)
# PostgreSQL only: on SQLite ``seq`` is the rowid, which every entry of the (tx_id, prev_hash)
# index above already carries (migration 0004 says why it was dropped there).
Index("ix_ledger_tx_seq", ledger.c.tx_id, ledger.c.seq).ddl_if(dialect="postgresql")
_ONLY_ON["postgresql"].add("ix_ledger_tx_seq")


def exists_on(dialect: str, name: str | None) -> bool:
    """Whether an object of :data:`metadata` (an index, a CHECK or a foreign key: names are
    unique across kinds) exists on that backend, for Alembic's ``include_object`` and the
    schema tests."""
    return not any(name in names for other, names in _ONLY_ON.items() if other != dialect)


EFFECT_TABLES = {"operation": operations, "compensation": compensation_steps, "outbox": outbox}

# -- the commands layer (seed 000): stored commands, their executions, idempotency, principals --

COMMAND_SCOPES = ("company", "room")
EXECUTION_STATUSES = ("running", "succeeded", "failed", "staged", "manual_review")
PRINCIPAL_KINDS = ("user", "client")
PERMISSIONS = ("execute", "read", "manage", "approve")
CALLBACK_EVENTS = ("succeeded", "failed", "staged")
CALLBACK_STATES = ("pending", "running", "delivered", "failed")


def _in(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


commands = Table(
    "commands",
    metadata,
    Column("command_id", String(64), primary_key=True),
    Column("tenant", String(TENANT_LENGTH), nullable=False),
    Column("name", String(SAGA_NAME_LENGTH), nullable=False),
    Column("scope_kind", String(16), nullable=False),
    Column("scope_id", String(64), nullable=False),
    Column("tag_id", String(64), nullable=True),
    Column("version", Integer, nullable=False),  # drift behaviour: 1 = fields exist, 2 = contract
    Column("mode", String(16), nullable=False),  # execute | query
    Column("definition", Json, nullable=False),  # the exact stored definition (digest input)
    Column("digest", String(64), nullable=False),
    Column("saga_digest", String(64), ForeignKey("saga_definitions.digest"), nullable=True),
    Column("created_by", String(64), nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    Column("deleted_at", BigInteger, nullable=True),  # soft delete
    CheckConstraint(f"scope_kind IN ({_in(COMMAND_SCOPES)})", name="scope_kind"),
    CheckConstraint("version IN (1, 2)", name="version"),
    CheckConstraint("mode IN ('execute', 'query')", name="mode"),
)
Index("ix_commands_tenant_name", commands.c.tenant, commands.c.name)

executions = Table(
    "executions",
    metadata,
    Column("execution_id", String(64), primary_key=True),
    Column("command_id", String(64), ForeignKey("commands.command_id"), nullable=False),
    Column("command_digest", String(64), nullable=False),
    Column(
        "tx_id", String(TX_ID_LENGTH), nullable=True
    ),  # NULL when it failed before any transaction
    Column("status", String(16), nullable=False),
    Column("invoker_kind", String(8), nullable=False),
    Column("invoker_id", String(64), nullable=False),
    Column("actor_bucket", String(80), nullable=False),  # user:{id} | client:{id}
    Column("idempotency_key", String(IDEMPOTENCY_KEY_LENGTH), nullable=True),
    Column("origin", String(16), nullable=False),  # manual | agent
    Column("input_snapshot", Json, nullable=False),
    Column("authorization_snapshot", Json, nullable=False),
    Column("steps", Json, nullable=True),  # <= 40 entries
    Column("result_refs", Json, nullable=True),  # <= 20 entries
    Column("error_code", String(64), nullable=True),
    Column("error", Text, nullable=True),  # safe text, <= 4096 chars
    Column("response", Json, nullable=True),  # snapshot <= 65 536 bytes, else a stand-in
    Column("lifecycle_snapshot", Json, nullable=True),  # agent delivery marker (issue 6)
    Column("staged_change_id", String(64), nullable=True),
    Column("room_id", String(64), nullable=True),
    Column("duration_ms", Integer, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    CheckConstraint(f"status IN ({_in(EXECUTION_STATUSES)})", name="status"),
    CheckConstraint(f"invoker_kind IN ({_in(PRINCIPAL_KINDS)})", name="invoker_kind"),
    CheckConstraint("origin IN ('manual', 'agent')", name="origin"),
)
Index("ix_executions_command_created", executions.c.command_id, executions.c.created_at)
Index("ix_executions_tx", executions.c.tx_id)

idempotency_reservations = Table(
    "idempotency_reservations",
    metadata,
    Column("command_id", String(64), primary_key=True),
    Column("actor_bucket", String(80), primary_key=True),
    Column("key", String(IDEMPOTENCY_KEY_LENGTH), primary_key=True),
    Column("execution_id", String(64), nullable=False),
    Column("expires_at", BigInteger, nullable=False),
    Column("created_at", BigInteger, nullable=False),
)

principals = Table(
    "principals",
    metadata,
    Column("principal_id", String(64), primary_key=True),
    Column("tenant", String(TENANT_LENGTH), nullable=False),
    Column("kind", String(8), nullable=False),
    Column("name", String(SAGA_NAME_LENGTH), nullable=False),
    Column("verified", Integer, nullable=False, server_default=text("0")),  # 0/1 on both backends
    Column("disabled", Integer, nullable=False, server_default=text("0")),
    Column("api_key_sha256", String(64), nullable=True, unique=True),
    Column("created_at", BigInteger, nullable=False),
    Column("deleted_at", BigInteger, nullable=True),  # not alive once set
    CheckConstraint(f"kind IN ({_in(PRINCIPAL_KINDS)})", name="kind"),
)

grants = Table(
    "grants",
    metadata,
    Column("grant_id", String(64), primary_key=True),
    Column("principal_id", String(64), ForeignKey("principals.principal_id"), nullable=False),
    Column("provider", String(NAME_LENGTH), nullable=False),
    Column("action", String(NAME_LENGTH), nullable=False),  # '*' = every action of the provider
    Column("permission", String(16), nullable=False),
    Column("max_amount", BigInteger, nullable=True),  # cap on payload[amount_field]
    Column("amount_field", String(100), nullable=True),
    Column("readable_fields", Json, nullable=True),  # NULL = every result field
    Column("created_at", BigInteger, nullable=False),
    CheckConstraint(f"permission IN ({_in(PERMISSIONS)})", name="permission"),
    UniqueConstraint("principal_id", "provider", "action", "permission"),
)

room_members = Table(
    "room_members",
    metadata,
    Column("room_id", String(64), primary_key=True),
    Column("principal_id", String(64), ForeignKey("principals.principal_id"), primary_key=True),
    Column("language", String(16), nullable=True),
    Column("joined_at", BigInteger, nullable=False),
    Column("left_at", BigInteger, nullable=True),  # a member no longer once set
)

action_settings = Table(
    "action_settings",
    metadata,
    Column("provider", String(NAME_LENGTH), primary_key=True),
    Column("action", String(NAME_LENGTH), primary_key=True),
    Column("requires_approval", Integer, nullable=False, server_default=text("0")),
    Column("approval_policy", Json, nullable=True),
    Column("locked_for", String(100), nullable=True),  # an operation holding the action
    Column("revision", Integer, nullable=False, server_default=text("1")),
    Column("updated_at", BigInteger, nullable=False),
)

callback_runs = Table(
    "callback_runs",
    metadata,
    Column("run_id", String(64), primary_key=True),
    Column("execution_id", String(64), ForeignKey("executions.execution_id"), nullable=False),
    Column("event", String(16), nullable=False),
    Column("target", Text, nullable=False),
    Column("payload", Json, nullable=False),
    Column("state", String(16), nullable=False),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("lease_owner", String(128), nullable=True),
    Column("lease_until", BigInteger, nullable=True),
    Column("fence", BigInteger, nullable=False, server_default=text("0")),
    Column("next_attempt_at", BigInteger, nullable=True),
    Column("last_error", Text, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    CheckConstraint(f"event IN ({_in(CALLBACK_EVENTS)})", name="event"),
    CheckConstraint(f"state IN ({_in(CALLBACK_STATES)})", name="state"),
    CheckConstraint("attempts <= 5", name="attempts"),
    UniqueConstraint("execution_id", "event", "target"),
)
Index("ix_callback_runs_state_next", callback_runs.c.state, callback_runs.c.next_attempt_at)

# -- the agent toolbox (staged actions, approvals) ----------------------------------------------

STAGED_ACTION_STATES = ("pending", "executed", "released", "expired")
STAGED_CHANGE_STATES = ("pending", "approved", "rejected")

#: Private confirmation state of an agent's staged action. The token itself is never stored:
#: only its SHA-256, so a copy of the database cannot confirm anybody's plan.
staged_actions = Table(
    "staged_actions",
    metadata,
    Column("token_sha256", String(64), primary_key=True),
    Column(
        "execution_id",
        String(64),
        ForeignKey("executions.execution_id"),
        nullable=False,
        unique=True,
    ),
    Column("command_id", String(64), nullable=False),
    Column("digest", String(64), nullable=False),  # pinned: forwarded as expected digest
    Column("room_id", String(64), nullable=True),
    Column("language", String(16), nullable=False),
    Column("invoker_kind", String(8), nullable=False),
    Column("invoker_id", String(64), nullable=False),
    Column("state", String(16), nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    CheckConstraint(f"state IN ({_in(STAGED_ACTION_STATES)})", name="state"),
)

#: A frozen plan waiting for an approver (409 approval_required).
staged_changes = Table(
    "staged_changes",
    metadata,
    Column("staged_change_id", String(64), primary_key=True),
    Column(
        "execution_id",
        String(64),
        ForeignKey("executions.execution_id"),
        nullable=False,
        unique=True,
    ),
    Column("command_id", String(64), nullable=False),
    Column("digest", String(64), nullable=False),
    Column("requested_by", String(64), nullable=False),
    Column("state", String(16), nullable=False),
    Column("decided_by", String(64), nullable=True),
    Column("reason", Text, nullable=True),
    Column("decided_at", BigInteger, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    CheckConstraint(f"state IN ({_in(STAGED_CHANGE_STATES)})", name="state"),
)
Index("ix_executions_room_created", executions.c.room_id, executions.c.created_at)


def column_length(column: Column[Any]) -> int:
    """The declared length of a ``String`` column: the one place a text limit is written, so
    callers that refuse over-long input read it here instead of repeating the number."""
    length = getattr(column.type, "length", None)
    if not isinstance(length, int):
        raise TypeError(f"{column} has no declared length")
    return length
