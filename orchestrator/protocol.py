"""The effect protocol: one function for forward steps, compensation steps and outbox events.

::

    claim = CAS(effect: claimable AND lease expired) -> executing, fence+1   (effects.claim)
    if claim.previous in {executing, unknown}:       # we may have sent it before
        lookup -> found: confirmed | unavailable: unknown (or manual_review) | not found: go on
    if first attempt older than the provider's dedup window: manual_review (never resend blindly)
    apply(key, payload, fence) -> confirmed | rejected -> failed | timeout/lost/5xx -> unknown
    record (fenced write; a stale fence raises LeaseLost)         (ledger.effects.record)

:func:`decide` is the middle part: it talks to the provider and returns a :class:`Decision`
without touching our database, so the caller can record it in the same local transaction as
its next claim (commit economy). An LLM never turns ``unknown`` into ``failed``: only a
provider's answer or an operator does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from compensation.policy import REASON_BUDGET, REASON_PAYLOAD, REASON_WINDOW, RetryBudget
from ledger.effects import Claim
from ledger.errors import LeaseLost
from ledger.frozen import quick_init
from ledger.states import EffectState
from orchestrator.bounded import bounded
from orchestrator.crashpoints import CrashPoints
from orchestrator.logging import info_enabled
from providers.contract import (
    ActionContract,
    Confirmed,
    FencedOut,
    Found,
    NotFound,
    Provider,
    Rejected,
    Unavailable,
    Unknown,
)

log = structlog.get_logger(__name__)


@quick_init
@dataclass(frozen=True, slots=True)
class Decision:
    """What the provider's answers prove about one claimed effect."""

    state: EffectState
    action: str  # ledger action: apply / lookup / park
    remote_id: str | None = None
    result: Mapping[str, Any] | None = None
    error: str | None = None  # a short code, never provider prose
    lookups: int = 0
    applied: bool = False  # an apply was sent in this attempt
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def in_doubt(self) -> bool:
        """Still unknown: reconcile later."""
        return self.state is EffectState.UNKNOWN


def echo_mismatches(contract: ActionContract, payload: Any, result: Any) -> list[str]:
    """Fields the provider's result must echo from the payload but does not."""
    if not isinstance(payload, Mapping) or not isinstance(result, Mapping):
        return list(contract.echo_fields)
    return [f for f in contract.echo_fields if f in payload and result.get(f) != payload.get(f)]


def _position(claim: Claim) -> dict[str, Any]:
    """A crash point's context for ``claim`` (built only when a point is armed)."""
    return {
        "kind": claim.kind._value_,
        "name": claim.name,
        "tx_id": claim.tx_id,
        "key": claim.key,
    }


def _safe_reason(value: str) -> str:
    # Provider reasons go to the ledger as evidence, bounded; never into an error envelope.
    return value[:200]


