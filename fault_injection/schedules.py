"""Randomized fault schedules: generated from ``(seed, index)``, run, checked, shrunk on failure.

A :class:`Schedule` is a small, JSON-able description of one trial: a few sagas, some provider
faults, at most one crash, how many workers recover concurrently, the caller's execute budget,
and optionally a *paused worker* (a stale holder whose apply is held past its lease, then
released). :func:`generate` derives it from ``random.Random(f"{seed}:{index}")`` alone, so
``agent-txn fault-inject run --suite random --seed S --only I --workers K`` replays exactly the
schedule a run reported (the interleaving of concurrent workers is the only thing left to
chance).

:func:`run_schedule` plays one schedule on a shared :class:`~fault_injection.harness.Harness`:
every schedule has its own tx ids, order ids and fault plan, so thousands of them share one
database pair, and an :class:`EnginePool` lets healthy engines ("processes") serve the next
schedule. :func:`run_random` runs a whole seed and hands each failure to the shrinker
(:mod:`fault_injection.shrink`), which re-runs every candidate on a fresh database pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from sqlalchemy import BindParameter, Select, bindparam, func, select
from sqlalchemy.engine import make_url

from fault_injection import shrink as shrinking
from fault_injection.harness import DatabasePair, Harness, fresh_databases
from fault_injection.holding import HoldingProvider
from fault_injection.results import ScenarioResult
from fault_injection.sagas import STOCK, order_saga
from ledger import schema
from ledger.states import TX_TERMINAL, EffectState, TxState
from orchestrator.crashpoints import POINTS, SimulatedCrash
from orchestrator.engine import Orchestrator
from orchestrator.saga import Saga
from providers.fake.faults import FaultKind, FaultRule
from providers.fake.shop import FakeShop

__all__ = [
    "FAULT_KINDS",
    "VARIANTS",
    "CrashSpec",
    "EnginePool",
    "FaultSpec",
    "PauseSpec",
    "SagaSpec",
    "Schedule",
    "ShopClock",
    "generate",
    "open_harness",
    "repro_command",
    "run_fresh",
    "run_random",
    "run_schedule",
    "schedule_from_json",
]

Variant = Literal["happy", "validation-fails", "three-step"]
CrashPhase = Literal["execute", "recovery"]

#: Saga variants: the seed's order, an order whose post-condition fails after every step was
#: confirmed (so it must be compensated), and a three-step order whose last payload needs an
#: earlier result.
VARIANTS: Final[tuple[Variant, ...]] = ("happy", "validation-fails", "three-step")
#: Fault kinds the generator draws from. DUPLICATE_DELIVERY matches no apply or lookup yet.
FAULT_KINDS: Final[tuple[FaultKind, ...]] = tuple(
    k for k in FaultKind if k is not FaultKind.DUPLICATE_DELIVERY
)
#: Every provider action the order sagas call (forward, reversal, outbox).
ACTIONS: Final[tuple[tuple[str, str], ...]] = (
    ("inventory", "reserve"),
    ("inventory", "release"),
    ("payments", "charge"),
    ("payments", "refund"),
    ("email", "send"),
)
#: Provider-call budget of schedule engines; TIMEOUT faults hold answers just past it. Not
#: smaller: under four concurrent callers the fake shop's SQLite applies take 60-80 ms at p90
#: and 125-175 ms at p99 here (one writer, busy-handler sleeps), and at 0.05 s about one
#: ordinary call in ten timed out, which made outcomes differ from run to run.
CALL_TIMEOUT_S: Final = 0.25
#: Each recovery round moves the workers' clocks this much further (past the 30 s suite lease,
#: and past the lease of a worker that died in the round before).
ROUND_ADVANCE_S: Final = 40.0
#: A paused worker's call budget: its apply is held by the test, never cut by its own timeout
#: (and short of half the lease, so no heartbeat renews what a frozen process could not).
STALE_CALL_TIMEOUT_S: Final = 10.0
#: Bounds that keep one broken schedule from stalling a soak of thousands.
DRAIN_TIMEOUT_S: Final = 10.0
SCHEDULE_TIMEOUT_S: Final = 60.0
#: The most rounds and recovery workers a saved schedule may ask for. Why bounds: ``replay``
#: read any integer; ``"rounds": 100000000000000000000`` ran into SCHEDULE_TIMEOUT_S (a FAIL
#: that was not the schedule's), and as many workers never ended. The generator draws 1 or 2
#: rounds; each round only moves the clocks ROUND_ADVANCE_S further, and a round may take
#: DRAIN_TIMEOUT_S. Workers as many as ``fault-inject run --workers`` takes.
SAVED_ROUNDS_LIMIT: Final = 10
SAVED_WORKERS_LIMIT: Final = 64
#: Rounds after the schedule's own, granted only to replace workers that died or to absorb a
#: released stale holder.
MAX_ROUNDS: Final = 4
#: A worker that found nothing due while sagas are in flight (another worker is in a call, an
#: effect backs off) polls again after _POLL_S, doubling up to _POLL_MAX_S while nothing
#: comes. At a flat 5 ms, three idle workers beside a call held to its 0.25 s budget made some
#: 150 empty passes: 1 181 of 1 268 passes over 100 schedules were empty, and the polling was
#: a fifth of a run's CPU. The cap stays above the suite's 20 ms longest backoff, so work that
#: falls due waits at most one more poll.
_POLL_S: Final = 0.005
_POLL_MAX_S: Final = 0.04
_AMOUNT: Final = 1200
_OVER_LIMIT: Final = (1000, 1500)  # max_amount, amount: the post-condition fails
_JSON_VERSION: Final = 1


# -- the schedule -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SagaSpec:
    """One saga of a schedule: its caller-chosen tx id, its order and its variant."""

    tx_id: str
    order_id: str
    variant: Variant

    def saga(self) -> Saga:
        """The saga definition of this variant."""
        if self.variant == "validation-fails":
            return order_saga(max_amount=_OVER_LIMIT[0])
        return order_saga(three_steps=self.variant == "three-step")

    def inputs(self) -> dict[str, Any]:
        """The execute inputs (amount over the limit for ``validation-fails``)."""
        amount = _OVER_LIMIT[1] if self.variant == "validation-fails" else _AMOUNT
        return {"order_id": self.order_id, "sku": "sku-1", "amount": amount}

    def steps(self) -> tuple[str, ...]:
        """Names of its forward steps, in order."""
        return (
            ("reserve", "charge", "wrap") if self.variant == "three-step" else ("reserve", "charge")
        )


@dataclass(frozen=True)
class FaultSpec:
    """A :class:`~providers.fake.faults.FaultRule` in JSON-able form."""

    kind: FaultKind
    provider: str | None = None
    action: str | None = None
    times: int | None = 1
    skip: int = 0
    applied: bool = True
    delay_s: float = 0.0
    effect_first: bool = True

    def rule(self) -> FaultRule:
        """The rule to install in the shop's fault plan."""
        return FaultRule(
            self.kind,
            provider=self.provider,
            action=self.action,
            times=self.times,
            skip=self.skip,
            applied=self.applied,
            delay_s=self.delay_s,
            effect_first=self.effect_first,
        )

    def describe(self) -> str:
        """``lose_response@payments.charge x1`` — for lines and logs."""
        target = f"{self.provider or '*'}.{self.action or '*'}"
        times = "forever" if self.times is None else f"x{self.times}"
        return f"{self.kind.value}@{target} {times}"


