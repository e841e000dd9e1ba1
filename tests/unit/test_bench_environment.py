"""What ``agent-txn bench`` says it ran on (:mod:`fault_injection.bench_environment`)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from fault_injection.bench_environment import (
    _server_version_or_none,
    one_line,
    processor_model,
    usable_cpus,
)

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu vme

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
"""


def test_processor_model_is_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    assert processor_model(cpuinfo) == "Intel(R) Xeon(R) Processor"


@pytest.mark.parametrize("content", [None, "processor\t: 0\nmodel name\t:   \n"])
def test_processor_model_falls_back_to_the_platform(tmp_path: Path, content: str | None) -> None:
    """No file (not Linux), or one without a model name (some ARM kernels): the platform's
    guess, and ``None`` rather than an empty string."""
    cpuinfo = tmp_path / "cpuinfo"
    if content is not None:
        cpuinfo.write_text(content)
    assert processor_model(cpuinfo) == (platform.processor() or None)


def test_usable_cpus_are_the_affinity_where_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process pinned to some CPUs runs on those, not on all the machine has (a container's
    limit, ``taskset``): the bench must report the CPUs the run could use."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {3, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cpus() == 2


def test_usable_cpus_without_an_affinity_are_all_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert usable_cpus() == 8


def _environment(**changes: object) -> dict[str, object]:
    env: dict[str, object] = {
        "processor": "Intel(R) Xeon(R) Processor",
        "cpus": 2,
        "os": "Linux 6.1.0",
        "arch": "x86_64",
        "python": "CPython 3.11.7",
        "sqlite": "3.40.1",
        "postgresql": None,
        "agent_txn": "0.1.0",
        "dbos": None,
    }
    env.update(changes)
    return env


def test_one_line_names_only_what_the_run_used() -> None:
    line = one_line(_environment())
    assert line == (
        "on: Intel(R) Xeon(R) Processor, 2 CPUs · Linux 6.1.0 x86_64 · CPython 3.11.7 · "
        "SQLite 3.40.1 · agent-txn 0.1.0"
    )
    both = one_line(_environment(postgresql="15.19", dbos="3.4.0", processor=None))
    assert both.startswith("on: unknown processor, 2 CPUs")
    assert "PostgreSQL 15.19" in both and both.endswith("dbos 3.4.0")


async def test_an_unreachable_server_has_no_version() -> None:
    """The bench itself reports the unreachable server a moment later; describing the run
    must not be where it fails."""
    assert await _server_version_or_none("postgresql://postgres@127.0.0.1:1/none") is None
