"""The fake shop provider: inventory, payments and email over a database of their own."""

from providers.fake.faults import (
    FaultKind,
    FaultPlan,
    FaultRule,
    ProviderUnavailable,
    ResponseLost,
)
from providers.fake.provider import FakeProvider
from providers.fake.shop import COUNTED_ACTIONS, FakeShop
from providers.fake.store import CallRecord, EffectRecord, ShopDatabaseError

__all__ = [
    "COUNTED_ACTIONS",
    "CallRecord",
    "EffectRecord",
    "FakeProvider",
    "FakeShop",
    "FaultKind",
    "FaultPlan",
    "FaultRule",
    "ProviderUnavailable",
    "ResponseLost",
    "ShopDatabaseError",
]
