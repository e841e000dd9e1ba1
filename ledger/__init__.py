"""agent-txn's durable store: one schema on SQLite and PostgreSQL, leases, fencing, the ledger."""

from ledger.errors import (
    DuplicateKey,
    InvalidTransition,
    LeaseLost,
    LedgerTampered,
    SchemaOutdated,
    StorageError,
    StoreBusy,
    StoreUnavailable,
)
from ledger.states import EffectState, TxState
from ledger.store import Store, StoreStats

__all__ = [
    "DuplicateKey",
    "EffectState",
    "InvalidTransition",
    "LeaseLost",
    "LedgerTampered",
    "SchemaOutdated",
    "StorageError",
    "Store",
    "StoreBusy",
    "StoreStats",
    "StoreUnavailable",
    "TxState",
]
