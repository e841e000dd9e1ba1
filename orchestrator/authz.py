"""Authentication and authorization of command callers: no definer rights (seed 000).

A command carries no rights of its own. Every step runs with the *caller's* grants, checked when
the command is prepared and again just before each effect (a grant revoked mid-saga stops the next
effect), so seeing a command never means being allowed to run all of it.

* :func:`authenticate_jwt` / :func:`authenticate_api_key` turn a credential into a :class:`Caller`;
  command routes then insist on a JWT (:func:`require_jwt`).
* :func:`load_principal` turns a caller into a :class:`Principal` (row + grants + membership) or
  refuses. Every refusal is the same :class:`~orchestrator.errors.PrincipalNotAuthorized` with no
  details, so a caller cannot tell "no such id" from "another tenant's" or "disabled" and cannot
  probe ids; the reason goes to the operator log instead.
* :func:`authorize_step`, :func:`check_readable`, :func:`manages` and :func:`can_see_execution`
  are pure functions of a loaded principal, so the engine can check a whole plan without another
  query; :func:`recheck_step` is the reload-and-check the engine runs before each effect.

Grant matching: a grant on ``(provider, action)`` is used when the principal has one; otherwise a
grant on ``(provider, "*")``. The most specific grant wins, so an operator can cap or narrow one
action below a provider-wide grant.
"""

from __future__ import annotations

import hashlib
import math
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final, Literal, Self

import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import principals as repo
from ledger.principals import ANY_ACTION, GrantRow, MembershipRow, PrincipalRow
from orchestrator.errors import FieldNotReadable, JwtRequired, PrincipalNotAuthorized

log = structlog.get_logger("agent_txn.authz")

Kind = Literal["user", "client"]
AuthMethod = Literal["jwt", "api_key", "trusted"]
#: The scopes a command can be mounted in (``commands.scope_kind``).
SCOPE_KINDS: Final = ("company", "room")

KINDS: Final = ("user", "client")
#: Shortest HS256 secret accepted (RFC 7518 §3.2: at least the hash size).
MIN_HS256_SECRET_BYTES: Final = 32
#: Smallest RSA key accepted for RS256 (NIST SP 800-131A).
MIN_RSA_BITS: Final = 2048
#: Longest id a principal or room column holds.
MAX_ID_LENGTH: Final = 64
#: Payload key read for an amount cap when the grant names none.
DEFAULT_AMOUNT_FIELD: Final = "amount"


