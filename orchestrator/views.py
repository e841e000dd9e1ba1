"""Typed results callers receive: a saga's outcome and a transaction's full picture."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ledger.effects import Effect
from ledger.states import TX_TERMINAL, EffectState, TxState
from ledger.transactions import TxRecord
from orchestrator.errors import REGISTRY
from providers.contract import full_remote_id

if TYPE_CHECKING:
    from orchestrator.driver import SagaRun


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """Why a saga did not commit: a registered code, its fixed message, where it happened."""

    code: str
    message: str
    step: str | None = None
    reason: str | None = None

    @classmethod
    def from_stored(cls, stored: Any) -> ErrorInfo | None:
        """Rebuild from the ``error`` column (``{code, step?, check?, reason?}``)."""
        if not isinstance(stored, dict) or "code" not in stored:
            return None
        code = str(stored["code"])
        entry = REGISTRY.get(code)
        message = entry.message if entry else REGISTRY["command_execution_failed"].message
        step = stored.get("step") or stored.get("check")
        return cls(code, message, str(step) if step else None, stored.get("reason"))


@dataclass(frozen=True, slots=True)
class SagaResult:
    """The outcome of ``execute``: status, ids the providers gave, and why if not committed."""

    tx_id: str
    status: TxState
    remote_ids: dict[str, str] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    error: ErrorInfo | None = None
    #: The definition's result projection, when it has one and the saga committed.
    output: Any = None

    @property
    def committed(self) -> bool:
        """Every effect confirmed and validated."""
        return self.status is TxState.COMMITTED

    @property
    def in_doubt(self) -> bool:
        """Still in flight: an effect is being reconciled; workers will finish it."""
        return self.status not in TX_TERMINAL and self.status is not TxState.MANUAL_REVIEW


def _confirmed(ops: Sequence[Effect]) -> tuple[dict[str, str], dict[str, Any]]:
    # The provider's whole id, also where an over-long one is stored as its stand-in
    # (``orchestrator.driver.storable_remote_id``): the caller asked the provider, not us.
    ids = {
        o.name: full_remote_id(o.remote_id, o.result) or o.remote_id
        for o in ops
        if o.state is EffectState.CONFIRMED and o.remote_id
    }
    results = {o.name: o.result for o in ops if o.state is EffectState.CONFIRMED}
    return ids, results


def result_of(run: SagaRun) -> SagaResult:
    """The result as the driving holder knows it (no extra read)."""
    ids, results = _confirmed(run.ops)
    error = ErrorInfo.from_stored(run.error)
    if run.txc.status not in TX_TERMINAL and run.txc.status is not TxState.MANUAL_REVIEW:
        step = run.paused_on.name if run.paused_on is not None else None
        error = ErrorInfo("in_doubt", REGISTRY["in_doubt"].message, step)
    output = run.output() if run.txc.status is TxState.COMMITTED else None
    return SagaResult(run.tx_id, run.txc.status, ids, results, error, output)


@dataclass(frozen=True, slots=True)
class TransactionView:
    """A transaction with every effect row (for ``get``, ``review``, the CLI)."""

    tx: TxRecord
    operations: list[Effect]
    compensations: list[Effect]
    outbox: list[Effect]

    def result(self) -> SagaResult:
        """The stored outcome as a :class:`SagaResult`."""
        ids, results = _confirmed(self.operations)
        error = ErrorInfo.from_stored(self.tx.error)
        if self.tx.status not in TX_TERMINAL and self.tx.status is not TxState.MANUAL_REVIEW:
            doubt = next(
                (o.name for o in self.operations if o.state is not EffectState.CONFIRMED), None
            )
            error = ErrorInfo("in_doubt", REGISTRY["in_doubt"].message, doubt)
        return SagaResult(self.tx.tx_id, self.tx.status, ids, results, error)


def view_of(
    tx: TxRecord, ops: list[Effect], comps: list[Effect], outbox: list[Effect]
) -> TransactionView:
    """Bundle the rows of one transaction."""
    return TransactionView(tx, ops, comps, outbox)
