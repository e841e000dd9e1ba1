"""PostgreSQL: a local transaction's writes sent as one statement (data-modifying CTEs).

Why: on PostgreSQL the engine's cost per saga is round trips, not SQL. A saga's four local
transactions ran 13 statements plus a ``BEGIN`` and a ``COMMIT`` each — 21 round trips, and two
thirds of the client's samples sat in the socket writes (``docs/benchmarks-log.md``). Most of those
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

SQLite runs each write at once (its statements cost microseconds; it has no round trips),
except in a transaction that may still be shipped to the SQLite writer process
(:mod:`ledger.sqlite_writer`, ``Work._deferred``): there they are held back the same way, so
that they exist as a list when the block ends, and the member hands the list to the writer
instead of running it (or, if it begins here after all, runs them one by one:
:meth:`ledger.hot.HotPath.send`).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ledger.canonical import plain_json
from ledger.errors import LeaseLost
from ledger.frozen import quick_init

if TYPE_CHECKING:  # ledger.hot imports this module
    from ledger.hot import Compiled

#: The text the failing ``CAST`` carries; the index of the fenced write follows it.
MARKER = "agent_txn_lease_lost:"
_MARKER_RE = re.compile(re.escape(MARKER) + r"(\d+):")
_PLACEHOLDER = re.compile(r"\$(\d+)")
_INVALID_TEXT_REPRESENTATION = "22P02"


@quick_init
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


def composable(sql: str) -> bool:
    """Whether a compiled statement's ``sql`` can be one CTE of the combined statement: it
    carries no literal (placeholders are renumbered textually, so no ``$n`` may hide in a
    string). Decided once per compiled statement (:attr:`ledger.hot.Compiled.composable`)."""
    return "'" not in sql and sql.startswith(("INSERT", "UPDATE", "DELETE"))


def _renumbered(sql: str, offset: int) -> str:
    if not offset:
        return sql
    return _PLACEHOLDER.sub(lambda m: f"${int(m.group(1)) + offset}", sql)


class Composer:
    """Builds (and caches by shape) the combined statement for a sequence of writes, and its
    batch statement (:func:`batch_statement`)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[tuple[int, bool, int], ...], str] = {}
        self._batches: dict[str, BatchStatement | None] = {}

    def statement(self, writes: Sequence[PendingWrite]) -> tuple[str, list[Any]]:
        shape = tuple((id(w.compiled), w.lost is not None, w.rows) for w in writes)
        sql = self._cache.get(shape)
        if sql is None:
            sql = self._cache[shape] = _compose(writes)
            self._batches[sql] = batch_statement(writes)
        args: list[Any] = []
        for w in writes:
            args.extend(w.args)
        return sql, args

    def batch(self, sql: str) -> BatchStatement | None:
        """The batch statement of a combined statement this composer made (``None``: it has
        none, and a batch of it goes as ``executemany``)."""
        return self._batches.get(sql)


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
        counts.append(_count(i, w.lost, "count(*) = 1"))
    return _assembled(parts, counts)


def _count(i: int, lost: LeaseLost | None, exactly: str) -> str:
    """The outer query's read of write ``i``: its rows' count, or, for a fenced write, a
    ``CAST`` that fails unless ``exactly`` holds (``count(*)`` in it keeps the planner from
    folding it into a constant and failing early)."""
    if lost is None:
        return f"(SELECT count(*) FROM w{i}) AS c{i}"
    return (
        f"(SELECT CASE WHEN {exactly} THEN 1 "
        f"ELSE CAST('{MARKER}{i}:' || count(*) AS integer) END FROM w{i}) AS c{i}"
    )


def _assembled(parts: Sequence[str], counts: Sequence[str]) -> str:
    # The outer query reads every count, left to right: that runs the CTEs in the order they
    # were written, and a fenced write is judged before any later write runs — so a stale
    # fence is reported as such, not as the duplicate key a later insert would then hit (the
    # order in which the writes ran one by one). Unread CTEs would run last, in reverse.
    every = ", ".join(f"c{i}" for i in range(len(counts)))
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


