"""PostgreSQL: a local transaction's writes sent as one statement (data-modifying CTEs).

Why: on PostgreSQL the engine's cost per saga is round trips, not SQL. A saga's four local
transactions ran 13 statements plus a ``BEGIN`` and a ``COMMIT`` each — 21 round trips, and two
thirds of the client's samples sat in the socket writes (``docs/benchmarks.md``). Most of those
statements are *blind* writes: their only outcome is success, a constraint error, or — for a
fenced update — "no row matched" (the lease is lost). Nothing in the transaction reads their
result. So :class:`~ledger.store.Work` holds them back and sends them, with the transaction's
ledger rows, as one statement::

    WITH w0 AS (UPDATE operations SET ... WHERE op_key = $1 AND fence = $2 ... RETURNING 1),
         w1 AS (INSERT INTO outbox (...) VALUES ($9, ...) RETURNING 1),
         w2 AS (INSERT INTO ledger (...) VALUES ($17, ...), ($26, ...) RETURNING 1)
    SELECT c0, c1, c2 FROM (
        SELECT (SELECT CASE WHEN count(*) = 1 THEN 1
                     ELSE CAST('agent_txn_lease_lost:0:' || count(*) AS integer) END
                FROM w0) AS c0,
               (SELECT count(*) FROM w1) AS c1,
               (SELECT count(*) FROM w2) AS c2) AS counts

PostgreSQL runs every data-modifying CTE exactly once and to completion, and a statement is
atomic. The outer query reads the counts left to right, so the CTEs run in the order the writes
were made, and each fenced write is judged as soon as it has run: one that matched no row makes
its ``CAST`` fail before any later write runs, which aborts the whole statement. So a stale
fence is reported as :class:`~ledger.errors.LeaseLost` (not as, say, the duplicate key a later
insert would then meet), and it undoes the transaction's other writes, exactly as when the
writes ran one by one. ``count(*)`` in the ``CAST`` keeps the planner from folding it into a
constant and failing early.

When the statement is the transaction's first, it is sent outside an explicit transaction: an
implicit one commits it, and SQLAlchemy's ``COMMIT`` has nothing to send (its asyncpg adapter
begins lazily, at the first statement). A transaction whose writes are all blind then costs one
round trip instead of ``BEGIN`` + N + ``COMMIT``.

What keeps this invisible to the code that writes:

* before any other statement on the connection (a read, a ``RETURNING`` claim, anything through
  SQLAlchemy) the pending writes are sent first (``before_execute`` event), so later statements
  see them as they would have;
* a write to a row already pending (same ``row`` identity) sends the pending ones first: CTEs
  share one snapshot and would not see each other's changes;
* errors are those of the write itself — a duplicate key is still
  :class:`~ledger.errors.DuplicateKey`, a stale fence still :class:`~ledger.errors.LeaseLost` —
  only raised later: at the latest when the transaction block ends, before its commit.
  :meth:`~ledger.store.Work.send_writes` sends them at once where a caller must catch one
  inside the block.

SQLite runs each write at once (its statements cost microseconds; it has no round trips).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ledger.errors import LeaseLost

if TYPE_CHECKING:  # ledger.hot imports this module
    from ledger.hot import Compiled

#: The text the failing ``CAST`` carries; the index of the fenced write follows it.
MARKER = "agent_txn_lease_lost:"
_MARKER_RE = re.compile(re.escape(MARKER) + r"(\d+):")
_PLACEHOLDER = re.compile(r"\$(\d+)")
_INVALID_TEXT_REPRESENTATION = "22P02"


@dataclass(frozen=True, slots=True)
class PendingWrite:
    """One blind write held back until the transaction's writes are sent."""

    compiled: Compiled
    args: tuple[Any, ...]
    #: Raised if the write changes no row (a fenced update); ``None``: no check (an insert).
    lost: LeaseLost | None
    #: The row it writes, e.g. ``("transactions", tx_id)``: a second write to it waits.
    row: Hashable | None
    #: Rows of a multi-row ``INSERT``: ``args`` holds this many rows' arguments, in order. The
    #: ledger's rows go as one: within one ``VALUES`` list PostgreSQL draws ``seq`` in list
    #: order, while separate CTEs have no defined order among themselves.
    rows: int = 1


def composable(compiled: Compiled) -> bool:
    """Whether a compiled statement can be one CTE of the combined statement: its SQL carries
    no literal (placeholders are renumbered textually, so no ``$n`` may hide in a string)."""
    return "'" not in compiled.sql and compiled.sql.startswith(("INSERT", "UPDATE", "DELETE"))


def _renumbered(sql: str, offset: int) -> str:
    if not offset:
        return sql
    return _PLACEHOLDER.sub(lambda m: f"${int(m.group(1)) + offset}", sql)


class Composer:
    """Builds (and caches by shape) the combined statement for a sequence of writes."""

    def __init__(self) -> None:
        self._cache: dict[tuple[tuple[int, bool, int], ...], str] = {}

    def statement(self, writes: Sequence[PendingWrite]) -> tuple[str, list[Any]]:
        shape = tuple((id(w.compiled), w.lost is not None, w.rows) for w in writes)
        sql = self._cache.get(shape)
        if sql is None:
            sql = self._cache[shape] = _compose(writes)
        args: list[Any] = []
        for w in writes:
            args.extend(w.args)
        return sql, args


def _compose(writes: Sequence[PendingWrite]) -> str:
    parts: list[str] = []
    counts: list[str] = []
    offset = 0
    for i, w in enumerate(writes):
        n = len(w.compiled.names)
        if w.rows == 1:
            sql = _renumbered(w.compiled.sql, offset)
            offset += n
        else:
            head_sql, values = w.compiled.sql.split(" VALUES ", 1)  # no placeholder in the head
            tuples = []
            for _ in range(w.rows):
                tuples.append(_renumbered(values, offset))
                offset += n
            sql = f"{head_sql} VALUES {', '.join(tuples)}"
        parts.append(f"w{i} AS ({sql} RETURNING 1)")
        if w.lost is None:
            counts.append(f"(SELECT count(*) FROM w{i}) AS c{i}")
        else:
            # count(*) keeps the CAST from being folded (and failing) at plan time.
            counts.append(
                f"(SELECT CASE WHEN count(*) = 1 THEN 1 "
                f"ELSE CAST('{MARKER}{i}:' || count(*) AS integer) END FROM w{i}) AS c{i}"
            )
    # The outer query reads every count, left to right: that runs the CTEs in the order they
    # were written, and a fenced write is judged before any later write runs — so a stale
    # fence is reported as such, not as the duplicate key a later insert would then hit (the
    # order in which the writes ran one by one). Unread CTEs would run last, in reverse.
    every = ", ".join(f"c{i}" for i in range(len(writes)))
    return (
        "WITH "
        + ",\n     ".join(parts)
        + f"\nSELECT {every} FROM (SELECT {', '.join(counts)}) AS counts"
    )


def lease_lost_in(exc: BaseException, writes: Sequence[PendingWrite]) -> LeaseLost | None:
    """The :class:`LeaseLost` of the fenced write that matched no row, if ``exc`` is the
    combined statement's failing ``CAST``."""
    if getattr(exc, "sqlstate", None) != _INVALID_TEXT_REPRESENTATION:
        return None  # only the CAST fails this way; a message merely quoting the text does not
    found = _MARKER_RE.search(str(exc))
    if found is None:
        return None
    index = int(found.group(1))
    return writes[index].lost if index < len(writes) else None
