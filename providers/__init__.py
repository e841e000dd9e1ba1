"""Providers: the contract every effect-holding system meets, the registry, and the fake shop."""

from providers.contract import (
    ActionContract,
    ApplyOutcome,
    Confirmed,
    FencedOut,
    Found,
    JsonObject,
    LookupOutcome,
    NotFound,
    Provider,
    Rejected,
    Unavailable,
    Unknown,
    UnknownAction,
)
from providers.fake import (
    FakeShop,
    FaultKind,
    FaultPlan,
    FaultRule,
    ProviderUnavailable,
    ResponseLost,
)
from providers.registry import DuplicateProvider, ProviderRegistry, UnknownProvider

__all__ = [
    "ActionContract",
    "ApplyOutcome",
    "Confirmed",
    "DuplicateProvider",
    "FakeShop",
    "FaultKind",
    "FaultPlan",
    "FaultRule",
    "FencedOut",
    "Found",
    "JsonObject",
    "LookupOutcome",
    "NotFound",
    "Provider",
    "ProviderRegistry",
    "ProviderUnavailable",
    "Rejected",
    "ResponseLost",
    "Unavailable",
    "Unknown",
    "UnknownAction",
    "UnknownProvider",
]
