"""What a suite run produces: one result per scenario, and the run's summary."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fault_injection.invariants import Violation


@dataclass
class ScenarioResult:
    """One scenario (a seed assertion, a matrix cell, a random schedule)."""

    suite: str
    name: str
    passed: bool
    line: (
        str  # the human line, e.g. "PASS crash before call: lookup-before-apply, charge=1 email=1"
    )
    counts: dict[str, int] = field(default_factory=dict)
    faults: Counter[str] = field(default_factory=Counter)
    crashes: int = 0
    sagas: int = 0
    violations: list[Violation] = field(default_factory=list)
    repro: str | None = None  # one-line command that reproduces a failure exactly
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """JSON form for the report."""
        return {
            "suite": self.suite,
            "name": self.name,
            "passed": self.passed,
            "line": self.line,
            "counts": self.counts,
            "faults": dict(self.faults),
            "crashes": self.crashes,
            "sagas": self.sagas,
            "violations": [
                {
                    "invariant": v.invariant,
                    "name": v.name,
                    "tx_id": v.tx_id,
                    "message": v.message,
                    "evidence": v.evidence,
                    "ledger_excerpt": v.ledger_excerpt,
                }
                for v in self.violations
            ],
            "repro": self.repro,
            "seconds": round(self.seconds, 3),
            "detail": self.detail,
        }


@dataclass
class RunSummary:
    """Totals over every scenario of a run."""

    results: list[ScenarioResult] = field(default_factory=list)
    seed: int | None = None

    @property
    def ok(self) -> bool:
        """No scenario failed."""
        return all(r.passed for r in self.results)

    @property
    def faults(self) -> Counter[str]:
        """Faults injected, by kind."""
        total: Counter[str] = Counter()
        for r in self.results:
            total.update(r.faults)
        return total

    @property
    def violations(self) -> list[Violation]:
        """Every invariant violation found."""
        return [v for r in self.results for v in r.violations]

    def to_json(self) -> dict[str, Any]:
        """JSON form for the report."""
        return {
            "ok": self.ok,
            "seed": self.seed,
            "scenarios": len(self.results),
            "passed": sum(r.passed for r in self.results),
            "faults": dict(self.faults),
            "crashes": sum(r.crashes for r in self.results),
            "sagas": sum(r.sagas for r in self.results),
            "violations": len(self.violations),
            "seconds": round(sum(r.seconds for r in self.results), 3),
            "results": [r.to_json() for r in self.results],
        }