# -- callers ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling, as far as the credential says; nothing here has been authorized yet.

    ``auth`` records how the identity was established: ``jwt`` and ``api_key`` from a request,
    ``trusted`` for the in-process Python API (the host application vouches for the id).
    ``room_id`` is the room the credential acts through, if it is bound to one; ``ai`` marks an
    agent acting for the principal (recorded in the audit snapshot).
    """

    principal_id: str
    kind: Kind
    auth: AuthMethod
    room_id: str | None = None
    ai: bool = False

    @classmethod
    def user(cls, principal_id: str, *, room_id: str | None = None, ai: bool = False) -> Caller:
        """A user named by trusted in-process code."""
        return cls(principal_id, "user", "trusted", room_id, ai)

    @classmethod
    def client(cls, principal_id: str, *, room_id: str | None = None, ai: bool = False) -> Caller:
        """A client (service, bot, social channel) named by trusted in-process code."""
        return cls(principal_id, "client", "trusted", room_id, ai)

    @property
    def bucket(self) -> str:
        """The idempotency bucket: two principals never share one, even with the same key."""
        return f"{self.kind}:{self.principal_id}"


class AuthSettings(BaseModel):
    """How request credentials are verified. Frozen; passed explicitly, never read from globals.

    Exactly one algorithm is accepted per deployment, so a token cannot pick its own (no
    ``alg: none``, no HS256 token signed with the RS256 public key as its secret).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    jwt_algorithm: Literal["HS256", "RS256"] = "HS256"
    #: Shared secret for HS256 (at least 32 bytes).
    jwt_secret: SecretStr | None = None
    #: PEM-encoded RSA public key for RS256 (at least 2048 bits).
    jwt_public_key: str | None = None
    #: When set, tokens must carry this ``aud``; when unset, tokens carrying any ``aud`` are
    #: refused (a token meant for another service is not for us).
    audience: str | None = None
    #: When set, tokens must carry this ``iss``.
    issuer: str | None = None
    #: Clock skew tolerated on ``exp`` / ``nbf`` / ``iat``.
    leeway_seconds: int = Field(default=0, ge=0, le=300)
    #: The tenant this deployment serves; a token's optional ``tenant`` claim must equal it.
    tenant: str = Field(default="default", min_length=1, max_length=100)

    @model_validator(mode="after")
    def _key_fits_algorithm(self) -> Self:
        if self.jwt_algorithm == "HS256":
            if self.jwt_secret is None:
                raise ValueError("HS256 needs jwt_secret")
            if len(self.jwt_secret.get_secret_value().encode()) < MIN_HS256_SECRET_BYTES:
                raise ValueError(f"jwt_secret must be at least {MIN_HS256_SECRET_BYTES} bytes")
            if self.jwt_public_key is not None:
                raise ValueError("jwt_public_key is for RS256; HS256 takes jwt_secret")
        else:
            if self.jwt_public_key is None:
                raise ValueError("RS256 needs jwt_public_key (PEM)")
            if self.jwt_secret is not None:
                raise ValueError("jwt_secret is for HS256; RS256 takes jwt_public_key")
            # Local, as jwt's below: every process that runs sagas imports this module, and only
            # a server checking tokens needs PyJWT and cryptography (a twentieth of start-up).
            from cryptography.hazmat.primitives import serialization
            from cryptography.hazmat.primitives.asymmetric import rsa

            try:
                key = serialization.load_pem_public_key(self.jwt_public_key.encode())
            except ValueError:
                raise ValueError("jwt_public_key is not a PEM public key") from None
            if not isinstance(key, rsa.RSAPublicKey):
                raise ValueError("jwt_public_key must be an RSA public key for RS256")
            if key.key_size < MIN_RSA_BITS:
                raise ValueError(f"jwt_public_key must be at least {MIN_RSA_BITS} bits")
        return self

    def verification_key(self) -> str:
        """The secret (HS256) or public key (RS256) tokens are verified with."""
        if self.jwt_algorithm == "HS256":
            assert self.jwt_secret is not None  # the validator guarantees it
            return self.jwt_secret.get_secret_value()
        assert self.jwt_public_key is not None
        return self.jwt_public_key


def _refuse(event: str, **why: Any) -> PrincipalNotAuthorized:
    """Log the reason for operators; the caller only ever gets the one uniform refusal."""
    log.info(event, **why)
    return PrincipalNotAuthorized()


