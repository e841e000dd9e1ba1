"""``agent-txn serve`` in a subprocess: a real uvicorn on a real socket, as an operator runs it.

The principal is set up with ``agent-txn principals …`` on the same SQLite file the server uses,
the token is the one ``agent-txn principals token`` prints, and the order command is authored and
executed over HTTP. SIGTERM must end the process cleanly (exit 0, no traceback) after closing the
engine. Start-up refusals (no usable JWT key, a port already taken) are one ``error:`` line with
exit code 2, like every other CLI failure.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from orchestrator import cli
from providers.fake.shop import FakeShop
from tests.support.commands import order_command

REPO = Path(__file__).resolve().parents[2]
SECRET = "serve-acceptance-secret-0123456789abcdef"
START_TIMEOUT = 30.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_TXN_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def agent_txn(*args: str) -> str:
    """Run an ``agent-txn`` command in process; fail the test unless it exits 0."""
    env = {k: None for k in os.environ if k.startswith("AGENT_TXN_")}
    result = CliRunner().invoke(cli.app, list(args), env=env)
    assert result.exit_code == 0, (args, result.stdout, result.stderr)
    return result.stdout


@dataclass
class Server:
    """A running ``agent-txn serve`` process and the URL it printed."""

    process: subprocess.Popen[str]
    url: str
    lines: queue.Queue[str]
    pump: threading.Thread

    def stop(self) -> tuple[int, str, str]:
        """SIGTERM, then the exit code and the rest of stdout / all of stderr."""
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=30)
        self.pump.join(timeout=10)  # stdout is at EOF once the process is gone
        assert self.process.stdout is not None and self.process.stderr is not None
        err = self.process.stderr.read()
        self.process.stdout.close()
        self.process.stderr.close()
        rest = []
        while not self.lines.empty():
            rest.append(self.lines.get())
        return code, "".join(rest), err


def _pump(stream: object, lines: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line)


def start_server(*args: str, env: dict[str, str]) -> Server:
    """Start ``agent-txn serve *args`` and wait for its "serving on" line."""
    process = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "serve", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    pump = threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True)
    pump.start()
    try:
        line = lines.get(timeout=START_TIMEOUT)
    except queue.Empty:
        process.kill()
        _, err = process.communicate(timeout=10)
        raise AssertionError(f"agent-txn serve did not start:\n{err}") from None
    server = Server(process, line.split(" on ", 1)[-1].strip(), lines, pump)
    if not line.startswith("agent-txn serving on http://127.0.0.1:"):
        code, out, err = server.stop()
        raise AssertionError(f"unexpected first line {line!r} (exit {code}):\n{out}\n{err}")
    return server


@pytest.fixture
def databases(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Our database (schema upgraded, principal alice with grants) and a stocked shop database."""
    db = f"sqlite+aiosqlite:///{tmp_path / 'agent.db'}"
    shop = f"sqlite+aiosqlite:///{tmp_path / 'provider.db'}"
    agent_txn("db", "upgrade", "--db", db)
    agent_txn("principals", "add", "alice", "--kind", "user", "--name", "Alice", "--db", db)
    for provider in ("inventory", "payments", "email"):
        for permission in ("manage", "execute"):
            agent_txn(
                "principals", "grant", "alice", provider, "*", "--permission", permission,
                "--db", db,
            )  # fmt: skip

    async def stock() -> None:
        async with await FakeShop.open(shop) as opened:
            await opened.seed_stock({"sku-1": 10})

    asyncio.run(stock())
    yield db, shop


def test_serve_executes_a_command_over_http_and_stops_cleanly(
    databases: tuple[str, str],
) -> None:
    db, shop = databases
    jwt = agent_txn("principals", "token", "alice", "--secret", SECRET, "--db", db).strip()
    server = start_server(
        "--db", db, "--port", "0", "--fake-shop", shop, env=_env(AGENT_TXN_JWT_SECRET=SECRET)
    )
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert client.get("/healthz").json() == {"status": "ok"}
            headers = {"Authorization": f"Bearer {jwt}"}
            created = client.post(
                "/v1/commands", json={"definition": order_command()}, headers=headers
            )
            assert created.status_code == 201, created.text
            command_id = created.json()["command_id"]
            inputs = {"order_id": "o-1", "sku": "sku-1", "amount": 1200}
            executed = client.post(
                f"/v1/commands/{command_id}/execute",
                json={"inputs": inputs, "idempotency_key": "acceptance-1"},
                headers=headers,
            )
            assert executed.status_code == 200, executed.text
            body = executed.json()
            assert body["status"] == "succeeded"
            assert executed.headers["X-Execution-Id"] == body["execution_id"]
            record = client.get(
                f"/v1/commands/{command_id}/executions/{body['execution_id']}", headers=headers
            )
            assert record.json()["status"] == "succeeded"
            refused = client.get("/v1/commands", headers={"Authorization": "Bearer nope"})
            assert refused.status_code == 403
    finally:
        code, out, err = server.stop()
    assert code == 0, err
    assert "agent-txn stopped" in out
    assert "Traceback" not in err


def test_serve_without_a_jwt_key_is_one_error_line(databases: tuple[str, str]) -> None:
    db, _ = databases
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--db", db, "--port", "0"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: a JWT key is needed"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_serve_with_a_short_secret_never_echoes_it(databases: tuple[str, str]) -> None:
    db, _ = databases
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--db", db, "--port", "0"],
        cwd=REPO,
        env=_env(AGENT_TXN_JWT_SECRET="short-secret-xyz"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: JWT settings:"), done.stderr
    assert "short-secret-xyz" not in done.stderr


def test_serve_on_a_taken_port_is_one_error_line(databases: tuple[str, str]) -> None:
    db, _ = databases
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--db", db, "--port", str(port)],
            cwd=REPO,
            env=_env(AGENT_TXN_JWT_SECRET=SECRET),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: cannot serve on 127.0.0.1:{port}"), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("option", "error"),
    [
        # getaddrinfo's IDNA encoding refuses a label over 63 characters: UnicodeError.
        (["--host", "a" * 70], "error: cannot serve on " + "a" * 70 + ":0: not a valid host name"),
        # A DER key (or any binary file) failed to decode as text: UnicodeDecodeError.
        (["--jwt-public-key-file", sys.executable], "error: --jwt-public-key-file: not a PEM"),
    ],
)
def test_serve_refuses_a_host_or_key_file_it_cannot_read_in_one_line(
    databases: tuple[str, str], option: list[str], error: str
) -> None:
    db, _ = databases
    secret = {} if option[0] == "--jwt-public-key-file" else {"AGENT_TXN_JWT_SECRET": SECRET}
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--db", db, "--port", "0", *option],
        cwd=REPO,
        env=_env(**secret),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(error), done.stderr
    assert "Traceback" not in done.stderr
