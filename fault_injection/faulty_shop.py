"""The fake shop with faults from the environment, for worker processes (``--app``).

``AGENT_TXN_FLEET_FAULTS`` is a comma-separated list of ``kind:provider.action:skip:times``
(``lose_response:payments.charge:0:40``): each rule lets ``skip`` matching calls through, then
injects its fault into the next ``times`` calls of that process.
"""

from __future__ import annotations

import os

from providers.fake.faults import FaultKind, FaultPlan, FaultRule
from providers.fake.shop import FakeShop


def parse_faults(spec: str) -> list[FaultRule]:
    """Rules from the ``kind:provider.action:skip:times`` list."""
    rules = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, target, skip, times = item.split(":")
        provider, _, action = target.partition(".")
        rules.append(
            FaultRule(
                FaultKind(kind),
                provider=provider,
                action=action,
                skip=int(skip),
                times=int(times),
                delay_s=0.2,
            )
        )
    return rules


async def build() -> FakeShop:
    """The shop at ``$AGENT_TXN_FLEET_PROVIDER_URL`` with ``$AGENT_TXN_FLEET_FAULTS``."""
    plan = FaultPlan(parse_faults(os.environ.get("AGENT_TXN_FLEET_FAULTS", "")))
    return await FakeShop.open(os.environ["AGENT_TXN_FLEET_PROVIDER_URL"], faults=plan)
