"""``python -m orchestrator.cli`` (how the fleet and the concurrency scenarios start their worker
processes) answers a refusal as the console script does: one ``error:`` line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_refusal_raised_outside_the_cli_module_is_one_line_under_python_m(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "none.db"
    # The worker's store check lives in orchestrator.workerproc, which raises the CliFailure it
    # imports from orchestrator.cli: the class a __main__ copy of the module did not catch.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "worker",
            "--once",
            "--db",
            f"sqlite:///{missing}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [
        f"error: no agent-txn database at {missing}; run `agent-txn db upgrade --db "
        f"sqlite+aiosqlite:///{missing}`"
    ], done.stderr
    assert not missing.exists()