@dataclass(frozen=True)
class CrashSpec:
    """One simulated process death at ``point`` while saga ``saga`` is being driven.

    ``phase`` says whose process dies: the caller's (during ``execute``) or the first recovery
    worker's. ``where`` narrows the position: crash-point context keys (``name`` = step or
    event, ``kind`` = operation / compensation / outbox, ``state``, ``next``) and the values
    they must have.
    """

    point: str
    saga: int
    phase: CrashPhase = "execute"
    where: tuple[tuple[str, str], ...] = ()

    def matches(self, tx_id: str) -> Callable[[Mapping[str, Any]], bool]:
        """The ``when`` predicate for :meth:`CrashPoints.arm`."""
        wanted = dict(self.where)

        def when(ctx: Mapping[str, Any]) -> bool:
            # Recovery workers drive every saga; the tx id pins the crash to the chosen one.
            if ctx.get("tx_id") != tx_id:
                return False
            return all(ctx.get(k) == v for k, v in wanted.items())

        return when


@dataclass(frozen=True)
class PauseSpec:
    """A stale holder: saga ``saga`` runs on an engine whose first ``provider.action`` apply is
    held until the recovery workers have taken the saga over (its lease ran out), then sent."""

    saga: int
    provider: str
    action: str


@dataclass(frozen=True)
class Schedule:
    """One randomized trial. Equal schedules replay the same trial."""

    seed: int
    index: int
    sagas: tuple[SagaSpec, ...]
    faults: tuple[FaultSpec, ...] = ()
    crash: CrashSpec | None = None
    #: Recovery workers draining concurrently (1..max_workers).
    workers: int = 1
    #: The caller's execute budget: 0 leaves every in-doubt effect to the workers.
    budget_s: float = 0.0
    pause: PauseSpec | None = None
    #: Recovery rounds, each with the workers' clocks further ahead.
    rounds: int = 1
    #: The workers come back after the provider's dedup window (keys may be forgotten).
    aged: bool = False
    call_timeout_s: float = CALL_TIMEOUT_S
    #: The ``--workers`` the generator was given (part of the repro).
    max_workers: int = 4

    @property
    def tx_ids(self) -> list[str]:
        """Tx ids of its sagas, in order."""
        return [s.tx_id for s in self.sagas]

    @property
    def size(self) -> int:
        """A measure the shrinker only ever lowers (sagas, faults, crash, pause, extras)."""
        return (
            len(self.sagas)
            + len(self.faults)
            + (self.crash is not None)
            + (self.pause is not None)
            + (self.workers - 1)
            + (self.rounds - 1)
            + self.aged
            + sum(f.skip + (f.times is None) for f in self.faults)
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict; :func:`schedule_from_json` reads it back to an equal schedule."""
        data = asdict(self)
        data["version"] = _JSON_VERSION
        data["sagas"] = list(data["sagas"])
        data["faults"] = [{**f, "kind": f["kind"].value} for f in data["faults"]]
        if self.crash is not None:
            data["crash"]["where"] = dict(self.crash.where)
        return data

    def describe(self) -> str:
        """A short human summary (sagas, faults, crash, pause)."""
        parts = [",".join(s.variant for s in self.sagas)]
        parts += [f.describe() for f in self.faults]
        if self.crash is not None:
            where = ",".join(f"{k}={v}" for k, v in self.crash.where)
            parts.append(
                f"crash {self.crash.point}[{where}] saga {self.crash.saga} ({self.crash.phase})"
            )
        if self.pause is not None:
            parts.append(f"pause {self.pause.provider}.{self.pause.action} saga {self.pause.saga}")
        return "; ".join(parts)


def schedule_from_json(data: Mapping[str, Any] | str | bytes) -> Schedule:
    """Read a schedule written by :meth:`Schedule.to_json` (a dict or its JSON text).

    Raises :class:`ValueError` naming the first field that is missing or malformed.
    """
    raw: Any = json.loads(data) if isinstance(data, str | bytes) else data
    if not isinstance(raw, Mapping):
        raise ValueError("a schedule is a JSON object")
    try:
        version = raw.get("version", _JSON_VERSION)
        if version != _JSON_VERSION:
            raise ValueError(f"unsupported schedule version {version!r}")
        sagas = tuple(_saga_from(s) for s in raw["sagas"])
        faults = tuple(_fault_from(f) for f in raw.get("faults", ()))
        crash = _crash_from(raw["crash"]) if raw.get("crash") is not None else None
        pause = _pause_from(raw["pause"]) if raw.get("pause") is not None else None
        schedule = Schedule(
            seed=_int(raw["seed"], "seed"),
            index=_int(raw["index"], "index"),
            sagas=sagas,
            faults=faults,
            crash=crash,
            workers=_int(raw.get("workers", 1), "workers"),
            budget_s=_float(raw.get("budget_s", 0.0), "budget_s"),
            pause=pause,
            rounds=_int(raw.get("rounds", 1), "rounds"),
            aged=bool(raw.get("aged", False)),
            call_timeout_s=_float(raw.get("call_timeout_s", CALL_TIMEOUT_S), "call_timeout_s"),
            max_workers=_int(raw.get("max_workers", 4), "max_workers"),
        )
    except KeyError as exc:
        raise ValueError(f"schedule field {exc.args[0]!r} is missing") from None
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"malformed schedule: {exc}") from None
    _validate(schedule)
    return schedule


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"schedule field {name!r} must be an integer")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"schedule field {name!r} must be a number")
    return float(value)


def _saga_from(raw: Mapping[str, Any]) -> SagaSpec:
    variant = raw["variant"]
    if variant not in VARIANTS:
        raise ValueError(f"unknown saga variant {variant!r}; known: {', '.join(VARIANTS)}")
    return SagaSpec(str(raw["tx_id"]), str(raw["order_id"]), variant)


def _fault_from(raw: Mapping[str, Any]) -> FaultSpec:
    try:
        kind = FaultKind(raw["kind"])
    except ValueError:
        raise ValueError(f"unknown fault kind {raw['kind']!r}") from None
    times = raw.get("times", 1)
    return FaultSpec(
        kind=kind,
        provider=raw.get("provider"),
        action=raw.get("action"),
        times=None if times is None else _int(times, "times"),
        skip=_int(raw.get("skip", 0), "skip"),
        applied=bool(raw.get("applied", True)),
        delay_s=float(raw.get("delay_s", 0.0)),
        effect_first=bool(raw.get("effect_first", True)),
    )


def _crash_from(raw: Mapping[str, Any]) -> CrashSpec:
    phase = raw.get("phase", "execute")
    if phase not in ("execute", "recovery"):
        raise ValueError(f"crash phase must be 'execute' or 'recovery', not {phase!r}")
    where = raw.get("where") or {}
    return CrashSpec(
        point=str(raw["point"]),
        saga=_int(raw["saga"], "crash.saga"),
        phase=phase,
        where=tuple(sorted((str(k), str(v)) for k, v in dict(where).items())),
    )


def _pause_from(raw: Mapping[str, Any]) -> PauseSpec:
    return PauseSpec(_int(raw["saga"], "pause.saga"), str(raw["provider"]), str(raw["action"]))


def _validate(s: Schedule) -> None:
    if not s.sagas:
        raise ValueError("a schedule needs at least one saga")
    if len(set(s.tx_ids)) != len(s.tx_ids):
        raise ValueError("tx ids of a schedule must be distinct")
    if not 1 <= s.max_workers <= SAVED_WORKERS_LIMIT:
        raise ValueError(f"max_workers must be in 1..{SAVED_WORKERS_LIMIT}, not {s.max_workers}")
    if not 1 <= s.workers <= s.max_workers:
        raise ValueError(f"workers must be in 1..{s.max_workers}, not {s.workers}")
    if not 1 <= s.rounds <= SAVED_ROUNDS_LIMIT:
        raise ValueError(f"rounds must be in 1..{SAVED_ROUNDS_LIMIT}, not {s.rounds}")
    # Written as ranges that must hold, so that NaN (which JSON's loader takes) fails them too.
    # Past SCHEDULE_TIMEOUT_S a budget or a call only waits for the schedule to be cut.
    limit = SCHEDULE_TIMEOUT_S
    if not 0 <= s.budget_s <= limit:
        raise ValueError(f"budget_s must be from 0 to {limit:g} s, not {s.budget_s}")
    if not 0 < s.call_timeout_s <= limit:
        raise ValueError(
            f"call_timeout_s must be above 0 and at most {limit:g} s, not {s.call_timeout_s}"
        )
    if s.crash is not None:
        if s.crash.point not in POINTS:
            raise ValueError(f"unknown crash point {s.crash.point!r}")
        if not 0 <= s.crash.saga < len(s.sagas):
            raise ValueError(f"crash.saga {s.crash.saga} is not a saga of the schedule")
    if s.pause is not None:
        if not 0 <= s.pause.saga < len(s.sagas):
            raise ValueError(f"pause.saga {s.pause.saga} is not a saga of the schedule")
        if (s.pause.provider, s.pause.action) not in ACTIONS:
            raise ValueError(f"pause action {s.pause.provider}.{s.pause.action} is unknown")
    for f in s.faults:
        f.rule()  # FaultRule checks times, skip and delay_s itself


# -- generation ---------------------------------------------------------------------------------


def _weighted(rng: random.Random, options: Sequence[tuple[Any, float]]) -> Any:
    values, weights = zip(*options, strict=True)
    return rng.choices(values, weights=weights)[0]


def generate(seed: int, index: int, *, workers: int = 4) -> Schedule:
    """Schedule ``index`` of ``seed``: the same arguments always give an equal schedule."""
    if workers < 1:
        raise ValueError("workers must be at least 1")
    rng = random.Random(f"{seed}:{index}")
    n_sagas = _weighted(rng, ((1, 0.45), (2, 0.35), (3, 0.2)))
    sagas = tuple(
        SagaSpec(
            f"r{seed}-{index}-{n}",
            f"o{seed}-{index}-{n}",
            _weighted(rng, (("happy", 0.5), ("validation-fails", 0.25), ("three-step", 0.25))),
        )
        for n in range(n_sagas)
    )
    n_faults = _weighted(rng, ((0, 0.2), (1, 0.35), (2, 0.25), (3, 0.12), (4, 0.08)))
    faults = tuple(_gen_fault(rng) for _ in range(n_faults))
    crash = _gen_crash(rng, sagas) if rng.random() < 0.5 else None
    pause = _gen_pause(rng, sagas) if rng.random() < 0.15 else None
    n_workers = rng.randint(1, workers)
    budget = 0.0 if rng.random() < 0.5 else rng.choice((0.02, 0.05, 0.1))
    rounds = 2 if rng.random() < 0.25 else 1
    # FORGET_KEYS only fires for keys older than the provider's dedup window.
    forgets = any(f.kind is FaultKind.FORGET_KEYS for f in faults)
    aged = rng.random() < (0.85 if forgets else 0.05)
    return Schedule(
        seed=seed,
        index=index,
        sagas=sagas,
        faults=faults,
        crash=crash,
        workers=n_workers,
        budget_s=budget,
        pause=pause,
        rounds=rounds,
        aged=aged,
        call_timeout_s=CALL_TIMEOUT_S,
        max_workers=workers,
    )


def _gen_fault(rng: random.Random) -> FaultSpec:
    kind: FaultKind = rng.choice(FAULT_KINDS)
    provider: str | None
    action: str | None
    if rng.random() < 0.1:
        provider = action = None  # every call of the kind
        times: int | None = rng.choice((1, 2))
    else:
        provider, action = rng.choice(ACTIONS)
        times = _weighted(rng, ((1, 0.55), (2, 0.2), (3, 0.1), (None, 0.15)))
        if kind is FaultKind.TIMEOUT and times is None:
            times = 3  # each firing costs a whole call budget; "forever" would cost seconds
    skip = _weighted(rng, ((0, 0.7), (1, 0.2), (2, 0.1)))
    applied = rng.random() < 0.5 if kind is FaultKind.INDETERMINATE_5XX else True
    delay, effect_first = 0.0, True
    if kind is FaultKind.TIMEOUT:
        # Just past the call budget: the caller gives up, the schedule stays fast.
        delay = round(CALL_TIMEOUT_S + rng.uniform(0.005, 0.03), 3)
        effect_first = rng.random() < 0.5
    return FaultSpec(kind, provider, action, times, skip, applied, delay, effect_first)


def _positions(rng: random.Random, point: str, saga: SagaSpec) -> tuple[tuple[str, str], ...]:
    """A context filter that can match at ``point`` for ``saga`` (or none: the first hit)."""
    if point.startswith("effect."):
        options: list[tuple[str, str]] = [("operation", s) for s in saga.steps()]
        options.append(("outbox", "receipt"))
        if saga.variant == "validation-fails" or rng.random() < 0.3:
            options += [("compensation", s) for s in saga.steps()]
        if rng.random() < 0.2:
            return ()
        kind, name = rng.choice(options)
        return (("kind", kind), ("name", name))
    if point == "record.before_commit":
        choice = rng.random()
        if choice < 0.35:
            return (("state", rng.choice(("confirmed", "unknown", "failed"))),)
        if choice < 0.7:
            return (("next", rng.choice((*saga.steps(), "receipt"))),)
    return ()


def _gen_crash(rng: random.Random, sagas: tuple[SagaSpec, ...]) -> CrashSpec:
    point: str = rng.choice(sorted(POINTS))
    index = rng.randrange(len(sagas))
    phase: CrashPhase = "execute"
    if not point.startswith("prepare."):
        # Lookups mostly happen in recovery; everything else mostly in the caller's process.
        bias = 0.6 if point.endswith("_lookup") else 0.35
        phase = "recovery" if rng.random() < bias else "execute"
    return CrashSpec(point, index, phase, _positions(rng, point, sagas[index]))


def _gen_pause(rng: random.Random, sagas: tuple[SagaSpec, ...]) -> PauseSpec:
    index = rng.randrange(len(sagas))
    options = [("inventory", "reserve"), ("payments", "charge"), ("email", "send")]
    if sagas[index].variant == "validation-fails":
        options += [("payments", "refund"), ("inventory", "release")]
    provider, action = rng.choice(options)
    return PauseSpec(index, provider, action)


def repro_command(schedule: Schedule, *, db: str | None = None) -> str:
    """The one-line command that replays generated schedule ``schedule.index`` exactly."""
    cmd = (
        f"agent-txn fault-inject run --suite random --seed {schedule.seed} "
        f"--only {schedule.index} --workers {schedule.max_workers}"
    )
    return cmd + (f" --db {_safe_url(db)}" if db else "")


def _replay_command(path: str | Path, db: str | None) -> str:
    return f"agent-txn fault-inject replay {path}" + (f" --db {_safe_url(db)}" if db else "")


def _safe_url(url: str) -> str:
    # A repro line ends up in CI logs and reports: never a password.
    return make_url(url).render_as_string(hide_password=True)


# -- the shop's clock ---------------------------------------------------------------------------


class ShopClock:
    """The fake provider's clock: wall time plus an offset that only ever grows.

    "Aged" schedules move the provider's clock along with the workers' so that its idempotency
    cache ages past the dedup window as the engine sees it; ages are differences, so a larger
    offset left by earlier schedules changes nothing for later ones.
    """

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def at_least(self, offset: float) -> None:
        """Move the offset forward to ``offset`` (never back)."""
        self.offset = max(self.offset, offset)


async def open_harness(dbs: DatabasePair, *, dedup_window_seconds: float = 86400.0) -> Harness:
    """A stocked harness whose shop clock is a :class:`ShopClock` (needed by aged schedules)."""
    shop = await FakeShop.open(
        dbs.provider, clock=ShopClock(), dedup_window_seconds=dedup_window_seconds
    )
    try:
        await shop.seed_stock(STOCK)
    except BaseException:
        await shop.close()
        raise
    return Harness(dbs, shop)


# -- running one schedule -----------------------------------------------------------------------


class EnginePool:
    """Engines ("processes") that outlive one schedule: a caller that runs the sagas one after
    the other, and recovery workers. A process that crashes is abandoned and never comes back;
    a fresh one replaces it when needed.

    Reuse is what keeps thousands of schedules affordable: a cold engine pays for its
    connections, asyncpg's type introspection and SQLAlchemy's statement compilation again
    (measured here: a saga costs about 30-55 ms on a warm engine, 75-100 ms on a fresh one). A
    returned engine is disarmed and its clock put back to the database's, so the next schedule
    sees the same process a fresh start would give it, minus the warm-up.
    """

    def __init__(self, harness: Harness, *, keep: int = 8) -> None:
        self.harness = harness
        self.keep = keep
        self._idle: dict[tuple[tuple[str, Any], ...], list[Orchestrator]] = {}
        self._offsets: dict[int, float] = {}

    async def take(self, **settings: Any) -> Orchestrator:
        """An idle engine with these settings, or a new one; its clock reads the database's."""
        idle = self._idle.get(_settings_key(settings))
        if idle:
            orch = idle.pop()
            self.set_clock(orch, 0.0)
            return orch
        return await self.harness.engine(**settings)

    def set_clock(self, orch: Orchestrator, offset: float) -> None:
        """Shift ``orch``'s clocks to ``offset`` seconds ahead of the database's."""
        orch.store.advance_clock(offset - self._offsets.get(id(orch), 0.0))
        self._offsets[id(orch)] = offset

    async def give_back(self, orch: Orchestrator, **settings: Any) -> None:
        """Keep a healthy engine for the next schedule (closed if the pool is full)."""
        orch.crashpoints.disarm()
        orch.crashpoints.hits.clear()
        idle = self._idle.setdefault(_settings_key(settings), [])
        if sum(len(v) for v in self._idle.values()) < self.keep:
            idle.append(orch)
        else:
            await self.discard(orch)

    async def discard(self, orch: Orchestrator) -> None:
        """Close an engine for good."""
        self._offsets.pop(id(orch), None)
        with contextlib.suppress(ValueError):
            self.harness.engines.remove(orch)  # the harness would keep it for ever otherwise
        await orch.close()

    async def abandon(self, orch: Orchestrator) -> None:
        """A crashed engine: dropped as a dead process is (no lease released)."""
        self._offsets.pop(id(orch), None)
        await self.harness.crash(orch)

    async def close(self) -> None:
        """Close every idle engine."""
        idle, self._idle = self._idle, {}
        for engines in idle.values():
            for orch in engines:
                await self.discard(orch)


def _settings_key(settings: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(settings.items()))


@dataclass
class _Stale:
    task: asyncio.Task[Any]
    gate: HoldingProvider
    engine: Orchestrator


@dataclass
class _Run:
    """The engines ("processes") of one schedule and what happened to them."""

    schedule: Schedule
    harness: Harness
    pool: EnginePool
    live: list[Orchestrator] = field(default_factory=list)
    crashes: int = 0
    errors: list[str] = field(default_factory=list)
    stale: _Stale | None = None
    #: False once something was interrupted: its engines are closed, not reused.
    healthy: bool = True

    def settings(self) -> dict[str, Any]:
        return {
            "call_timeout_seconds": self.schedule.call_timeout_s,
            # The suite kills processes, not machines: NORMAL is as durable for that, and
            # skips an fsync per commit.
            "sqlite_synchronous": "NORMAL",
        }

    async def engine(self) -> Orchestrator:
        orch = await self.pool.take(**self.settings())
        self.live.append(orch)
        return orch

    async def crash(self, orch: Orchestrator) -> None:
        self.crashes += 1
        with contextlib.suppress(ValueError):
            self.live.remove(orch)
        await self.pool.abandon(orch)

    async def retire(self, orch: Orchestrator) -> None:
        with contextlib.suppress(ValueError):
            self.live.remove(orch)
        if self.healthy:
            await self.pool.give_back(orch, **self.settings())
        else:
            await self.pool.discard(orch)

    async def close(self) -> None:
        if self.stale is not None:
            stale, self.stale = self.stale, None
            stale.gate.gate.set()
            if not stale.task.done():
                stale.task.cancel()
            with contextlib.suppress(BaseException):
                await stale.task
            await self.pool.discard(stale.engine)
        for orch in list(self.live):
            await self.retire(orch)

    # -- the caller's side ---------------------------------------------------------------------

    async def execute_all(self) -> None:
        s = self.schedule
        for n, spec in enumerate(s.sagas):
            crash = (
                s.crash if s.crash and s.crash.phase == "execute" and s.crash.saga == n else None
            )
            if s.pause is not None and s.pause.saga == n:
                await self._start_stale(spec, s.pause, crash)
            else:
                await self._execute(spec, crash)

    def _arm(self, orch: Orchestrator, crash: CrashSpec | None) -> None:
        if crash is not None:
            tx_id = self.schedule.sagas[crash.saga].tx_id
            orch.crashpoints.arm(crash.point, when=crash.matches(tx_id), times=1)

    async def _execute(self, spec: SagaSpec, crash: CrashSpec | None) -> None:
        orch = await self.engine()
        self._arm(orch, crash)
        try:
            await orch.execute(
                spec.saga(), spec.inputs(), tx_id=spec.tx_id, budget_seconds=self.schedule.budget_s
            )
            # The receipt's record rides on a later transaction (ledger/riders.py): land it as
            # the caller's process would, by its next transaction or the store's flush.
            await orch.store.riders.settle()
            _dead_if_crashed(orch)
        except SimulatedCrash:
            await self.crash(orch)
            return
        except Exception as exc:
            # The caller gets a result or a registered error for a retry; a schedule has no
            # reason to see either, so anything raised here is worth a look.
            self.healthy = False
            self.errors.append(f"execute {spec.tx_id}: {type(exc).__name__}: {exc}"[:300])
        await self.retire(orch)

    async def _start_stale(self, spec: SagaSpec, pause: PauseSpec, crash: CrashSpec | None) -> None:
        # Its own engine, never pooled: its registry holds the pausing provider.
        settings = {**self.settings(), "call_timeout_seconds": STALE_CALL_TIMEOUT_S}
        orch = await self.harness.engine(**settings)
        inner = {p.name: p for p in self.harness.shop.providers()}[pause.provider]
        gate = HoldingProvider(inner, pause.action)
        orch.register_provider(gate)
        self._arm(orch, crash)
        task = asyncio.create_task(
            orch.execute(spec.saga(), spec.inputs(), tx_id=spec.tx_id, budget_seconds=0)
        )
        reached = asyncio.create_task(gate.reached.wait())
        await asyncio.wait({task, reached}, return_when=asyncio.FIRST_COMPLETED)
        if not reached.done():
            reached.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reached
        self.stale = _Stale(task, gate, orch)
        if task.done():
            await self._finish_stale()  # it never reached the held apply (crash, rejection…)

    async def _finish_stale(self) -> None:
        stale = self.stale
        if stale is None:
            return
        stale.gate.gate.set()
        try:
            await asyncio.wait_for(asyncio.shield(stale.task), DRAIN_TIMEOUT_S)
            await asyncio.wait_for(stale.engine.store.riders.settle(), DRAIN_TIMEOUT_S)
            _dead_if_crashed(stale.engine)
        except SimulatedCrash:
            self.stale = None
            self.crashes += 1
            await self.harness.crash(stale.engine)
            return
        except TimeoutError:
            self.errors.append("the released stale holder did not finish")
        except Exception as exc:
            self.errors.append(f"stale holder: {type(exc).__name__}: {exc}"[:300])
        self.stale = None
        if not stale.task.done():
            stale.task.cancel()
            with contextlib.suppress(BaseException):
                await stale.task
        await self.pool.discard(stale.engine)

    # -- the workers' side ---------------------------------------------------------------------

    async def recover_all(self) -> None:
        s = self.schedule
        jump = self.harness.shop.dedup_window_seconds + 1.0 if s.aged else 0.0
        clock = self.harness.shop.clock
        shop_base = clock.offset if isinstance(clock, ShopClock) else 0.0
        workers = [await self.engine() for _ in range(s.workers)]
        crash = s.crash if s.crash is not None and s.crash.phase == "recovery" else None
        round_no = 0
        while True:
            round_no += 1
            advance = jump + ROUND_ADVANCE_S * round_no
            for w in workers:
                self.pool.set_clock(w, advance)
            if isinstance(clock, ShopClock):
                clock.at_least(shop_base + advance)
            if crash is not None and round_no == 1:
                self._arm(workers[0], crash)
            abort = asyncio.Event()
            died = await asyncio.gather(*(self._drain(w, abort) for w in workers))
            for w, dead in zip(workers, died, strict=True):
                if dead:
                    await self.crash(w)
            workers = [w for w, dead in zip(workers, died, strict=True) if not dead]
            had_stale = self.stale is not None
            await self._finish_stale()
            more = round_no < s.rounds or any(died) or had_stale
            if not more or round_no >= s.rounds + MAX_ROUNDS:
                break
            if not workers:
                workers = [await self.engine()]
            if not (round_no < s.rounds) and not await self.in_flight(workers[0]):
                break  # the extra round was for a dead worker or a stale holder: nothing left

    async def _drain(self, orch: Orchestrator, abort: asyncio.Event) -> bool:
        """Recover until our sagas are idle; True if this worker "died" (simulated crash)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        idle = _POLL_S
        try:
            while not abort.is_set() and time.monotonic() < deadline:
                _dead_if_crashed(orch)
                report = await orch.recover()
                _dead_if_crashed(orch)
                if report.transactions or report.events:
                    idle = _POLL_S
                    continue
                if not await self.in_flight(orch):
                    return False
                await asyncio.sleep(idle)
                idle = min(idle * 2, _POLL_MAX_S)
        except SimulatedCrash:
            # The dead worker's leases stay held for this round: the others stop at their next
            # pass, and the next round (clocks further ahead) takes over.
            abort.set()
            return True
        except Exception as exc:
            self.healthy = False
            self.errors.append(f"worker: {type(exc).__name__}: {exc}"[:300])
        return False

    async def in_flight(self, orch: Orchestrator) -> int:
        """Our sagas not yet terminal or parked, plus their unsettled outbox events."""
        async with orch.store.read() as conn:
            found = await conn.execute(_IN_FLIGHT, {"ids": self.schedule.tx_ids})
            return int(found.scalar_one())

    async def statuses(self, orch: Orchestrator) -> Counter[str]:
        """Status counts of this schedule's transactions."""
        tx = schema.transactions
        stmt = (
            select(tx.c.status, func.count())
            .where(tx.c.tx_id.in_(self.schedule.tx_ids))
            .group_by(tx.c.status)
        )
        async with orch.store.read() as conn:
            rows = (await conn.execute(stmt)).all()
        return Counter({str(status): int(n) for status, n in rows})


def _in_flight_statement() -> Select[tuple[int]]:
    tx, ob = schema.transactions, schema.outbox
    ids: BindParameter[str] = bindparam("ids", expanding=True)
    idle = [st.value for st in (*TX_TERMINAL, TxState.MANUAL_REVIEW, TxState.STAGED)]
    waiting = [e.value for e in (EffectState.PENDING, EffectState.EXECUTING, EffectState.UNKNOWN)]
    busy = (
        select(func.count())
        .select_from(tx)
        .where(tx.c.tx_id.in_(ids), tx.c.status.not_in(idle))
        .scalar_subquery()
    )
    events = (
        select(func.count())
        .select_from(ob)
        .where(ob.c.tx_id.in_(ids), ob.c.state.in_(waiting))
        .scalar_subquery()
    )
    return select(busy + events)


#: One statement, built once: workers poll it between passes while an effect backs off.
_IN_FLIGHT = _in_flight_statement()


def _dead_if_crashed(orch: Orchestrator) -> None:
    """Raise :class:`SimulatedCrash` here if an armed point fired anywhere in ``orch``.

    Why: a crash stands for the whole process dying, but a riding record's crash points fire
    in whichever task hosts it (ledger/riders.py), often the store's flush task, whose
    exception nobody awaits. Left there, the "dead" process went on: its worker kept the
    outbox event's lease and the run ended with the event still executing (seed 1205,
    schedule 207, on PostgreSQL). As in the matrix (``fault_injection.matrix``), the crash
    counts where it fired."""
    if orch.crashpoints.hits:
        raise SimulatedCrash(next(iter(orch.crashpoints.hits)))


async def run_schedule(
    schedule: Schedule,
    harness: Harness,
    *,
    pool: EnginePool | None = None,
    repro_db: str | None = None,
    replay_file: str | Path | None = None,
) -> ScenarioResult:
    """Play ``schedule`` on ``harness`` and check every invariant over its transactions.

    Passed iff the invariant check is clean (every saga settled: terminal, or parked in
    manual_review with evidence) and no engine call raised anything but a simulated crash.
    Engines come from ``pool`` and go back to it (default: fresh engines, closed at the end).
    ``repro_db`` is the ``--db`` the run was given (for the repro line); ``replay_file`` is
    where a schedule that :func:`generate` did not produce (a shrunk one) was saved.
    """
    if pool is None:
        own = EnginePool(harness, keep=0)
        try:
            return await run_schedule(
                schedule, harness, pool=own, repro_db=repro_db, replay_file=replay_file
            )
        finally:
            await own.close()
    started = time.perf_counter()
    shop = harness.shop
    shop.faults.clear()
    for f in schedule.faults:
        shop.faults.add(f.rule())
    before = await shop.counts()
    run = _Run(schedule, harness, pool)
    outcomes: Counter[str] = Counter()
    try:
        async with asyncio.timeout(SCHEDULE_TIMEOUT_S):
            await run.execute_all()
            await run.recover_all()
            probe = run.live[0] if run.live else await run.engine()
            outcomes = await run.statuses(probe)
    except TimeoutError:
        run.healthy = False  # interrupted mid-call: never reuse those engines
        run.errors.append(f"schedule did not finish within {SCHEDULE_TIMEOUT_S:.0f} s")
    except BaseException:
        run.healthy = False
        raise
    finally:
        await run.close()
    report = await harness.check(tx_ids=schedule.tx_ids)
    fired = Counter({k.value: n for k, n in shop.faults.fired.items()})
    shop.faults.clear()  # the next schedule starts from an empty plan either way
    after = await shop.counts()
    passed = report.ok and not run.errors
    if schedule == generate(schedule.seed, schedule.index, workers=schedule.max_workers):
        repro = repro_command(schedule, db=repro_db)
    else:
        # Not what (seed, index) generates (a shrunk or hand-edited schedule): only its JSON
        # replays it; run_random saves shrunk ones under this name.
        file = replay_file or f"shrunk-{schedule.seed}-{schedule.index}.json"
        repro = _replay_command(file, repro_db)
    result = ScenarioResult(
        suite="random",
        name=f"schedule {schedule.index}",
        passed=passed,
        line=_line(schedule, passed, run.crashes, report.violations, run.errors),
        counts={k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)},
        faults=fired,
        crashes=run.crashes,
        sagas=len(schedule.sagas),
        violations=list(report.violations),
        repro=repro,
        seconds=time.perf_counter() - started,
        detail={"outcomes": dict(outcomes)},
    )
    if not passed:
        # Passing results stay small (a soak keeps thousands); failures carry the evidence.
        result.detail["schedule"] = schedule.to_json()
        result.detail["describe"] = schedule.describe()
        if run.errors:
            result.detail["errors"] = run.errors
    return result


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _line(
    s: Schedule, passed: bool, crashes: int, violations: Sequence[Any], errors: Sequence[str]
) -> str:
    line = (
        f"{'PASS' if passed else 'FAIL'} schedule {s.index} (seed {s.seed}): "
        f"{_plural(len(s.sagas), 'saga')}, {_plural(len(s.faults), 'fault')}, "
        f"{_plural(crashes, 'crash', 'crashes')}, {_plural(s.workers, 'worker')}"
    )
    if s.pause is not None:
        line += ", paused worker"
    if violations:
        first = violations[0]
        line += f" — {_plural(len(violations), 'violation')}: {first.name}: {first.message}"
    elif errors:
        line += f" — {errors[0]}"
    return line