async def decide(
    provider: Provider,
    contract: ActionContract,
    claim: Claim,
    *,
    payload: Any,
    budget: RetryBudget,
    call_timeout: float,
    claimed_at_ms: int | None,
    crashpoints: CrashPoints,
    on_apply: Callable[[], None] | None = None,
) -> Decision:
    """Lookup-first when the effect may have been sent, then apply; never writes our store."""
    bound = (
        log.bind(tx_id=claim.tx_id, op_key=claim.key, step=claim.name, fence=claim.fence)
        if info_enabled()
        else None
    )
    if claim.attempts > budget.attempts + 1:
        # A probe that keeps dying (the holder crashed mid-call every time) must not loop.
        return Decision(
            EffectState.MANUAL_REVIEW,
            "park",
            error="budget_exhausted",
            detail={"reason": REASON_BUDGET, "attempts": claim.attempts},
        )
    lookups = 0
    evidence: dict[str, Any] = {}
    expired = _outside_dedup_window(contract, claim, claimed_at_ms)
    # The last chance to decide: a budget spent or a dedup window gone. If the provider can void
    # a key it never saw, ask it to, so a late original still in flight is refused (no hanging
    # effect) and "not found" becomes proof that it never will happen.
    final = budget.exhausted(claim.attempts) or expired
    void = final and contract.supports_void
    if claim.maybe_sent:
        if contract.supports_lookup:
            if crashpoints.armed:
                crashpoints.hit("effect.before_lookup", **_position(claim))
            lookups += 1
            try:
                answer = await bounded(
                    provider.lookup(
                        claim.action, key=claim.key, payload=payload, void_if_missing=void
                    ),
                    call_timeout,
                )
            except (TimeoutError, Exception) as exc:  # any failure to answer is "unavailable"
                answer = Unavailable(type(exc).__name__)
            if crashpoints.armed:
                crashpoints.hit("effect.after_lookup", **_position(claim))
            if bound is not None:
                bound.info("lookup", answer=type(answer).__name__)
            if isinstance(answer, Found):
                return Decision(
                    EffectState.CONFIRMED,
                    "lookup",
                    remote_id=answer.remote_id,
                    result=dict(answer.result),
                    lookups=lookups,
                    detail={
                        "lookup": "found",
                        "echo_mismatch": echo_mismatches(contract, payload, answer.result),
                    },
                )
            if isinstance(answer, Unavailable):
                state = (
                    EffectState.MANUAL_REVIEW
                    if budget.exhausted(claim.attempts)
                    else EffectState.UNKNOWN
                )
                return Decision(
                    state,
                    "lookup",
                    error="lookup_unavailable",
                    lookups=lookups,
                    detail={
                        "lookup": "unavailable",
                        "reason": _safe_reason(answer.reason),
                        "attempts": claim.attempts,
                    },
                )
            assert isinstance(answer, NotFound)
            evidence["lookup"] = "not_found"
            evidence["voided"] = answer.voided
            # Past the dedup window the provider may have forgotten the key, so its "never
            # saw it" proves nothing (the tombstone still refuses a late original): park below.
            if void and answer.voided and not expired:
                return Decision(
                    EffectState.FAILED,
                    "lookup",
                    error="voided",
                    lookups=lookups,
                    detail={**evidence, "reason": "never applied; the key is now void"},
                )
            if not contract.lookup_authoritative:
                return Decision(
                    EffectState.MANUAL_REVIEW,
                    "lookup",
                    error="lookup_not_authoritative",
                    lookups=lookups,
                    detail=evidence,
                )
        elif not contract.dedups_by_key:
            # No lookup and no dedup: a resend could act twice. Only a person can decide.
            return Decision(
                EffectState.MANUAL_REVIEW,
                "park",
                error="no_lookup_no_dedup",
                detail={"reason": "provider can neither look up nor dedup this action"},
            )
        if expired:
            return Decision(
                EffectState.MANUAL_REVIEW,
                "park",
                error="dedup_window_expired",
                lookups=lookups,
                detail={**evidence, "reason": REASON_WINDOW},
            )
        evidence["resend"] = True  # a new attempt, after proof the provider never saw it
    if crashpoints.armed:
        crashpoints.hit("effect.before_apply", **_position(claim))
    if on_apply is not None:
        on_apply()
    try:
        outcome = await bounded(
            provider.apply(claim.action, key=claim.key, payload=payload, fence=claim.fence),
            call_timeout,
        )
    except TimeoutError:
        outcome = Unknown("timeout")
    except Exception as exc:  # lost response, reset, anything: we cannot know
        outcome = Unknown(type(exc).__name__)
    if crashpoints.armed:
        crashpoints.hit("effect.after_apply", **_position(claim))
    if bound is not None:
        bound.info("apply", outcome=type(outcome).__name__)
    if isinstance(outcome, FencedOut):
        raise LeaseLost(f"{claim.kind._value_} {claim.key} (provider)", claim.fence)
    if isinstance(outcome, Confirmed):
        return Decision(
            EffectState.CONFIRMED,
            "apply",
            remote_id=outcome.remote_id,
            result=dict(outcome.result),
            lookups=lookups,
            applied=True,
            detail={
                **evidence,
                "echo_mismatch": echo_mismatches(contract, payload, outcome.result),
            },
        )
    if isinstance(outcome, Rejected):
        return Decision(
            EffectState.FAILED,
            "apply",
            error="rejected",
            lookups=lookups,
            applied=True,
            detail={**evidence, "reason": _safe_reason(outcome.reason)},
        )
    state = EffectState.MANUAL_REVIEW if budget.exhausted(claim.attempts) else EffectState.UNKNOWN
    return Decision(
        state,
        "apply",
        error="unknown",
        lookups=lookups,
        applied=True,
        detail={**evidence, "reason": _safe_reason(outcome.reason), "attempts": claim.attempts},
    )


def _outside_dedup_window(
    contract: ActionContract, claim: Claim, claimed_at_ms: int | None
) -> bool:
    if claim.first_attempt_at is None or claimed_at_ms is None:
        return False
    age_ms = claimed_at_ms - claim.first_attempt_at
    return age_ms > contract.dedup_window_seconds * 1000


__all__ = ["REASON_PAYLOAD", "Decision", "decide", "echo_mismatches"]
