"""Alembic environment for agent-txn's own database.

Runtime use is programmatic (:mod:`ledger.migrate`): the caller opens the transaction, takes the
migration lock and passes its sync ``Connection`` in ``config.attributes["connection"]``; this
module then runs inside that transaction and commits nothing itself.

Without that attribute (the plain ``alembic`` CLI with an ini file) it connects to
``sqlalchemy.url`` itself, or renders SQL in offline mode (``alembic upgrade --sql``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from alembic import context
from sqlalchemy import Connection, create_engine, pool
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from ledger.schema import exists_on, metadata

config = context.config
target_metadata = metadata


def _run(connection: Connection) -> None:
    dialect = connection.dialect.name

    def include_object(_obj: Any, name: str | None, *_: Any) -> bool:
        return exists_on(dialect, name)  # autogenerate: what this backend has by design

    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=dialect == "sqlite",
        compare_type=True,
        include_object=include_object,
    )
    # Inside a caller's transaction this is a no-op: the caller commits (or rolls back) it all.
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError(
            "no database: pass a connection in config.attributes['connection'] "
            "(see ledger.migrate) or set sqlalchemy.url"
        )
    return url


def run_migrations_offline() -> None:
    url = _url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=make_url(url).get_backend_name() == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_run)
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = _url()
    if make_url(url).get_dialect().is_async:
        asyncio.run(_run_async(url))
        return
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
