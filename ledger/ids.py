"""Identifiers the engine mints for the rows it appends at a saga's rate: time-ordered.

Why not ``uuid4().hex``: every index keyed by a random id takes each new entry on a random
page of its B-tree. Four indexes a saga writes lead with its ``tx_id`` (the transaction's
primary key, the ledger's fork guard ``(tx_id, prev_hash)``, the effects' ``(tx_id, step)``
and ``(tx_id, kind)``), so with random ids each commit dirtied pages all over those trees.
SQLite writes each dirtied page to the WAL and copies it back at the checkpoint; PostgreSQL
logs a full image of each page at its first change after a checkpoint. With ids that grow
with time, the entries of the sagas in flight sit together at the right edge of each tree,
on pages the previous commits already dirtied.

The layout is UUIDv7's (RFC 9562, section 5.7), written as 32 lowercase hex digits like
``uuid4().hex``: 48 bits of Unix milliseconds, the version (7), 12 random bits, the variant
(``10``), 62 random bits. 74 random bits per millisecond keep a collision out of reach, and
the primary keys refuse one anyway. The id tells the time it was minted (as the row's
``created_at`` already does); ids that must not (approval handles) stay ``uuid4``.
Measured in ``docs/benchmarks-log.md`` (item 40)."""

from __future__ import annotations

import os
import time

_MS_MASK = (1 << 48) - 1
_RAND_B_MASK = (1 << 62) - 1
_VERSION_AND_VARIANT = (0x7 << 76) | (0b10 << 62)


def time_ordered_id() -> str:
    """A new UUIDv7 as 32 hex digits (sortable by the millisecond it was minted)."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits: 12 for rand_a, 62 for rand_b
    value = (
        (ms & _MS_MASK) << 80 | _VERSION_AND_VARIANT | (rand >> 68) << 64 | (rand & _RAND_B_MASK)
    )
    return f"{value:032x}"
