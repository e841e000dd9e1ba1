"""The two-database order demo of seed 003: three orders, three fault plans, one provable outcome.

Our durable state lives in one database (``agent.db``), the fake shop's effects in another
(``provider.db``), so rolling back ours could never undo a charge. Each order gets its own fault
plan; afterwards the demo prints the ledger timeline and the effects the *provider's* database
counted for that order, then checks the ledger's hash chains::

    report = await run_demo("sqlite+aiosqlite:///agent.db", "sqlite+aiosqlite:///provider.db",
                            out=Console())
    assert report.ok
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy import Table as DbTable
from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from ledger import schema as store_schema
from ledger.dialects import normalize_url, sqlite_file, table_names, translate
from ledger.events import LedgerEntry
from ledger.migrate import VERSION_TABLE
from ledger.schema import transactions as transactions_table
from ledger.states import TxState
from orchestrator.config import EngineSettings
from orchestrator.engine import Orchestrator
from orchestrator.expressions import concat, ref
from orchestrator.saga import Compensation, Event, Input, Saga, Step
from orchestrator.views import TransactionView
from providers.fake import schema as shop_schema
from providers.fake.faults import FaultKind, FaultRule
from providers.fake.shop import COUNTED_ACTIONS, FakeShop

__all__ = [
    "DEMO_SCENARIOS",
    "DemoError",
    "DemoReport",
    "OrderReport",
    "Scenario",
    "compact_json",
    "format_counts",
    "key_facts",
    "order_saga",
    "require_fresh",
    "run_demo",
    "same_database",
    "subject_labels",
    "transition",
    "utc_iso",
]

SKU: Final = "sku-1"
STOCK: Final = 10
#: Short counter names, in the order the seed prints them; the first three always appear.
_SHORT: Final = {
    "inventory.reserve": "reserve",
    "inventory.release": "release",
    "payments.charge": "charge",
    "payments.refund": "refund",
    "email.send": "email",
}
_ALWAYS: Final = frozenset({"reserve", "charge", "email"})
_ORDER: Final = ("reserve", "release", "charge", "refund", "email")


class DemoError(Exception):
    """The demo cannot run as asked (e.g. the store already holds transactions)."""


def order_saga() -> Saga:
    """The seed's order: reserve stock, charge the card; the receipt goes out after commit."""
    return Saga(
        "order",
        inputs={
            "order_id": Input("string", min_length=1),
            "sku": Input("string", min_length=1),
            "amount": Input("integer", minimum=1),  # minor units (cents)
            "email": Input("string", min_length=3),
        },
        # One live transaction per order: a second attempt gets the first one's outcome.
        business_key=concat("order:", ref("inputs.order_id")),
        steps=[
            Step(
                "reserve",
                "inventory",
                "reserve",
                {"sku": ref("inputs.sku"), "quantity": 1},
                compensation=Compensation("release", {"reservation_id": ref("forward.remote_id")}),
            ),
            Step(
                "charge",
                "payments",
                "charge",
                {
                    "amount": ref("inputs.amount"),
                    "currency": "EUR",
                    "order_id": ref("inputs.order_id"),
                },
                compensation=Compensation(
                    "refund",
                    {
                        "charge_id": ref("forward.remote_id"),
                        "amount": ref("forward.payload.amount"),
                    },
                ),
            ),
        ],
        outbox=[
            Event(
                "receipt",
                "email",
                "send",
                {
                    "to": ref("inputs.email"),
                    "template": "receipt",
                    "order_id": ref("inputs.order_id"),
                    "charge_id": ref("steps.charge.remote_id"),
                },
            )
        ],
    )


@dataclass(frozen=True)
class Scenario:
    """One demo order: its fault plan and what the provider must have counted afterwards."""

    order_id: str
    title: str
    amount: int
    faults: tuple[FaultRule, ...]
    expected_status: TxState
    #: Short counter name -> effects for this order; every counter not named must stay 0.
    expected_counts: Mapping[str, int]


DEMO_SCENARIOS: Final[tuple[Scenario, ...]] = (
    Scenario(
        "order-41",
        "happy path",
        1200,
        (),
        TxState.COMMITTED,
        {"reserve": 1, "charge": 1, "email": 1},
    ),
    Scenario(
        "order-42",
        "charge response lost -> unknown -> lookup",
        1300,
        (FaultRule(FaultKind.LOSE_RESPONSE, provider="payments", action="charge"),),
        TxState.COMMITTED,
        {"reserve": 1, "charge": 1, "email": 1},
    ),
    Scenario(
        "order-43",
        "charge rejected -> reservation released",
        1400,
        (FaultRule(FaultKind.REJECT, provider="payments", action="charge"),),
        TxState.COMPENSATED,
        {"reserve": 1, "release": 1, "charge": 0, "email": 0},
    ),
)

