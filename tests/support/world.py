"""Test worlds: our engine plus the fake shop, and more engines ("processes") on the same data."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Protocol

from orchestrator.config import EngineSettings
from orchestrator.engine import Orchestrator
from providers.fake.shop import FakeShop


class Urls(Protocol):
    """The pair of database URLs a world lives on."""

    @property
    def store(self) -> str: ...

    @property
    def provider(self) -> str: ...

    @property
    def backend(self) -> str: ...


#: For tests that drive work through a bounded number of passes (one ``recover`` call, a
#: worker's ``once`` loop) and then expect every saga settled. A provider call cut by
#: :func:`fast_settings`' 2 s budget is a legitimate "unknown" that only a later pass settles,
#: after its backoff; on a loaded CI machine the fake shop's SQLite once took that long (w-6,
#: CI of 2026-12-05). Timeouts have their own tests; in these the budget must not decide the
#: outcome.
ONE_PASS_CALL_TIMEOUT_S = 60.0


def fast_settings(**overrides: object) -> EngineSettings:
    """Settings for tests: tiny backoffs, a short execute budget, a unique worker id."""
    base: dict[str, object] = {
        "backoff_initial_seconds": 0.005,
        "backoff_max_seconds": 0.05,
        "execute_budget_seconds": 2.0,
        "call_timeout_seconds": 2.0,
        "lease_seconds": 30.0,
        "reconcile_attempts": 6,
        "compensation_attempts": 4,
        "worker_id": f"test-{uuid.uuid4().hex[:6]}",
    }
    base.update(overrides)
    return EngineSettings.model_validate(base)


@dataclass
class World:
    """Our store, the fake provider's database, and a way to start more engines on them."""

    urls: Urls
    shop: FakeShop
    orch: Orchestrator
    extra: list[Orchestrator]

    async def engine(self, **settings: object) -> Orchestrator:
        """Another engine (a "process") on the same databases, sharing the shop."""
        orch = await Orchestrator.open(
            self.urls.store, providers=self.shop.providers(), settings=fast_settings(**settings)
        )
        self.extra.append(orch)
        return orch
