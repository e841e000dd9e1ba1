"""Blocking one-off reads and writes of a database by URL, for tests that drive the CLI in a
subprocess and look at what it left behind (``agent-txn demo``, ``agent-txn worker``)."""

from __future__ import annotations

import asyncio

from sqlalchemy import text

from ledger import dialects


def table_names(url: str) -> set[str]:
    """The tables of the database ``url`` names."""

    async def read() -> set[str]:
        engine = dialects.create_engine(url)
        try:
            async with engine.connect() as conn:
                return await dialects.table_names(conn)
        finally:
            await engine.dispose()

    return asyncio.run(read())


def execute(url: str, statement: str) -> None:
    """Run ``statement`` in its own committed transaction."""

    async def run() -> None:
        engine = dialects.create_engine(url)
        try:
            async with engine.begin() as conn:
                await conn.execute(text(statement))
        finally:
            await engine.dispose()

    asyncio.run(run())
