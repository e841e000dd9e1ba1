"""Run reports: JSON for machines, Markdown for auditors."""

from __future__ import annotations

import json
from pathlib import Path

from fault_injection.results import RunSummary


def report_paths(path: Path) -> tuple[Path, Path]:
    """The two files ``--report PATH`` writes: ``PATH.json`` and ``PATH.md``. A ``.json`` or
    ``.md`` ending on ``PATH`` is dropped first (``rep.json`` writes ``rep.json`` and
    ``rep.md``); any other ending is kept, the suffix appended to it: ``Path.with_suffix``
    replaced it, and ``soak.v1`` and ``soak.v2`` both wrote ``soak.json``."""
    base = path.with_suffix("") if path.suffix in {".json", ".md"} else path
    return base.with_name(base.name + ".json"), base.with_name(base.name + ".md")


def write_report(summary: RunSummary, path: Path) -> list[Path]:
    """Write :func:`report_paths` of ``path``, making their folder if it is missing."""
    as_json, as_md = report_paths(path)
    as_json.parent.mkdir(parents=True, exist_ok=True)
    as_json.write_text(json.dumps(summary.to_json(), indent=2, default=str) + "\n")
    as_md.write_text(markdown(summary))
    return [as_json, as_md]


def markdown(summary: RunSummary) -> str:
    """The human report: totals, then every scenario line, then each violation in full."""
    data = summary.to_json()
    lines = [
        "# agent-txn fault-injection report",
        "",
        f"- result: **{'PASS' if summary.ok else 'FAIL'}**",
        f"- scenarios: {data['scenarios']} ({data['passed']} passed)",
        f"- sagas: {data['sagas']}, crashes: {data['crashes']}",
        "- faults injected: "
        + (", ".join(f"{k}={v}" for k, v in sorted(summary.faults.items())) or "none"),
        f"- invariant violations: {data['violations']}",
    ]
    if summary.seed is not None:
        lines.append(f"- seed: {summary.seed}")
    lines += ["", "## Scenarios", "", "| suite | result | line | seconds |", "|---|---|---|---|"]
    for r in summary.results:
        line = r.line.replace("|", "\\|")
        lines.append(f"| {r.suite} | {'PASS' if r.passed else 'FAIL'} | {line} | {r.seconds:.2f} |")
    failing = [r for r in summary.results if not r.passed]
    if failing:
        lines += ["", "## Failures", ""]
        for r in failing:
            lines += [f"### {r.name}", "", f"`{r.repro}`" if r.repro else "", ""]
            for v in r.violations:
                lines += [
                    f"- invariant {v.invariant} ({v.name}), tx `{v.tx_id}`: {v.message}",
                    "",
                    "```json",
                    json.dumps(
                        {"evidence": v.evidence, "ledger": v.ledger_excerpt}, indent=2, default=str
                    ),
                    "```",
                    "",
                ]
    return "\n".join(lines) + "\n"
