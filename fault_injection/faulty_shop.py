"""The fake shop with faults from the environment, for worker processes (``--app``).

``AGENT_TXN_FLEET_FAULTS`` is a comma-separated list of ``kind:provider.action:skip:times``
(``lose_response:payments.charge:0:40``): each rule lets ``skip`` matching calls through, then
injects its fault into the next ``times`` calls of that process.
"""

from __future__ import annotations

import os

from providers.fake.actions import build_specs
from providers.fake.faults import FaultKind, FaultPlan, FaultRule
from providers.fake.shop import FakeShop


def parse_faults(spec: str) -> list[FaultRule]:
    """Rules from the ``kind:provider.action:skip:times`` list. Raises :class:`ValueError`
    naming the item that is not one (the CLI checks the list before it starts any worker, which
    would otherwise die of it at start, unseen)."""
    rules = []
    shop = build_specs(0.0)  # the shop's actions, by provider
    for item in filter(None, (part.strip() for part in spec.split(","))):
        fields = item.split(":")
        if len(fields) != 4:
            raise ValueError(f"{item!r} is not kind:provider.action:skip:times")
        kind, target, skip, times = fields
        provider, dot, action = target.partition(".")
        if not (provider and dot and action):
            raise ValueError(f"{item!r}: {target!r} is not provider.action (payments.charge)")
        if action not in shop.get(provider, {}):
            # A rule for an action the shop has not (a typo) never fires: the fleet ran as if
            # no fault had been asked for.
            known = ", ".join(f"{p}.{a}" for p, actions in shop.items() for a in actions)
            raise ValueError(f"{item!r}: the fake shop has no action {target!r} ({known})")
        if kind not in {k.value for k in FaultKind}:
            kinds = ", ".join(k.value for k in FaultKind)
            raise ValueError(f"{item!r}: unknown fault kind {kind!r} (one of {kinds})")
        if not (skip.isdigit() and times.isdigit()):
            raise ValueError(f"{item!r}: skip and times are whole numbers from 0")
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