# -- Batch statements: one execution for a batch of transactions ---------------------------
#
# Why: a batch of the group sender (ledger/grouped.py) was one ``executemany``: one round trip,
# but the server still ran the combined statement once per member, each time with its own
# Bind, portal, executor start-up (ExecInitNode over every CTE's plan) and end. For sixteen
# members of the outbox's "confirm and log" statement that per-execution work was 43 % of the
# server's CPU (docs/benchmarks-log.md, item 48). The batch statement runs the same writes for
# every member in one execution. Its one argument is a JSON array with one element per member,
# that member's arguments (``[[a1, a2, …], [b1, b2, …]]``); ``jsonb_array_elements`` turns it
# back into one row per member, and each placeholder ``$k::TYPE`` of the combined statement
# becomes ``(members.m->>i)::TYPE``, the same cast of the member's i-th argument. Why JSON
# and not an array per placeholder (``unnest($1::bigint[], …)``): asyncpg checks every
# element of an array argument in Python-facing code, which cost the client more than the
# ``executemany`` did; one JSON text is one call of the C encoder, and the server's parse of
# it cost less than decoding the arrays (item 48 has both).
#
# * An ``INSERT … VALUES (…)`` becomes ``INSERT … SELECT … FROM members`` in the members'
#   order; a multi-row insert (the ledger's) adds ``generate_series`` over its rows, so a
#   member's rows draw ``seq`` in the order written.
# * An ``UPDATE t SET … WHERE …`` finds each member's rows with the statement's own ``WHERE``
#   in a ``LATERAL`` subquery (a primary-key probe with the member's values), and updates them
#   by ``ctid``. Why not a plain join (``FROM members WHERE t.key = …``): on a young table the
#   planner joins it by a sequential scan of ``t``, and a generic plan made then is kept as the
#   table grows (the same trap as item 33's). A subquery with ``OFFSET 0`` is never flattened
#   into a join, so every plan, young or old, is an index probe per member and a TID fetch
#   (``tests/integration/test_query_plans.py``). It returns every row the ``WHERE`` matches,
#   as the statement did.
# * A fenced write must change exactly one row of each member: the rows it changed must number
#   the members and carry every member's ordinality. If any member's fence is stale, or a
#   concurrent writer moved one of the rows (PostgreSQL's recheck then finds a different
#   ``ctid`` and skips it), the statement fails and nothing of it is committed: the sender
#   then has each member send its own statement alone, exactly as when an ``executemany``
#   batch is refused. So does any other refusal, such as a text the JSON cannot carry to
#   PostgreSQL (a NUL, which the engine refuses earlier anyway).
#
# Only statements this module can read with certainty get a batch statement: every placeholder
# cast to one of a few one-word types (SQLAlchemy's asyncpg dialect casts each bind), an
# ``UPDATE`` whose ``SET`` holds no subquery, an ``INSERT`` with one ``VALUES`` tuple; and
# only arguments JSON holds (strings, integers, booleans, ``None``; anything else and the
# batch goes as ``executemany``).

_CAST = re.compile(
    r"\$(\d+)::(VARCHAR|TEXT|BIGINT|INTEGER|SMALLINT|BOOLEAN|JSONB|JSON)(?![A-Za-z0-9_(\[])"
)
_UPDATE = re.compile(r"UPDATE (\w+) SET (.+?) WHERE (.+)\Z", re.DOTALL)
#: The exact types of the arguments a batch statement carries (not their subclasses, which the
#: encoder might write otherwise, nor floats, whose text a cast may read differently).
_ARGUMENT_TYPES = frozenset({str, int, bool, type(None)})


