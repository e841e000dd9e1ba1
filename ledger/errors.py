"""The storage layer's own small exception types; the orchestrator maps them to error codes.

::

    StorageError
    ├── InvalidTransition   a write asked for an edge the state table lacks (a bug)
    ├── LeaseLost           a fenced write matched no row: another holder owns it now
    ├── DuplicateKey        a unique key (op key, business key, ...) already exists
    ├── LedgerTampered      the hash chain or the replay does not match the rows
    ├── SchemaOutdated      the database is behind this package's migrations
    │   ├── MigrationFailed the database refused a migration's statement
    │   └── ForeignDatabase no agent-txn schema, but other applications' tables
    ├── ValueNotStorable    the database refused a value as too long or out of range for its column
    ├── StoreBusy           lock contention (SQLite busy, PostgreSQL lock/serialization); retryable
    └── StoreUnavailable    the database could not be reached or the connection dropped; retryable

Driver exceptions are translated in :mod:`ledger.dialects` with ``raise ... from exc`` so the
original stays in the traceback for operators but never reaches a caller's error envelope.
"""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every error raised by :mod:`ledger`."""

    retryable: bool = False


class InvalidTransition(StorageError):
    """A state change that the transition table does not allow."""

    def __init__(self, machine: str, from_state: str, to_state: str) -> None:
        super().__init__(f"{machine} transition {from_state!r} -> {to_state!r} is not allowed")
        self.machine = machine
        self.from_state = from_state
        self.to_state = to_state


class LeaseLost(StorageError):
    """A fenced write matched no row: the lease expired and another holder claimed the row."""

    def __init__(self, subject: str, fence: int) -> None:
        # The message is written when read, not here: a fenced write carries its LeaseLost
        # in case it matches no row, so one is made for every such write (three per saga).
        super().__init__(subject, fence)
        self.subject = subject
        self.fence = fence

    def __str__(self) -> str:
        return f"lease on {self.subject} lost (fence {self.fence} is no longer current)"


class DuplicateKey(StorageError):
    """A row with the same unique key already exists."""

    def __init__(self, what: str) -> None:
        super().__init__(f"duplicate {what}")
        self.what = what


class LedgerTampered(StorageError):
    """The ledger's hash chain or replay disagrees with the stored rows."""


class SchemaOutdated(StorageError):
    """The database schema is older (or newer) than the migrations this package ships."""


class MigrationFailed(SchemaOutdated):
    """The database refused a statement of a migration (an object of the same name already
    there, no privilege to create one, ...). The migrations run in one transaction, so none of
    them was applied: the schema is still outdated."""


class ForeignDatabase(SchemaOutdated):
    """The database has no agent-txn schema but holds other tables: it is not created there
    by itself (``Store.open``), only on purpose (``agent-txn db upgrade``)."""


class StoreBusy(StorageError):
    """Lock contention; the same write may succeed if retried."""

    retryable = True


class StoreUnavailable(StorageError):
    """The database could not be reached or the connection dropped mid-transaction."""

    retryable = True


class ValueNotStorable(StorageError):
    """The database refused a value written to it: a string longer than its column, a number
    out of its column's range (PostgreSQL's data exceptions, SQLSTATE class 22; SQLite stores
    either). Every such value is meant to be refused before the write, where it enters
    (``ledger.schema`` names the widths the checks use), so this is the safety net: the
    statement failed and wrote nothing, and the same value fails again."""
