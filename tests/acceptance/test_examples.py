"""The examples run as documented: ``python examples/agent_loop.py`` on a fresh SQLite file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AGENT_LOOP = REPO / "examples" / "agent_loop.py"


def _run(*args: str, answer: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_TXN_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(AGENT_LOOP), *args],
        cwd=REPO,
        env=env,
        input=answer,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_person_says_yes_and_the_order_runs_once() -> None:
    done = _run(answer="yes\n")  # the person's answer, typed at the input() prompt
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert any("amount: 1200" in line for line in lines)  # the proposal was shown first
    assert "succeeded: " in lines[-2]  # after the input() prompt (no echo from a pipe)
    assert lines[-1] == "charges in the shop: 1"
    assert "Traceback" not in done.stderr


def test_the_scripted_yes_runs_without_a_terminal() -> None:
    done = _run("--yes", answer="")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-2:] == [
        "succeeded: Done. Tell the person what was completed.",
        "charges in the shop: 1",
    ]


def test_no_means_nothing_is_done() -> None:
    done = _run(answer="no\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "charges in the shop: 0"


def test_the_glue_is_at_most_ten_lines() -> None:
    text = AGENT_LOOP.read_text()
    glue = re.search(r"# --- glue[^\n]*\n(.*?)\n\s*# --- end of glue ---", text, re.S)
    assert glue is not None
    lines = [line for line in glue.group(1).splitlines() if line.strip()]
    assert len(lines) <= 10, lines
    assert "orch.agent.prepare" in glue.group(1)
    assert "execute_staged_action" in glue.group(1)
