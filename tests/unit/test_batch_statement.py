"""The batch statement of a combined statement (ledger/batched.py): which statements get one,
the SQL it is, and that each placeholder reads the right argument of each member.

What could break: a placeholder reading another placeholder's argument, or another row's (a
write applied with someone else's values); a multi-row insert's rows reordered (the ledger draws
``seq`` in row order); a fenced write's check no longer per member; a statement or an argument
this module cannot carry with certainty sent anyway instead of keeping ``executemany``. The
statements run against PostgreSQL in ``tests/integration/test_grouped_commits.py`` and
``test_query_plans.py``.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st

from ledger.batched import BatchStatement, PendingWrite, batch_statement, composable
from ledger.errors import LeaseLost
from ledger.hot import Compiled

UPDATE = (
    "UPDATE outbox SET state=$1::VARCHAR, lookups=(outbox.lookups + $2::BIGINT), "
    "result=$3::JSONB WHERE outbox.event_key = $4::VARCHAR AND outbox.fence = $5::BIGINT"
)
INSERT = "INSERT INTO ledger (tx_id, n, detail) VALUES ($1::VARCHAR, $2::BIGINT, $3::VARCHAR)"


def _write(sql: str, names: int, *, rows: int = 1, fenced: bool = False) -> PendingWrite:
    names_ = tuple(f"n{i}" for i in range(names))
    compiled = Compiled(sql, cast(Any, None), names_, (), None, composable(sql))
    lost = LeaseLost("outbox", 1) if fenced else None
    return PendingWrite(compiled, (), lost, None, rows=rows)


def _update_then_ledger() -> BatchStatement:
    batch = batch_statement([_write(UPDATE, 5, fenced=True), _write(INSERT, 3, rows=2)])
    assert batch is not None
    return batch


def test_the_members_are_one_json_argument_read_back_row_by_row() -> None:
    sql = _update_then_ledger().sql
    assert sql.startswith(
        "WITH members AS (SELECT m, ord FROM jsonb_array_elements($1::jsonb) WITH ORDINALITY"
        " AS members(m, ord)),"
    )


def test_an_update_finds_each_members_rows_by_its_own_where_and_updates_them_by_ctid() -> None:
    sql = _update_then_ledger().sql
    assert (
        "w0 AS (UPDATE outbox SET state=(members.m->>0)::VARCHAR, lookups=(outbox.lookups + "
        "(members.m->>1)::BIGINT), result=(members.m->>2)::JSONB FROM members CROSS JOIN "
        "LATERAL (SELECT outbox.ctid AS t FROM outbox WHERE outbox.event_key = "
        "(members.m->>3)::VARCHAR AND outbox.fence = (members.m->>4)::BIGINT OFFSET 0) AS x0 "
        "WHERE outbox.ctid = x0.t RETURNING members.ord)"
    ) in sql
    # The fenced write must have changed one row of each member: $2 is the number of members.
    assert (
        "CASE WHEN count(*) = $2::BIGINT AND count(DISTINCT ord) = $2::BIGINT THEN 1 "
        "ELSE CAST('agent_txn_lease_lost:0:' || count(*) AS integer) END FROM w0"
    ) in sql


def test_a_multi_row_insert_reads_its_rows_in_order_after_the_earlier_writes() -> None:
    sql = _update_then_ledger().sql
    assert (
        "w1 AS (INSERT INTO ledger (tx_id, n, detail) SELECT "
        "(members.m->>(5 + g1.j * 3))::VARCHAR, (members.m->>(6 + g1.j * 3))::BIGINT, "
        "(members.m->>(7 + g1.j * 3))::VARCHAR FROM members CROSS JOIN generate_series(0, 1) "
        "AS g1(j) ORDER BY members.ord, g1.j RETURNING 1)"
    ) in sql
    assert sql.endswith("(SELECT count(*) FROM w1) AS c1) AS counts")


def _read(sql: str, member: list[Any], rows: int = 2) -> list[list[Any]]:
    """What each placeholder of each write reads from ``member``'s JSON element, row by row,
    by following the ``->>`` indexes the SQL holds (``(first + gN.j * width)`` for row ``j``)."""
    element = json.loads(json.dumps(member))
    reads = []
    for index in re.findall(r"members\.m->>(\d+|\(\d+ \+ g\d+\.j \* \d+\))\)::", sql):
        row = re.fullmatch(r"\((\d+) \+ g\d+\.j \* (\d+)\)", index)
        if row is None:
            reads.append([element[int(index)]])
        else:
            first, width = int(row.group(1)), int(row.group(2))
            reads.append([element[first + j * width] for j in range(rows)])
    return reads


@given(
    st.lists(
        st.lists(
            st.one_of(st.none(), st.integers(), st.booleans(), st.text(max_size=3)),
            min_size=11,
            max_size=11,
        ),
        min_size=2,
        max_size=20,
    )
)
def test_every_argument_reaches_its_placeholder_and_member(members: list[list[Any]]) -> None:
    batch = _update_then_ledger()
    args = batch.arguments(members)
    assert args is not None and args[1] == len(members) and len(args) == 2
    document = json.loads(args[0])
    assert document == members  # one element per member, in order, each its own arguments
    for member in members:
        reads = _read(batch.sql, member)
        # The update's five placeholders, its WHERE's two among them, then the insert's three
        # columns, each over the two rows.
        assert [r[0] for r in reads[:5]] == member[:5]
        assert reads[5:] == [
            [member[5], member[8]],
            [member[6], member[9]],
            [member[7], member[10]],
        ]


def test_without_a_fenced_write_no_member_count_is_passed() -> None:
    batch = batch_statement([_write(INSERT, 3), _write(INSERT, 3, rows=2)])
    assert batch is not None and not batch.counted
    assert "$2" not in batch.sql and "count(DISTINCT" not in batch.sql
    args = batch.arguments([list(range(9)), list(range(9, 18))])
    assert args == ["[[0, 1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]"]


def test_arguments_json_cannot_carry_exactly_keep_executemany() -> None:
    batch = _update_then_ledger()
    base: list[Any] = ["s", 1, None, "ev", 7, "tx", 1, "d", "tx", 2, "d"]
    for odd in (1.5, Decimal("1"), b"bytes", ("a",)):
        member = list(base)
        member[1] = odd
        assert batch.arguments([base, member]) is None, odd


def test_a_placeholder_used_twice_reads_one_argument() -> None:
    sql = (
        "UPDATE operations SET state=$1::VARCHAR WHERE operations.tx_id = $2::VARCHAR AND "
        "(SELECT transactions.fence FROM transactions WHERE transactions.tx_id = $2::VARCHAR)"
        " = $3::BIGINT"
    )
    batch = batch_statement([_write(INSERT, 3), _write(sql, 3, fenced=True)])
    assert batch is not None
    assert (
        "WHERE operations.tx_id = (members.m->>4)::VARCHAR AND (SELECT transactions.fence FROM "
        "transactions WHERE transactions.tx_id = (members.m->>4)::VARCHAR) = "
        "(members.m->>5)::BIGINT OFFSET 0"
    ) in batch.sql


def test_statements_it_cannot_read_with_certainty_keep_executemany() -> None:
    unreadable = [
        # A placeholder without a cast, or with a cast of more than one word, or of a type
        # whose value JSON may not carry exactly.
        "UPDATE outbox SET state=$1 WHERE outbox.event_key = $2::VARCHAR",
        "UPDATE outbox SET at=$1::TIMESTAMP WITH TIME ZONE WHERE outbox.event_key = $2::VARCHAR",
        "UPDATE outbox SET x=$1::NUMERIC WHERE outbox.event_key = $2::VARCHAR",
        # A subquery in SET; no WHERE; a DELETE; an INSERT with more after its VALUES.
        "UPDATE outbox SET n=(SELECT 1 WHERE $1::BIGINT > 0) WHERE outbox.event_key = $2::VARCHAR",
        "UPDATE outbox SET state=$1::VARCHAR, kind=$2::VARCHAR",
        "DELETE FROM outbox WHERE outbox.event_key = $1::VARCHAR AND outbox.fence = $2::BIGINT",
        "INSERT INTO ledger (a, b) VALUES ($1::VARCHAR, $2::BIGINT) ON CONFLICT DO NOTHING",
    ]
    for sql in unreadable:
        assert batch_statement([_write(INSERT, 3), _write(sql, 2)]) is None, sql
    # A multi-row UPDATE has no meaning: never rewritten.
    assert batch_statement([_write(UPDATE, 5, rows=2)]) is None
    # Placeholders that do not match the statement's parameter count.
    assert batch_statement([_write(INSERT, 4)]) is None
