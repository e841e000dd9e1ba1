"""The invariant checker: what DESIGN.md promises, judged on both databases after a run.

:func:`check_invariants` reads our store and the fake provider's database (read-only, never
through the provider's ``apply``/``lookup``) and returns every :class:`Violation` with the
transaction, the rows that prove it and an excerpt of that transaction's ledger. Effect counts
come from the provider's own tables, never from our bookkeeping. The numbers are those of
DESIGN.md "Invariants":

1. ``double_effect`` / ``double_charge`` — at most one applied provider effect per
   (provider, key), forgotten cache entries included; per business intent (business key, else
   tx id) at most one ``payments.charge`` that is not fully refunded.
2. ``in_flight`` / ``effect_in_flight`` — (``require_settled``) every transaction committed,
   compensated, failed or manual_review; no effect left pending / executing / unknown.
3. ``committed_op_not_confirmed``, ``unbacked_confirmation``, ``reversal_missing``,
   ``reversal_not_at_provider``, ``reversal_not_in_business_state``,
   ``irreversible_in_compensated``, ``failed_with_effect`` — each terminal status is
   proved by the provider's rows.
4. ``outbox_before_commit`` / ``outbox_without_event`` / ``outbox_sent_twice`` /
   ``outbox_claimed_before_commit`` — nothing of the outbox is observable before the commit.
5. ``resend_without_lookup`` (provider log) / ``ledger_resend_without_lookup`` (our ledger).
6. ``stale_fence_applied`` (provider log) / ``ledger_fence_regressed`` /
   ``ledger_fence_mismatch`` (our ledger).
7. ``ledger_verify`` / ``append_only_not_enforced``.
8. ``payload_mismatch_reached_provider`` / ``payload_fingerprint_differs``.
9. ``error_leak`` — stored errors are closed envelopes of registered codes with no provider,
   exception or SQL text.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from fault_injection._evidence import (
    CHARGE,
    ERROR_KEYS,
    FAKE_PROVIDERS,
    OPERATION,
    OUTBOX,
    Snapshot,
    business_reversal,
    call_json,
    effect_json,
    entry_json,
    group,
    leak,
    load,
    ours_json,
    provider_texts_by_tx,
    strings,
    vocabulary,
)
from ledger.events import LedgerEntry
from ledger.states import EffectState, TxState
from orchestrator.errors import REGISTRY

SETTLED = frozenset({TxState.COMMITTED, TxState.COMPENSATED, TxState.FAILED, TxState.MANUAL_REVIEW})
#: Statuses that legitimately keep never-reached effects ``pending``.
PARKED = frozenset({TxState.MANUAL_REVIEW.value, TxState.STAGED.value})
IN_FLIGHT_EFFECT = frozenset({EffectState.EXECUTING.value, EffectState.UNKNOWN.value})
MAYBE_SENT = frozenset({EffectState.EXECUTING.value, EffectState.UNKNOWN.value})
#: Provider actions whose effects are notifications (outbox-only by the saga shape rule).
NOTIFY_ACTIONS = frozenset({("email", "send")})


@dataclass(frozen=True)
class Violation:
    """One broken invariant, with the rows that prove it."""

    invariant: int  # 1..9 as numbered in DESIGN.md "Invariants"
    name: str  # short slug, e.g. "double_effect", "in_flight", "resend_without_lookup"
    tx_id: str | None
    message: str
    evidence: dict[str, Any]  # the rows that prove it (JSON-able)
    ledger_excerpt: list[dict[str, Any]]  # that tx's ledger rows (last 20), JSON-able

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "invariant": self.invariant,
            "name": self.name,
            "tx_id": self.tx_id,
            "message": self.message,
            "evidence": self.evidence,
            "ledger_excerpt": self.ledger_excerpt,
        }


@dataclass(frozen=True)
class CheckReport:
    """The outcome of one check: every violation and how much was looked at."""

    violations: list[Violation]
    transactions: int
    effects: int  # provider ``effects`` rows examined
    ledger_rows: int

    @property
    def ok(self) -> bool:
        """No invariant is broken."""
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        """JSON form, with a count per invariant."""
        by: dict[str, int] = defaultdict(int)
        for v in self.violations:
            by[str(v.invariant)] += 1
        return {
            "ok": self.ok,
            "transactions": self.transactions,
            "effects": self.effects,
            "ledger_rows": self.ledger_rows,
            "by_invariant": dict(sorted(by.items())),
            "violations": [v.to_json() for v in self.violations],
        }


class _Out:
    """Collects violations, attaching the ledger excerpt of their transaction."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self.items: list[Violation] = []

    def add(self, n: int, name: str, tx_id: str | None, message: str, **evidence: Any) -> None:
        self.items.append(Violation(n, name, tx_id, message, evidence, self.snap.excerpt(tx_id)))


