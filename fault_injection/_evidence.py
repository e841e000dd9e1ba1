"""Evidence for the invariant checker: one read-only snapshot of both databases.

The checker never trusts one side alone, so it loads both: our store (transactions, effects,
ledger, and the ledger's own verification) and the fake provider's database (its ``effects``,
``calls`` log and business tables). Rows are plain JSON-able dicts so a violation can quote
them verbatim. Provider rows are matched to ours by idempotency key only — the provider knows
nothing else about us.

Both connections are read-only (SQLite ``query_only`` / PostgreSQL
``default_transaction_read_only``). :func:`load` opens them and disposes them before it
returns; an :class:`EvidenceReader` keeps them open for many snapshots of the same pair, as a
run that checks after every schedule does (``fault_injection.harness.Harness.check``).

Also here, because they are judgements of evidence rather than invariants: what counts as
provider, exception or SQL text in a stored error (invariant 9), and what the shop's business
tables must show after a reversal (invariant 3).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Table, event, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from compensation import policy
from ledger import dialects, events
from ledger.events import LedgerEntry, LedgerProblem
from ledger.schema import compensation_steps, ledger, operations, outbox, saga_definitions
from ledger.schema import transactions as transactions_table
from ledger.store import Store
from orchestrator import keys
from orchestrator.config import EngineSettings
from orchestrator.errors import REGISTRY
from providers.fake import schema as shop
from providers.fake.actions import build_specs

#: Bound parameters per ``IN (...)`` chunk: far below SQLite's and asyncpg's limits.
_CHUNK = 500

#: Providers whose effects live in the fake shop's database. Effects of any other provider (a
#: user's own, registered in a test) leave no rows there, so their absence proves nothing.
FAKE_PROVIDERS = frozenset(build_specs(1.0))

#: What an effect row of ours is: a forward op, a reversal or an outbox event.
OPERATION, COMPENSATION, OUTBOX = "operation", "compensation", "outbox"


@dataclass(frozen=True, slots=True)
class KeyRef:
    """Which of our rows an idempotency key belongs to.

    ``row`` is ``None`` for a key we can *derive* for a transaction but never stored (an outbox
    event key of a transaction that never committed): a provider effect under such a key is
    attributable by the hash alone, and is exactly the evidence invariant 4 looks for.
    """

    kind: str
    tx_id: str
    row: dict[str, Any] | None


@dataclass
class Snapshot:
    """Everything the invariants are judged on, read in one pass."""

    txs: dict[str, dict[str, Any]] = field(default_factory=dict)
    definitions: dict[str, dict[str, Any]] = field(default_factory=dict)
    ops: list[dict[str, Any]] = field(default_factory=list)
    comps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    ledger: dict[str, list[LedgerEntry]] = field(default_factory=dict)
    ledger_problems: dict[str, list[LedgerProblem]] = field(default_factory=dict)
    #: Append-only triggers found on ``ledger`` and those the migration creates.
    triggers: set[str] = field(default_factory=set)
    expected_triggers: set[str] = field(default_factory=set)
    #: Provider ``effects`` and ``calls`` rows, in ``seq`` order.
    p_effects: list[dict[str, Any]] = field(default_factory=list)
    p_calls: list[dict[str, Any]] = field(default_factory=list)
    reservations: dict[str, dict[str, Any]] = field(default_factory=dict)
    charges: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Key → our row; filled by :meth:`index`.
    owners: dict[str, KeyRef] = field(default_factory=dict)
    #: Whether every provider row was loaded (no ``tx_ids`` filter): only then is a provider
    #: effect under a key we do not know a stray effect rather than someone else's.
    whole_provider: bool = True
    _by_key: dict[str, list[dict[str, Any]]] | None = field(default=None, repr=False)
    _resolved: set[tuple[str, str]] | None = field(default=None, repr=False)

    def index(self) -> None:
        """Map every key (stored or derivable) to the transaction it belongs to."""
        for tx_id, tx in self.txs.items():
            definition = self.definitions.get(tx["definition_digest"], {})
            for event_key in derived_event_keys(tx_id, definition):
                self.owners.setdefault(event_key, KeyRef(OUTBOX, tx_id, None))
        for kind, rows, column in (
            (OPERATION, self.ops, "op_key"),
            (COMPENSATION, self.comps, "op_key"),
            (OUTBOX, self.events, "event_key"),
        ):
            for row in rows:
                self.owners[row[column]] = KeyRef(kind, row["tx_id"], row)

    def our_keys(self) -> set[str]:
        """Every key that belongs to a checked transaction, stored or derivable."""
        return set(self.owners)

    def applied(self, key: str, provider: str | None = None) -> list[dict[str, Any]]:
        """Applied provider effects under ``key`` (forgotten cache entries included)."""
        if self._by_key is None:
            self._by_key = group(self.p_effects, "key")
        return [
            e
            for e in self._by_key.get(key, [])
            if e["status"] == "applied" and (provider is None or e["provider"] == provider)
        ]

    def calls_by_key(self) -> dict[tuple[str, str], list[dict[str, Any]]]:
        """The provider's request log grouped per (provider, key), in ``seq`` order."""
        grouped: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for c in self.p_calls:
            grouped[(c["provider"], c["key"])].append(c)
        return grouped

    def operator_resolved(self, tx_id: str, subject: str) -> bool:
        """An operator confirmed this effect: their decision is the evidence, not the provider."""
        if self._resolved is None:
            self._resolved = {
                (e.tx_id, e.subject)
                for entries in self.ledger.values()
                for e in entries
                if e.action == "operator_resolve" and e.subject is not None
            }
        return (tx_id, subject) in self._resolved

    def excerpt(self, tx_id: str | None, limit: int = 20) -> list[dict[str, Any]]:
        """The last ``limit`` ledger rows of ``tx_id`` as JSON-able dicts."""
        if tx_id is None:
            return []
        return [entry_json(e) for e in self.ledger.get(tx_id, [])[-limit:]]


