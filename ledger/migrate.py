"""Schema migrations, applied programmatically (no ``alembic.ini`` at runtime).

* :data:`REVISIONS` are the revisions this package ships, oldest first; :data:`HEAD` is the newest.
  They are written out here, not read from the scripts, so that checking a database's revision
  (what every ``Store.open()`` does) needs neither Alembic nor the scripts: importing Alembic and
  parsing the scripts was about a tenth of every ``agent-txn`` command's start-up. A test holds
  the list equal to what Alembic finds in ``migrations/versions``; Alembic itself is imported
  only to upgrade or downgrade.
* :func:`upgrade` applies migrations in **one** database transaction, serialised against other
  processes doing the same: PostgreSQL takes a transaction-scoped advisory lock first; SQLite
  holds its single write lock (``BEGIN IMMEDIATE``) for the whole run. After the lock the revision
  is read again, so the second of two concurrent callers finds the work done and does nothing.
* :func:`ensure_schema` is what ``Store.open()`` calls: upgrade an empty database, refuse (with
  :class:`~ledger.errors.SchemaOutdated`) one that is behind or ahead of this package, and refuse
  (with :class:`~ledger.errors.ForeignDatabase`) to create the schema by itself in a database
  that holds other applications' tables: a mistyped ``--db`` naming another application's
  database got agent-txn's tables written into it. :func:`upgrade` (``agent-txn db upgrade``)
  is how agent-txn's tables are put beside others on purpose.

A statement of a migration that the database refuses is raised as
:class:`~ledger.errors.MigrationFailed`, with the database's one-line reason (names of schema
objects, never row data): that is an operator's problem to fix, not a bug. Every other driver
error (a lost connection, a lock held) propagates untranslated (``ledger.dialects`` translates
them at the store boundary).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from sqlalchemy import Connection, inspect, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ledger.dialects import READ_ONLY_OPTION, translate
from ledger.errors import ForeignDatabase, MigrationFailed, SchemaOutdated, StoreBusy

if TYPE_CHECKING:
    from alembic.config import Config

AutoUpgrade = Literal["empty", "always", "never"]

#: The Alembic script directory shipped inside the package.
MIGRATIONS_DIR: Final = Path(__file__).resolve().parent / "migrations"

#: Key of the PostgreSQL advisory lock that serialises migrations (ASCII ``"agtxnmig"``).
PG_MIGRATION_LOCK_KEY: Final = int.from_bytes(b"agtxnmig", "big")

_UPGRADE_HINT = "run `agent-txn db upgrade`"


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config for the packaged scripts; ``connection`` is handed to ``env.py``."""
    from alembic.config import Config  # local: only migrating needs Alembic (module docs)

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("path_separator", "os")
    if connection is not None:
        config.attributes["connection"] = connection
    return config


#: Every revision in ``migrations/versions``, oldest first (a single line of history). Adding a
#: migration means adding its revision here; ``tests/integration/test_migrations.py`` fails
#: until the two agree.
REVISIONS: Final[tuple[str, ...]] = (
    "0001",
    "0002",
    "0003",
    "0004",
    "0005",
    "0006",
    "0007",
    "0008",
    "0009",
)

#: The newest revision this package ships: the one every store needs.
HEAD: Final[str] = REVISIONS[-1]

#: Every revision this package ships (a database at another was migrated by a newer agent-txn).
KNOWN_REVISIONS: Final[frozenset[str]] = frozenset(REVISIONS)

#: Alembic's table of the database's revision (its default name, which ``env.py`` keeps).
VERSION_TABLE: Final = "alembic_version"


def _current_sync(connection: Connection) -> str | None:
    """The revision in :data:`VERSION_TABLE`, read as Alembic's
    ``MigrationContext.get_current_revision()`` reads it: ``None`` when the table is missing or
    empty."""
    if not connection.dialect.has_table(connection, VERSION_TABLE):
        return None
    rows = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    if len(rows) > 1:
        # Alembic writes one row per branch head, and this package's history has one branch.
        raise SchemaOutdated(
            f"database schema has several revisions at once ({', '.join(sorted(rows))}) in "
            f"{VERSION_TABLE}; agent-txn's migrations are one line, so the table was edited by "
            "hand or by another tool: leave one row, the revision the schema is really at"
        )
    return rows[0] if rows else None