def _tx_of(snap: Snapshot, key: str) -> str | None:
    ref = snap.owners.get(key)
    return ref.tx_id if ref else None


# -- 1 ----------------------------------------------------------------------------------------


def check_1_at_most_one_effect(snap: Snapshot, out: _Out) -> None:
    """One applied effect per (provider, key); one unrefunded charge per business intent."""
    per_key: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for e in snap.p_effects:
        if e["status"] == "applied":
            per_key[(e["provider"], e["key"])].append(e)
    for (provider, key), rows in per_key.items():
        if len(rows) > 1:
            out.add(
                1,
                "double_effect",
                _tx_of(snap, key),
                f"{len(rows)} applied {provider} effects for key {key}",
                key=key,
                provider=provider,
                count=len(rows),
                effects=[effect_json(e) for e in rows],
            )
    intents: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for (provider, key), rows in per_key.items():
        ref = snap.owners.get(key)
        if ref is None or ref.kind != OPERATION or ref.row is None:
            continue
        if (provider, str(ref.row["action"])) != CHARGE:
            continue
        tx = snap.txs[ref.tx_id]
        for e in rows:
            charge = snap.charges.get(str(e["remote_id"]))
            # A fully refunded charge belongs to a retired attempt (compensated): a retry of the
            # same business intent may charge again, so only live money counts.
            if charge is not None and int(charge["refunded"]) >= int(charge["amount"]):
                continue
            intents[tx["business_key"] or tx["tx_id"]].append((ref.tx_id, e))
    for intent, charged in intents.items():
        if len(charged) > 1:
            out.add(
                1,
                "double_charge",
                charged[-1][0],
                f"business intent {intent} holds {len(charged)} unrefunded charges",
                business_intent=intent,
                count=len(charged),
                charges=[
                    {"tx_id": t, **effect_json(e), "charge": snap.charges.get(str(e["remote_id"]))}
                    for t, e in charged
                ],
            )


# -- 2 ----------------------------------------------------------------------------------------


def check_2_settled(snap: Snapshot, out: _Out) -> None:
    """Nothing in flight once the workers have drained."""
    settled = {s.value for s in SETTLED} | {TxState.STAGED.value}
    for tx_id, tx in snap.txs.items():
        if tx["status"] not in settled:
            out.add(
                2,
                "in_flight",
                tx_id,
                f"transaction {tx_id} is still {tx['status']}",
                status=tx["status"],
                lease_owner=tx["lease_owner"],
                lease_until=tx["lease_until"],
                fence=tx["fence"],
                next_attempt_at=tx["next_attempt_at"],
            )
    for row in [*snap.ops, *snap.comps, *snap.events]:
        status = snap.txs[row["tx_id"]]["status"]
        parked_pending = row["state"] == EffectState.PENDING.value and status in PARKED
        if row["state"] in IN_FLIGHT_EFFECT or (
            row["state"] == EffectState.PENDING.value and not parked_pending
        ):
            out.add(
                2,
                "effect_in_flight",
                row["tx_id"],
                f"effect {row.get('op_key') or row.get('event_key')} is still {row['state']}"
                f" (transaction {status})",
                effect=ours_json(row),
                tx_status=status,
            )


# -- 3 ----------------------------------------------------------------------------------------


def _compensated_steps(snap: Snapshot, tx: dict[str, Any]) -> dict[str, bool]:
    definition = snap.definitions.get(tx["definition_digest"], {})
    return {str(s["name"]): bool(s.get("compensation")) for s in definition.get("steps", [])}