def entry_json(e: LedgerEntry) -> dict[str, Any]:
    """A ledger row as evidence (hashes shortened: they name the row, they prove nothing here)."""
    return {
        "seq": e.seq,
        "subject": e.subject,
        "action": e.action,
        "from_state": e.from_state,
        "to_state": e.to_state,
        "detail": e.detail,
        "created_at": e.created_at,
        "hash": e.hash[:16],
    }


def effect_json(e: dict[str, Any]) -> dict[str, Any]:
    """A provider ``effects`` row as evidence (payload bodies left out: the sha names them)."""
    wanted = ("seq", "provider", "action", "key", "status", "remote_id", "payload_sha256")
    out = {k: e[k] for k in wanted}
    out["reason"] = e.get("reason")
    out["created_at"] = e["created_at"]
    out["forgotten_at"] = e["forgotten_at"]
    return out


def call_json(c: dict[str, Any]) -> dict[str, Any]:
    """A provider ``calls`` row as evidence."""
    wanted = ("seq", "call", "provider", "action", "key", "fence", "outcome", "fault")
    out = {k: c[k] for k in wanted}
    out["created_effect"] = bool(c["created_effect"])
    return out


def ours_json(row: dict[str, Any]) -> dict[str, Any]:
    """One of our effect rows as evidence."""
    key = row.get("op_key") or row.get("event_key")
    wanted = ("tx_id", "provider", "action", "state", "fence", "attempts", "remote_id")
    out: dict[str, Any] = {"key": key, **{k: row.get(k) for k in wanted}}
    out["payload_sha256"] = row.get("payload_sha256")
    if row.get("forward_op_key"):
        out["forward_op_key"] = row["forward_op_key"]
    return out


