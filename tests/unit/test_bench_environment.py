"""What ``agent-txn bench`` says it ran on (:mod:`fault_injection.bench_environment`)."""

from __future__ import annotations

import os
import platform
import tempfile
from pathlib import Path

import pytest

from fault_injection.bench_environment import (
    _server_version_or_none,
    filesystem_of,
    memory_files_note,
    one_line,
    processor_model,
    sqlite_files,
    usable_cpus,
)
from fault_injection.harness import scratch_folder, sqlite_folder

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


MOUNTS = """/dev/vda / ext4 rw,relatime 0 0
proc /proc proc rw 0 0
tmpfs /tmp tmpfs rw,nosuid 0 0
/dev/vdb /srv/my\\040data xfs rw 0 0
/dev/vdc /srv/my\\040data/db ext4 rw 0 0
tmpfs /srv/my\\040data/db tmpfs rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "filesystem"),
    [
        ("/var/lib/agent", "ext4"),  # only / above it
        ("/tmp", "tmpfs"),
        ("/tmp/bench-1", "tmpfs"),
        ("/tmpfoo", "ext4"),  # a mount point is a whole path part, not a prefix of the text
        ("/srv/my data/x", "xfs"),  # \\040 is a space
        ("/srv/my data/db/x", "tmpfs"),  # the longest mount point, and the last one mounted
    ],
)
def test_the_file_system_is_that_of_the_nearest_mount_point(
    tmp_path: Path, path: str, filesystem: str
) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS)
    assert filesystem_of(Path(path), mounts) == filesystem


def test_no_mounts_to_read_is_an_unknown_file_system(tmp_path: Path) -> None:
    assert filesystem_of(tmp_path, tmp_path / "no-such-file") is None


def test_sqlite_files_are_where_the_url_names_or_in_the_temporary_folder(tmp_path: Path) -> None:
    named = sqlite_files(f"sqlite+aiosqlite:///{tmp_path / 'bench.db'}")
    assert named == {"folder": str(tmp_path), "filesystem": filesystem_of(tmp_path)}
    default = sqlite_files(None)
    assert default is not None and default["folder"] == tempfile.gettempdir()
    assert sqlite_files("postgresql+asyncpg://postgres@127.0.0.1/postgres") is None


def test_a_run_folder_is_made_in_the_folder_the_sqlite_url_names(tmp_path: Path) -> None:
    with scratch_folder(f"sqlite:///{tmp_path / 'x.db'}", "run-") as made:
        assert Path(made).parent == tmp_path and Path(made).name.startswith("run-")
    assert not Path(made).exists()
    with scratch_folder(None, "run-") as made:
        assert Path(made).parent == Path(tempfile.gettempdir())
    assert sqlite_folder("postgresql://postgres@127.0.0.1/postgres") is None
    for memory in ("sqlite://", "sqlite:///:memory:", "sqlite+aiosqlite:///:memory:"):
        with pytest.raises(ValueError, match="in-memory SQLite database cannot be shared"):
            sqlite_folder(memory)


def test_files_in_memory_get_a_note_and_files_on_a_disk_none() -> None:
    on_tmpfs = _environment(sqlite_files={"folder": "/tmp", "filesystem": "tmpfs"})
    note = memory_files_note(on_tmpfs)
    assert note is not None and note.startswith("note: the SQLite files are in /tmp, on tmpfs")
    assert "--db sqlite+aiosqlite:///DIR/bench.db" in note
    assert one_line(on_tmpfs).endswith("SQLite 3.40.1 (files in /tmp, tmpfs) · agent-txn 0.1.0")
    on_disk = _environment(sqlite_files={"folder": "/srv", "filesystem": "ext4"})
    assert memory_files_note(on_disk) is None
    unknown = _environment(sqlite_files={"folder": "/srv", "filesystem": None})
    assert memory_files_note(unknown) is None
    assert "(files in /srv, file system unknown)" in one_line(unknown)
    assert memory_files_note(_environment()) is None  # PostgreSQL: no files