def check_3_outcomes_proved(snap: Snapshot, out: _Out) -> None:
    """committed / compensated / failed are each proved by the provider's own rows."""
    ops, comps = group(snap.ops, "tx_id"), group(snap.comps, "tx_id")
    for row in [*snap.ops, *snap.comps, *snap.events]:
        key = row.get("op_key") or row["event_key"]
        if row["state"] != EffectState.CONFIRMED.value or row["provider"] not in FAKE_PROVIDERS:
            continue
        if snap.operator_resolved(row["tx_id"], key):
            continue  # an operator's decision is evidence by design
        applied = snap.applied(key, row["provider"])
        if not any(e["remote_id"] == row["remote_id"] for e in applied):
            out.add(
                3,
                "unbacked_confirmation",
                row["tx_id"],
                f"we hold {key} confirmed as {row['remote_id']}; the provider has no such effect",
                ours=ours_json(row),
                provider_effects=[effect_json(e) for e in applied],
            )
    for tx_id, tx in snap.txs.items():
        status = tx["status"]
        mine = ops.get(tx_id, [])
        if status == TxState.COMMITTED.value:
            for op in mine:
                if op["state"] != EffectState.CONFIRMED.value:
                    out.add(
                        3,
                        "committed_op_not_confirmed",
                        tx_id,
                        f"committed, but op {op['step']} is {op['state']}",
                        op=ours_json(op),
                    )
        if status == TxState.COMPENSATED.value:
            _check_compensated(snap, out, tx, mine, comps.get(tx_id, []))
        if status in (TxState.COMPENSATED.value, TxState.FAILED.value):
            for op in mine:
                if status == TxState.FAILED.value and op["state"] == EffectState.CONFIRMED.value:
                    out.add(
                        3,
                        "failed_with_effect",
                        tx_id,
                        f"failed, but op {op['step']} is confirmed",
                        op=ours_json(op),
                    )
                elif op["state"] != EffectState.CONFIRMED.value:
                    applied = snap.applied(op["op_key"], op["provider"])
                    if applied:
                        out.add(
                            3,
                            "failed_with_effect",
                            tx_id,
                            f"{status}, op {op['step']} is {op['state']}, yet the provider holds"
                            f" {len(applied)} applied effect(s) for it (nothing reverses them)",
                            op=ours_json(op),
                            provider_effects=[effect_json(e) for e in applied],
                        )


def _check_compensated(
    snap: Snapshot,
    out: _Out,
    tx: dict[str, Any],
    ops: list[dict[str, Any]],
    comps: list[dict[str, Any]],
) -> None:
    tx_id = tx["tx_id"]
    reversible = _compensated_steps(snap, tx)
    by_forward = group(comps, "forward_op_key")
    for op in ops:
        if op["state"] != EffectState.CONFIRMED.value:
            continue
        if not reversible.get(op["step"], False):
            out.add(
                3,
                "irreversible_in_compensated",
                tx_id,
                f"compensated, but confirmed op {op['step']} has no compensation",
                op=ours_json(op),
            )
            continue
        mine = by_forward.get(op["op_key"], [])
        confirmed = [c for c in mine if c["state"] == EffectState.CONFIRMED.value]
        if len(confirmed) != 1:
            out.add(
                3,
                "reversal_missing",
                tx_id,
                f"op {op['step']} has {len(confirmed)} confirmed reversals (want exactly 1)",
                op=ours_json(op),
                reversals=[ours_json(c) for c in mine],
            )
            continue
        comp = confirmed[0]
        if snap.operator_resolved(tx_id, comp["op_key"]):
            continue  # an operator said it was reversed (perhaps out of band): their call
        applied = snap.applied(comp["op_key"], comp["provider"])
        if len(applied) != 1 and comp["provider"] in FAKE_PROVIDERS:
            out.add(
                3,
                "reversal_not_at_provider",
                tx_id,
                f"reversal {comp['op_key']} of {op['step']}: {len(applied)} applied provider"
                " effects (want exactly 1)",
                reversal=ours_json(comp),
                provider_effects=[effect_json(e) for e in applied],
            )
        problem = business_reversal(snap, op, comp)
        if problem is not None:
            out.add(
                3,
                "reversal_not_in_business_state",
                tx_id,
                f"reversal of {op['step']} answered success, the provider's state disagrees:"
                f" {problem[0]}",
                op=ours_json(op),
                reversal=ours_json(comp),
                business_row=problem[1],
            )


# -- 4 ----------------------------------------------------------------------------------------