def _valid_id(value: Any) -> bool:
    """A principal or room id as a token may carry it: no control characters (NUL above all,
    which PostgreSQL cannot even compare) and no lone surrogates, so it is refused here the
    same way on both backends instead of failing in the database."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_ID_LENGTH
        and value.strip() == value
        and not any(unicodedata.category(c) in ("Cc", "Cs") for c in value)
    )


def authenticate_jwt(token: str, settings: AuthSettings) -> Caller:
    """Verify a bearer token and return its caller; any problem is the one uniform refusal.

    Required claims: ``exp`` and ``sub`` (the principal id). Optional: ``kind`` (``user`` by
    default), ``room`` (the room it acts through), ``ai`` (a JSON boolean), ``tenant`` (must equal
    the deployment's). The signature is checked with the configured algorithm only.
    """
    import jwt  # local: see AuthSettings._key_fits_algorithm

    required = ["exp", "sub"]
    if settings.audience is not None:
        required.append("aud")
    if settings.issuer is not None:
        required.append("iss")
    try:
        claims = jwt.decode(
            token,
            settings.verification_key(),
            algorithms=[settings.jwt_algorithm],
            audience=settings.audience,
            issuer=settings.issuer,
            leeway=settings.leeway_seconds,
            options={"require": required, "enforce_minimum_key_length": True},
        )
    except (jwt.PyJWTError, TypeError, ValueError) as exc:
        raise _refuse("authz.jwt_refused", reason=type(exc).__name__) from None
    if not isinstance(claims, dict):
        raise _refuse("authz.jwt_refused", reason="claims_not_an_object")
    subject = claims.get("sub")
    kind = claims.get("kind", "user")
    room = claims.get("room")
    ai = claims.get("ai", False)
    tenant = claims.get("tenant", settings.tenant)
    if not _valid_id(subject):
        raise _refuse("authz.jwt_refused", reason="bad_sub")
    if kind not in KINDS:
        raise _refuse("authz.jwt_refused", reason="bad_kind", sub=subject)
    if room is not None and not _valid_id(room):
        raise _refuse("authz.jwt_refused", reason="bad_room", sub=subject)
    if not isinstance(ai, bool):
        raise _refuse("authz.jwt_refused", reason="bad_ai", sub=subject)
    if tenant != settings.tenant:
        raise _refuse("authz.jwt_refused", reason="other_tenant", sub=subject)
    return Caller(str(subject), kind, "jwt", room, ai)


def hash_api_key(key: str) -> str:
    """The SHA-256 hex digest stored for an API key (the key itself is never stored)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


async def authenticate_api_key(conn: AsyncConnection, key: str) -> Caller:
    """The caller an API key belongs to; unknown keys (and deleted principals) are refused."""
    if not key:
        raise _refuse("authz.api_key_refused", reason="empty")
    row = await repo.by_api_key(conn, hash_api_key(key))
    if row is None or not row.alive or row.kind not in KINDS:
        raise _refuse("authz.api_key_refused", reason="unknown_key")
    kind: Kind = "user" if row.kind == "user" else "client"
    return Caller(row.principal_id, kind, "api_key")


def require_jwt(caller: Caller) -> None:
    """Command routes act for a person holding a token; an API key is refused with 403."""
    if caller.auth == "api_key":
        raise JwtRequired()


# -- principals ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Principal:
    """An authorized caller: its row, its grants and (in room scope) its membership, as loaded.

    A snapshot: the engine reloads it (:func:`recheck_step`) before each effect instead of
    trusting one loaded minutes earlier.
    """

    caller: Caller
    row: PrincipalRow
    grants: tuple[GrantRow, ...]
    membership: MembershipRow | None

    @property
    def principal_id(self) -> str:
        """The principal's id."""
        return self.row.principal_id

    @property
    def kind(self) -> str:
        """``user`` or ``client``."""
        return self.row.kind

    def grant_for(self, provider: str, action: str, permissions: frozenset[str]) -> list[GrantRow]:
        """The grants that decide ``provider.action`` for ``permissions``: the exact action's if
        there are any, else the provider-wide (``*``) ones."""
        exact = [
            g
            for g in self.grants
            if g.provider == provider and g.action == action and g.permission in permissions
        ]
        if exact:
            return exact
        return [
            g
            for g in self.grants
            if g.provider == provider and g.action == ANY_ACTION and g.permission in permissions
        ]


async def require_known_principal(
    conn: AsyncConnection, caller: Caller, *, tenant: str
) -> PrincipalRow:
    """The caller's principal row, if it may act at all in ``tenant`` whatever the scope: it
    exists in ``tenant``, is alive, verified, not disabled and of the caller's kind. Anything
    else is the one uniform refusal.

    The scope-free half of :func:`load_principal`. The HTTP layer runs it for every JWT caller,
    so a validly signed token naming nobody of this tenant is refused the same way on every
    route, including the ones (listings) that would otherwise just find nothing to show.
    """
    who = {"principal_id": caller.principal_id, "kind": caller.kind}
    row = await repo.get_principal(conn, caller.principal_id)
    if row is None:
        raise _refuse("authz.principal_refused", reason="unknown", **who)
    if row.tenant != tenant:
        raise _refuse("authz.principal_refused", reason="other_tenant", **who)
    if not row.alive:
        raise _refuse("authz.principal_refused", reason="deleted", **who)
    if not row.verified:
        raise _refuse("authz.principal_refused", reason="unverified", **who)
    if row.disabled:
        raise _refuse("authz.principal_refused", reason="disabled", **who)
    if row.kind != caller.kind:
        raise _refuse("authz.principal_refused", reason="kind_mismatch", **who)
    return row


async def load_principal(
    conn: AsyncConnection,
    caller: Caller,
    *,
    tenant: str,
    scope_kind: str,
    scope_id: str,
) -> Principal:
    """Check that ``caller`` may act at all in this scope, and load what later checks need.

    The principal must exist in ``tenant``, be alive, verified and not disabled, and be of the
    caller's kind. In ``room`` scope it must still be a member of ``scope_id``; a caller bound to a
    room (token ``room`` claim) may act only in that room and only while a member of it.
    ``scope_kind`` is ``company`` or ``room`` (as stored on the command row); anything else is a
    programming error (:class:`ValueError`), not a refusal.
    """
    if scope_kind not in SCOPE_KINDS:
        raise ValueError(f"scope_kind must be 'company' or 'room', not {scope_kind!r}")
    who = {"principal_id": caller.principal_id, "kind": caller.kind}
    row = await require_known_principal(conn, caller, tenant=tenant)
    room: str | None = None
    if scope_kind == "room":
        if caller.room_id is not None and caller.room_id != scope_id:
            raise _refuse("authz.principal_refused", reason="other_room", **who)
        room = scope_id
    elif caller.room_id is not None:
        room = caller.room_id
    member: MembershipRow | None = None
    if room is not None:
        member = await repo.membership(conn, room, row.principal_id)
        if member is None or not member.current:
            raise _refuse("authz.principal_refused", reason="not_a_member", room_id=room, **who)
    grants = tuple(await repo.grants_of(conn, row.principal_id))
    return Principal(caller=caller, row=row, grants=grants, membership=member)


def _amount(value: Any) -> int | float | Decimal | None:
    """A finite number, or ``None`` (booleans, strings and NaN are not amounts)."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Decimal) and not value.is_finite():
        return None
    return value


def authorize_step(
    principal: Principal,
    *,
    provider: str,
    action: str,
    payload: Mapping[str, Any] | None,
    permission: str = "execute",
) -> None:
    """Refuse unless the principal holds ``permission`` on ``provider.action`` within its cap.

    With a capped grant the payload's amount field (the grant's ``amount_field``, else
    ``amount``) must be a number no larger than ``max_amount``; a missing or non-numeric amount is
    refused, since an unreadable amount cannot be shown to be within the cap. ``payload=None``
    means "not rendered yet" (prepare): only the grant's existence is checked, and the engine
    checks again with the rendered payload before the effect.
    """
    who = {"principal_id": principal.principal_id, "provider": provider, "action": action}
    found = principal.grant_for(provider, action, frozenset({permission}))
    if not found:
        raise _refuse("authz.step_refused", reason="no_grant", permission=permission, **who)
    grant = found[0]  # the unique key allows one grant per (provider, action, permission)
    if grant.max_amount is None or payload is None:
        return
    field = grant.amount_field or DEFAULT_AMOUNT_FIELD
    amount = _amount(payload.get(field))
    if amount is None:
        raise _refuse("authz.step_refused", reason="amount_unreadable", field=field, **who)
    if amount > grant.max_amount:
        raise _refuse(
            "authz.step_refused", reason="over_cap", field=field, cap=grant.max_amount, **who
        )


def _split(resource: str) -> tuple[str, str] | None:
    provider, dot, action = resource.partition(".")
    if not dot or not provider or not action:
        return None
    return provider, action


def check_readable(principal: Principal, reads: Mapping[str, set[str]]) -> None:
    """Refuse a result projection that names a field the principal may not read.

    ``reads`` maps ``"provider.action"`` to the result fields the command exposes from it. A field
    is readable under an ``execute`` or ``read`` grant whose ``readable_fields`` is ``None`` (all)
    or lists it. The first unreadable field (in sorted order, so the answer is stable) is named in
    the error as ``provider.action.field``.
    """
    for resource in sorted(reads):
        parts = _split(resource)
        if parts is None:
            raise ValueError(f"read keys are 'provider.action', not {resource!r}")
        provider, action = parts
        found = principal.grant_for(provider, action, frozenset({"execute", "read"}))
        everything = any(g.readable_fields is None for g in found)
        allowed = {f for g in found for f in (g.readable_fields or ())}
        for field in sorted(reads[resource]):
            if not found or not (everything or field in allowed):
                log.info(
                    "authz.field_refused",
                    principal_id=principal.principal_id,
                    field=f"{provider}.{action}.{field}",
                )
                raise FieldNotReadable(details={"field": f"{provider}.{action}.{field}"})


def manages(principal: Principal, resources: Sequence[str]) -> bool:
    """Whether the principal holds ``manage`` on every ``"provider.action"`` in ``resources``.

    An empty list is *not* managed: "manages everything in nothing" would make records that
    name no resource visible to everyone in scope.
    """
    if not resources:
        return False
    for resource in resources:
        parts = _split(resource)
        if parts is None or not principal.grant_for(*parts, frozenset({"manage"})):
            return False
    return True


def can_see_execution(
    principal: Principal,
    *,
    invoker_kind: str | None,
    invoker_id: str | None,
    snapshot: Any,
    mounted_scope: tuple[str, str],
) -> bool:
    """Whether an execution record is visible to the principal (else: 404 not found).

    Visible to its invoker, or to a principal who — now — manages every resource the frozen
    ``authorization_snapshot`` names, when that snapshot's scope is the mounted one. Visibility
    follows what the execution touched then, not what the command touches today. A missing or
    malformed snapshot is invisible (fail closed).
    """
    if (
        invoker_kind is not None
        and invoker_id is not None
        and invoker_kind == principal.kind
        and invoker_id == principal.principal_id
    ):
        return True
    if not isinstance(snapshot, dict):
        return False
    version = snapshot.get("version")
    scope = snapshot.get("scope")
    resources = snapshot.get("resource_ids")
    if type(version) is not int or version != 1:
        return False
    if not isinstance(scope, dict):
        return False
    kind, scope_id = scope.get("kind"), scope.get("id")
    if not isinstance(kind, str) or not isinstance(scope_id, str):
        return False
    if (kind, scope_id) != tuple(mounted_scope):
        return False
    if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
        return False
    return manages(principal, resources)


async def recheck_step(
    conn: AsyncConnection,
    *,
    tenant: str,
    invoker_kind: str,
    invoker_id: str,
    scope_kind: str,
    scope_id: str,
    provider: str,
    action: str,
    payload: Mapping[str, Any] | None,
) -> bool:
    """Reload the invoker and check one step, just before its effect: ``True`` only if allowed.

    Reads the principal, its grants and its membership afresh, so a principal disabled, removed
    from the room or stripped of the grant since prepare gets ``False``. Every authorization
    failure is ``False`` (an unknown kind or scope too); storage errors propagate (an unreachable
    database is not a verdict).
    """
    if invoker_kind not in KINDS:
        return False
    kind: Kind = "user" if invoker_kind == "user" else "client"
    try:
        principal = await load_principal(
            conn,
            Caller(invoker_id, kind, "trusted"),
            tenant=tenant,
            scope_kind=scope_kind,
            scope_id=scope_id,
        )
        authorize_step(principal, provider=provider, action=action, payload=payload)
    except (PrincipalNotAuthorized, ValueError):
        return False
    return True
