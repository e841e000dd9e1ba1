"""``orchestrator.authz`` without a database: tokens, settings, and the pure grant checks.

JWT verification must accept exactly the configured algorithm with the configured key, require
``exp`` and ``sub``, and turn every problem into the same refusal (no oracle for attackers). The
grant checks (:func:`authorize_step`, :func:`check_readable`, :func:`manages`,
:func:`can_see_execution`) are pure functions of a loaded principal, so they are tested here on
hand-built principals; ``tests/integration/test_principals.py`` repeats the important ones on
principals loaded from both databases.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Iterator, Mapping, MutableMapping
from decimal import Decimal
from typing import Any

import jwt
import pytest
import structlog
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from pydantic import ValidationError
from structlog.testing import capture_logs

from ledger.principals import GrantRow, MembershipRow, PrincipalRow
from orchestrator.authz import (
    AuthSettings,
    Caller,
    Principal,
    authenticate_jwt,
    authorize_step,
    can_see_execution,
    check_readable,
    hash_api_key,
    manages,
    require_jwt,
)
from orchestrator.errors import FieldNotReadable, JwtRequired, PrincipalNotAuthorized

SECRET = "s3cret-for-tests-0123456789abcdef"  # 33 bytes
REFUSAL = {
    "error": "principal_not_authorized",
    "phase": "execute",
    "message": "Command principal is not authorized",
    "retryable": False,
    "details": {},
}


@pytest.fixture
def info_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """The structlog events at info and above, whatever an earlier test (a CLI run) configured."""
    previous = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**previous)


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def public_pem(key: rsa.RSAPrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


@pytest.fixture(scope="module")
def rs_settings(rsa_key: rsa.RSAPrivateKey) -> AuthSettings:
    return AuthSettings(jwt_algorithm="RS256", jwt_public_key=public_pem(rsa_key))


HS = AuthSettings(jwt_secret=SECRET)


def claims(**extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"sub": "u1", "exp": int(time.time()) + 600}
    base.update(extra)
    return {k: v for k, v in base.items() if v is not None}


def hs_token(secret: str = SECRET, **extra: Any) -> str:
    return jwt.encode(claims(**extra), secret, algorithm="HS256")


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forged(header: Mapping[str, Any], payload: Mapping[str, Any], key: bytes | None) -> str:
    """A token built by hand, as an attacker would: PyJWT refuses to sign these itself."""
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"
    if key is None:
        return signing_input + "."
    signature = hmac.new(key, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64(signature)}"


def refused(token: str, settings: AuthSettings = HS) -> dict[str, Any]:
    with pytest.raises(PrincipalNotAuthorized) as info:
        authenticate_jwt(token, settings)
    return info.value.envelope()


# -- tokens -------------------------------------------------------------------------------------


def test_valid_hs256_token() -> None:
    caller = authenticate_jwt(hs_token(room="room-1", ai=True), HS)
    assert caller == Caller("u1", "user", "jwt", room_id="room-1", ai=True)
    assert caller.bucket == "user:u1"


def test_kind_claim_and_defaults() -> None:
    caller = authenticate_jwt(hs_token(kind="client"), HS)
    assert (caller.kind, caller.room_id, caller.ai, caller.bucket) == (
        "client",
        None,
        False,
        "client:u1",
    )


def test_valid_rs256_token(rsa_key: rsa.RSAPrivateKey, rs_settings: AuthSettings) -> None:
    token = jwt.encode(claims(sub="u2"), rsa_key, algorithm="RS256")
    assert authenticate_jwt(token, rs_settings) == Caller("u2", "user", "jwt")


def test_alg_none_is_refused() -> None:
    token = forged({"alg": "none", "typ": "JWT"}, claims(), None)
    assert refused(token) == REFUSAL


def test_expired_token_is_refused_and_leeway_tolerates_skew() -> None:
    token = hs_token(exp=int(time.time()) - 30)
    assert refused(token) == REFUSAL
    lenient = AuthSettings(jwt_secret=SECRET, leeway_seconds=120)
    assert authenticate_jwt(token, lenient).principal_id == "u1"


def test_wrong_secret_is_refused() -> None:
    assert refused(hs_token(secret="another-secret-of-enough-length-xyz")) == REFUSAL


def test_hs256_token_signed_with_the_public_key_is_refused(
    rsa_key: rsa.RSAPrivateKey, rs_settings: AuthSettings
) -> None:
    # The classic confusion attack: HMAC over the token with the (public) PEM as the secret.
    pem = public_pem(rsa_key).encode()
    token = forged({"alg": "HS256", "typ": "JWT"}, claims(), pem)
    assert refused(token, rs_settings) == REFUSAL


def test_rs256_token_against_hs256_settings_is_refused(rsa_key: rsa.RSAPrivateKey) -> None:
    token = jwt.encode(claims(), rsa_key, algorithm="RS256")
    assert refused(token, HS) == REFUSAL


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"sub": None}, id="missing-sub"),
        pytest.param({"exp": None}, id="missing-exp"),
        pytest.param({"sub": ""}, id="empty-sub"),
        pytest.param({"sub": 7}, id="numeric-sub"),
        pytest.param({"sub": "x" * 65}, id="sub-too-long"),
        pytest.param({"kind": "admin"}, id="unknown-kind"),
        pytest.param({"ai": "true"}, id="ai-not-a-boolean"),
        pytest.param({"room": ""}, id="empty-room"),
        pytest.param({"tenant": "other"}, id="other-tenant"),
        pytest.param({"aud": "someone-else"}, id="unexpected-audience"),
        # Resolved when the test runs (a collection-time timestamp goes stale in long runs).
        pytest.param({"nbf": "in-10-minutes"}, id="not-yet-valid"),
    ],
)
def test_bad_claims_are_the_same_refusal(extra: dict[str, Any]) -> None:
    body = claims()
    for key, value in extra.items():
        if value is None:
            body.pop(key)
        elif value == "in-10-minutes":
            body[key] = int(time.time()) + 600
        else:
            body[key] = value
    token = forged({"alg": "HS256", "typ": "JWT"}, body, SECRET.encode())
    assert refused(token) == REFUSAL


def test_garbage_is_refused() -> None:
    assert refused("not.a.token") == REFUSAL
    assert refused("") == REFUSAL


def test_audience_and_issuer_are_enforced_when_configured() -> None:
    strict = AuthSettings(jwt_secret=SECRET, audience="agent-txn", issuer="idp")
    assert authenticate_jwt(hs_token(aud="agent-txn", iss="idp"), strict).principal_id == "u1"
    assert refused(hs_token(aud="agent-txn"), strict) == REFUSAL  # iss missing
    assert refused(hs_token(aud="other", iss="idp"), strict) == REFUSAL
    assert refused(hs_token(aud="agent-txn", iss="evil"), strict) == REFUSAL


def test_refusals_log_the_reason_but_never_the_token(
    info_logs: list[MutableMapping[str, Any]],
) -> None:
    token = hs_token(kind="admin")
    refused(token)
    assert [(e["event"], e["reason"]) for e in info_logs] == [("authz.jwt_refused", "bad_kind")]
    assert token not in json.dumps(info_logs, default=str)


# -- settings -----------------------------------------------------------------------------------


def test_settings_refuse_weak_or_mismatched_keys(rsa_key: rsa.RSAPrivateKey) -> None:
    with pytest.raises(ValidationError, match="at least 32 bytes"):
        AuthSettings(jwt_secret="short")
    with pytest.raises(ValidationError, match="HS256 needs jwt_secret"):
        AuthSettings()
    with pytest.raises(ValidationError, match="RS256 needs jwt_public_key"):
        AuthSettings(jwt_algorithm="RS256")
    with pytest.raises(ValidationError, match="not a PEM public key"):
        AuthSettings(jwt_algorithm="RS256", jwt_public_key="-----BEGIN nonsense")
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    with pytest.raises(ValidationError, match="at least 2048 bits"):
        AuthSettings(jwt_algorithm="RS256", jwt_public_key=public_pem(small))
    with pytest.raises(ValidationError, match="jwt_secret is for HS256"):
        AuthSettings(jwt_algorithm="RS256", jwt_public_key=public_pem(rsa_key), jwt_secret=SECRET)


def test_settings_do_not_show_the_secret() -> None:
    assert SECRET not in repr(HS)
    assert SECRET not in str(HS.model_dump())


# -- api keys and callers -----------------------------------------------------------------------


def test_hash_api_key_is_sha256_hex() -> None:
    expected = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert hash_api_key("abc") == expected


def test_require_jwt_refuses_api_keys_only() -> None:
    with pytest.raises(JwtRequired) as info:
        require_jwt(Caller("u1", "user", "api_key"))
    assert info.value.http_status == 403
    assert info.value.message == "Command routes require JWT authentication"
    require_jwt(Caller("u1", "user", "jwt"))
    require_jwt(Caller.client("c1"))


def test_trusted_helpers() -> None:
    assert Caller.user("u1") == Caller("u1", "user", "trusted")
    assert Caller.client("c1", room_id="r") == Caller("c1", "client", "trusted", "r")
    assert Caller.client("c1").bucket == "client:c1"


# -- grant checks on hand-built principals -------------------------------------------------------


def make_grant(
    provider: str,
    action: str,
    permission: str = "execute",
    *,
    max_amount: int | None = None,
    amount_field: str | None = None,
    readable: tuple[str, ...] | None = None,
) -> GrantRow:
    return GrantRow(
        grant_id=f"g-{provider}-{action}-{permission}",
        principal_id="u1",
        provider=provider,
        action=action,
        permission=permission,
        max_amount=max_amount,
        amount_field=amount_field,
        readable_fields=readable,
        created_at=0,
    )


def make_principal(*grants: GrantRow, kind: str = "user") -> Principal:
    row = PrincipalRow("u1", "default", kind, "Ann", True, False, None, 0, None)
    member = MembershipRow("room-1", "u1", None, 0, None)
    caller = Caller("u1", "user" if kind == "user" else "client", "jwt")
    return Principal(caller=caller, row=row, grants=tuple(grants), membership=member)


def allowed(principal: Principal, payload: Mapping[str, Any] | None, **kw: Any) -> bool:
    target = {"provider": "shop", "action": "charge", **kw}
    try:
        authorize_step(principal, payload=payload, **target)
    except PrincipalNotAuthorized as exc:
        assert exc.envelope() == REFUSAL
        return False
    return True


def test_authorize_step_needs_a_matching_grant() -> None:
    assert not allowed(make_principal(), None)
    assert not allowed(make_principal(make_grant("shop", "refund")), None)
    assert not allowed(make_principal(make_grant("bank", "*")), None)
    assert not allowed(make_principal(make_grant("shop", "charge", "read")), None)
    assert allowed(make_principal(make_grant("shop", "charge")), {})
    assert allowed(make_principal(make_grant("shop", "*")), {})
    reader = make_principal(make_grant("shop", "charge", "read"))
    assert allowed(reader, None, permission="read")


def test_authorize_step_caps() -> None:
    capped = make_principal(make_grant("shop", "charge", max_amount=100))
    assert allowed(capped, {"amount": 100})
    assert allowed(capped, {"amount": 99.5})
    assert allowed(capped, {"amount": Decimal("100")})
    assert not allowed(capped, {"amount": 101})
    assert not allowed(capped, {"amount": 100.01})
    for unreadable in ({}, {"amount": "50"}, {"amount": True}, {"amount": None}):
        assert not allowed(capped, unreadable), unreadable
    assert not allowed(capped, {"amount": float("nan")})
    assert not allowed(capped, {"amount": Decimal("NaN")})
    # Not rendered yet: only the grant's existence is checked (the engine re-checks later).
    assert allowed(capped, None)


def test_authorize_step_amount_field() -> None:
    capped = make_principal(make_grant("shop", "charge", max_amount=10, amount_field="cents"))
    assert allowed(capped, {"cents": 10, "amount": 10_000})
    assert not allowed(capped, {"cents": 11, "amount": 1})
    assert not allowed(capped, {"amount": 1})


def test_the_exact_grant_wins_over_the_wildcard() -> None:
    principal = make_principal(
        make_grant("shop", "*"), make_grant("shop", "charge", max_amount=100)
    )
    assert not allowed(principal, {"amount": 500})
    assert allowed(principal, {"amount": 500}, action="refund")


def test_authorize_step_logs_the_reason_for_operators(
    info_logs: list[MutableMapping[str, Any]],
) -> None:
    capped = make_principal(make_grant("shop", "charge", max_amount=100))
    assert not allowed(capped, {"amount": 101})
    assert not allowed(make_principal(), None)
    assert [e["reason"] for e in info_logs] == ["over_cap", "no_grant"]
    assert all(e["log_level"] == "info" for e in info_logs)


def readable_error(principal: Principal, reads: Mapping[str, set[str]]) -> str | None:
    try:
        check_readable(principal, reads)
    except FieldNotReadable as exc:
        assert exc.http_status == 403
        assert set(exc.envelope()["details"]) == {"field"}
        return str(exc.details["field"])
    return None


def test_check_readable() -> None:
    everything = make_principal(make_grant("shop", "charge"))
    assert readable_error(everything, {"shop.charge": {"id", "amount"}}) is None
    narrow = make_principal(make_grant("shop", "charge", "read", readable=("id",)))
    assert readable_error(narrow, {"shop.charge": {"id"}}) is None
    assert readable_error(narrow, {"shop.charge": {"id", "card"}}) == "shop.charge.card"
    assert readable_error(narrow, {"shop.refund": {"id"}}) == "shop.refund.id"
    manager_only = make_principal(make_grant("shop", "charge", "manage"))
    assert readable_error(manager_only, {"shop.charge": {"id"}}) == "shop.charge.id"
    wildcard = make_principal(make_grant("shop", "*", "read", readable=("id",)))
    assert readable_error(wildcard, {"shop.refund": {"id"}}) is None
    assert readable_error(wildcard, {"shop.refund": {"total"}}) == "shop.refund.total"


def test_check_readable_joins_the_fields_of_the_deciding_grants() -> None:
    principal = make_principal(
        make_grant("shop", "charge", "execute", readable=("id",)),
        make_grant("shop", "charge", "read", readable=("amount",)),
        make_grant("shop", "*", "read"),  # less specific: not consulted for shop.charge
    )
    assert readable_error(principal, {"shop.charge": {"id", "amount"}}) is None
    assert readable_error(principal, {"shop.charge": {"card"}}) == "shop.charge.card"


def test_check_readable_names_the_first_field_in_sorted_order() -> None:
    narrow = make_principal(make_grant("shop", "charge", readable=()))
    reads = {"shop.refund": {"b", "a"}, "shop.charge": {"z", "y"}}
    assert readable_error(narrow, reads) == "shop.charge.y"


def test_manages() -> None:
    principal = make_principal(
        make_grant("shop", "charge", "manage"), make_grant("mail", "*", "manage")
    )
    assert manages(principal, ["shop.charge"])
    assert manages(principal, ["shop.charge", "mail.send", "mail.bounce"])
    assert not manages(principal, ["shop.charge", "shop.refund"])
    assert not manages(make_principal(make_grant("shop", "charge")), ["shop.charge"])
    assert not manages(principal, [])
    assert not manages(principal, ["shopcharge"])


MOUNT = ("room", "room-1")
GOOD_SNAPSHOT = {"version": 1, "scope": {"kind": "room", "id": "room-1"}, "resource_ids": ["a.b"]}


def test_the_invoker_always_sees_its_execution() -> None:
    bare = make_principal()
    assert can_see_execution(
        bare, invoker_kind="user", invoker_id="u1", snapshot=None, mounted_scope=MOUNT
    )
    # Same id, other kind: a client "u1" is somebody else.
    assert not can_see_execution(
        bare, invoker_kind="client", invoker_id="u1", snapshot=None, mounted_scope=MOUNT
    )
    assert not can_see_execution(
        bare, invoker_kind=None, invoker_id=None, snapshot=None, mounted_scope=MOUNT
    )


def test_a_manager_in_scope_sees_it() -> None:
    manager = make_principal(make_grant("a", "b", "manage"))
    assert can_see_execution(
        manager, invoker_kind="user", invoker_id="u9", snapshot=GOOD_SNAPSHOT, mounted_scope=MOUNT
    )
    assert not can_see_execution(
        manager,
        invoker_kind="user",
        invoker_id="u9",
        snapshot=GOOD_SNAPSHOT,
        mounted_scope=("room", "room-2"),
    )
    executor = make_principal(make_grant("a", "b"))
    assert not can_see_execution(
        executor, invoker_kind="user", invoker_id="u9", snapshot=GOOD_SNAPSHOT, mounted_scope=MOUNT
    )


@pytest.mark.parametrize(
    "snapshot",
    [
        None,
        [],
        "snapshot",
        {},
        {**GOOD_SNAPSHOT, "version": 2},
        {**GOOD_SNAPSHOT, "version": True},
        {**GOOD_SNAPSHOT, "version": "1"},
        {k: v for k, v in GOOD_SNAPSHOT.items() if k != "version"},
        {**GOOD_SNAPSHOT, "scope": None},
        {**GOOD_SNAPSHOT, "scope": ["room", "room-1"]},
        {**GOOD_SNAPSHOT, "scope": {"kind": "room"}},
        {**GOOD_SNAPSHOT, "scope": {"kind": "room", "id": 1}},
        {**GOOD_SNAPSHOT, "resource_ids": "a.b"},
        {**GOOD_SNAPSHOT, "resource_ids": ["a.b", 3]},
        {**GOOD_SNAPSHOT, "resource_ids": []},
        {k: v for k, v in GOOD_SNAPSHOT.items() if k != "resource_ids"},
    ],
)
def test_malformed_snapshots_are_invisible(snapshot: Any) -> None:
    manager = make_principal(make_grant("a", "b", "manage"))
    assert not can_see_execution(
        manager, invoker_kind="user", invoker_id="u9", snapshot=snapshot, mounted_scope=MOUNT
    )