def check_4_outbox_after_commit(snap: Snapshot, out: _Out) -> None:
    """No outbox effect before the commit; each event sent at most once."""
    for e in snap.p_effects:
        if e["status"] != "applied":
            continue
        ref = snap.owners.get(e["key"])
        if ref is not None and ref.kind == OUTBOX:
            status = snap.txs[ref.tx_id]["status"]
            if status != TxState.COMMITTED.value:
                out.add(
                    4,
                    "outbox_before_commit",
                    ref.tx_id,
                    f"outbox effect {e['key']} exists, transaction {ref.tx_id} is {status}",
                    effect=effect_json(e),
                    tx_status=status,
                    outbox_row=None if ref.row is None else ours_json(ref.row),
                )
            elif ref.row is None:
                out.add(
                    4,
                    "outbox_without_event",
                    ref.tx_id,
                    f"outbox effect {e['key']} has no outbox row",
                    effect=effect_json(e),
                )
        elif ref is None and snap.whole_provider and (e["provider"], e["action"]) in NOTIFY_ACTIONS:
            out.add(
                4,
                "outbox_without_event",
                None,
                f"{e['provider']}.{e['action']} effect {e['key']} matches no outbox event",
                effect=effect_json(e),
            )
    for ev in snap.events:
        applied = snap.applied(ev["event_key"])
        if len(applied) > 1:
            out.add(
                4,
                "outbox_sent_twice",
                ev["tx_id"],
                f"outbox event {ev['kind']} sent {len(applied)} times",
                event=ours_json(ev),
                provider_effects=[effect_json(e) for e in applied],
            )
    _check_outbox_ledger_order(snap, out)


def _check_outbox_ledger_order(snap: Snapshot, out: _Out) -> None:
    for tx_id, rows in group(snap.events, "tx_id").items():
        entries = snap.ledger.get(tx_id, [])
        commit = next(
            (e for e in entries if e.subject is None and e.to_state == TxState.COMMITTED.value),
            None,
        )
        for ev in rows:
            # The plan row comes first and the claim after it; both must follow the commit.
            early = [
                e
                for e in entries
                if e.subject == ev["event_key"]
                and e.action in ("plan", "claim")
                and (commit is None or e.seq < commit.seq)
            ]
            if early:
                out.add(
                    4,
                    "outbox_claimed_before_commit",
                    tx_id,
                    f"outbox event {ev['kind']} appears in the ledger before the commit",
                    commit=None if commit is None else entry_json(commit),
                    early_rows=[entry_json(e) for e in early],
                )


# -- 5 ----------------------------------------------------------------------------------------


def check_5_lookup_before_resend(snap: Snapshot, out: _Out) -> None:
    """A re-send is preceded by an answered lookup (provider log and our ledger agree)."""
    for (provider, key), calls in snap.calls_by_key().items():
        applies: list[dict[str, Any]] = []
        for i, c in enumerate(calls):
            if c["call"] != "apply" or c["outcome"] == "fenced_out":
                continue
            if applies and not _lookup_since(calls, i, applies, c):
                out.add(
                    5,
                    "resend_without_lookup",
                    _tx_of(snap, key),
                    f"{provider} key {key}: apply #{c['seq']} (fence {c['fence']}) re-sent with"
                    f" no lookup after apply #{applies[-1]['seq']} (fence {applies[-1]['fence']})",
                    key=key,
                    calls=[call_json(x) for x in calls],
                )
            applies.append(c)
    for tx_id, entries in snap.ledger.items():
        needs_lookup: dict[str, LedgerEntry] = {}
        for e in entries:
            if e.subject is None:
                continue
            if e.action == "claim":
                if e.from_state in MAYBE_SENT:
                    needs_lookup[e.subject] = e
                else:
                    needs_lookup.pop(e.subject, None)
                continue
            if e.from_state != EffectState.EXECUTING.value:
                continue
            claim = needs_lookup.pop(e.subject, None)
            if claim is not None and e.action == "apply" and "lookup" not in e.detail:
                out.add(
                    5,
                    "ledger_resend_without_lookup",
                    tx_id,
                    f"{e.subject}: claimed from {claim.from_state} (seq {claim.seq}), then"
                    f" applied (seq {e.seq}) without a lookup",
                    claim=entry_json(claim),
                    apply=entry_json(e),
                )