#: Small backoff so the lost-response order reconciles in milliseconds, not seconds.
DEMO_SETTINGS: Final = EngineSettings(backoff_initial_seconds=0.02, execute_budget_seconds=5)


@dataclass(frozen=True)
class OrderReport:
    """What happened to one demo order."""

    order_id: str
    scenario: str
    status: str
    tx_id: str
    #: Effects the provider database counted for this order, by short name (all five).
    counts: dict[str, int]
    passed: bool
    ledger_rows: int = 0

    @property
    def counts_line(self) -> str:
        """``reserve=1 charge=1 email=1`` (release / refund only when they happened)."""
        return format_counts(self.counts)


@dataclass
class DemoReport:
    """The whole run: per-order outcomes, provider totals, ledger verification."""

    orders: list[OrderReport] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    store: str = ""
    provider: str = ""

    @property
    def ok(self) -> bool:
        """Every order ended as expected and the ledger verified."""
        return all(o.passed for o in self.orders) and not self.problems

    def order(self, order_id: str) -> OrderReport:
        """One order's report by id."""
        for o in self.orders:
            if o.order_id == order_id:
                return o
        raise KeyError(order_id)


def format_counts(counts: Mapping[str, int], *, every: bool = False) -> str:
    """Counters as the seed prints them: ``reserve=1 release=1 charge=0 email=0``."""
    return " ".join(
        f"{name}={counts.get(name, 0)}"
        for name in _ORDER
        if every or name in _ALWAYS or counts.get(name, 0)
    )


def _short_counts(raw: Mapping[str, int]) -> dict[str, int]:
    return {_SHORT[a]: int(raw.get(a, 0)) for a in COUNTED_ACTIONS}


