"""What starting a process costs: the packages only some commands need stay unimported.

Every ``agent-txn`` command, worker, crash-matrix victim and program embedding the engine pays
its imports before doing anything. Alembic (and the migration scripts it parsed for the head
revision), PyJWT with cryptography, uvicorn and httpx were about a third of the CPU of
``agent-txn --help`` or ``agent-txn review list`` (``docs/benchmarks-log.md``, item 67); they
are imported by the code that migrates, checks tokens, serves HTTP or calls a provider over it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Top-level packages a process must not import just to start.
ONLY_WHEN_USED = (
    "alembic",
    "mako",
    "jwt",
    "cryptography",
    "uvicorn",
    "fastapi",
    "mcp",
    "httpx",
)


@pytest.mark.parametrize(
    "start",
    [
        "import orchestrator",  # a program embedding the engine
        "import orchestrator.cli; orchestrator.cli.load_plugins()",  # every agent-txn command
    ],
)
def test_starting_imports_none_of_the_packages_only_some_commands_use(start: str) -> None:
    code = (
        f"import sys; {start}\n"
        "imported = {name.split('.')[0] for name in sys.modules}\n"
        f"print(' '.join(sorted(imported & {set(ONLY_WHEN_USED)!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
