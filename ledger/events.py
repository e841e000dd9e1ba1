"""The append-only ledger: reading, hash-chain verification and replay.

Rows are written only through :meth:`ledger.store.Work.log` (buffered, inserted at commit). There
is no update or delete function here, and the database refuses both (triggers installed by the
initial migration). Each transaction's rows form a hash chain: ``hash = sha256(prev_hash, row)``
and ``UNIQUE(tx_id, prev_hash)`` forbids forks, so an edited, deleted or inserted row breaks the
chain and :func:`verify` names it.

:func:`replay` folds a transaction's rows into the state of every subject; :func:`verify` also
compares that with the current rows, so the ledger alone is proved able to reproduce the state.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ARRAY, String, bindparam, func, select, true
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import Select

from ledger.schema import (
    compensation_steps,
    ledger,
    operations,
    outbox,
    saga_definitions,
    transactions,
)
from ledger.store import GENESIS_HASH, Chain, ledger_hash


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One ledger row."""

    seq: int
    tx_id: str
    subject: str | None
    action: str
    from_state: str | None
    to_state: str | None
    detail: dict[str, Any]
    detail_text: str
    created_at: int
    prev_hash: str
    hash: str


@dataclass(frozen=True, slots=True)
class LedgerProblem:
    """A place where the ledger and the truth disagree."""

    tx_id: str
    seq: int | None
    problem: str


async def read(conn: AsyncConnection, tx_id: str) -> list[LedgerEntry]:
    """A transaction's ledger in order."""
    stmt = select(ledger).where(ledger.c.tx_id == tx_id).order_by(ledger.c.seq)
    return [entry_from_row(row._mapping) for row in (await conn.execute(stmt)).all()]


async def chain_of(conn: AsyncConnection, tx_id: str) -> Chain:
    """The chain of ``tx_id`` positioned at its newest row (for a holder resuming it)."""
    stmt = (
        select(ledger.c.hash).where(ledger.c.tx_id == tx_id).order_by(ledger.c.seq.desc()).limit(1)
    )
    head = (await conn.execute(stmt)).scalar_one_or_none()
    return Chain(tx_id=tx_id, head=head or GENESIS_HASH)


# Built once: a worker runs it every claim pass (building and cache-keying it per call cost
# more client CPU than the query). SQLite finds each group's ``max(seq)`` on the
# ``(tx_id, prev_hash)`` index and the row by its rowid.
_NEWEST_HEADS = select(ledger.c.tx_id, ledger.c.hash).where(
    ledger.c.seq.in_(
        select(func.max(ledger.c.seq))
        .where(ledger.c.tx_id.in_(bindparam("p_tx_ids", expanding=True)))
        .group_by(ledger.c.tx_id)
        .scalar_subquery()
    )
)


def _newest_heads_pg() -> Select[tuple[str, str]]:
    """PostgreSQL: one backward step on ``ix_ledger_tx_seq`` per id (``LATERAL … LIMIT 1``).

    Why not :data:`_NEWEST_HEADS` there: its generic plan, made once from the table's size at
    the time (small on a young database), hash-joins a *sequential scan* of the whole ledger,
    and a worker's connection keeps that plan, so every claim pass read every ledger row ever
    written. Per id, the newest row by the index is the cheapest plan at any size, so it is the
    plan the server makes whatever it knows (``tests/integration/test_query_plans.py``)."""
    ids = (
        func.unnest(bindparam("p_tx_ids", type_=ARRAY(String)))
        .table_valued("tx_id")
        .render_derived(name="ids")
    )
    newest = (
        select(ledger.c.hash)
        .where(ledger.c.tx_id == ids.c.tx_id)
        .order_by(ledger.c.seq.desc())
        .limit(1)
        .lateral("newest")
    )
    return select(ids.c.tx_id, newest.c.hash).select_from(ids.join(newest, true()))


_NEWEST_HEADS_PG = _newest_heads_pg()


async def chains_of(conn: AsyncConnection, tx_ids: Iterable[str]) -> dict[str, Chain]:
    """Chains of many transactions at their newest rows, in one statement."""
    ids = list(tx_ids)
    if not ids:
        return {}
    if conn.dialect.name == "postgresql":
        rows = await conn.execute(_NEWEST_HEADS_PG, {"p_tx_ids": ids})
    else:
        rows = await conn.execute(_NEWEST_HEADS, {"p_tx_ids": ids})
    heads = {tx_id: head for tx_id, head in rows.all()}
    return {tx_id: Chain(tx_id=tx_id, head=heads.get(tx_id, GENESIS_HASH)) for tx_id in ids}