def _lookup_since(
    calls: list[dict[str, Any]], i: int, applies: list[dict[str, Any]], c: dict[str, Any]
) -> bool:
    """Whether the holder of this apply's fence looked up before sending it.

    * An earlier apply with the *same* fence is this holder's own earlier send: a lookup must
      lie between the two.
    * Earlier applies with lower fences only: this holder claimed after an older one that may
      have sent, so it must have looked up at some point before. The old holder's in-flight
      apply may still reach the provider *after* that lookup (harmless: the key dedups), so
      the lookup need not follow it.
    * Earlier applies with higher fences only: this is a stale holder's first send, which is
      fencing's business (invariant 6), not a re-send.
    """
    fence = c["fence"] if c["fence"] is not None else 0
    earlier = [(a["fence"] or 0, a["seq"]) for a in applies]
    same = [seq for f, seq in earlier if f == fence]
    if same:
        since: int | None = same[-1]
    elif any(f < fence for f, _ in earlier):
        since = None
    else:
        return True
    return any(
        x["call"] == "lookup"
        and x["outcome"] != "unavailable"
        and (since is None or x["seq"] > since)
        for x in calls[:i]
    )


# -- 6 ----------------------------------------------------------------------------------------


def check_6_fencing(snap: Snapshot, out: _Out) -> None:
    """No stale fence lands: at the provider, nor in our ledger."""
    for (provider, key), calls in snap.calls_by_key().items():
        highest: dict[str, Any] | None = None
        for c in calls:
            # 'unavailable' applies never reached the fence check: the provider never saw them.
            if c["call"] != "apply" or c["fence"] is None or c["outcome"] == "unavailable":
                continue
            if highest is not None and c["fence"] < highest["fence"]:
                # The log records the provider's decision even when a fault then loses the
                # answer, so anything but fenced_out means a stale fence was acted on.
                if c["outcome"] != "fenced_out":
                    out.add(
                        6,
                        "stale_fence_applied",
                        _tx_of(snap, key),
                        f"{provider} key {key}: apply #{c['seq']} with fence {c['fence']} got"
                        f" {c['outcome']} after fence {highest['fence']} (#{highest['seq']})",
                        key=key,
                        stale=call_json(c),
                        newer=call_json(highest),
                    )
                continue
            if c["outcome"] != "fenced_out":
                highest = c
    for tx_id, entries in snap.ledger.items():
        last: dict[str | None, LedgerFence] = {}
        for e in entries:
            fence = e.detail.get("fence")
            if e.action in ("claim", "prepare"):
                prev = last.get(e.subject)
                if prev is not None and (not isinstance(fence, int) or fence <= prev.fence):
                    out.add(
                        6,
                        "ledger_fence_regressed",
                        tx_id,
                        f"{e.subject or 'transaction'}: claim seq {e.seq} has fence {fence},"
                        f" not above {prev.fence} (seq {prev.seq})",
                        claim=entry_json(e),
                        previous_seq=prev.seq,
                    )
                if isinstance(fence, int):
                    last[e.subject] = LedgerFence(fence, e.seq)
                continue
            if e.subject is None or e.from_state != EffectState.EXECUTING.value:
                continue
            held = last.get(e.subject)
            if held is None or fence != held.fence:
                out.add(
                    6,
                    "ledger_fence_mismatch",
                    tx_id,
                    f"{e.subject}: {e.action} seq {e.seq} carries fence {fence}, the latest"
                    f" claim holds {None if held is None else held.fence}",
                    row=entry_json(e),
                    claim_seq=None if held is None else held.seq,
                )


@dataclass(frozen=True, slots=True)
class LedgerFence:
    """The latest claim's fence of one subject, and where it was written."""

    fence: int
    seq: int


# -- 7 ----------------------------------------------------------------------------------------


def check_7_ledger_verifies(snap: Snapshot, out: _Out) -> None:
    """Hash chain and replay (``ledger.events.verify``), and append-only enforcement."""
    for tx_id, problems in snap.ledger_problems.items():
        if problems:
            out.add(
                7,
                "ledger_verify",
                tx_id,
                f"ledger of {tx_id}: {problems[0].problem}"
                + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
                problems=[{"seq": p.seq, "problem": p.problem} for p in problems],
            )
    missing = snap.expected_triggers - snap.triggers
    if missing:
        out.add(
            7,
            "append_only_not_enforced",
            None,
            f"ledger triggers missing: {', '.join(sorted(missing))}",
            missing=sorted(missing),
            found=sorted(snap.triggers),
        )


# -- 8 ----------------------------------------------------------------------------------------


