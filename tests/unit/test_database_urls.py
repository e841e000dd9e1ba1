"""What ``ledger.dialects.normalize_url`` makes of the URLs users type: the driver filled in,
libpq's ``sslmode`` said as asyncpg's ``ssl``, and what would only fail at the first connection,
with the driver's own traceback, refused at once with its reason."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy.exc import DatabaseError

from ledger.dialects import in_memory, normalize_url, translate
from ledger.errors import StoreUnavailable


@pytest.mark.parametrize(
    ("given", "normalized"),
    [
        ("sqlite:///x.db", "sqlite+aiosqlite:///x.db"),
        ("postgres://u@h/d", "postgresql+asyncpg://u@h/d"),
        ("postgresql://u@h:6432/d", "postgresql+asyncpg://u@h:6432/d"),
        # The URLs hosting providers hand out carry libpq's name for it.
        ("postgresql://u@h/d?sslmode=require", "postgresql+asyncpg://u@h/d?ssl=require"),
        # asyncpg's own name wins where both are given.
        (
            "postgresql://u@h/d?ssl=disable&sslmode=require",
            "postgresql+asyncpg://u@h/d?ssl=disable",
        ),
        (
            "postgresql://u@h/d?timeout=5&statement_cache_size=0",
            "postgresql+asyncpg://u@h/d?statement_cache_size=0&timeout=5",
        ),
    ],
)
def test_the_url_a_user_types_is_the_one_the_store_opens(given: str, normalized: str) -> None:
    assert normalize_url(given) == normalized


@pytest.mark.parametrize(
    ("given", "reason"),
    [
        # Each of these printed a driver's traceback at the first connection.
        ("postgresql+psycopg2://u@h/d", "agent-txn reaches postgresql through asyncpg"),
        ("sqlite+pysqlite:///x.db", "agent-txn reaches sqlite through aiosqlite"),
        ("postgresql://u@h:99999/d", "port 99999 is not a TCP port"),
        ("postgresql://u@h/d?bogus=1", "unknown PostgreSQL connection option 'bogus'"),
        ("postgresql://u@h/d?server_settings=x", "option 'server_settings'"),
        ("postgresql://u@h/d?timeout=soon", "timeout must be a number >= 0, not 'soon'"),
        ("postgresql://u@h/d?statement_cache_size=-1", "statement_cache_size must be a number"),
        ("postgresql://u@h/d?timeout=inf", "timeout must be a number"),
        ("postgresql://u@h/d?timeout=nan", "timeout must be a number"),
    ],
)
def test_a_url_that_cannot_connect_is_refused_with_its_reason(given: str, reason: str) -> None:
    with pytest.raises(ValueError) as raised:
        normalize_url(given)
    assert reason in str(raised.value)


@pytest.mark.parametrize("message", ["file is not a database", "database disk image is malformed"])
def test_a_file_that_is_not_a_database_is_store_unavailable(message: str) -> None:
    # SQLite opens any file and fails at its first read; SQLAlchemy wraps it as DatabaseError,
    # which no rule knew, and the inline driver raises it unwrapped.
    for raised in (
        DatabaseError("PRAGMA journal_mode", {}, sqlite3.DatabaseError(message)),
        sqlite3.DatabaseError(message),
    ):
        translated = translate(raised)
        assert isinstance(translated, StoreUnavailable)
        assert str(translated) == "not a SQLite database file, or a damaged one"


@pytest.mark.parametrize(
    ("url", "memory"),
    [
        ("sqlite://", True),
        ("sqlite+aiosqlite:///:memory:", True),
        ("sqlite+aiosqlite:///agent.db", False),
        ("sqlite+aiosqlite:////tmp/agent.db?timeout=5", False),
        ("postgresql+asyncpg://u@h/d", False),
    ],
)
def test_an_in_memory_sqlite_url_is_told_from_a_file(url: str, memory: bool) -> None:
    assert in_memory(url) is memory
