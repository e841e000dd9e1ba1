"""An in-memory shop: inventory, payments and email over plain dicts, no database.

It offers the fake shop's actions with the *same contracts and payload checks* (taken from
:mod:`providers.fake.actions`), the same key + payload dedup (a replay answers the first result;
another payload under a used key is refused), the same lookup (with void tombstones), the same
fencing (highest fence per key) and the same read-only query actions (``inventory.stock``,
``payments.charges``: answered fresh, never remembered). What it leaves out is what costs time:
no database, no call log, no fault plan. The benchmark uses it to measure the engine alone; the
fault-injection suite keeps using the fake shop, whose effects survive a crash of this process.

Everything runs on one event loop without awaiting inside a decision, so each apply or lookup is
atomic with respect to the other coroutines: no lock is needed.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from random import getrandbits
from types import MappingProxyType
from typing import Any

from providers.contract import (
    ActionContract,
    ApplyOutcome,
    Confirmed,
    FencedOut,
    Found,
    JsonObject,
    LookupOutcome,
    NotFound,
    Provider,
    Rejected,
    UnknownAction,
)
from providers.fake.actions import (
    build_specs,
    charge_item,
    charges_answer,
    required_problem,
    stock_answer,
)
from providers.fake.shop import COUNTED_ACTIONS

# The fake shop's canonical form, so both providers judge "same payload" identically.
from providers.fake.store import canonical_json as _canonical

Business = Callable[[str, JsonObject], Confirmed | Rejected]


def _new_id(prefix: str) -> str:
    """A remote id: 20 random hex digits (80 bits) after ``prefix``.

    From :mod:`random`'s generator (seeded from the OS, and afresh in a forked child), not
    ``os.urandom``: an in-memory provider's ids need to be unique, not unguessable, and the
    system call was 1.2 % of a saga's samples through this provider (``docs/benchmarks-log.md``,
    item 43)."""
    return f"{prefix}_{getrandbits(80):020x}"


@dataclass(slots=True)
class _Entry:
    """What the provider remembers about one key (the fake shop's ``effects`` row)."""

    action: str
    payload_sha256: str
    status: str  # applied | rejected | voided
    remote_id: str | None = None
    result: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None


@dataclass
class _Books:
    """The business state every provider of one shop shares."""

    stock: dict[str, int] = field(default_factory=dict)
    #: reservation_id -> (sku, quantity, released_by)
    reservations: dict[str, list[Any]] = field(default_factory=dict)
    #: charge_id -> {"amount", "currency", "refunded", "order_id"} (insertion = creation order)
    charges: dict[str, dict[str, Any]] = field(default_factory=dict)
    emails: list[dict[str, Any]] = field(default_factory=list)
    #: Applied effects per ``provider.action`` (replays not counted): the bench's checker.
    applied: Counter[str] = field(default_factory=Counter)
    #: Effects applied per (provider, key); more than one would break at-most-once.
    per_key: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: apply + lookup calls that reached a provider.
    calls: int = 0


class MemoryProvider:
    """A :class:`~providers.contract.Provider` whose effects live in a :class:`MemoryShop`."""

    def __init__(
        self,
        name: str,
        contracts: Mapping[str, ActionContract],
        validators: Mapping[str, Callable[[JsonObject], str | None]],
        business: Mapping[str, Business],
        books: _Books,
    ) -> None:
        self._name = name
        self._contracts = MappingProxyType(dict(contracts))
        self._validators = dict(validators)
        self._business = dict(business)
        self._books = books
        self._entries: dict[str, _Entry] = {}
        self._fences: dict[str, int] = {}

    @property
    def name(self) -> str:
        """The provider's name (``inventory``, ``payments``, ``email``)."""
        return self._name

    def contract(self, action: str) -> ActionContract:
        """The contract of ``action``; raises :class:`UnknownAction` if there is none."""
        try:
            return self._contracts[action]
        except KeyError:
            offered = ", ".join(sorted(self._contracts))
            raise UnknownAction(
                f"provider {self._name!r} has no action {action!r} (it offers: {offered})"
            ) from None

    def actions(self) -> Mapping[str, ActionContract]:
        """Every action this provider offers."""
        return self._contracts

    def __repr__(self) -> str:
        return f"MemoryProvider({self._name!r}, actions={sorted(self._contracts)!r})"

    async def apply(
        self, action: str, *, key: str, payload: JsonObject, fence: int
    ) -> ApplyOutcome:
        """Perform ``action`` at most once for ``key`` (fence, payload, dedup, effect)."""
        contract = self.contract(action)
        self._books.calls += 1
        if contract.supports_fencing:
            highest = self._fences.get(key)
            if highest is not None and fence < highest:
                return FencedOut(highest)
            self._fences[key] = fence if highest is None else max(highest, fence)
        problem, text = self._payload_problem(contract, payload)
        if problem is not None:
            return Rejected(f"invalid_payload: {problem}")
        if contract.read_only:
            # A read has no effect to remember: no entry, no counters, a fresh answer each time.
            return self._business[action](key, payload)
        sha = hashlib.sha256(text.encode()).hexdigest()
        entry = self._entries.get(key)
        if entry is not None:
            return _replay(entry, action, sha)
        decided = self._business[action](key, payload)
        if isinstance(decided, Confirmed):
            self._entries[key] = _Entry(
                action, sha, "applied", decided.remote_id, dict(decided.result)
            )
            self._books.applied[f"{self._name}.{action}"] += 1
            self._books.per_key[(self._name, key)] += 1
        else:
            # Rejected promises the key never takes effect: remember it, as the fake shop does.
            self._entries[key] = _Entry(action, sha, "rejected", reason=decided.reason)
        return decided

    def _payload_problem(self, contract: ActionContract, payload: object) -> tuple[str | None, str]:
        """What is wrong with ``payload`` (``None``: nothing) and its canonical text (encoded
        once: the check and the fingerprint both need it)."""
        if not isinstance(payload, Mapping) or not all(isinstance(k, str) for k in payload):
            return "payload must be a JSON object", ""
        missing = required_problem(contract, payload)
        if missing is not None:
            return missing, ""
        try:
            text = _canonical(dict(payload))
        except (TypeError, ValueError) as exc:
            return f"payload is not JSON: {exc}", ""
        return self._validators[contract.name](payload), text

    async def lookup(
        self, action: str, *, key: str, payload: JsonObject, void_if_missing: bool = False
    ) -> LookupOutcome:
        """What became of an earlier apply with ``key``; may leave a void tombstone."""
        contract = self.contract(action)
        self._books.calls += 1
        entry = self._entries.get(key)
        if entry is not None:
            if entry.action != action:
                return NotFound(voided=False)
            if entry.status == "applied" and entry.remote_id is not None:
                return Found(entry.remote_id, entry.result)
            return NotFound(voided=True)
        if not (void_if_missing and contract.supports_void):
            return NotFound(voided=False)
        try:
            sha = hashlib.sha256(_canonical(dict(payload)).encode()).hexdigest()
        except (TypeError, ValueError):
            sha = ""
        self._entries[key] = _Entry(action, sha, "voided")
        return NotFound(voided=True)


def _replay(entry: _Entry, action: str, sha: str) -> ApplyOutcome:
    if entry.status == "voided":
        return Rejected("voided")
    if entry.action != action or entry.payload_sha256 != sha:
        return Rejected("idempotency_payload_mismatch")
    if entry.status == "rejected":
        return Rejected(entry.reason or "rejected")
    assert entry.remote_id is not None
    return Confirmed(entry.remote_id, entry.result)


class MemoryShop:
    """Three in-memory providers over shared books; :meth:`counts` is the effect counter."""

    def __init__(self, dedup_window_seconds: float = 86400.0) -> None:
        self._books = _Books()
        specs = build_specs(dedup_window_seconds)
        b = self._books

        def reserve(key: str, payload: JsonObject) -> Confirmed | Rejected:
            sku, quantity = str(payload["sku"]), int(payload["quantity"])
            if sku not in b.stock:
                return Rejected("unknown_sku")
            if b.stock[sku] < quantity:
                return Rejected("out_of_stock")
            b.stock[sku] -= quantity
            rid = _new_id("res")
            b.reservations[rid] = [sku, quantity, None]
            return Confirmed(rid, {"reservation_id": rid, "sku": sku, "quantity": quantity})

        def release(key: str, payload: JsonObject) -> Confirmed | Rejected:
            rid = str(payload["reservation_id"])
            held = b.reservations.get(rid)
            if held is None:
                return Rejected("unknown_reservation")
            if held[2] is not None:
                return Rejected("already_released")
            release_id = _new_id("rel")
            held[2] = release_id
            b.stock[held[0]] += held[1]
            return Confirmed(release_id, {"release_id": release_id, "reservation_id": rid})

        def charge(key: str, payload: JsonObject) -> Confirmed | Rejected:
            if payload.get("card") == "declined":
                return Rejected("card_declined")
            cid = _new_id("ch")
            amount, currency = int(payload["amount"]), str(payload["currency"])
            b.charges[cid] = {
                "amount": amount,
                "currency": currency,
                "refunded": 0,
                "order_id": payload.get("order_id"),
            }
            return Confirmed(cid, {"charge_id": cid, "amount": amount, "currency": currency})

        def refund(key: str, payload: JsonObject) -> Confirmed | Rejected:
            cid, amount = str(payload["charge_id"]), int(payload["amount"])
            held = b.charges.get(cid)
            if held is None:
                return Rejected("unknown_charge")
            currency = payload.get("currency")
            if currency is not None and currency != held["currency"]:
                return Rejected("currency_mismatch")
            if held["refunded"] + amount > held["amount"]:
                return Rejected("over_refund")
            held["refunded"] += amount
            refund_id = _new_id("re")
            return Confirmed(
                refund_id, {"refund_id": refund_id, "charge_id": cid, "amount": amount}
            )

        def send(key: str, payload: JsonObject) -> Confirmed | Rejected:
            mid = _new_id("msg")
            b.emails.append({"message_id": mid, "key": key, "to": str(payload["to"])})
            return Confirmed(mid, {"message_id": mid})

        def stock(key: str, payload: JsonObject) -> Confirmed | Rejected:
            sku = str(payload["sku"])
            return stock_answer(sku, b.stock.get(sku))

        def charges(key: str, payload: JsonObject) -> Confirmed | Rejected:
            wanted = payload.get("order_id")
            items = [
                charge_item(cid, c["order_id"], c["amount"], c["currency"], c["refunded"])
                for cid, c in b.charges.items()
                if wanted is None or c["order_id"] == wanted
            ]
            return charges_answer(None if wanted is None else str(wanted), items)

        business: dict[str, dict[str, Business]] = {
            "inventory": {"reserve": reserve, "release": release, "stock": stock},
            "payments": {"charge": charge, "refund": refund, "charges": charges},
            "email": {"send": send},
        }

        def make(name: str) -> MemoryProvider:
            return MemoryProvider(
                name,
                {a: s.contract for a, s in specs[name].items()},
                {a: s.validate for a, s in specs[name].items()},
                business[name],
                b,
            )

        self.inventory = make("inventory")
        self.payments = make("payments")
        self.email = make("email")

    def providers(self) -> list[Provider]:
        """The three providers, ready for a :class:`~providers.registry.ProviderRegistry`."""
        return [self.inventory, self.payments, self.email]

    def seed_stock(self, levels: Mapping[str, int]) -> None:
        """Set the available stock of each SKU."""
        for sku, available in levels.items():
            if available < 0:
                raise ValueError(f"stock of {sku!r} cannot be negative")
            self._books.stock[sku] = available

    def stock(self, sku: str) -> int:
        """Units of ``sku`` available now; raises :class:`KeyError` for an unknown SKU."""
        return self._books.stock[sku]

    def counts(self) -> dict[str, int]:
        """Applied effects per ``provider.action`` (the fake shop's counters, same keys)."""
        return {name: self._books.applied.get(name, 0) for name in COUNTED_ACTIONS}

    def duplicate_keys(self) -> list[tuple[str, str]]:
        """(provider, key) pairs that took effect more than once (empty when at-most-once held)."""
        return [k for k, n in self._books.per_key.items() if n > 1]

    @property
    def calls(self) -> int:
        """apply + lookup calls received so far."""
        return self._books.calls


__all__ = ["MemoryProvider", "MemoryShop"]
