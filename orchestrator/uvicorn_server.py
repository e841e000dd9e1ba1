"""uvicorn's server for ``agent-txn serve``, with signal handling that returns control to us.

A module of its own so that uvicorn is imported only by the command that serves HTTP, not by
every ``agent-txn`` command (the CLI imports :mod:`orchestrator.serve` to register ``serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Iterator

import uvicorn


class SignalledServer(uvicorn.Server):
    """uvicorn's server with signal handling that returns control to us.

    uvicorn re-raises a captured SIGTERM once it has shut down, which would kill the process
    (default handler) before the engine and the providers are closed; here the signal only asks
    for the graceful shutdown, and ``serve`` returns normally. ``on_ready`` runs once the socket
    accepts requests."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.on_ready()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        handled = (signal.SIGINT, signal.SIGTERM)
        for sig in handled:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
