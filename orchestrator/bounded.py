"""A provider call bounded by a deadline, with no timer when the call never waits.

Why: every provider call the effect protocol makes (two steps and an outbox event a saga in
the order workload) runs under the engine's call timeout. ``asyncio.timeout`` arms a timer for
it on the event loop (a ``TimerHandle`` pushed on the loop's heap) and cancels it on the way
out (the cancelled handle stays in the heap until the loop sweeps it): about 4 microseconds a
call measured on its own, more with a saga's worth of other timers on the heap. A call that
answers without ever waiting (an in-process provider, a client with the answer cached) can
never be cut by that timer: nothing else runs while it runs. So :func:`bounded` takes the
call's first step itself, as an eager task does (``asyncio.eager_task_factory`` in Python
3.12), and arms the timer only if the call waits. The deadline is the same either way:
``seconds`` from when the call began (``docs/benchmarks-log.md``, item 64).

What a caller sees is what ``async with asyncio.timeout(seconds): await call`` gives: the
call's value, its exception, ``TimeoutError`` when the deadline cuts it, and the caller's own
cancellation as ``CancelledError``. The second part of the call runs in the caller's task
exactly as an ``await`` would run it (every value the call yields goes to the task, and what
the task sends or throws goes back), so cancellation, ``uncancel`` and the call's own
``finally`` blocks behave as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Generator
from types import CoroutineType
from typing import Any, TypeVar, cast

T = TypeVar("T")


class _Bounded(Awaitable[T]):
    __slots__ = ("_call", "_seconds")

    def __init__(self, call: Awaitable[T], seconds: float) -> None:
        self._call = call
        self._seconds = seconds

    def __await__(self) -> Generator[Any, Any, T]:
        call = self._call
        # ``async def`` methods give a CoroutineType: a plain type test, before the ABC's.
        if type(call) is not CoroutineType and not isinstance(call, Coroutine):
            # A future or another awaitable: no first step to take here.
            return (yield from _with_timer(call, self._seconds).__await__())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._seconds
        try:
            waiting_on = call.send(None)
        except StopIteration as done:
            return cast(T, done.value)
        # It waits: from here on the deadline applies, counted from the call's start.
        rest: T = yield from _rest_with_timer(call, waiting_on, deadline).__await__()
        return rest


def bounded(call: Awaitable[T], seconds: float) -> Awaitable[T]:
    """``call`` under a deadline of ``seconds``: ``TimeoutError`` if it has not answered by then
    (see the module's doc for why no timer is armed for a call that never waits)."""
    return _Bounded(call, seconds)


async def _with_timer(call: Awaitable[T], seconds: float) -> T:
    async with asyncio.timeout(seconds):
        return await call


async def _rest_with_timer(call: Coroutine[Any, Any, T], waiting_on: Any, deadline: float) -> T:
    async with asyncio.timeout_at(deadline):
        return await _Resumed(call, waiting_on)


class _Resumed(Awaitable[T]):
    """The rest of a coroutine whose first step was taken already and yielded ``waiting_on``:
    awaiting this gives that value to the task first, then goes on as ``await call`` would."""

    __slots__ = ("_call", "_waiting_on")

    def __init__(self, call: Coroutine[Any, Any, T], waiting_on: Any) -> None:
        self._call = call
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, T]:
        call = self._call
        waiting_on = self._waiting_on
        while True:
            try:
                sent = yield waiting_on
            except GeneratorExit:
                call.close()
                raise
            except BaseException as exc:  # a cancellation, above all: the call's to handle
                try:
                    waiting_on = call.throw(exc)
                except StopIteration as done:
                    return cast(T, done.value)
                continue
            if sent is None:
                # What a task sends: the rest is a plain ``yield from``, as ``await`` is.
                return (yield from call.__await__())
            try:
                waiting_on = call.send(sent)
            except StopIteration as done:
                return cast(T, done.value)
