"""A fake shop whose first charge is slow (for worker tests run with ``--app``)."""

from __future__ import annotations

import os

from providers.fake.faults import FaultKind, FaultPlan, FaultRule
from providers.fake.shop import FakeShop


async def build() -> FakeShop:
    """The shop at ``$AGENT_TXN_TEST_PROVIDER_URL``; its first charge takes ``$SLOW_SECONDS``."""
    delay = float(os.environ.get("SLOW_SECONDS", "2"))
    plan = FaultPlan(
        [FaultRule(FaultKind.TIMEOUT, provider="payments", action="charge", delay_s=delay)]
    )
    return await FakeShop.open(os.environ["AGENT_TXN_TEST_PROVIDER_URL"], faults=plan)


async def build_slowly() -> FakeShop:
    """The shop at ``$AGENT_TXN_TEST_PROVIDER_URL``, after touching ``$OPENING_MARKER`` and
    sleeping ``$OPEN_SECONDS``: a worker process that is still opening when the test signals."""
    import asyncio
    from pathlib import Path

    await asyncio.to_thread(Path(os.environ["OPENING_MARKER"]).touch)
    await asyncio.sleep(float(os.environ.get("OPEN_SECONDS", "3")))
    return await FakeShop.open(os.environ["AGENT_TXN_TEST_PROVIDER_URL"])