# -- a whole run --------------------------------------------------------------------------------


async def run_random(
    db: str | None,
    workdir: Path,
    *,
    schedules: int,
    seed: int,
    workers: int = 4,
    only: int | None = None,
    shrink: bool = True,
    progress: Callable[[ScenarioResult], None] | None = None,
    dbs: DatabasePair | None = None,
    shrunk_dir: Path | None = None,
) -> list[ScenarioResult]:
    """Run schedules ``0..schedules-1`` of ``seed`` (or just ``only``) on one database pair.

    The pair is ``dbs`` if given, else a fresh one made from ``db`` (``None`` = SQLite files
    under ``workdir``). Each failure is shrunk (unless ``shrink`` is false) on fresh database
    pairs; the minimal schedule goes to ``result.detail["shrunk"]`` and to a JSON file in
    ``shrunk_dir`` (default ``workdir``; the CLI gives a folder that outlives the run) that
    ``result.detail["shrunk_repro"]`` replays. Prints nothing.
    """
    if schedules < 0:
        raise ValueError("schedules must be >= 0")
    indexes: Collection[int] = [only] if only is not None else range(schedules)
    results: list[ScenarioResult] = []
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as stack:
        if dbs is None:
            dbs = await stack.enter_async_context(fresh_databases(db, workdir))
        harness = await open_harness(dbs)
        stack.push_async_callback(harness.close)
        pool = EnginePool(harness, keep=workers + 2)
        stack.push_async_callback(pool.close)
        for index in indexes:
            schedule = generate(seed, index, workers=workers)
            result = await run_schedule(schedule, harness, pool=pool, repro_db=db)
            if not result.passed and shrink:
                await _shrink_into(result, schedule, db, dbs, workdir, shrunk_dir or workdir)
            results.append(result)
            if progress is not None:
                progress(result)
    return results


