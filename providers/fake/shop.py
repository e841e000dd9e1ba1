"""The fake shop: three remote services (inventory, payments, email) over one database of theirs.

The shop database is separate from agent-txn's, so rolling back the engine's state never undoes
an effect here, and every counter a test asserts on (``charge == 1``) is read back from it. Two
shops opened on one URL see the same effects; each has its own fault plan and clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.engine import URL

from providers.contract import Provider
from providers.fake import schema
from providers.fake.actions import build_specs
from providers.fake.faults import FaultPlan
from providers.fake.provider import FakeProvider, ShopContext
from providers.fake.store import CallRecord, EffectRecord, Store

#: Every counter :meth:`FakeShop.counts` reports, always present.
COUNTED_ACTIONS: tuple[str, ...] = (
    "inventory.reserve",
    "inventory.release",
    "payments.charge",
    "payments.refund",
    "email.send",
)


class FakeShop:
    """Open with :meth:`open`; close with :meth:`close` (or use ``async with``)."""

    def __init__(
        self,
        store: Store,
        faults: FaultPlan,
        clock: Callable[[], float],
        dedup_window_seconds: float,
    ) -> None:
        self._store = store
        #: The fault plan every call of this shop consults; add rules at any time.
        self.faults = faults
        self.clock = clock
        self.dedup_window_seconds = dedup_window_seconds
        ctx = ShopContext(store, faults, clock, dedup_window_seconds)
        specs = build_specs(dedup_window_seconds)
        self.inventory = FakeProvider("inventory", specs["inventory"], ctx)
        self.payments = FakeProvider("payments", specs["payments"], ctx)
        self.email = FakeProvider("email", specs["email"], ctx)

    @classmethod
    async def open(
        cls,
        url: str | URL,
        *,
        faults: FaultPlan | None = None,
        clock: Callable[[], float] | None = None,
        dedup_window_seconds: float = 86400.0,
    ) -> FakeShop:
        """Connect to the shop database at ``url``, creating its tables if missing.

        ``clock`` is the provider's own clock in seconds (default :func:`time.time`).
        """
        if dedup_window_seconds <= 0:
            raise ValueError("dedup_window_seconds must be positive")
        store = await Store.open(url)
        plan = faults if faults is not None else FaultPlan()
        return cls(store, plan, clock or time.time, dedup_window_seconds)

    async def close(self) -> None:
        """Let every call in progress finish, then dispose of the database engine."""
        await self._store.dispose()

    async def settle(self) -> None:
        """Wait until no call is in progress, those whose callers stopped waiting (a call
        timeout, a "crash") included: once a request has reached the shop it runs to its end,
        as it would at a real provider."""
        await self._store.settle()

    async def __aenter__(self) -> FakeShop:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def providers(self) -> list[Provider]:
        """The three providers, ready for a :class:`~providers.registry.ProviderRegistry`."""
        return [self.inventory, self.payments, self.email]

    # -- business state -----------------------------------------------------------------------

    async def seed_stock(self, levels: Mapping[str, int]) -> None:
        """Set the available stock of each SKU (creating SKUs as needed)."""
        s = schema.stock
        async with self._store.write(None, None) as conn:
            for sku, available in levels.items():
                if available < 0:
                    raise ValueError(f"stock of {sku!r} cannot be negative")
                # Past the column's range the driver failed, printing the SQL and parameters.
                if available > schema.MAX_STOCK:
                    raise ValueError(f"stock of {sku!r} cannot be above {schema.MAX_STOCK}")
                changed = await conn.execute(
                    update(s).where(s.c.sku == sku).values(available=available)
                )
                if changed.rowcount == 0:
                    await conn.execute(insert(s).values(sku=sku, available=available))

    async def stock(self, sku: str) -> int:
        """Units of ``sku`` available now; raises :class:`KeyError` for an unknown SKU."""
        s = schema.stock
        async with self._store.engine.connect() as conn:
            value = (
                await conn.execute(select(s.c.available).where(s.c.sku == sku))
            ).scalar_one_or_none()
        if value is None:
            raise KeyError(f"unknown sku {sku!r}")
        return int(value)

    async def reservations(self) -> list[dict[str, Any]]:
        """Every reservation (``released_by`` is the release id once returned)."""
        return await self._store.rows("reservations")

    async def charges(self) -> list[dict[str, Any]]:
        """Every charge with its ``amount`` and ``refunded`` total (minor units)."""
        return await self._store.rows("charges")

    async def emails(self) -> list[dict[str, Any]]:
        """Every email sent."""
        return await self._store.rows("emails")

    # -- protocol state -----------------------------------------------------------------------

    async def counts(self) -> dict[str, int]:
        """Applied effects per ``provider.action``, read from the shop database (0 if none)."""
        found = await self._store.applied_counts()
        counts = dict.fromkeys(COUNTED_ACTIONS, 0)
        for (provider, action), n in found.items():
            counts[f"{provider}.{action}"] = n
        return counts

    async def effects(self, action: str | None = None) -> list[EffectRecord]:
        """Rows of ``effects`` (all statuses), oldest first.

        ``action`` is ``"charge"`` or ``"payments.charge"``; ``None`` means every action.
        """
        provider: str | None = None
        if action is not None and "." in action:
            provider, action = action.split(".", 1)
        return await self._store.effects(provider, action)

    async def calls(self, key: str | None = None) -> list[CallRecord]:
        """The request log, oldest first, optionally for one idempotency key."""
        return await self._store.calls(key)

    def __repr__(self) -> str:
        return f"FakeShop({self._store.engine.url.render_as_string()!r})"


__all__ = ["COUNTED_ACTIONS", "FakeShop"]
