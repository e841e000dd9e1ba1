"""The provider contract: what agent-txn needs from any system an effect crosses into.

A provider is anything with side effects: a payment API, an inventory service, a mailer. It
exposes two calls, modelled on httpx's one-method transport:

* ``apply(action, key=..., payload=..., fence=...)`` performs the effect at most once per key and
  answers :class:`Confirmed`, :class:`Rejected` or :class:`Unknown` (or :class:`FencedOut` when it
  has already seen a newer fence for that key). Raising any exception means *unknown* too: the
  caller cannot tell whether the effect happened.
* ``lookup(action, key=..., payload=...)`` asks what became of an earlier apply with that key and
  answers :class:`Found`, :class:`NotFound` or :class:`Unavailable`.

Each action declares an :class:`ActionContract`: its compensation (or that it is irreversible),
whether apply dedups by key and for how long, whether lookup exists and is authoritative, whether
fencing is honoured, and which result fields must echo the payload. The engine never assumes more
than the contract says.

A ``remote_id`` may be as long as the provider likes: the engine stores at most a bounded number
of characters of it (``ledger.effects.REMOTE_ID_MAX``), so an id longer than that is recorded as
:func:`bounded_remote_id` (a prefix plus a digest of the whole id) with the whole id kept in the
effect's result under :data:`FULL_REMOTE_ID_FIELD`; :func:`full_remote_id` gives it back to
templates (``forward.remote_id``), so a refund still names the provider's real charge id.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any, Final, Protocol, runtime_checkable

JsonObject = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ActionContract:
    """What one provider action promises; the engine relies on nothing else."""

    name: str
    #: Name of the action (same provider) that reverses this one; ``None`` = irreversible.
    compensation: str | None = None
    #: ``True`` for actions that are themselves reversals: compensating them is refused.
    is_compensation: bool = False
    #: Same key + same payload answers the first result instead of acting again.
    dedups_by_key: bool = True
    #: How long the provider remembers a key; an op first sent earlier is never re-sent blindly.
    dedup_window_seconds: float = 24 * 3600.0
    #: ``lookup`` exists for this action.
    supports_lookup: bool = True
    #: A ``NotFound`` from lookup proves the effect never happened (within the dedup window).
    lookup_authoritative: bool = True
    #: The provider keeps the highest fence per key and refuses a lower one.
    supports_fencing: bool = True
    #: The provider can void a key it never saw, so a late original is refused (anti-hanging).
    supports_void: bool = False
    #: Result fields that must equal the payload's (``amount``, ``currency`` ...).
    echo_fields: tuple[str, ...] = ()
    #: Top-level payload fields that must be present.
    required_fields: tuple[str, ...] = ()
    #: A read: ``apply`` answers :class:`Confirmed` with data and changes nothing. Only query steps
    #: (and ``/query``) call read-only actions; they need no key dedup, lookup or compensation.
    read_only: bool = False
    #: The action's declared schema: every payload and result field it knows. Commands that
    #: reference a field outside it are refused at authoring, and version-1 commands re-check
    #: before each execute that their fields still exist. Empty = undeclared (nothing checked).
    fields: tuple[str, ...] = ()

    @property
    def irreversible(self) -> bool:
        """True when no compensation exists (a pivot, or a notification for the outbox)."""
        return self.compensation is None


# -- apply outcomes ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The provider holds the effect; ``remote_id`` names it there."""

    remote_id: str
    result: JsonObject = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Rejected:
    """A definite no: the provider did not and will not perform this effect for this key."""

    reason: str


@dataclass(frozen=True, slots=True)
class Unknown:
    """The effect may or may not have happened (timeout, lost response, indeterminate 5xx)."""

    reason: str


@dataclass(frozen=True, slots=True)
class FencedOut:
    """The provider has seen a newer fence for this key: the caller's lease is stale."""

    highest_fence: int


ApplyOutcome = Confirmed | Rejected | Unknown | FencedOut


# -- lookup outcomes ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Found:
    """An earlier apply with this key took effect."""

    remote_id: str
    result: JsonObject = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NotFound:
    """No effect with this key exists (authoritative only if the contract says so).

    ``voided`` is true when the provider also wrote a tombstone for the key (anti-hanging): a
    late original carrying it will be refused.
    """

    voided: bool = False


@dataclass(frozen=True, slots=True)
class Unavailable:
    """The lookup itself could not be answered; the effect stays in doubt."""

    reason: str


LookupOutcome = Found | NotFound | Unavailable


# -- remote ids longer than the engine stores ---------------------------------------------------

#: Result field holding the provider's whole id when the recorded one is its bounded stand-in.
FULL_REMOTE_ID_FIELD: Final = "agent_txn_full_remote_id"
#: Separates a bounded id's prefix from the digest of the whole id.
_DIGEST_MARK: Final = "~sha256:"
_DIGEST_CHARS: Final = 64


def bounded_remote_id(remote_id: str, limit: int) -> str:
    """``remote_id`` itself if it has at most ``limit`` characters, else a stand-in that does.

    Why a stand-in and not a refusal: the provider *did* act, so its answer must be recorded
    (an effect recorded as not done, or re-sent under a new key, could charge twice), and a
    record the database refuses would be retried for ever. Why this one: the stand-in is a
    pure function of the whole id (the same answer from apply and from a later lookup records
    the same id on every backend), it stays unique (a SHA-256 of the whole id) and still reads
    like the provider's id (its first characters), so a person can match it.
    """
    if len(remote_id) <= limit:
        return remote_id
    keep = limit - len(_DIGEST_MARK) - _DIGEST_CHARS
    if keep < 0:
        raise ValueError(f"a remote id limit of {limit} cannot hold a digest")
    digest = sha256(remote_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{remote_id[:keep]}{_DIGEST_MARK}{digest}"


def full_remote_id(stored: str | None, result: Any) -> str | None:
    """The provider's whole id of an effect recorded as ``stored`` with ``result``.

    The result's copy counts only if ``stored`` is its stand-in: a provider result that
    happens to carry a field of that name cannot change which id a template renders."""
    if stored is None or _DIGEST_MARK not in stored or not isinstance(result, Mapping):
        return stored
    full = result.get(FULL_REMOTE_ID_FIELD)
    if not isinstance(full, str) or len(full) <= len(stored):
        return stored
    return full if bounded_remote_id(full, len(stored)) == stored else stored


class UnknownAction(LookupError):
    """The provider has no action of that name."""


@runtime_checkable
class Provider(Protocol):
    """A system that holds effects. Implementations must be safe to call concurrently."""

    @property
    def name(self) -> str:
        """The provider's name as steps reference it (``payments``)."""
        ...

    def contract(self, action: str) -> ActionContract:
        """The contract of ``action``; raises :class:`UnknownAction` if there is none."""
        ...

    def actions(self) -> Mapping[str, ActionContract]:
        """Every action this provider offers."""
        ...

    async def apply(
        self, action: str, *, key: str, payload: JsonObject, fence: int
    ) -> ApplyOutcome:
        """Perform ``action`` at most once for ``key``. Raising means the outcome is unknown."""
        ...

    async def lookup(
        self, action: str, *, key: str, payload: JsonObject, void_if_missing: bool = False
    ) -> LookupOutcome:
        """What became of an earlier apply with ``key``.

        With ``void_if_missing`` (only where the contract says ``supports_void``) a provider that
        has never seen the key records a tombstone so a late original is refused.
        """
        ...
