"""The crash matrix: every named crash point x every position where it applies x two crash modes.

A cell is ``(point, position, mode)``, named like ``effect.after_apply@charge/kill``:

* positions (see :data:`fault_injection.victim.POSITIONS`): the three steps of
  ``order_saga(three_steps=True)`` (``reserve``, ``charge``, ``wrap``) and its outbox event
  (``receipt``), which commit; and the three reversals of the same saga with
  ``max_amount=1000`` run for 1500 (``undo-wrap``, ``undo-charge``, ``undo-reserve``, in the
  order they run), whose post-condition fails after every step was confirmed.
* points: ``effect.*`` and ``record.*`` at every position; ``prepare.*`` once (at ``reserve``),
  ``commit.*`` once (at ``receipt``), ``compensation.after_plan`` once (at ``undo-wrap``).
  ``effect.before_lookup`` / ``effect.after_lookup`` need a reclaim: the first apply at the
  position loses its response (:func:`fault_injection.victim.lookup_fault`), so the engine's
  in-call reconcile looks it up in the victim (for the outbox event, a committed saga leaves
  that to the workers, so the victim also drains once as its own worker).
* modes: ``inprocess`` — the point raises ``SimulatedCrash`` inside ``execute`` (or, for the
  outbox event's ``record.*``, in the transaction its record rides on: :mod:`ledger.riders`),
  the engine is abandoned; ``kill`` — a real subprocess (:mod:`fault_injection.victim`,
  forked by :mod:`fault_injection.forkserver` in a run of cells) SIGKILLs itself at the point
  and must die by signal 9.

Then a fresh engine recovers (clocks past the dead leases), the invariant checker runs on the
cell's transaction, and the cell passes only if it is clean, the transaction ended committed
(forward and outbox cells) or compensated (reversal cells), and the provider's own counters
moved exactly once per intent. ``prepare.before_commit`` leaves nothing behind by design, so
there the recovery must find nothing, and the caller's retry with the same ``tx_id`` commits.
Every cell finally retries ``execute`` with its ``tx_id`` and inputs, as a caller whose process
died would: that must return the same outcome and move nothing.

One database pair serves the whole matrix: each cell has its own tx id and order id (hence its
own business key), counters are compared as deltas, and stock is seeded once.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Final

from sqlalchemy.engine import make_url

import fault_injection
from fault_injection import forkserver
from fault_injection.forkserver import ForkedProcess, ForkServer, ForkServerGone
from fault_injection.harness import DatabasePair, Harness, fresh_databases, suite_settings
from fault_injection.invariants import Violation
from fault_injection.results import ScenarioResult
from fault_injection.victim import (
    NOT_REACHED,
    POSITIONS,
    applies,
    arm,
    inputs_for,
    lookup_fault,
    needs_worker,
    saga_for,
    seed_if_empty,
)
from ledger.states import TxState
from orchestrator.crashpoints import POINTS, SimulatedCrash
from orchestrator.engine import Orchestrator
from orchestrator.errors import TransactionNotFound
from providers.fake.faults import FaultPlan
from providers.fake.shop import COUNTED_ACTIONS, FakeShop

SUITE: Final = "matrix"
MODES: Final = ("inprocess", "kill")

#: Provider counters a committed cell must move: reserve + wrap, one charge, one receipt.
COMMITTED: Final = {
    "inventory.reserve": 2,
    "inventory.release": 0,
    "payments.charge": 1,
    "payments.refund": 0,
    "email.send": 1,
}
#: ... and a compensated one: both reservations released, the charge refunded, no receipt.
COMPENSATED: Final = {
    "inventory.reserve": 2,
    "inventory.release": 2,
    "payments.charge": 1,
    "payments.refund": 1,
    "email.send": 0,
}
#: The counters shown on a result line, per outcome (all five are always compared).
_SHOWN: Final = {
    TxState.COMMITTED: ("inventory.reserve", "payments.charge", "email.send"),
    TxState.COMPENSATED: ("inventory.release", "payments.refund", "email.send"),
}

#: A victim that neither dies nor returns in this long is hung: kill it, fail the cell.
VICTIM_TIMEOUT_SECONDS: Final = 60.0
#: What a waiting victim (``--wait``) reads on its stdin before it touches any database.
GO: Final = b"go\n"
#: Kill cells whose victims start ahead of their turn: start-up (~0.6 s of CPU) outlasts a
#: cell's own work; measured on 2 cores, 1-3 ahead all halve the kill half's time, and more
#: would only compete for the same cores.
LOOKAHEAD: Final = 2
#: How long recovery may take to settle one cell (it needs milliseconds).
RECOVERY_TIMEOUT_SECONDS: Final = 15.0


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: a crash point, the position it fires at, and the crash mode."""

    point: str
    position: str
    mode: str

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if not applies(self.point, self.position):
            raise ValueError(f"{self.point} does not apply at position {self.position!r}")

    @property
    def name(self) -> str:
        """``point@position/mode``, e.g. ``effect.after_apply@charge/kill``."""
        return f"{self.point}@{self.position}/{self.mode}"

    @property
    def compensate(self) -> bool:
        """The cell runs the compensating saga (a reversal position)."""
        return POSITIONS[self.position].compensate

    @property
    def expected(self) -> TxState:
        """The terminal status the transaction must end in."""
        return TxState.COMPENSATED if self.compensate else TxState.COMMITTED


