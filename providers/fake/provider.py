"""One fake remote service (``inventory``, ``payments`` or ``email``) over the shop database.

``apply`` runs in ONE shop-database transaction: fence check, payload check, idempotency cache
(replay, mismatch, void tombstone, forgotten key), then the business effect and its entry, and
the call-log row. Faults are layered around that transaction: FAIL_BEFORE and TIMEOUT with
``effect_first=False`` act before it; LOSE_RESPONSE, TIMEOUT and INDETERMINATE_5XX after it has
committed, which is exactly the situation the engine must survive.

Read-only actions (``inventory.stock``, ``payments.charges``) skip the idempotency cache: they
have no effect to remember, so they are answered fresh on every call and only logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from sqlalchemy.ext.asyncio import AsyncConnection

from providers.contract import (
    ActionContract,
    ApplyOutcome,
    Confirmed,
    FencedOut,
    Found,
    JsonObject,
    LookupOutcome,
    NotFound,
    Rejected,
    Unavailable,
    Unknown,
    UnknownAction,
)
from providers.fake.actions import ActionSpec, required_problem
from providers.fake.faults import (
    CallKind,
    FaultKind,
    FaultPlan,
    FaultRule,
    ProviderUnavailable,
    ResponseLost,
)
from providers.fake.store import EffectRecord, Store, canonical_json, sha256_hex

_APPLY_FAULTS = frozenset(
    {
        FaultKind.LOSE_RESPONSE,
        FaultKind.FAIL_BEFORE,
        FaultKind.REJECT,
        FaultKind.TIMEOUT,
        FaultKind.INDETERMINATE_5XX,
    }
)
_LOOKUP_FAULTS = frozenset({FaultKind.LOOKUP_UNAVAILABLE})
_FORGET = frozenset({FaultKind.FORGET_KEYS})
_HTTP_503 = "http 503"


@dataclass(frozen=True, slots=True)
class ShopContext:
    """What every provider of one shop shares: its database, fault plan and clock."""

    store: Store
    faults: FaultPlan
    clock: Callable[[], float]
    dedup_window_seconds: float


def _describe(outcome: ApplyOutcome) -> str:
    if isinstance(outcome, Confirmed):
        return "confirmed"
    if isinstance(outcome, Rejected):
        return f"rejected:{outcome.reason}"
    if isinstance(outcome, Unknown):
        return f"unknown:{outcome.reason}"
    return "fenced_out"


class FakeProvider:
    """A :class:`~providers.contract.Provider` whose effects live in the shop database."""

    def __init__(self, name: str, specs: Mapping[str, ActionSpec], ctx: ShopContext) -> None:
        self._name = name
        self._specs = dict(specs)
        self._contracts = MappingProxyType({a: s.contract for a, s in self._specs.items()})
        self._ctx = ctx

    @property
    def name(self) -> str:
        """The provider's name (``inventory``, ``payments``, ``email``)."""
        return self._name

    def contract(self, action: str) -> ActionContract:
        """The contract of ``action``; raises :class:`UnknownAction` if there is none."""
        return self._spec(action).contract

    def actions(self) -> Mapping[str, ActionContract]:
        """Every action this provider offers."""
        return self._contracts

    def _spec(self, action: str) -> ActionSpec:
        try:
            return self._specs[action]
        except KeyError:
            offered = ", ".join(sorted(self._specs))
            raise UnknownAction(
                f"provider {self._name!r} has no action {action!r} (it offers: {offered})"
            ) from None

    def __repr__(self) -> str:
        return f"FakeProvider({self._name!r}, actions={sorted(self._specs)!r})"

    # -- apply --------------------------------------------------------------------------------

    async def apply(
        self, action: str, *, key: str, payload: JsonObject, fence: int
    ) -> ApplyOutcome:
        """Perform ``action`` at most once for ``key``, with the fault plan's interference."""
        spec = self._spec(action)
        ctx = self._ctx
        fault = ctx.faults.match("apply", self._name, action, key, kinds=_APPLY_FAULTS)
        kind = None if fault is None else fault.kind
        if kind is FaultKind.FAIL_BEFORE:

            async def log_refusal(conn: AsyncConnection) -> None:
                await self._log(conn, "apply", action, key, fence, "unavailable", kind, False)

            await ctx.store.call(None, None, log_refusal)
            raise ProviderUnavailable(f"{self._name}.{action}: injected failure before apply")
        if fault is not None and kind is FaultKind.TIMEOUT and not fault.effect_first:
            # The request is "in flight" and has not reached the provider: if the caller gives
            # up now, nothing happened and nothing is logged.
            await asyncio.sleep(fault.delay_s)

        async def apply_and_log(conn: AsyncConnection) -> ApplyOutcome:
            outcome, created = await self._apply_in_txn(conn, spec, key, payload, fence, fault)
            seen = outcome
            if kind is FaultKind.INDETERMINATE_5XX:
                seen = Unknown(_HTTP_503)
            if isinstance(outcome, FencedOut):
                # The log records what the provider decided; the fault column says what then
                # became of the answer. A refused stale fence must never read as applied.
                answer = "fenced_out"
            elif kind is FaultKind.LOSE_RESPONSE:
                answer = "lost_response"
            elif isinstance(seen, Confirmed) and not created and not spec.contract.read_only:
                answer = "replayed"
            else:
                answer = _describe(seen)
            await self._log(conn, "apply", action, key, fence, answer, kind, created)
            return seen

        # Once the request has reached the shop, the caller's giving up does not cut it short.
        seen = await ctx.store.call(self._name, key, apply_and_log)
        if kind is FaultKind.LOSE_RESPONSE:
            raise ResponseLost(f"{self._name}.{action}: response lost after the call committed")
        if fault is not None and kind is FaultKind.TIMEOUT and fault.effect_first:
            await asyncio.sleep(fault.delay_s)
        return seen

    async def _apply_in_txn(
        self,
        conn: AsyncConnection,
        spec: ActionSpec,
        key: str,
        payload: JsonObject,
        fence: int,
        fault: FaultRule | None,
    ) -> tuple[ApplyOutcome, bool]:
        """The provider's decision for one apply; returns it and whether an effect was created."""
        ctx, contract = self._ctx, spec.contract
        if contract.supports_fencing:
            highest = await ctx.store.check_fence(conn, self._name, key, fence)
            if highest is not None:
                return FencedOut(highest), False

        problem = self._payload_problem(spec, payload)
        if problem is not None:
            return Rejected(f"invalid_payload: {problem}"), False
        if contract.read_only:
            return await self._read(conn, spec, key, payload, fault), False
        payload_text = canonical_json(dict(payload))
        sha = sha256_hex(payload_text)

        entry = await self._remembered(conn, "apply", contract.name, key)
        if entry is not None:
            return self._replay(entry, contract.name, sha), False

        now = ctx.clock()
        entry_values = {
            "provider": self._name,
            "key": key,
            "action": contract.name,
            "payload": payload_text,
            "payload_sha256": sha,
            "created_at": now,
        }
        if fault is not None and fault.kind is FaultKind.INDETERMINATE_5XX and not fault.applied:
            return Unknown(_HTTP_503), False
        if fault is not None and fault.kind is FaultKind.REJECT:
            decided: Confirmed | Rejected = Rejected("injected_rejection")
        else:
            decided = await spec.perform(conn, key, payload)
        if isinstance(decided, Confirmed):
            await ctx.store.insert_entry(
                conn,
                **entry_values,
                status="applied",
                remote_id=decided.remote_id,
                result=canonical_json(dict(decided.result)),
            )
            return decided, True
        # A definite rejection is remembered: Rejected promises this key will never take effect,
        # so a retry with the same key must not succeed later (after a restock, say).
        await ctx.store.insert_entry(conn, **entry_values, status="rejected", reason=decided.reason)
        return decided, False

    @staticmethod
    async def _read(
        conn: AsyncConnection,
        spec: ActionSpec,
        key: str,
        payload: JsonObject,
        fault: FaultRule | None,
    ) -> ApplyOutcome:
        """A read-only action: answered from the business tables, with no idempotency entry.

        A read has no effect to remember, so the key is not recorded: a later read with the same
        key reads again (and sees what changed since). Faults still apply, so a query step can be
        made to fail like any call.
        """
        if fault is not None and fault.kind is FaultKind.INDETERMINATE_5XX and not fault.applied:
            return Unknown(_HTTP_503)
        if fault is not None and fault.kind is FaultKind.REJECT:
            return Rejected("injected_rejection")
        return await spec.perform(conn, key, payload)

    @staticmethod
    def _payload_problem(spec: ActionSpec, payload: object) -> str | None:
        if not isinstance(payload, Mapping) or not all(isinstance(k, str) for k in payload):
            return "payload must be a JSON object"
        missing = required_problem(spec.contract, payload)
        if missing is not None:
            return missing
        try:
            canonical_json(dict(payload))
        except (TypeError, ValueError) as exc:
            return f"payload is not JSON: {exc}"
        return spec.validate(payload)

    @staticmethod
    def _replay(entry: EffectRecord, action: str, sha: str) -> ApplyOutcome:
        # A tombstone refuses whatever payload the late original carries.
        if entry.status == "voided":
            return Rejected("voided")
        if entry.action != action or entry.payload_sha256 != sha:
            return Rejected("idempotency_payload_mismatch")
        if entry.status == "rejected":
            return Rejected(entry.reason or "rejected")
        assert entry.remote_id is not None  # a CHECK constraint guarantees it
        return Confirmed(entry.remote_id, entry.result or {})

    async def _remembered(
        self, conn: AsyncConnection, call: CallKind, action: str, key: str
    ) -> EffectRecord | None:
        """The cache entry for ``key``, unless FORGET_KEYS prunes it for being too old."""
        ctx = self._ctx
        entry = await ctx.store.live_entry(conn, self._name, key)
        if entry is None:
            return None
        age = ctx.clock() - entry.created_at
        if age > ctx.dedup_window_seconds and ctx.faults.match(
            call, self._name, action, key, kinds=_FORGET
        ):
            await ctx.store.forget(conn, entry.seq, ctx.clock())
            return None
        return entry

    # -- lookup -------------------------------------------------------------------------------

    async def lookup(
        self, action: str, *, key: str, payload: JsonObject, void_if_missing: bool = False
    ) -> LookupOutcome:
        """What became of an earlier apply with ``key``; may leave a void tombstone."""
        spec = self._spec(action)
        ctx = self._ctx
        fault = ctx.faults.match("lookup", self._name, action, key, kinds=_LOOKUP_FAULTS)
        if fault is not None:
            refused = fault.kind

            async def log_refusal(conn: AsyncConnection) -> None:
                await self._log(conn, "lookup", action, key, None, "unavailable", refused, False)

            await ctx.store.call(None, None, log_refusal)
            return Unavailable("injected")

        async def look_up_and_log(conn: AsyncConnection) -> LookupOutcome:
            outcome = await self._lookup_in_txn(conn, spec, key, payload, void_if_missing)
            if isinstance(outcome, Found):
                answer = "found"
            else:
                answer = "voided" if outcome.voided else "not_found"
            await self._log(conn, "lookup", action, key, None, answer, None, False)
            return outcome

        return await ctx.store.call(self._name, key, look_up_and_log)

    async def _lookup_in_txn(
        self,
        conn: AsyncConnection,
        spec: ActionSpec,
        key: str,
        payload: JsonObject,
        void_if_missing: bool,
    ) -> Found | NotFound:
        contract = spec.contract
        entry = await self._remembered(conn, "lookup", contract.name, key)
        if entry is not None:
            if entry.action != contract.name:
                # The key belongs to another action: nothing of this one happened, and an apply
                # of this action with the key would be refused as a mismatch, but we wrote no
                # tombstone, so we do not claim one.
                return NotFound(voided=False)
            if entry.status == "applied" and entry.remote_id is not None:
                return Found(entry.remote_id, entry.result or {})
            # A tombstone or a remembered rejection: a late original will be refused.
            return NotFound(voided=True)
        if not (void_if_missing and contract.supports_void):
            return NotFound(voided=False)
        try:
            payload_text = canonical_json(dict(payload))
        except (TypeError, ValueError):
            payload_text = "{}"
        await self._ctx.store.insert_entry(
            conn,
            provider=self._name,
            key=key,
            action=contract.name,
            payload=payload_text,
            payload_sha256=sha256_hex(payload_text),
            status="voided",
            created_at=self._ctx.clock(),
        )
        return NotFound(voided=True)

    async def _log(
        self,
        conn: AsyncConnection,
        call: CallKind,
        action: str,
        key: str,
        fence: int | None,
        outcome: str,
        fault: FaultKind | None,
        created_effect: bool,
    ) -> None:
        await self._ctx.store.log_call(
            conn,
            call=call,
            provider=self._name,
            action=action,
            key=key,
            fence=fence,
            outcome=outcome,
            fault=None if fault is None else fault.value,
            created_effect=created_effect,
            at=self._ctx.clock(),
        )


__all__ = ["FakeProvider", "ShopContext"]
