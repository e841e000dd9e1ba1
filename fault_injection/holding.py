"""A provider wrapper that freezes one call mid-flight: a request in the network, or a worker
stopped by a long GC pause while its lease runs out."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Literal

from providers.contract import ActionContract, ApplyOutcome, LookupOutcome, Provider


class HoldingProvider:
    """Delegates to ``inner`` but freezes the first apply of ``action`` until :attr:`gate` opens.

    ``hold="request"`` freezes it before the provider sees it (a request still in flight);
    ``hold="answer"`` lets the provider act and freezes the answer (a worker paused after the
    call). Either way the holder's lease can run out meanwhile, as in a long GC pause.
    """

    def __init__(
        self, inner: Provider, action: str, *, hold: Literal["request", "answer"] = "request"
    ) -> None:
        self.inner = inner
        self.action = action
        self.hold = hold
        self.gate = asyncio.Event()
        self.reached = asyncio.Event()
        #: Set once the held call has come back (whatever it answered).
        self.done = asyncio.Event()
        self._held = False
        #: ``void_if_missing`` of every lookup the engine made through this provider.
        self.voids: list[bool] = []

    @property
    def name(self) -> str:
        """The wrapped provider's name."""
        return self.inner.name

    def contract(self, action: str) -> ActionContract:
        """The wrapped provider's contract."""
        return self.inner.contract(action)

    def actions(self) -> Mapping[str, ActionContract]:
        """The wrapped provider's actions."""
        return self.inner.actions()

    async def apply(
        self, action: str, *, key: str, payload: Mapping[str, Any], fence: int
    ) -> ApplyOutcome:
        """The inner apply, the first one of :attr:`action` frozen as configured."""
        if action != self.action or self._held:
            return await self.inner.apply(action, key=key, payload=payload, fence=fence)
        self._held = True
        try:
            if self.hold == "request":
                self.reached.set()
                await self.gate.wait()
                return await self.inner.apply(action, key=key, payload=payload, fence=fence)
            outcome = await self.inner.apply(action, key=key, payload=payload, fence=fence)
            self.reached.set()
            await self.gate.wait()
            return outcome
        finally:
            self.done.set()

    async def lookup(
        self, action: str, *, key: str, payload: Mapping[str, Any], void_if_missing: bool = False
    ) -> LookupOutcome:
        """The inner lookup (its ``void_if_missing`` recorded)."""
        self.voids.append(void_if_missing)
        return await self.inner.lookup(
            action, key=key, payload=payload, void_if_missing=void_if_missing
        )