def _where(url: str) -> str:
    """A file path for SQLite, else the URL without its password."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database:
        return parsed.database
    return parsed.render_as_string(hide_password=True)


async def run_demo(
    store_url: str,
    provider_url: str,
    *,
    out: Console,
    scenarios: Sequence[Scenario] = DEMO_SCENARIOS,
) -> DemoReport:
    """Run the demo orders against fresh databases, printing as it goes; returns the report."""
    report = DemoReport(store=_where(store_url), provider=_where(provider_url))
    await require_fresh(store_url, provider_url)
    if same_database(store_url, provider_url):
        raise DemoError("the demo needs two different databases, one for each side")
    shop = await FakeShop.open(provider_url)
    try:
        await shop.seed_stock({SKU: STOCK})
        orch = await Orchestrator.open(
            store_url, providers=shop.providers(), settings=DEMO_SETTINGS
        )
        try:
            saga = order_saga()
            await orch.register(saga)
            out.print(
                f"[bold]agent-txn demo[/]: our state in {escape(report.store)}, "
                f"the provider's effects in {escape(report.provider)}"
            )
            for scenario in scenarios:
                report.orders.append(await _run_order(orch, shop, saga, scenario, out))
            shop.faults.clear()
            problems = await orch.verify_ledger()
            report.problems = [
                f"{p.tx_id}" + (f" seq {p.seq}" if p.seq is not None else "") + f": {p.problem}"
                for p in problems
            ]
        finally:
            await orch.close()
    finally:
        await shop.close()
    # A second connection that shares nothing with the one the providers used: the totals come
    # from the provider's database itself, not from anything held in this process.
    auditor = await FakeShop.open(provider_url)
    try:
        report.totals = _short_counts(await auditor.counts())
    finally:
        await auditor.close()
    _print_summary(report, out)
    return report


def same_database(first: str, second: str) -> bool:
    """Whether two URLs name one database: SQLite files compared by their resolved paths
    (``sqlite:///one.db`` and ``sqlite:///$PWD/one.db`` are one file), others by their URLs."""
    files = sqlite_file(first), sqlite_file(second)
    if files[0] is not None and files[1] is not None:
        return os.path.realpath(files[0]) == os.path.realpath(files[1])
    return make_url(normalize_url(first)) == make_url(normalize_url(second))


async def require_fresh(store_url: str | None, provider_url: str | None) -> None:
    """Refuse, before anything is written anywhere, a database the demo cannot make its own.

    The agent-txn database must hold nothing but (an empty) agent-txn schema; the provider's
    nothing but (an empty) shop: the demo's business keys and counts assume fresh databases,
    and on a database the user named it refuses rather than deletes. Both are read before the
    shop opens: it writes its tables and stock, which a refusal of the other database left
    behind. ``None`` skips one (the demo's own files, which it recreates)."""
    if provider_url is not None:
        await _require_empty_provider(provider_url)
    if store_url is not None:
        await _require_empty_store(store_url)


async def _contents(url: str, ours: set[str], counted: DbTable) -> tuple[list[str], int]:
    """The tables of ``url`` that are not in ``ours``, and the rows of ``counted`` (counted
    only when there are none such: another application's table of that name is not ours to
    read). A SQLite file that does not exist yet is not opened (SQLite would create it, and a
    refusal after left an empty file): it is empty, if its folder exists."""
    if _sqlite_file_to_come(url):
        return [], 0
    engine = create_async_engine(normalize_url(url), poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            tables = await table_names(conn)
            others = sorted(tables - ours)
            rows = 0
            if not others and counted.name in tables:
                query = select(func.count()).select_from(counted)
                rows = (await conn.execute(query)).scalar_one()
    except Exception as exc:
        translated = translate(exc)
        if translated is None:
            raise
        raise translated from None
    finally:
        await engine.dispose()
    return others, rows


def _sqlite_file_to_come(url: str) -> bool:
    """Whether ``url`` names a SQLite file not made yet; refused if its folder is missing."""
    path = sqlite_file(url)
    if path is None or os.path.exists(path):
        return False
    if not os.path.isdir(os.path.dirname(path)):
        raise DemoError(f"the folder of {path} does not exist")
    return True


def _listed(names: list[str]) -> str:
    return f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"


async def _require_empty_store(url: str) -> None:
    ours = set(store_schema.metadata.tables) | {VERSION_TABLE}
    others, existing = await _contents(url, ours, transactions_table)
    if others:
        # Orchestrator.open would refuse it too (ForeignDatabase), but only after the shop
        # had written its tables and stock into the provider's database.
        raise DemoError(
            f"the demo needs an agent-txn database of its own; this one holds other tables "
            f"({_listed(others)})"
        )
    if existing:
        raise DemoError(
            f"the demo needs an empty agent-txn database; this one already holds {existing} "
            "transaction(s) (use a fresh --db / --provider-db, or omit them to use --dir)"
        )


async def _require_empty_provider(url: str) -> None:
    """Refuse a provider database that holds anything: opening the shop writes its tables and
    stock there (into the agent-txn database itself when ``--provider-db`` named it), and its
    earlier effects would be counted as the demo's."""
    others, effects = await _contents(url, set(shop_schema.metadata.tables), shop_schema.effects)
    if others:
        raise DemoError(
            f"the demo needs a provider database of its own; this one holds other tables "
            f"({_listed(others)})"
        )
    if effects:
        raise DemoError(
            f"the demo needs an empty provider database; this one already holds {effects} "
            "effect(s) (use a fresh --provider-db, or omit it to use --dir)"
        )


async def _run_order(
    orch: Orchestrator, shop: FakeShop, saga: Saga, scenario: Scenario, out: Console
) -> OrderReport:
    shop.faults.clear()
    for rule in scenario.faults:
        shop.faults.add(rule)
    before = _short_counts(await shop.counts())
    result = await orch.execute(
        saga,
        {
            "order_id": scenario.order_id,
            "sku": SKU,
            "amount": scenario.amount,
            "email": f"buyer+{scenario.order_id}@example.com",
        },
    )
    # The receipt is an outbox event: it may still be in flight when execute returns.
    await orch.drain(timeout_seconds=10)
    after = _short_counts(await shop.counts())
    delta = {name: after[name] - before[name] for name in after}
    view = await orch.get(result.tx_id)
    entries = await orch.ledger(result.tx_id)
    status = view.tx.status
    expected = {name: scenario.expected_counts.get(name, 0) for name in delta}
    passed = status is scenario.expected_status and delta == expected

    out.print()
    out.rule(
        f"[bold]{escape(scenario.order_id)}[/] · {escape(scenario.title)} · "
        f"[{'green' if status is TxState.COMMITTED else 'yellow'}]{status.value}[/]",
        align="left",
    )
    out.print(f"fault plan: {escape(_describe_faults(scenario.faults))}")
    out.print(_timeline(view, entries))
    verdict = "[green]PASS[/]" if passed else "[red]FAIL[/]"
    out.print(f"{verdict} provider effects for {escape(scenario.order_id)}: {format_counts(delta)}")
    if not passed:
        out.print(
            f"     expected {scenario.expected_status.value} with {format_counts(expected)}",
            style="red",
        )
    return OrderReport(
        order_id=scenario.order_id,
        scenario=scenario.title,
        status=status.value,
        tx_id=result.tx_id,
        counts=delta,
        passed=passed,
        ledger_rows=len(entries),
    )


def _describe_faults(rules: Sequence[FaultRule]) -> str:
    if not rules:
        return "none"
    parts = []
    for r in rules:
        target = ".".join(x for x in (r.provider, r.action) if x) or "any call"
        times = "always" if r.times is None else ("once" if r.times == 1 else f"{r.times} times")
        parts.append(f"{r.kind.value} on {target} ({times})")
    return "; ".join(parts)


def subject_labels(view: TransactionView) -> dict[str | None, str]:
    """Readable names for ledger subjects: step names, ``undo <step>``, outbox event names."""
    labels: dict[str | None, str] = {None: "saga"}
    for op in view.operations:
        labels[op.key] = op.name
    for comp in view.compensations:
        labels[comp.key] = f"undo {comp.name}"
    for event in view.outbox:
        labels[event.key] = event.name
    return labels


def key_facts(entry: LedgerEntry) -> str:
    """The few details of a ledger row a reader needs (remote id, lookup answer, reason)."""
    d = entry.detail
    facts: list[str] = []
    if entry.action == "plan":
        facts.append(f"{d.get('provider', '?')}.{d.get('action', '?')}")
    elif entry.action == "claim":
        facts.append(f"attempt {d.get('attempt', '?')}, fence {d.get('fence', '?')}")
    if "lookup" in d:
        facts.append(
            f"lookup {d['lookup']}" + (f": {d['remote_id']}" if d.get("remote_id") else "")
        )
    if entry.to_state == "unknown":
        facts.append(f"outcome unknown ({d.get('reason', d.get('error', '?'))})")
    elif entry.to_state == "failed" and entry.subject is not None:
        facts.append(f"{d.get('error', 'failed')}: {d.get('reason', '?')}")
    if d.get("remote_id") and "lookup" not in d:
        facts.append(str(d["remote_id"]))
    error = d.get("error")
    if entry.subject is None and isinstance(error, Mapping):
        where = f" at {error['step']}" if error.get("step") else ""
        facts.append(f"{error.get('code', '?')}{where}")
    if d.get("echo_mismatch"):
        facts.append(f"echo mismatch: {compact_json(d['echo_mismatch'])}")
    return ", ".join(facts)


def compact_json(value: Any) -> str:
    """JSON with no spaces and sorted keys (how ledger details are shown)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def utc_iso(epoch_ms: int) -> str:
    """``2026-01-31T12:00:00.123Z`` for a ledger timestamp (epoch milliseconds)."""
    stamp = datetime.fromtimestamp(epoch_ms / 1000, tz=UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def transition(entry: LedgerEntry) -> str:
    """``from → to`` (``∅`` for a row that creates its subject)."""
    if entry.to_state is None:
        return entry.from_state or ""
    return f"{entry.from_state or '∅'} → {entry.to_state}"


def _timeline(view: TransactionView, entries: Sequence[LedgerEntry]) -> Table:
    labels = subject_labels(view)
    start = entries[0].created_at if entries else 0
    table = Table(box=None, pad_edge=False, padding=(0, 1), show_edge=False)
    table.add_column("t", justify="right", no_wrap=True, style="dim")
    table.add_column("subject", no_wrap=True)
    table.add_column("action", no_wrap=True)
    table.add_column("transition", no_wrap=True)
    table.add_column("facts", overflow="fold")
    for e in entries:
        label = labels.get(e.subject, (e.subject or "")[:12])
        table.add_row(
            f"+{e.created_at - start}ms",
            escape(label),
            escape(e.action),
            escape(transition(e)),
            escape(key_facts(e)),
        )
    return table


def _print_summary(report: DemoReport, out: Console) -> None:
    out.print()
    out.rule("[bold]summary[/]", align="left")
    for o in report.orders:
        mark = "[green]PASS[/]" if o.passed else "[red]FAIL[/]"
        out.print(f"{mark} {escape(o.order_id)} {o.status}: {format_counts(o.counts)}")
    out.print(
        f"provider totals (read from the provider's database): "
        f"{format_counts(report.totals, every=True)}"
    )
    rows = sum(o.ledger_rows for o in report.orders)
    if report.problems:
        out.print(f"[red]ledger verification FAILED: {len(report.problems)} problem(s)[/]")
        for p in report.problems:
            out.print(f"  {escape(p)}")
    else:
        out.print(f"ledger OK: {len(report.orders)} transactions, {rows} rows verified")
    out.print(f"our state:            {escape(report.store)}")
    out.print(f"the provider's state: {escape(report.provider)}")