async def _read_connection(engine: AsyncEngine) -> AsyncConnection:
    conn = await engine.connect()
    # SQLite store engines begin read-only transactions DEFERRED: no write lock for a version check.
    return await conn.execution_options(**{READ_ONLY_OPTION: True})


async def current_revision(engine: AsyncEngine) -> str | None:
    """The database's revision, or ``None`` for an empty database (no ``alembic_version``)."""
    conn = await _read_connection(engine)
    try:
        async with conn.begin():
            return await conn.run_sync(_current_sync)
    finally:
        await conn.close()


def _unknown_revision(current: str) -> SchemaOutdated:
    return SchemaOutdated(
        f"database schema is at revision {current!r}, which this version of agent-txn does not "
        f"know (its newest is {HEAD!r}): the database was migrated by a newer agent-txn; "
        "upgrade the agent-txn package instead of running this one against it"
    )


def _behind(current: str | None) -> SchemaOutdated:
    where = "empty (no agent-txn schema)" if current is None else f"at revision {current!r}"
    return SchemaOutdated(
        f"database schema is {where} but this agent-txn needs revision {HEAD!r}; {_UPGRADE_HINT}"
    )


def _lock_for_migration(connection: Connection) -> None:
    """Serialise migrations across processes; held until the surrounding transaction ends."""
    dialect = connection.dialect.name
    if dialect == "postgresql":
        connection.execute(
            text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_MIGRATION_LOCK_KEY}
        )
    elif dialect == "sqlite":
        # A store engine has already sent BEGIN IMMEDIATE on begin. A plain aiosqlite/pysqlite
        # engine sends no BEGIN at all before DDL (the driver only opens transactions for DML),
        # so every CREATE would autocommit and two processes would race: open the write
        # transaction ourselves.
        driver = connection.connection.driver_connection
        if not getattr(driver, "in_transaction", False):
            connection.exec_driver_sql("BEGIN IMMEDIATE")


def _refuse_foreign_tables(connection: Connection) -> None:
    """Refuse a database without agent-txn's schema that holds other tables (its default
    schema's): creating ours by itself there would write into another application's database.
    An empty ``alembic_version`` is ours (a database downgraded to ``base`` keeps it)."""
    others = _other_tables_sync(connection)
    if others:
        raise _foreign(others)


def _other_tables_sync(connection: Connection) -> list[str]:
    return sorted(set(inspect(connection).get_table_names()) - {VERSION_TABLE})


def _foreign(others: list[str]) -> ForeignDatabase:
    shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    return ForeignDatabase(
        f"database holds other tables ({shown}) and no agent-txn schema: is it agent-txn's "
        "database? agent-txn creates its schema by itself only in an empty one; "
        f"{_UPGRADE_HINT} to add its tables beside them on purpose"
    )


def _upgrade_sync(connection: Connection, revision: str, only_if_empty: bool = False) -> None:
    _lock_for_migration(connection)
    current = _current_sync(connection)
    if current is not None and current not in KNOWN_REVISIONS:
        raise _unknown_revision(current)
    if current is None and only_if_empty:
        # Checked under the lock: a concurrent opener that just created the schema has
        # committed it, so its tables are read with its revision, not as a stranger's.
        _refuse_foreign_tables(connection)
    if revision in ("head", HEAD) and current == HEAD:
        return  # another process finished it while we waited for the lock
    from alembic import command  # local: only migrating needs Alembic (module docs)

    command.upgrade(alembic_config(connection), revision)


def _downgrade_sync(connection: Connection, revision: str) -> None:
    _lock_for_migration(connection)
    current = _current_sync(connection)
    if current is not None and current not in KNOWN_REVISIONS:
        raise _unknown_revision(current)
    from alembic import command

    command.downgrade(alembic_config(connection), revision)