def entry_from_row(m: Any) -> LedgerEntry:
    """A :class:`LedgerEntry` from a ledger row mapping (detail parsed, its text kept)."""
    text = str(m["detail"])
    try:
        detail = json.loads(text)
    except ValueError:
        detail = {"unparsable": True}
    return LedgerEntry(
        seq=int(m["seq"]),
        tx_id=m["tx_id"],
        subject=m["subject"],
        action=m["action"],
        from_state=m["from_state"],
        to_state=m["to_state"],
        detail=detail if isinstance(detail, dict) else {"value": detail},
        detail_text=text,
        created_at=int(m["created_at"]),
        prev_hash=m["prev_hash"],
        hash=m["hash"],
    )


def check_chain(entries: Iterable[LedgerEntry]) -> list[LedgerProblem]:
    """Problems in one transaction's chain (entries in ``seq`` order)."""
    problems: list[LedgerProblem] = []
    expected_prev = GENESIS_HASH
    for e in entries:
        if e.prev_hash != expected_prev:
            problems.append(LedgerProblem(e.tx_id, e.seq, "chain broken: prev_hash mismatch"))
        recomputed = ledger_hash(
            e.prev_hash,
            e.tx_id,
            e.subject,
            e.action,
            e.from_state,
            e.to_state,
            e.detail_text,
            e.created_at,
        )
        if recomputed != e.hash:
            problems.append(LedgerProblem(e.tx_id, e.seq, "row content does not match its hash"))
        expected_prev = e.hash
    return problems


def replay(entries: Iterable[LedgerEntry]) -> dict[str | None, str | None]:
    """Fold a chain into the last state of every subject (``None`` = the transaction itself)."""
    state: dict[str | None, str | None] = {}
    for e in entries:
        if e.to_state is not None:
            state[e.subject] = e.to_state
    return state


async def current_states(conn: AsyncConnection, tx_id: str) -> dict[str | None, str | None]:
    """The stored state of the transaction and of each of its effects."""
    states: dict[str | None, str | None] = {}
    tx = (
        await conn.execute(select(transactions.c.status).where(transactions.c.tx_id == tx_id))
    ).scalar_one_or_none()
    if tx is not None:
        states[None] = tx
    for table, key in (
        (operations, operations.c.op_key),
        (compensation_steps, compensation_steps.c.op_key),
        (outbox, outbox.c.event_key),
    ):
        rows = await conn.execute(select(key, table.c.state).where(table.c.tx_id == tx_id))
        for k, s in rows.all():
            states[k] = s
    return states


#: (child table's key column, parent key column, what an orphan is called) for every key that
#: PostgreSQL does not enforce (``ledger.schema._sqlite_key``).
_PARENTS = (
    (ledger.c.tx_id, transactions.c.tx_id, "ledger entries for no transaction"),
    (operations.c.tx_id, transactions.c.tx_id, "operations for no transaction"),
    (compensation_steps.c.tx_id, transactions.c.tx_id, "compensation steps for no transaction"),
    (outbox.c.tx_id, transactions.c.tx_id, "outbox events for no transaction"),
    (transactions.c.definition_digest, saga_definitions.c.digest, "a transaction of no definition"),
)


async def _orphans(conn: AsyncConnection) -> list[tuple[str, str]]:
    """``(tx_id, problem)`` for each transaction with rows whose parent does not exist (for a
    transaction of no definition: its own id), in id order per kind."""
    found: list[tuple[str, str]] = []
    for child, parent, what in _PARENTS:
        tx_column = child.table.c.tx_id
        query = (
            select(tx_column)
            .where(~select(parent).where(parent == child).exists())
            .distinct()
            .order_by(tx_column)
        )
        found.extend((orphan, what) for orphan in (await conn.execute(query)).scalars())
    return found


async def verify(conn: AsyncConnection, tx_id: str | None = None) -> list[LedgerProblem]:
    """Verify the hash chain and the replay of one transaction (or all of them).

    Verifying all of them also reports rows whose parent does not exist — ledger entries and
    effects for no transaction, transactions of no registered definition: on PostgreSQL no
    foreign key refuses such a row at insert (migrations 0007 and 0008), so this is where one
    would show."""
    problems: list[LedgerProblem] = []
    if tx_id is None:
        ids = list((await conn.execute(select(transactions.c.tx_id))).scalars().all())
        for orphan, what in await _orphans(conn):
            problems.append(LedgerProblem(orphan, None, what))
    else:
        ids = [tx_id]
    for tid in ids:
        entries = await read(conn, tid)
        if tx_id is not None and not entries:
            exists = await conn.execute(
                select(transactions.c.tx_id).where(transactions.c.tx_id == tid)
            )
            if exists.first() is None:
                problems.append(LedgerProblem(tid, None, "no such transaction"))
                continue
        problems.extend(check_chain(entries))
        replayed = replay(entries)
        current = await current_states(conn, tid)
        for subject in sorted(set(replayed) | set(current), key=lambda s: s or ""):
            if replayed.get(subject) != current.get(subject):
                what = subject or "transaction"
                problems.append(
                    LedgerProblem(
                        tid,
                        None,
                        f"replay of {what} gives {replayed.get(subject)!r}, "
                        f"stored state is {current.get(subject)!r}",
                    )
                )
    return problems