def derived_event_keys(tx_id: str, definition: dict[str, Any]) -> list[str]:
    """Outbox keys the transaction *would* use with the default tenant and environment.

    Keys hash (tenant, environment, ...) and neither is stored, so only the defaults can be
    derived; a provider effect under such a key is still attributable by the hash match alone.
    """
    tenant = str(EngineSettings.model_fields["tenant"].default)
    environment = str(EngineSettings.model_fields["environment"].default)
    version = int(definition.get("version", 1))
    return [
        keys.event_key(
            tenant=tenant,
            environment=environment,
            provider=str(ev["provider"]),
            tx_id=tx_id,
            event=str(ev["name"]),
            version=version,
        )
        for ev in definition.get("outbox", [])
    ]


def _chunks(values: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(values), _CHUNK):
        yield values[start : start + _CHUNK]


async def _rows(
    conn: AsyncConnection, table: Table, column: str, values: Collection[str] | None
) -> list[dict[str, Any]]:
    """Rows of ``table`` (all, or those whose ``column`` is in ``values``), in primary-key order."""
    order = list(table.primary_key.columns)
    if values is None:
        result = await conn.execute(select(table).order_by(*order))
        return [dict(m) for m in result.mappings().all()]
    out: list[dict[str, Any]] = []
    for chunk in _chunks(sorted(values)):
        stmt = select(table).where(table.c[column].in_(list(chunk))).order_by(*order)
        out.extend(dict(m) for m in (await conn.execute(stmt)).mappings().all())
    return sorted(out, key=lambda r: tuple(r[c.name] for c in order))


async def _load_ours(snap: Snapshot, store: Store, tx_ids: Collection[str] | None) -> None:
    async with store.read() as conn:
        for tx in await _rows(conn, transactions_table, "tx_id", tx_ids):
            snap.txs[tx["tx_id"]] = tx
        ids = set(snap.txs) if tx_ids is not None else None
        digests = {tx["definition_digest"] for tx in snap.txs.values()}
        for d in await _rows(conn, saga_definitions, "digest", digests):
            snap.definitions[d["digest"]] = dict(d["definition"] or {})
        snap.ops = await _rows(conn, operations, "tx_id", ids)
        snap.comps = await _rows(conn, compensation_steps, "tx_id", ids)
        snap.events = await _rows(conn, outbox, "tx_id", ids)
        for row in await _rows(conn, ledger, "tx_id", ids):
            snap.ledger.setdefault(row["tx_id"], []).append(events.entry_from_row(row))
        for tx_id in snap.txs:
            # verify() re-reads the rows; it is the one definition of "the ledger verifies".
            snap.ledger_problems[tx_id] = await events.verify(conn, tx_id)
        snap.triggers, snap.expected_triggers = await _triggers(conn, store.dialect)


async def _triggers(conn: AsyncConnection, dialect: str) -> tuple[set[str], set[str]]:
    if dialect == "sqlite":
        sql = "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'ledger'"
        expected = {"ledger_append_only_update", "ledger_append_only_delete"}
    else:
        sql = (
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'ledger'::regclass AND NOT tgisinternal"
        )
        expected = {
            "ledger_append_only_update",
            "ledger_append_only_delete",
            "ledger_append_only_truncate",
        }
    found = {str(name) for name in (await conn.execute(text(sql))).scalars().all()}
    return found, expected