def matrix_cells(modes: Sequence[str] = MODES) -> list[Cell]:
    """Every meaningful cell for ``modes``: mode by mode, then point, then position order."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    return [
        Cell(point, position, mode)
        for mode in modes
        for point in POINTS
        for position in POSITIONS
        if applies(point, position)
    ]


@dataclass
class _Crash:
    """What the crash phase of a cell saw."""

    reached: bool
    problems: list[str]
    faults: Counter[str]
    detail: dict[str, Any]


async def open_harness(dbs: DatabasePair) -> Harness:
    """A harness on ``dbs`` whose shop is stocked once, never re-seeded: re-seeding would reset
    stock levels that earlier cells (or a concurrent victim) moved."""
    shop = await FakeShop.open(dbs.provider, faults=FaultPlan())
    try:
        await seed_if_empty(shop)
    except BaseException:
        await shop.close()
        raise
    return Harness(dbs, shop)


async def _crash_in_process(harness: Harness, cell: Cell, tx_id: str) -> _Crash:
    orch = await harness.engine()
    rule = lookup_fault(cell.point, cell.position)
    if rule is not None:
        harness.shop.faults.add(rule)
    seen: list[dict[str, Any]] = []

    def crash_here(point: str, ctx: Mapping[str, Any]) -> None:
        seen.append({k: ctx.get(k) for k in ("kind", "name", "state", "next")})
        raise SimulatedCrash(point)

    arm(orch.crashpoints, cell.point, cell.position, tx_id, action=crash_here)
    try:
        await orch.execute(saga_for(cell.position), inputs_for(cell.position, tx_id), tx_id=tx_id)
        if needs_worker(cell.point, cell.position):
            await orch.drain(timeout_seconds=RECOVERY_TIMEOUT_SECONDS)
        # The outbox event's record rides on a later transaction (ledger/riders.py): land it,
        # as the process's next transaction or its flush would.
        await orch.store.riders.settle()
    except SimulatedCrash:
        pass
    finally:
        # Whatever happened, this "process" is dead now: nothing of it may tidy up.
        await harness.crash(orch)
    # Counted where it fired: a riding record's crash may fire in the store's flush task,
    # whose exception nobody awaits (the process it stands for is dead either way).
    reached = bool(seen)
    faults: Counter[str] = Counter({str(k): n for k, n in harness.shop.faults.fired.items()})
    problems = [] if reached else [f"{cell.point} was never reached"]
    if reached:
        faults["crash"] += 1
    return _Crash(reached, problems, faults, {"at": seen[0] if seen else None})


def _victim_env() -> dict[str, str]:
    # The child must import this very checkout, whatever is installed in the interpreter.
    root = str(Path(fault_injection.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class Victim:
    """A victim subprocess started ahead of its cell, waiting (``--wait``) for a go.

    Start-up (the interpreter and the engine's imports, about 0.6 s of CPU) was most of a kill
    cell's cost. :func:`run_cells` forks its victims from one pre-imported process
    (:mod:`fault_injection.forkserver`) where the platform can, and starts the next cells'
    victims while the current cell runs. A waiting victim has touched no database: it blocks
    on its stdin before opening anything, so it cannot disturb the cell in progress.
    """

    def __init__(
        self, cell: Cell, tx_id: str, proc: asyncio.subprocess.Process | ForkedProcess
    ) -> None:
        self.cell = cell
        self.tx_id = tx_id
        self.proc = proc
        self.used = False

    @classmethod
    async def start(
        cls,
        cell: Cell,
        dbs: DatabasePair,
        tx_id: str,
        *,
        wait: bool,
        forks: ForkServer | None = None,
    ) -> Victim:
        """Spawn the victim of ``cell``; with ``wait`` it idles until :meth:`run`. With
        ``forks`` it is forked from that server instead of started afresh
        (:mod:`fault_injection.forkserver` says why)."""
        argv = [
            "--store",
            dbs.store,
            "--provider",
            dbs.provider,
            "--point",
            cell.point,
            "--position",
            cell.position,
            "--tx-id",
            tx_id,
            "--settings",
            suite_settings().model_dump_json(),
        ]
        if cell.compensate:
            argv.append("--compensate")
        if wait:
            argv.append("--wait")
        if forks is not None:
            return cls(cell, tx_id, await forks.spawn(argv, stdin=wait))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "fault_injection.victim",
            *argv,
            stdin=asyncio.subprocess.PIPE if wait else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=_victim_env(),
        )
        return cls(cell, tx_id, proc)

    async def run(self) -> tuple[int | None, bytes, bool]:
        """Let it go and wait for its end: (returncode, stderr, hung)."""
        self.used = True
        go = GO if self.proc.stdin is not None else None
        try:
            async with asyncio.timeout(VICTIM_TIMEOUT_SECONDS):
                _out, err = await self.proc.communicate(go)
            hung = False
        except TimeoutError:
            self.proc.kill()  # our own child, by its handle
            _out, err = await self.proc.communicate()
            hung = True
        return self.proc.returncode, err, hung

    async def cancel(self) -> None:
        """Send it home unused (closing its stdin makes a waiting victim exit untouched)."""
        if self.used:
            return
        self.used = True
        try:
            async with asyncio.timeout(VICTIM_TIMEOUT_SECONDS):
                await self.proc.communicate(b"")
        except TimeoutError:
            self.proc.kill()
            await self.proc.communicate()


async def _crash_by_kill(
    cell: Cell, dbs: DatabasePair, tx_id: str, victim: Victim | None
) -> _Crash:
    if victim is None:
        victim = await Victim.start(cell, dbs, tx_id, wait=False)
    code, err, hung = await victim.run()
    problems = [f"victim hung for {VICTIM_TIMEOUT_SECONDS:.0f}s"] if hung else []
    tail = err.decode(errors="replace").strip().splitlines()[-5:]
    reached = code == -signal.SIGKILL and not hung
    if not reached and not hung:
        if code == NOT_REACHED:
            problems.append(f"{cell.point} was never reached (victim exited {NOT_REACHED})")
        else:
            problems.append(f"victim exited {code}, not by SIGKILL: {' | '.join(tail)[-300:]}")
    faults: Counter[str] = Counter()
    if reached:
        faults["sigkill"] += 1
        # Reaching a lookup point proves the injected lost response fired in the victim.
        rule = lookup_fault(cell.point, cell.position)
        if rule is not None:
            faults[str(rule.kind)] += 1
    detail = {"returncode": code, "pid": victim.proc.pid, "victim": tail[-1] if tail else ""}
    return _Crash(reached, problems, faults, detail)


async def _status(orch: Orchestrator, tx_id: str) -> TxState | None:
    try:
        return (await orch.result(tx_id)).status
    except TransactionNotFound:
        return None


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in COUNTED_ACTIONS}


def _short(counts: dict[str, int], keys: Sequence[str]) -> str:
    # "email" reads better than "send"; the other actions name themselves.
    return " ".join(
        f"{'email' if k == 'email.send' else k.split('.', 1)[1]}={counts.get(k, 0)}" for k in keys
    )


def repro_db(dbs: DatabasePair) -> str:
    """The ``--db`` of a repro line: the PostgreSQL server (password hidden), or SQLite."""
    if dbs.backend == "sqlite":
        return "sqlite:///agent.db"
    return make_url(dbs.store).set(database="postgres").render_as_string(hide_password=True)


def repro_line(cell: Cell, db: str) -> str:
    """The one command that reruns ``cell`` alone on ``db``."""
    return (
        f"agent-txn fault-inject run --suite {SUITE} --only {shlex.quote(cell.name)} "
        f"--db {shlex.quote(db)}"
    )


async def run_cell(
    cell: Cell, dbs: DatabasePair, *, tx_id: str | None = None, repro: str | None = None
) -> ScenarioResult:
    """Crash ``cell``'s saga at its point, recover in a fresh engine, check everything.

    ``dbs`` may be shared with other cells (run one at a time): the cell touches only its own
    transaction and judges provider counters by their delta. ``tx_id`` defaults to a new one
    (a used one makes the point unreachable: the saga's outcome is already stored, so the cell
    fails). ``repro`` is the ``--db`` to put in the repro line (default: derived from ``dbs``).
    """
    return await _run_cell(cell, dbs, tx_id or _new_tx_id(), repro, None)


def _new_tx_id() -> str:
    return f"mx-{uuid.uuid4().hex[:16]}"


async def _run_cell(
    cell: Cell, dbs: DatabasePair, tx_id: str, repro: str | None, victim: Victim | None
) -> ScenarioResult:
    started = time.perf_counter()
    problems: list[str] = []
    crash = _Crash(False, [], Counter(), {})
    status: TxState | None = None
    delta: dict[str, int] = {}
    violations: list[Violation] = []
    try:
        harness = await open_harness(dbs)
        try:
            before = await harness.shop.counts()
            if cell.mode == "inprocess":
                crash = await _crash_in_process(harness, cell, tx_id)
            else:
                crash = await _crash_by_kill(cell, dbs, tx_id, victim)
            problems.extend(crash.problems)
            # Recover even when the point was not reached: the checker's view helps the reader.
            workers = await harness.recover(timeout_seconds=RECOVERY_TIMEOUT_SECONDS)
            orch = workers[0]
            saga, inputs = saga_for(cell.position), inputs_for(cell.position, tx_id)
            if cell.point == "prepare.before_commit":
                # Nothing was committed, so there is nothing to recover: it must stay so...
                if (found := await _status(orch, tx_id)) is not None:
                    problems.append(f"an uncommitted prepare left a transaction ({found.value})")
                if any(_delta(before, await harness.shop.counts()).values()):
                    problems.append("an uncommitted prepare moved provider counters")
                # ... and the caller's retry with the same tx id is a first, clean attempt.
                await orch.execute(saga, inputs, tx_id=tx_id)
                await orch.drain(timeout_seconds=RECOVERY_TIMEOUT_SECONDS)
            status = await _status(orch, tx_id)
            # A caller whose process died retries with the same tx id: same outcome, no effect.
            retried = await orch.execute(saga, inputs, tx_id=tx_id)
            if retried.status is not status:
                problems.append(f"a retry answered {retried.status.value}, stored {status}")
            report = await harness.check(tx_ids=[tx_id])
            violations = list(report.violations)
            delta = _delta(before, await harness.shop.counts())
        finally:
            await harness.close()
    except Exception as exc:  # a broken cell must be a FAIL line, not the end of the matrix
        problems.append(f"error: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        if victim is not None:
            await victim.cancel()  # only if it never ran (a harness that failed to open)
    expected = cell.expected
    if status is not expected and not any(p.startswith("error:") for p in problems):
        problems.append(f"ended {status.value if status else 'absent'}, expected {expected.value}")
    want = COMPENSATED if cell.compensate else COMMITTED
    if delta and delta != want:
        wrong = {k: v for k, v in delta.items() if v != want[k]}
        problems.append(
            "provider counts " + " ".join(f"{k}={v} (want {want[k]})" for k, v in wrong.items())
        )
    if violations:
        names = sorted({v.name for v in violations})
        problems.append(f"{len(violations)} violation(s): {', '.join(names)}")
    passed = not problems
    shown = _short(delta, _SHOWN[expected])
    if passed:
        line = f"PASS {cell.name}: {expected.value} {shown}"
    else:
        line = f"FAIL {cell.name}: {'; '.join(problems)}"
        if delta:
            line += f" [{status.value if status else 'absent'} {shown}]"
    return ScenarioResult(
        suite=SUITE,
        name=cell.name,
        passed=passed,
        line=line,
        counts=delta,
        faults=crash.faults,
        crashes=1 if crash.reached else 0,
        sagas=1,
        violations=violations,
        repro=repro_line(cell, repro or repro_db(dbs)),
        seconds=time.perf_counter() - started,
        detail={
            "tx_id": tx_id,
            "backend": dbs.backend,
            "mode": cell.mode,
            "status": status.value if status else None,
            "problems": problems,
            **crash.detail,
        },
    )


async def prepare_pair(dbs: DatabasePair) -> None:
    """Stock the shop and create our schema once, up front, so no cell pays for (or races
    on) the first-open work, and each cell's time is its own."""
    shop = await FakeShop.open(dbs.provider)
    try:
        await seed_if_empty(shop)
    finally:
        await shop.close()
    orch = await Orchestrator.open(dbs.store, settings=suite_settings())
    await orch.close()


async def run_cells(
    cells: Sequence[Cell],
    dbs: DatabasePair,
    *,
    repro: str | None = None,
    progress: Callable[[ScenarioResult], None] | None = None,
) -> list[ScenarioResult]:
    """Run ``cells`` one after another on the one pair ``dbs``; ``progress`` sees each result.

    Kill cells overlap start-up: the victims of the next :data:`LOOKAHEAD` kill cells are
    spawned (waiting, touching nothing) while the current cell runs, which takes the
    interpreter start (longer than a whole cell) off the critical path.
    """
    results: list[ScenarioResult] = []
    waiting: dict[int, Victim] = {}
    forks: ForkServer | None = None
    if forkserver.AVAILABLE and any(cell.mode == "kill" for cell in cells):
        try:
            forks = await ForkServer.start(_victim_env())
        except (ForkServerGone, OSError):
            forks = None  # victims start afresh, as where fork is missing: slower, the same
    try:
        for index, cell in enumerate(cells):
            for ahead in range(index, min(index + 1 + LOOKAHEAD, len(cells))):
                if cells[ahead].mode == "kill" and ahead not in waiting:
                    waiting[ahead] = await Victim.start(
                        cells[ahead], dbs, _new_tx_id(), wait=True, forks=forks
                    )
            mine = waiting.pop(index, None)
            tx_id = mine.tx_id if mine is not None else _new_tx_id()
            result = await _run_cell(cell, dbs, tx_id, repro, mine)
            results.append(result)
            if progress is not None:
                progress(result)
    finally:
        for victim in waiting.values():
            await victim.cancel()
        if forks is not None:
            await forks.close()
    return results


async def run_matrix(
    db: str | None,
    workdir: Path,
    *,
    modes: Sequence[str] = MODES,
    only: str | None = None,
    progress: Callable[[ScenarioResult], None] | None = None,
) -> list[ScenarioResult]:
    """Run every cell (or those whose name matches the ``only`` glob) on ONE fresh pair of
    databases (SQLite files under ``workdir``, or new databases on the ``db`` server).

    Cells run one after another; ``progress`` is called with each result as it lands. An
    ``only`` that matches no cell is an error, not an empty (and so silently passing) run.
    """
    cells = [c for c in matrix_cells(modes) if only is None or fnmatchcase(c.name, only)]
    if not cells:
        example = Cell("effect.after_apply", "charge", "kill").name
        raise ValueError(f"no matrix cell matches {only!r} (names look like {example!r})")
    async with fresh_databases(db, workdir) as dbs:
        await prepare_pair(dbs)
        shown = repro_db(dbs) if db is None else _hide_password(db)
        return await run_cells(cells, dbs, repro=shown, progress=progress)


def _hide_password(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


__all__ = [
    "COMMITTED",
    "COMPENSATED",
    "MODES",
    "SUITE",
    "Cell",
    "Victim",
    "matrix_cells",
    "open_harness",
    "prepare_pair",
    "repro_line",
    "run_cell",
    "run_cells",
    "run_matrix",
]
