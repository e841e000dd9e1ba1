"""``orchestrator.bounded``: a provider call under a deadline, with no timer for a call that
never waits, and otherwise what ``async with asyncio.timeout(seconds): await call`` gives."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import pytest

from orchestrator.bounded import bounded


class _TimerCount:
    """Counts the timers armed on the running loop (``call_at``, which ``call_later`` and
    ``asyncio.timeout`` use); the loop's own method is put back after the test."""

    def __init__(self, loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = 0
        original = loop.call_at

        def counting(when: float, callback: Callable[..., object], *args: Any, **kw: Any) -> Any:
            self.armed += 1
            return original(when, callback, *args, **kw)

        monkeypatch.setattr(loop, "call_at", counting)


async def _answers_at_once() -> str:
    return "done"


async def _waits(seconds: float, value: str = "late") -> str:
    await asyncio.sleep(seconds)
    return value


class _Hangs:
    """A call that waits far past any deadline here, and notes when it began and cleaned up."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.cleaned = False

    async def call(self) -> str:
        self.entered.set()
        try:
            await asyncio.sleep(30)
        finally:
            self.cleaned = True
        return "never"


async def test_a_call_that_never_waits_arms_no_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = _TimerCount(asyncio.get_running_loop(), monkeypatch)
    assert await bounded(_answers_at_once(), 5.0) == "done"
    assert counter.armed == 0


async def test_a_call_that_waits_is_bounded_by_a_timer_and_answers_in_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counter = _TimerCount(asyncio.get_running_loop(), monkeypatch)
    assert await bounded(_waits(0.01, "in time"), 5.0) == "in time"
    assert counter.armed == 2  # the call's own sleep and the deadline


async def test_a_call_past_its_deadline_raises_timeout_and_runs_its_cleanup() -> None:
    hangs = _Hangs()
    with pytest.raises(TimeoutError):  # the call itself would sleep for 30 s
        await bounded(hangs.call(), 0.05)
    assert hangs.cleaned
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the deadline's cancel was taken back


async def test_the_deadline_counts_from_the_calls_start_not_its_first_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    deadlines: list[float] = []
    original = asyncio.timeout_at

    def recording(when: float | None) -> asyncio.Timeout:
        assert when is not None
        deadlines.append(when)
        return original(when)

    began: list[float] = []

    async def busy_then_waits() -> str:
        # Work before the first wait, as a client encoding its request does: the loop's clock
        # moves on before the call first waits.
        began.append(loop.time())
        while loop.time() <= began[0]:
            pass
        await asyncio.sleep(0)
        return "ok"

    monkeypatch.setattr(asyncio, "timeout_at", recording)
    assert await bounded(busy_then_waits(), 1.0) == "ok"
    assert len(deadlines) == 1
    # Taken before the call's first step, not when it first waited.
    assert deadlines[0] <= began[0] + 1.0


@pytest.mark.parametrize("waits_first", [False, True])
async def test_the_calls_own_error_comes_through(waits_first: bool) -> None:
    async def fails() -> str:
        if waits_first:
            await asyncio.sleep(0)
        raise ConnectionResetError("lost")

    with pytest.raises(ConnectionResetError, match="lost"):
        await bounded(fails(), 5.0)


async def test_the_callers_cancellation_is_a_cancellation_not_a_timeout() -> None:
    hangs = _Hangs()

    async def caller() -> str:
        return await bounded(hangs.call(), 30.0)

    task = asyncio.create_task(caller())
    await hangs.entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert hangs.cleaned


async def test_a_call_that_handles_the_deadlines_cancel_returns_what_it_returns() -> None:
    # As with asyncio.timeout: a call that swallows the cancel and answers is not a timeout.
    async def answers_anyway() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "answered while cut"
        return "never"

    assert await bounded(answers_anyway(), 0.02) == "answered while cut"


async def test_values_a_task_never_sends_still_reach_the_call() -> None:
    # The rest of the call is driven as ``await`` drives it: what the driver sends goes in.
    received: list[Any] = []

    class Step:
        def __await__(self) -> Generator[str, Any, str]:
            received.append((yield "first"))
            received.append((yield "second"))
            return "end"

    async def call() -> str:
        return await Step()

    # Driven by hand inside the test's own task, which the deadline then belongs to.
    driver = bounded(call(), 5.0).__await__()
    assert driver.send(None) == "first"
    assert driver.send("a") == "second"
    with pytest.raises(StopIteration) as stopped:
        driver.send("b")
    assert stopped.value.value == "end"
    assert received == ["a", "b"]


async def test_closing_the_caller_mid_call_closes_the_call() -> None:
    hangs = _Hangs()

    async def caller() -> str:
        return await bounded(hangs.call(), 30.0)

    coro = caller()
    coro.send(None)  # into the call's sleep, inside this task
    coro.close()
    assert hangs.cleaned


@pytest.mark.parametrize("answers", [True, False])
async def test_an_awaitable_that_is_not_a_coroutine_is_bounded_too(answers: bool) -> None:
    future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    if answers:
        asyncio.get_running_loop().call_later(0.01, future.set_result, "from a future")
        assert await bounded(future, 5.0) == "from a future"
    else:
        with pytest.raises(TimeoutError):
            await bounded(future, 0.02)


async def _same_as_asyncio_timeout(
    make: Callable[[], Awaitable[str]], seconds: float
) -> tuple[object, object]:
    async def reference() -> str:
        async with asyncio.timeout(seconds):
            return await make()

    outcomes: list[object] = []
    for run in (reference(), bounded(make(), seconds)):
        try:
            outcomes.append(await run)
        except BaseException as exc:
            outcomes.append(type(exc))
    return outcomes[0], outcomes[1]


@pytest.mark.parametrize(
    ("make", "seconds"),
    [
        (_answers_at_once, 0.0),
        (_answers_at_once, 1.0),
        (lambda: _waits(0.0, "after one turn"), 1.0),
        (lambda: _waits(5.0), 0.02),
        (lambda: _waits(0.01, "in time"), 0.0),
    ],
)
async def test_outcomes_match_asyncio_timeout(
    make: Callable[[], Awaitable[str]], seconds: float
) -> None:
    reference, ours = await _same_as_asyncio_timeout(make, seconds)
    assert ours == reference
