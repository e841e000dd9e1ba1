"""Pure reverse-plan building: confirmed forward operations → compensation steps.

The plan is persisted whole (one local transaction) before any reversal is sent, so a crash
mid-compensation resumes the same plan with the same keys. Order is the reverse of the forward
order; each payload is rendered from the forward op's own payload, result and remote id.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ledger.effects import Effect, NewEffect
from ledger.states import EffectState


@dataclass(frozen=True, slots=True)
class ReversalSpec:
    """How a step is reversed: the compensation action and its payload template."""

    action: str
    payload: Any


@dataclass(frozen=True, slots=True)
class ReversePlan:
    """Reversals to persist, plus confirmed effects that nothing can reverse."""

    steps: list[NewEffect]
    irreversible: list[Effect]

    @property
    def complete(self) -> bool:
        """Every confirmed effect has a reversal."""
        return not self.irreversible


class PlanningError(ValueError):
    """A forward op is still in doubt, or a payload cannot be rendered."""


def plan_reversal(
    forward: Sequence[Effect],
    specs: Mapping[str, ReversalSpec | None],
    *,
    key_for: Callable[[Effect], str],
    render: Callable[[Effect, Any], tuple[Any, str]],
) -> ReversePlan:
    """Build the reverse plan of ``forward`` (a transaction's operations, in forward order).

    ``render(op, template)`` returns ``(payload, payload_sha256)`` for a compensation of ``op``.
    A forward op still ``executing``/``unknown`` must be resolved by lookup first: planning
    around it could leave its effect unreversed, so that is refused.
    """
    in_doubt = [op for op in forward if op.state in (EffectState.EXECUTING, EffectState.UNKNOWN)]
    if in_doubt:
        raise PlanningError(f"op {in_doubt[0].name!r} is still in doubt; resolve it first")
    steps: list[NewEffect] = []
    irreversible: list[Effect] = []
    confirmed = [op for op in forward if op.state is EffectState.CONFIRMED]
    for ordinal, op in enumerate(reversed(confirmed)):
        spec = specs.get(op.name)
        if spec is None:
            irreversible.append(op)
            continue
        payload, sha = render(op, spec.payload)
        steps.append(
            NewEffect(
                key=key_for(op),
                tx_id=op.tx_id,
                name=op.name,
                provider=op.provider,
                action=spec.action,
                ordinal=ordinal,
                payload=payload,
                payload_sha256=sha,
                forward_op_key=op.key,
            )
        )
    return ReversePlan(steps=steps, irreversible=irreversible)
