"""Compensation policy: retry budgets and when a person must decide.

A reversal can be lost, unknown or rejected like any effect. It is looked up and retried with
jittered exponential backoff (tenacity's wait strategy) until its budget of claims is spent;
then — or at once when the provider definitively refuses it — the transaction is parked in
``manual_review`` with its evidence, never retried forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenacity import RetryCallState, wait_random_exponential


@dataclass(frozen=True, slots=True)
class RetryBudget:
    """Claims allowed for one effect, and the backoff between them."""

    attempts: int
    initial_seconds: float
    max_seconds: float

    def exhausted(self, attempts_made: int) -> bool:
        """True once ``attempts_made`` claims have been spent."""
        return attempts_made >= self.attempts

    def delay_seconds(self, attempts_made: int) -> float:
        """Jittered exponential delay before the next attempt (tenacity's strategy)."""
        # Full jitter (AWS architecture blog): spreads K workers retrying one provider.
        wait = wait_random_exponential(multiplier=self.initial_seconds, max=self.max_seconds)
        state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = max(1, attempts_made)
        return float(wait(state))


#: Why a transaction is parked; stored in the ledger and shown by ``review list``.
REASON_BUDGET = "retry budget exhausted"
REASON_REVERSAL_REJECTED = "the provider refused a compensation"
REASON_IRREVERSIBLE = "a confirmed effect has no compensation"
REASON_WINDOW = "dedup window expired; re-sending could duplicate the effect"
REASON_PAYLOAD = "stored payload differs from the re-rendered one"
REASON_RETRIABLE_REJECTED = "a step after the pivot was rejected"