def _provider_engine(url: str) -> AsyncEngine:
    """A read-only engine on the provider's database (never through its apply / lookup).
    ``pool_pre_ping``: a reader kept across a PostgreSQL server restart (a scenario of the
    suite) replaces the pooled connection the restart killed instead of failing on it."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        engine = create_async_engine(parsed.set(drivername="sqlite+aiosqlite"))

        def _query_only(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            try:
                # The checker must not be able to change what it judges.
                cursor.execute("PRAGMA query_only = ON")
            finally:
                cursor.close()

        event.listen(engine.sync_engine, "connect", _query_only)
        return engine
    if backend == "postgresql":
        # Normalised as every engine on a user's URL is (libpq's sslmode becomes asyncpg's
        # ssl), and its numeric options given as numbers (``dialects.pg_numbers``).
        normalized = dialects.normalize_url(url)
        return create_async_engine(
            normalized,
            connect_args={
                **dialects.pg_numbers(normalized),
                "server_settings": {"default_transaction_read_only": "on"},
            },
            pool_pre_ping=True,
        )
    raise ValueError(f"unsupported provider database {backend!r}")


#: The fake shop's tables the checker reads (:func:`_load_provider`), and two of ours.
SHOP_TABLES: frozenset[str] = frozenset(
    t.name for t in (shop.effects, shop.calls, shop.reservations, shop.charges)
)
OUR_TABLES: frozenset[str] = frozenset({transactions_table.name, ledger.name})


async def table_names(url: str) -> set[str]:
    """The tables of the database ``url`` names, read as the checker reads (read-only), so that
    a pair given the wrong way round can be told before a query fails on a missing table."""
    engine = _provider_engine(url)
    try:
        async with engine.connect() as conn:
            return await dialects.table_names(conn)
    finally:
        await engine.dispose()


def _decode(row: dict[str, Any], *names: str) -> dict[str, Any]:
    for name in names:
        if isinstance(row.get(name), str):
            # Unparsable text stays as it is: it is evidence as it stands.
            with contextlib.suppress(ValueError):
                row[name] = json.loads(row[name])
    return row


async def _load_provider(snap: Snapshot, engine: AsyncEngine, keyset: set[str] | None) -> None:
    async with engine.connect() as conn:
        snap.p_effects = [
            _decode(r, "payload", "result") for r in await _rows(conn, shop.effects, "key", keyset)
        ]
        snap.p_calls = await _rows(conn, shop.calls, "key", keyset)
        for r in await _rows(conn, shop.reservations, "key", keyset):
            snap.reservations[r["reservation_id"]] = r
        for r in await _rows(conn, shop.charges, "key", keyset):
            snap.charges[r["charge_id"]] = r


class EvidenceReader:
    """Both databases of one pair, open for as many snapshots as a run takes.

    Why: a snapshot on fresh connections opened a store (its engine, the schema check) and a
    provider engine, and compiled each of its dozen statements anew for each new engine.
    A random run checks after every schedule: on SQLite that was about a sixth of the run's
    CPU (``docs/fault-injection.md``, "Measured soak"). Each snapshot still reads in a
    transaction of its own, so it sees everything committed before it, as a fresh connection
    would.
    """

    def __init__(self, store: Store, provider: AsyncEngine) -> None:
        self._store = store
        self._provider = provider

    @classmethod
    async def open(cls, store_url: str, provider_url: str) -> EvidenceReader:
        """Open our store (never upgraded: the checker judges the schema it finds) and a
        read-only engine on the provider's database."""
        store = await Store.open(store_url, auto_upgrade="never")
        return cls(store, _provider_engine(provider_url))

    async def load(self, tx_ids: Collection[str] | None) -> Snapshot:
        """Read both databases; with ``tx_ids``, only those transactions and their keys."""
        snap = Snapshot(whole_provider=tx_ids is None)
        await _load_ours(snap, self._store, None if tx_ids is None else set(tx_ids))
        snap.index()
        await _load_provider(snap, self._provider, None if tx_ids is None else snap.our_keys())
        return snap

    async def close(self) -> None:
        """Close both; the reader is not used after."""
        try:
            await self._store.close()
        finally:
            await self._provider.dispose()


async def load(store_url: str, provider_url: str, tx_ids: Collection[str] | None) -> Snapshot:
    """Read both databases once, on connections opened for it and closed after; with
    ``tx_ids``, only those transactions and their keys."""
    reader = await EvidenceReader.open(store_url, provider_url)
    try:
        return await reader.load(tx_ids)
    finally:
        await reader.close()


def group(rows: Iterable[dict[str, Any]], column: str) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by one column's value."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[r[column]].append(r)
    return out


# -- judging text (invariant 9) -------------------------------------------------------------

