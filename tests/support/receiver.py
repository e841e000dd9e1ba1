"""A real HTTP callback receiver for tests: ``http.server`` on a free local port, in a thread.

It records every request (path, run-id header, JSON body) and answers with the next status of a
script (the last one repeats), with a body that must never reach agent-txn's database. Like a
correct production receiver it deduplicates by the run-id header: :attr:`Receiver.effects`
counts each run id once however many times it arrives.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

RUN_ID_HEADER = "X-Agent-Txn-Callback-Run-ID"
#: What the receiver answers with; a test asserts it is never stored.
SECRET_BODY = "receiver-secret-body-do-not-store"


@dataclass
class Received:
    """One request as the receiver saw it."""

    path: str
    run_id: str | None
    body: Any


@dataclass
class Receiver:
    """The recorded requests and the status script."""

    url: str
    statuses: list[int] = field(default_factory=lambda: [200])
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_status(self) -> int:
        with self.lock:
            return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    @property
    def run_ids(self) -> list[str | None]:
        with self.lock:
            return [r.run_id for r in self.requests]

    @property
    def effects(self) -> set[str | None]:
        """What a deduplicating receiver acted on: one effect per run id."""
        return set(self.run_ids)


@contextmanager
def receiver(statuses: list[int] | None = None) -> Iterator[Receiver]:
    """Serve on 127.0.0.1:<free port> until the block ends."""
    state: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            with state.lock:
                state.requests.append(
                    Received(self.path, self.headers.get(RUN_ID_HEADER), json.loads(raw or b"null"))
                )
            status = state.next_status()
            body = SECRET_BODY.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet test output
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state = Receiver(url=f"http://127.0.0.1:{server.server_port}/hook")
    if statuses:
        state.statuses = list(statuses)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