def _server_of(db: str | None, dbs: DatabasePair) -> str | None:
    """Where fresh pairs for shrinking come from: the run's server, or SQLite files."""
    if db is not None:
        return db
    return dbs.store if dbs.backend == "postgres" else None


async def run_fresh(
    schedule: Schedule,
    db: str | None,
    workdir: Path,
    *,
    repro_db: str | None = None,
    replay_file: str | Path | None = None,
) -> ScenarioResult:
    """Run ``schedule`` alone on a new database pair (nothing earlier can mask or fake a result)."""
    with tempfile.TemporaryDirectory(dir=workdir, prefix="fresh-") as tmp:
        async with fresh_databases(db, Path(tmp)) as pair:
            harness = await open_harness(pair)
            try:
                return await run_schedule(
                    schedule, harness, repro_db=repro_db, replay_file=replay_file
                )
            finally:
                await harness.close()


async def _shrink_into(
    result: ScenarioResult,
    schedule: Schedule,
    db: str | None,
    dbs: DatabasePair,
    workdir: Path,
    shrunk_dir: Path,
) -> None:
    server = _server_of(db, dbs)

    async def attempt(candidate: Schedule) -> ScenarioResult:
        return await run_fresh(candidate, server, workdir)

    outcome = await shrinking.shrink(schedule, result, attempt)
    path = shrunk_dir / f"shrunk-{schedule.seed}-{schedule.index}.json"
    text = json.dumps(outcome.schedule.to_json(), indent=2, sort_keys=True) + "\n"
    await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(path.write_text, text)
    result.detail["shrunk"] = outcome.schedule.to_json()
    result.detail["shrunk_describe"] = outcome.schedule.describe()
    result.detail["shrunk_repro"] = _replay_command(path, db)
    result.detail["shrunk_line"] = outcome.result.line
    result.detail["shrink_runs"] = outcome.runs
    result.detail["shrink_reproduced"] = outcome.reproduced
    result.detail["shrunk_file"] = str(path)