#: Keys a stored error may carry (what orchestrator/driver.py writes, plus validation detail).
ERROR_KEYS = frozenset({"code", "step", "check", "reason", "failures"})
#: Reasons the fake provider gives (rejections, faults); none may reach a stored error.
PROVIDER_REASONS = frozenset(
    {
        "injected_rejection",
        "card_declined",
        "out_of_stock",
        "unknown_sku",
        "unknown_reservation",
        "already_released",
        "unknown_charge",
        "currency_mismatch",
        "over_refund",
        "invalid_payload",
        "voided",
        "lost_response",
        "http 503",
        "injected failure",
        "response lost",
    }
)
#: Our own short codes (decision errors of the protocol and driver): never a leak.
OUR_CODES = frozenset(
    {
        "budget_exhausted",
        "lookup_unavailable",
        "lookup_not_authoritative",
        "no_lookup_no_dedup",
        "dedup_window_expired",
        "idempotency_payload_mismatch",
        "payload_render_failed",
        "rejected",
        "unknown",
        "undecidable",
        "voided",
        "a compensation payload cannot be rendered",
    }
)
_EXCEPTION_NAME = re.compile(r"\b[A-Z][A-Za-z0-9]*(?:Error|Exception|Lost|Unavailable|Timeout)\b")
_SQL_OR_TRACE = re.compile(
    r"\b(?:SELECT|INSERT INTO|UPDATE|DELETE FROM)\b|\bWHERE\b|Traceback|SQLSTATE|sqlite3\.|"
    r"asyncpg\.|psycopg|\(Background on this error|File \""
)


def vocabulary() -> frozenset[str]:
    """Our own words: registered codes, protocol codes and the compensation policy's reasons."""
    reasons = {v for k, v in vars(policy).items() if k.startswith("REASON_") and isinstance(v, str)}
    return frozenset(REGISTRY) | OUR_CODES | reasons


def strings(value: Any) -> Iterable[str]:
    """Every string inside a JSON value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def leak(text: str, provider_texts: set[str], vocabulary: frozenset[str]) -> str | None:
    """What foreign text ``text`` carries (``None``: none). Exact words of ours never leak."""
    if text in vocabulary:
        return None
    for reason in sorted(provider_texts):
        if len(reason) >= 4 and reason in text:
            return f"provider text {reason!r}"
    if _EXCEPTION_NAME.search(text):
        return "an exception class name"
    if _SQL_OR_TRACE.search(text):
        return "SQL or traceback text"
    return None


def provider_texts_by_tx(snap: Snapshot) -> dict[str, set[str]]:
    """Reasons the provider gave under each transaction's keys (calls log and effects rows)."""
    texts: dict[str, set[str]] = defaultdict(lambda: set(PROVIDER_REASONS))
    for c in snap.p_calls:
        ref = snap.owners.get(c["key"])
        if ref is not None and ":" in c["outcome"]:
            texts[ref.tx_id].add(c["outcome"].split(":", 1)[1].strip())
    for e in snap.p_effects:
        ref = snap.owners.get(e["key"])
        if ref is not None and e["reason"]:
            texts[ref.tx_id].add(str(e["reason"]))
    return texts


# -- the shop's business state (invariant 3) ---------------------------------------------------

CHARGE = ("payments", "charge")


def business_reversal(
    snap: Snapshot, op: dict[str, Any], comp: dict[str, Any]
) -> tuple[str, Any] | None:
    """The shop's business tables must show the reversal, not only its answer."""
    action = (op["provider"], op["action"])
    if action == ("inventory", "reserve"):
        res = snap.reservations.get(str(op["remote_id"]))
        if res is None or res["released_by"] is None:
            return "the reservation still holds its stock", res
        if comp["remote_id"] is not None and res["released_by"] != comp["remote_id"]:
            return f"released by {res['released_by']}, not by {comp['remote_id']}", res
    if action == CHARGE:
        charge = snap.charges.get(str(op["remote_id"]))
        if charge is None or int(charge["refunded"]) != int(charge["amount"]):
            return "the charge is not fully refunded", charge
    return None  # other actions: no business table to compare with
