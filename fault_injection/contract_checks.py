"""Contract checks for *your* provider: does it really do what its ActionContract declares?

Seed 003 ends with a warning: before trusting Stripe, Adyen or an internal ledger, re-run the
contract tests — does the same key really deduplicate, how long is a key kept, can a result be
found by key, how is a duplicate refund recognised. agent-txn's guarantees rest on exactly those
promises, so this module probes them against a live provider (use a sandbox account)::

    checks = await check_provider_contract(
        my_payments, "charge", {"amount": 100, "currency": "EUR"},
        other_payload={"amount": 999, "currency": "EUR"},
    )
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]

Every check uses fresh keys (``key_prefix`` + random), so it can run against shared sandboxes.
Checks that the contract says do not apply are reported as passed with ``skipped=True``.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from providers.contract import (
    ActionContract,
    Confirmed,
    FencedOut,
    Found,
    NotFound,
    Provider,
    Rejected,
    UnknownAction,
)


@dataclass(frozen=True)
class ContractCheck:
    """One probed promise."""

    name: str
    passed: bool
    detail: str
    skipped: bool = False


def _key(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


async def check_provider_contract(
    provider: Provider,
    action: str,
    payload: Mapping[str, Any],
    *,
    other_payload: Mapping[str, Any] | None = None,
    advance_clock: Callable[[float], Awaitable[None] | None] | None = None,
    key_prefix: str = "agent-txn-contract",
) -> list[ContractCheck]:
    """Probe ``action`` of ``provider`` with real calls; one :class:`ContractCheck` per promise.

    ``advance_clock(seconds)``, when the provider's clock can be moved (a fake, a sandbox with
    test clocks), lets the dedup window itself be checked at its edge.
    """
    try:
        contract = provider.contract(action)
    except UnknownAction:
        return [ContractCheck("contract declared", False, f"{provider.name} has no {action!r}")]
    checks = [ContractCheck("contract declared", True, _describe(contract))]
    checks.append(_compensation_of_compensation(provider, contract))
    key = _key(key_prefix)
    first = await provider.apply(action, key=key, payload=payload, fence=1)
    if not isinstance(first, Confirmed):
        checks.append(ContractCheck("apply confirms", False, f"first apply answered {first!r}"))
        return checks
    checks.append(ContractCheck("apply confirms", True, f"remote id {first.remote_id}"))
    checks.append(await _dedup(provider, action, contract, key, payload, first))
    checks.extend(await _lookup(provider, action, contract, key, payload, first, key_prefix))
    checks.append(await _payload_mismatch(provider, action, contract, key, other_payload))
    checks.append(await _fencing(provider, action, contract, payload, key_prefix))
    checks.append(await _window(provider, action, contract, key, payload, first, advance_clock))
    return checks


def _describe(c: ActionContract) -> str:
    reverse = f"compensated by {c.compensation}" if c.compensation else "irreversible"
    return (
        f"{reverse}; dedup={c.dedups_by_key} window={c.dedup_window_seconds:g}s "
        f"lookup={c.supports_lookup} fencing={c.supports_fencing} void={c.supports_void}"
    )


def _compensation_of_compensation(provider: Provider, contract: ActionContract) -> ContractCheck:
    name = "compensation of a compensation is refused"
    if contract.compensation is None:
        return ContractCheck(name, True, "action is irreversible", skipped=True)
    try:
        reverse = provider.contract(contract.compensation)
    except UnknownAction:
        return ContractCheck(name, False, f"compensation {contract.compensation!r} does not exist")
    if reverse.compensation is not None or not reverse.is_compensation:
        return ContractCheck(
            name, False, f"{contract.compensation!r} declares its own compensation"
        )
    return ContractCheck(name, True, f"{contract.compensation!r} is terminal")


async def _dedup(
    provider: Provider,
    action: str,
    contract: ActionContract,
    key: str,
    payload: Mapping[str, Any],
    first: Confirmed,
) -> ContractCheck:
    name = "same key + same payload deduplicates"
    if not contract.dedups_by_key:
        return ContractCheck(name, True, "contract says no dedup", skipped=True)
    again = await provider.apply(action, key=key, payload=payload, fence=1)
    if isinstance(again, Confirmed) and again.remote_id == first.remote_id:
        return ContractCheck(name, True, "second apply returned the first effect")
    return ContractCheck(name, False, f"second apply answered {again!r}: a second effect?")


async def _lookup(
    provider: Provider,
    action: str,
    contract: ActionContract,
    key: str,
    payload: Mapping[str, Any],
    first: Confirmed,
    prefix: str,
) -> list[ContractCheck]:
    if not contract.supports_lookup:
        return [ContractCheck("lookup by key", True, "contract says no lookup", skipped=True)]
    found = await provider.lookup(action, key=key, payload=payload)
    ok = isinstance(found, Found) and found.remote_id == first.remote_id
    out = [ContractCheck("lookup by key finds the effect", ok, repr(found))]
    missing = await provider.lookup(action, key=_key(prefix), payload=payload)
    out.append(
        ContractCheck(
            "lookup of an unused key answers not found",
            isinstance(missing, NotFound),
            repr(missing),
        )
    )
    return out


async def _payload_mismatch(
    provider: Provider,
    action: str,
    contract: ActionContract,
    key: str,
    other: Mapping[str, Any] | None,
) -> ContractCheck:
    name = "same key + different payload is rejected"
    if other is None or not contract.dedups_by_key:
        return ContractCheck(name, True, "no other_payload given", skipped=True)
    answer = await provider.apply(action, key=key, payload=other, fence=1)
    if isinstance(answer, Rejected):
        return ContractCheck(name, True, f"rejected: {answer.reason}")
    return ContractCheck(name, False, f"answered {answer!r}: the key does not bind the payload")


async def _fencing(
    provider: Provider,
    action: str,
    contract: ActionContract,
    payload: Mapping[str, Any],
    prefix: str,
) -> ContractCheck:
    name = "a lower fence is refused"
    if not contract.supports_fencing:
        return ContractCheck(name, True, "contract says no fencing", skipped=True)
    key = _key(prefix)
    await provider.apply(action, key=key, payload=payload, fence=2)
    stale = await provider.apply(action, key=key, payload=payload, fence=1)
    if isinstance(stale, FencedOut):
        return ContractCheck(name, True, f"highest fence {stale.highest_fence}")
    return ContractCheck(name, False, f"fence 1 after fence 2 answered {stale!r}")


async def _window(
    provider: Provider,
    action: str,
    contract: ActionContract,
    key: str,
    payload: Mapping[str, Any],
    first: Confirmed,
    advance_clock: Callable[[float], Awaitable[None] | None] | None,
) -> ContractCheck:
    name = "key kept for the declared dedup window"
    if not contract.dedups_by_key:
        return ContractCheck(name, True, "contract says no dedup", skipped=True)
    if contract.dedup_window_seconds <= 0:
        return ContractCheck(name, False, "declared window is not positive")
    if advance_clock is None:
        return ContractCheck(
            name,
            True,
            f"declared {contract.dedup_window_seconds:g}s (clock not movable)",
            skipped=True,
        )
    moved = advance_clock(contract.dedup_window_seconds * 0.99)
    if moved is not None:
        await moved
    again = await provider.apply(action, key=key, payload=payload, fence=1)
    if isinstance(again, Confirmed) and again.remote_id == first.remote_id:
        return ContractCheck(name, True, "still deduplicated at 99% of the window")
    return ContractCheck(name, False, f"forgotten before the declared window: {again!r}")