async def _write_connection(engine: AsyncEngine) -> AsyncConnection:
    conn = await engine.connect()
    if conn.dialect.name == "postgresql":
        # The re-check after the lock must see the other migrator's commit: a fresh snapshot
        # per statement, whatever isolation level the engine defaults to.
        return await conn.execution_options(isolation_level="READ COMMITTED")
    return await conn.execution_options(**{READ_ONLY_OPTION: False})


def _refused(exc: DBAPIError) -> bool:
    """Whether the database refused a statement, as opposed to the connection being lost
    (SQLAlchemy invalidates it) or a lock being held."""
    return not (exc.connection_invalidated or isinstance(translate(exc), StoreBusy))


def _migration_failed(action: str, revision: str, exc: DBAPIError) -> MigrationFailed:
    # The driver's own exception (asyncpg's, or sqlite3's) carries the server's text alone; for
    # a migration that is the names of schema objects, never row data.
    orig = exc.orig
    driver = orig.__cause__ if orig is not None and orig.__cause__ is not None else orig
    reason = str(driver).strip().splitlines()[0] if str(driver).strip() else type(driver).__name__
    return MigrationFailed(
        f"the database refused the migrations ({action} to {revision}): {reason}; none was "
        "applied (they run in one transaction)"
    )


async def upgrade(
    engine: AsyncEngine, revision: str = "head", *, only_if_empty: bool = False
) -> None:
    """Apply migrations up to ``revision`` in one transaction, serialised across processes.
    Raises :class:`~ledger.errors.MigrationFailed` if the database refuses one of them; with
    ``only_if_empty``, :class:`~ledger.errors.ForeignDatabase` (nothing written) when the
    database has no agent-txn schema yet but holds other tables."""
    conn = await _write_connection(engine)
    try:
        async with conn.begin():
            await conn.run_sync(_upgrade_sync, revision, only_if_empty)
    except DBAPIError as exc:
        if not _refused(exc):
            raise
        raise _migration_failed("upgrade", revision, exc) from exc
    finally:
        await conn.close()


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    """Revert migrations down to ``revision`` (``"base"``: drop everything) in one transaction.
    Raises :class:`~ledger.errors.MigrationFailed` if the database refuses one of them."""
    conn = await _write_connection(engine)
    try:
        async with conn.begin():
            await conn.run_sync(_downgrade_sync, revision)
    except DBAPIError as exc:
        if not _refused(exc):
            raise
        raise _migration_failed("downgrade", revision, exc) from exc
    finally:
        await conn.close()


async def ensure_schema(engine: AsyncEngine, *, auto_upgrade: AutoUpgrade = "empty") -> None:
    """Make sure the database is at :data:`HEAD`, upgrading it as ``auto_upgrade`` allows.

    ``"empty"`` creates the schema in an empty database and refuses one that is behind;
    ``"always"`` upgrades whatever is behind; ``"never"`` only checks. A database at a revision
    this package does not know (migrated by a newer agent-txn) is refused in every mode, and
    so is one without agent-txn's schema that holds other tables
    (:class:`~ledger.errors.ForeignDatabase`: not created there, and not said to be "empty";
    :func:`upgrade` adds the schema beside them on purpose).

    Raises :class:`~ledger.errors.SchemaOutdated` when the database is not (and may not be made)
    current.
    """
    if auto_upgrade not in ("empty", "always", "never"):
        raise ValueError(f"auto_upgrade must be 'empty', 'always' or 'never', not {auto_upgrade!r}")
    current = await current_revision(engine)
    if current == HEAD:
        return
    if current is not None and current not in KNOWN_REVISIONS:
        raise _unknown_revision(current)
    if auto_upgrade == "always" or (auto_upgrade == "empty" and current is None):
        await upgrade(engine, only_if_empty=current is None)
        return
    if current is None:
        # Only checking: "empty, run db upgrade" would advise migrating another application's
        # database (the shop's, given as ``--db``). Read here, outside the migration lock, as
        # nothing is created on what it finds.
        conn = await _read_connection(engine)
        try:
            async with conn.begin():
                others = await conn.run_sync(_other_tables_sync)
        finally:
            await conn.close()
        if others:
            raise _foreign(others)
    raise _behind(current)
