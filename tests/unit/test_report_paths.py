"""``--report PATH`` writes ``PATH.json`` and ``PATH.md``, as its help and the docs say.

Before, ``write_report`` used ``Path.with_suffix``, which replaces a dotted ending: ``--report
rep/soak.v1`` and ``--report rep/soak.v2`` both wrote ``rep/soak.json`` and ``rep/soak.md``, the
second run silently over the first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fault_injection.report import report_paths, write_report
from fault_injection.results import RunSummary


@pytest.mark.parametrize(
    ("given", "written"),
    [
        ("rep/soak", ("rep/soak.json", "rep/soak.md")),
        ("rep/soak.v1", ("rep/soak.v1.json", "rep/soak.v1.md")),
        ("rep/2026.12.06", ("rep/2026.12.06.json", "rep/2026.12.06.md")),
        # A .json or .md ending names the pair, as before.
        ("rep/soak.json", ("rep/soak.json", "rep/soak.md")),
        ("rep/soak.md", ("rep/soak.json", "rep/soak.md")),
    ],
)
def test_the_report_appends_its_suffixes(given: str, written: tuple[str, str]) -> None:
    assert report_paths(Path(given)) == (Path(written[0]), Path(written[1]))


def test_two_reports_with_dotted_names_do_not_overwrite_each_other(tmp_path: Path) -> None:
    first = write_report(RunSummary(seed=1), tmp_path / "rep" / "soak.v1")
    second = write_report(RunSummary(seed=2), tmp_path / "rep" / "soak.v2")

    assert set(first).isdisjoint(second)
    assert all(path.is_file() for path in [*first, *second])
    assert '"seed": 1' in first[0].read_text() and '"seed": 2' in second[0].read_text()
