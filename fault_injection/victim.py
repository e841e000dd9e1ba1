"""The crash matrix's victim: one "process" that runs one saga and dies at one crash point.

Run as ``python -m fault_injection.victim --store URL --provider URL --point P --position POS
--tx-id TX [--compensate]``. It opens the fake shop on the provider database (seeding stock only
when the shop is empty: the parent seeds before spawning, and re-seeding would rewrite stock
levels other cells already moved), opens an engine on our database, arms ``P`` at ``POS`` with
an action that SIGKILLs this very process, and runs the saga. A real ``SIGKILL`` leaves no
``finally``, no rollback by us and no lease release: whatever the database did not commit is
gone, exactly as after a power cut of the process.

Exit status: killed by ``SIGKILL`` (``-9`` seen by the parent) when the point was reached;
``3`` when the saga finished without reaching it (the parent must count that as a failure, never
as a pass); ``2`` for a bad command line.

The same module also holds what the in-process half of the matrix shares with the victim (the
positions, the sagas, how a point is armed), so both modes crash at exactly the same place. It
imports only what a run needs (engine, fake shop, sagas): the subprocess's start-up time is the
main cost of the kill half of the matrix.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from fault_injection.sagas import STOCK, order, order_saga
from orchestrator.config import EngineSettings
from orchestrator.crashpoints import POINTS, CrashPoints
from orchestrator.engine import Orchestrator
from orchestrator.saga import Saga
from providers.fake.faults import FaultKind, FaultPlan, FaultRule
from providers.fake.shop import FakeShop

#: Exit status of a victim that finished without reaching its crash point.
NOT_REACHED: Final = 3
#: Exit status of a victim given a bad command line.
USAGE: Final = 2
#: Exit status of a waiting victim sent home (stdin closed) before it touched anything.
CANCELLED: Final = 0

#: Amounts of the two sagas: the committing one, and one over the compensating saga's limit.
COMMIT_AMOUNT: Final = 1200
COMPENSATE_AMOUNT: Final = 1500
MAX_AMOUNT: Final = 1000


@dataclass(frozen=True)
class Position:
    """One place in a saga where an effect is sent (forward step, outbox event, reversal)."""

    name: str
    #: ``kind`` of the effect.* crash-point context (operation / compensation / outbox).
    kind: str
    #: The effect's name in that context (a reversal carries its forward step's name).
    step: str
    provider: str
    action: str
    #: Applies of ``provider.action`` in the saga before this one (``inventory.reserve`` serves
    #: both reserve and wrap, ``inventory.release`` both reversals): the lost-response fault of
    #: a lookup cell lets that many through so it hits this position and no other.
    skip: int
    #: This position's outcome is the n-th ``record`` commit of the run (1-based); the record.*
    #: contexts carry no effect name, so a record cell is matched by counting.
    record_index: int
    #: Runs the compensating saga (post-condition fails after every step is confirmed).
    compensate: bool


#: Every position, in the order the engine reaches them.
POSITIONS: Final[Mapping[str, Position]] = {
    p.name: p
    for p in (
        Position("reserve", "operation", "reserve", "inventory", "reserve", 0, 1, False),
        Position("charge", "operation", "charge", "payments", "charge", 0, 2, False),
        Position("wrap", "operation", "wrap", "inventory", "reserve", 1, 3, False),
        Position("receipt", "outbox", "receipt", "email", "send", 0, 4, False),
        # The reverse plan runs wrap, charge, reserve; after the three forward records.
        Position("undo-wrap", "compensation", "wrap", "inventory", "release", 0, 4, True),
        Position("undo-charge", "compensation", "charge", "payments", "refund", 0, 5, True),
        Position("undo-reserve", "compensation", "reserve", "inventory", "release", 1, 6, True),
    )
}

FORWARD: Final = ("reserve", "charge", "wrap", "receipt")
COMPENSATION: Final = ("undo-wrap", "undo-charge", "undo-reserve")
LOOKUP_POINTS: Final = frozenset({"effect.before_lookup", "effect.after_lookup"})


def applies(point: str, position: str) -> bool:
    """Whether ``point`` at ``position`` is a meaningful cell.

    effect.* and record.* apply at every position; the once-per-saga points sit at the position
    whose effect they precede: ``prepare.*`` at the first step (the prepare commit claims it),
    ``commit.*`` at the outbox event (the commit writes and claims it), and
    ``compensation.after_plan`` at the first reversal (the plan commit claims it).
    """
    if point not in POINTS or position not in POSITIONS:
        return False
    family = point.split(".", 1)[0]
    if family in ("effect", "record"):
        return True
    return {
        "prepare": "reserve",
        "commit": "receipt",
        "compensation": "undo-wrap",
    }.get(family) == position


def needs_worker(point: str, position: str) -> bool:
    """True when the victim must also act as a worker (drain) after ``execute`` to reach the
    point: ``execute`` leaves an in-doubt outbox event of a committed saga to the workers
    (the caller's answer is already decided), so its reconciling lookup happens in a worker."""
    return point in LOOKUP_POINTS and POSITIONS[position].kind == "outbox"


def saga_for(position: str) -> Saga:
    """The three-step order saga; the compensating variant for reversal positions."""
    if POSITIONS[position].compensate:
        return order_saga(three_steps=True, max_amount=MAX_AMOUNT)
    return order_saga(three_steps=True)


def inputs_for(position: str, tx_id: str) -> dict[str, Any]:
    """Inputs of the cell's order; the order id is the tx id, so each cell has its own
    business key on a database pair shared by the whole matrix."""
    amount = COMPENSATE_AMOUNT if POSITIONS[position].compensate else COMMIT_AMOUNT
    return order(tx_id, amount=amount)


def lookup_fault(point: str, position: str) -> FaultRule | None:
    """The provider fault a lookup cell needs, else ``None``.

    A lookup only happens when an effect is claimed again after it may have been sent. The
    first apply at the position therefore loses its response (the effect commits at the
    provider, the answer never arrives): the engine records ``unknown`` and, within its
    ``execute`` budget, re-claims the effect and looks it up, in the same process. That lookup
    is where the point fires.
    """
    if point not in LOOKUP_POINTS:
        return None
    p = POSITIONS[position]
    return FaultRule(
        FaultKind.LOSE_RESPONSE, provider=p.provider, action=p.action, skip=p.skip, times=1
    )


CrashAction = Callable[[str, Mapping[str, Any]], None]


def arm(
    crashpoints: CrashPoints,
    point: str,
    position: str,
    tx_id: str,
    *,
    action: CrashAction | None = None,
) -> None:
    """Arm ``point`` to fire once, at ``position`` of transaction ``tx_id`` only.

    ``action`` ``None`` raises :class:`~orchestrator.crashpoints.SimulatedCrash` (in-process
    mode); the victim passes one that SIGKILLs the process.
    """
    if not applies(point, position):
        raise ValueError(f"{point} does not apply at {position}")
    p = POSITIONS[position]
    when: Callable[[Mapping[str, Any]], bool]
    family = point.split(".", 1)[0]
    if family == "effect":

        def when(ctx: Mapping[str, Any]) -> bool:
            return (
                ctx.get("tx_id") == tx_id
                and ctx.get("kind") == p.kind
                and ctx.get("name") == p.step
            )

    elif family == "record":
        seen = [0]

        def when(ctx: Mapping[str, Any]) -> bool:
            # "advance" commits record nothing; only outcome commits count.
            if ctx.get("tx_id") != tx_id or ctx.get("kind") != "record":
                return False
            seen[0] += 1
            return seen[0] == p.record_index

    else:

        def when(ctx: Mapping[str, Any]) -> bool:
            return ctx.get("tx_id") == tx_id

    crashpoints.arm(point, when=when, times=1, action=action)


def _sigkill(point: str, ctx: Mapping[str, Any]) -> None:
    # Say where we die (the parent keeps it as evidence), then die for real: no handler, no
    # finally, no flush of anything but this one unbuffered write.
    where = {k: ctx.get(k) for k in ("kind", "name", "state", "next")}
    os.write(2, f"victim: {point} {json.dumps(where, sort_keys=True)}\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


async def run_victim(
    store: str,
    provider: str,
    point: str,
    position: str,
    tx_id: str,
    settings: EngineSettings,
) -> int:
    """Run the cell's saga with ``point`` armed to SIGKILL; return :data:`NOT_REACHED` if it
    comes back (the point was never reached)."""
    plan = FaultPlan()
    rule = lookup_fault(point, position)
    if rule is not None:
        plan.add(rule)
    shop = await FakeShop.open(provider, faults=plan)
    try:
        await seed_if_empty(shop)
        orch = await Orchestrator.open(store, providers=shop.providers(), settings=settings)
        try:
            arm(orch.crashpoints, point, position, tx_id, action=_sigkill)
            await orch.execute(saga_for(position), inputs_for(position, tx_id), tx_id=tx_id)
            if needs_worker(point, position):
                await orch.drain(timeout_seconds=10)
        finally:
            await orch.close()
    finally:
        await shop.close()
    return NOT_REACHED


async def seed_if_empty(shop: FakeShop) -> None:
    """Stock the shop unless it already is (never reset levels other runs moved)."""
    try:
        await shop.stock(next(iter(STOCK)))
    except KeyError:
        await shop.seed_stock(STOCK)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fault_injection.victim",
        description="Run one saga and SIGKILL this process at one crash point.",
    )
    parser.add_argument("--store", required=True, help="our database URL")
    parser.add_argument("--provider", required=True, help="the fake provider's database URL")
    parser.add_argument("--point", required=True, choices=sorted(POINTS))
    parser.add_argument("--position", required=True, choices=list(POSITIONS))
    parser.add_argument("--tx-id", required=True)
    parser.add_argument(
        "--compensate",
        action="store_true",
        help="the position is a reversal (required exactly for undo-* positions)",
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help="start up, then wait for a 'go' line on stdin before touching any database "
        "(EOF: exit 0 untouched); lets the parent hide interpreter start-up",
    )
    parser.add_argument(
        "--settings",
        default=None,
        help="engine settings as JSON (default: the fault suite's)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (when not killed)."""
    args = _parse(argv)
    if not applies(args.point, args.position):
        print(f"victim: {args.point} does not apply at {args.position}", file=sys.stderr)
        return USAGE
    if args.compensate != POSITIONS[args.position].compensate:
        need = "needs" if POSITIONS[args.position].compensate else "does not take"
        print(f"victim: position {args.position} {need} --compensate", file=sys.stderr)
        return USAGE
    if args.settings is not None:
        settings = EngineSettings.model_validate_json(args.settings)
    else:
        from fault_injection.harness import suite_settings

        settings = suite_settings()
    if args.wait and sys.stdin.readline().strip() != "go":
        return CANCELLED
    return asyncio.run(
        run_victim(args.store, args.provider, args.point, args.position, args.tx_id, settings)
    )


if __name__ == "__main__":
    sys.exit(main())
