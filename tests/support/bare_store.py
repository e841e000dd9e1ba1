"""A bare store with one saga definition, and transaction rows written straight through the
ledger repositories (no engine): for tests of the storage layer's own behaviour."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from ledger import definitions, transactions
from ledger.store import Chain, Store, Work

DIGEST = "d" * 64
SAGA = "bare"


@asynccontextmanager
async def bare_store(url: str, *, commit_cohorts: bool = True) -> AsyncIterator[Store]:
    """A store on ``url`` holding the definition :data:`DIGEST` (transactions point at it)."""
    store = await Store.open(url, commit_cohorts=commit_cohorts)
    async with store.transaction() as work:
        await definitions.put(work, digest=DIGEST, name=SAGA, definition={"name": SAGA})
    try:
        yield store
    finally:
        await store.close()


async def insert_tx(
    work: Work,
    tx_id: str,
    inputs: Mapping[str, Any] | None = None,
    *,
    context: Mapping[str, Any] | None = None,
) -> transactions.TxClaim:
    """A transaction leased to ``w1`` and executing (two ledger rows: prepare, start)."""
    return await transactions.insert(
        work,
        Chain(tx_id),
        tx_id=tx_id,
        definition_digest=DIGEST,
        saga_name=SAGA,
        inputs=dict(inputs) if inputs is not None else {"n": tx_id},
        owner="w1",
        lease_ms=30_000,
        context=context,
    )
