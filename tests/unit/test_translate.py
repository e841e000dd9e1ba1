"""Which driver errors become which storage errors (``ledger.dialects.translate``), for the
PostgreSQL server's shortages (sqlstate class 53): each is ``StoreUnavailable``, retryable,
with its reason; the server refusing a connection for want of one is tested against a real
server in ``tests/integration/test_pg_connections.py``."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DBAPIError

from ledger.dialects import translate
from ledger.errors import StoreUnavailable, ValueNotStorable


class _ServerError(Exception):
    """What a driver raises: its message and the server's sqlstate."""

    def __init__(self, message: str, sqlstate: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("sqlstate", "reason"),
    [("53100", "disk full"), ("53200", "out of memory"), ("53400", "insufficient resources")],
)
def test_a_shortage_during_a_statement_is_store_unavailable(sqlstate: str, reason: str) -> None:
    # SQLAlchemy's asyncpg adapter wraps these as its generic Error, a DBAPIError.
    wrapped = DBAPIError("INSERT INTO ledger ...", {}, _ServerError("no room", sqlstate))
    translated = translate(wrapped)
    assert isinstance(translated, StoreUnavailable) and translated.retryable
    assert str(translated) == f"database out of resources ({sqlstate}: {reason})"


def test_a_refusal_while_connecting_names_its_reason() -> None:
    # asyncpg raises the server's refusal unwrapped while it connects.
    translated = translate(_ServerError("sorry, too many clients already", "53300"))
    assert isinstance(translated, StoreUnavailable)
    assert str(translated) == "database refused the connection (53300: too many connections)"


def test_an_error_of_another_class_is_not_taken_for_a_shortage() -> None:
    wrapped = DBAPIError("SELEC 1", {}, _ServerError("syntax error", "42601"))
    assert translate(wrapped) is None
    assert translate(_ServerError("syntax error", "42601")) is None


@pytest.mark.parametrize(
    ("sqlstate", "reason"),
    [
        ("22001", "string too long for its column"),
        ("22003", "number out of its column's range"),
        ("22012", "data exception"),
    ],
)
def test_a_data_exception_is_a_value_not_storable_without_the_value(
    sqlstate: str, reason: str
) -> None:
    """PostgreSQL's class 22: the value has no place in its column. Not retryable (the same
    value fails again) and not a lost database; the driver's text, which may quote the value,
    stays out."""
    text = "value too long for type character varying(100): 'secret-ish'"
    wrapped = DBAPIError("INSERT INTO outbox ...", {}, _ServerError(text, sqlstate))
    translated = translate(wrapped)
    assert isinstance(translated, ValueNotStorable) and not translated.retryable
    assert str(translated) == f"database refused a value ({sqlstate}: {reason})"


def test_an_integer_sqlite_cannot_bind_is_a_value_not_storable() -> None:
    translated = translate(OverflowError("Python int too large to convert to SQLite INTEGER"))
    assert isinstance(translated, ValueNotStorable)
    assert translate(OverflowError("int too large to convert to float")) is None