def check_8_one_payload_per_key(snap: Snapshot, out: _Out) -> None:
    """The same key never reaches the provider with another payload."""
    for c in snap.p_calls:
        if c["outcome"] == "rejected:idempotency_payload_mismatch":
            out.add(
                8,
                "payload_mismatch_reached_provider",
                _tx_of(snap, c["key"]),
                f"{c['provider']} key {c['key']}: call #{c['seq']} carried another payload",
                call=call_json(c),
            )
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for e in snap.p_effects:
        if e["status"] in ("applied", "rejected"):  # tombstones carry the lookup's payload
            by_key[(e["provider"], e["key"])].append(e)
    for (provider, key), rows in by_key.items():
        ref = snap.owners.get(key)
        ours = ref.row.get("payload_sha256") if ref is not None and ref.row else None
        shas = {e["payload_sha256"] for e in rows} | ({ours} if ours else set())
        if len(shas) > 1:
            out.add(
                8,
                "payload_fingerprint_differs",
                _tx_of(snap, key),
                f"{provider} key {key} has {len(shas)} payload fingerprints",
                key=key,
                ours=ours,
                provider_effects=[effect_json(e) for e in rows],
            )


# -- 9 ----------------------------------------------------------------------------------------


def check_9_errors_leak_nothing(snap: Snapshot, out: _Out) -> None:
    """Stored errors are closed envelopes: known keys, a registered code, no foreign text."""
    ours = vocabulary()
    texts_of = provider_texts_by_tx(snap)
    for tx_id, tx in snap.txs.items():
        errors: list[tuple[str, Any]] = [("transactions.error", tx["error"])]
        errors += [
            (f"ledger seq {e.seq}", e.detail["error"])
            for e in snap.ledger.get(tx_id, [])
            if e.subject is None and "error" in e.detail
        ]
        texts = {t for t in texts_of[tx_id] if t}
        for where, error in errors:
            if error is None:
                continue
            problems: list[str] = []
            if not isinstance(error, dict):
                problems.append("not a JSON object")
            else:
                extra = sorted(set(error) - ERROR_KEYS)
                if extra:
                    problems.append(f"unexpected keys {extra}")
                if error.get("code") not in REGISTRY:
                    problems.append(f"unregistered code {error.get('code')!r}")
                for s in strings({k: v for k, v in error.items() if k != "code"}):
                    found = leak(s, texts, ours)
                    if found:
                        problems.append(f"{found} in {s[:80]!r}")
            if problems:
                out.add(
                    9,
                    "error_leak",
                    tx_id,
                    f"{where} of {tx_id}: {'; '.join(problems)}",
                    where=where,
                    error=error,
                    problems=problems,
                )


CHECKS: tuple[tuple[int, Callable[[Snapshot, _Out], None]], ...] = (
    (1, check_1_at_most_one_effect),
    (2, check_2_settled),
    (3, check_3_outcomes_proved),
    (4, check_4_outbox_after_commit),
    (5, check_5_lookup_before_resend),
    (6, check_6_fencing),
    (7, check_7_ledger_verifies),
    (8, check_8_one_payload_per_key),
    (9, check_9_errors_leak_nothing),
)


async def check_invariants(
    store_url: str,
    provider_url: str,
    *,
    tx_ids: Collection[str] | None = None,
    require_settled: bool = True,
) -> CheckReport:
    """Check every invariant of DESIGN.md on our store and the provider's database.

    ``tx_ids`` limits the check to those transactions and the provider keys that belong to them
    (matched by idempotency key); without it every row of both databases is judged, and a
    provider notification under a key we do not know is a violation too. ``require_settled``
    adds invariant 2 (nothing in flight): pass ``False`` to check a run that is still going.
    Opens its own read-only connections and disposes them; :func:`check_snapshot` judges a
    snapshot an :class:`~fault_injection._evidence.EvidenceReader` kept open took instead.
    """
    snap = await load(store_url, provider_url, tx_ids)
    return check_snapshot(snap, require_settled=require_settled)


def check_snapshot(snap: Snapshot, *, require_settled: bool = True) -> CheckReport:
    """Every invariant of DESIGN.md, judged on one snapshot of both databases (see
    :func:`check_invariants`)."""
    out = _Out(snap)
    for number, check in CHECKS:
        if number == 2 and not require_settled:
            continue
        check(snap, out)
    return CheckReport(
        violations=out.items,
        transactions=len(snap.txs),
        effects=len(snap.p_effects),
        ledger_rows=sum(len(v) for v in snap.ledger.values()),
    )


__all__ = ["CheckReport", "Violation", "check_invariants", "check_snapshot"]