@dataclass(frozen=True, slots=True)
class BatchStatement:
    """A combined statement's form that runs it for many members in one execution."""

    sql: str
    #: Whether the statement checks a fenced write's count: the number of members is then its
    #: second parameter.
    counted: bool

    def arguments(self, members: Sequence[Sequence[Any]]) -> list[Any] | None:
        """The statement's arguments for these members' arguments (``None``: some argument is
        not one JSON carries exactly, and the batch goes as ``executemany``)."""
        for member in members:
            if not _ARGUMENT_TYPES.issuperset(map(type, member)):
                return None
        document = plain_json(members)
        return [document, len(members)] if self.counted else [document]


def batch_statement(writes: Sequence[PendingWrite]) -> BatchStatement | None:
    """The batch statement of the combined statement of ``writes`` (``None`` if some write's
    SQL is not one this module can rewrite with certainty; see above)."""
    parts = [
        "members AS (SELECT m, ord FROM jsonb_array_elements($1::jsonb) WITH ORDINALITY"
        " AS members(m, ord))"
    ]
    counts: list[str] = []
    offset = 0
    for i, w in enumerate(writes):
        n = len(w.compiled.names)
        if not _casts_all(w.compiled.sql, n):
            return None
        body = _member_reads(w.compiled.sql, offset, n, w.rows, f"g{i}")
        sql = _rewrite(body, i, w.rows)
        if sql is None:
            return None
        offset += n * w.rows
        parts.append(f"w{i} AS ({sql})")
        # One row of each member ($2 is their number): what ``count(*) = 1`` said of one.
        counts.append(
            _count(i, w.lost, "count(*) = $2::BIGINT AND count(DISTINCT ord) = $2::BIGINT")
        )
    return BatchStatement(_assembled(parts, counts), any(w.lost is not None for w in writes))


def _member_reads(sql: str, offset: int, n: int, rows: int, row: str) -> str:
    """``sql`` with each placeholder ``$k::TYPE`` turned into the same cast of the member's
    argument at ``offset + k - 1`` (for a multi-row insert, of row ``{row}.j``'s)."""

    def read(m: re.Match[str]) -> str:
        index = str(offset + int(m.group(1)) - 1)
        if rows != 1:
            index = f"({index} + {row}.j * {n})"
        return f"(members.m->>{index})::{m.group(2)}"

    return _CAST.sub(read, sql)


def _casts_all(sql: str, n: int) -> bool:
    """Whether every placeholder in ``sql`` is one of ``$1`` … ``$n`` with a cast this module
    reads, and each of them appears."""
    found = {int(m.group(1)) for m in _CAST.finditer(sql)}
    return len(_PLACEHOLDER.findall(sql)) == len(_CAST.findall(sql)) and found == set(
        range(1, n + 1)
    )


def _rewrite(body: str, i: int, rows: int) -> str | None:
    """One write's CTE for the batch statement (``body``: its SQL with the placeholders
    already turned into reads of the member's arguments)."""
    if body.startswith("INSERT INTO "):
        head, sep, values = body.partition(" VALUES ")
        if not sep or not values.startswith("(") or _closing(values) != len(values) - 1:
            return None
        if rows == 1:
            return f"{head} SELECT {values[1:-1]} FROM members ORDER BY members.ord RETURNING 1"
        return (
            f"{head} SELECT {values[1:-1]} FROM members CROSS JOIN generate_series(0, {rows - 1})"
            f" AS g{i}(j) ORDER BY members.ord, g{i}.j RETURNING 1"
        )
    update = _UPDATE.match(body)
    if rows != 1 or update is None:
        return None
    table, sets, where = update.groups()
    if "SELECT" in sets or " WHERE " in sets:
        return None
    return (
        f"UPDATE {table} SET {sets} FROM members CROSS JOIN LATERAL"
        f" (SELECT {table}.ctid AS t FROM {table} WHERE {where} OFFSET 0) AS x{i}"
        f" WHERE {table}.ctid = x{i}.t RETURNING members.ord"
    )


def _closing(text: str) -> int:
    """The index of the parenthesis that closes the one ``text`` opens with (-1: none)."""
    depth = 0
    for index, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                return index
    return -1
