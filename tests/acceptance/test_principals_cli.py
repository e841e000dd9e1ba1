"""``agent-txn principals …`` end to end, on both backends.

Most runs go through typer's ``CliRunner`` against the real ``agent-txn`` app (fast, in process);
one subprocess run proves the sub-app is registered when ``agent-txn`` runs as a real process and
that failures end as one ``error:`` line there too. What the CLI writes is checked with the library
itself: the token it mints authenticates, the principal it creates loads, the grant it records
authorizes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from typer.testing import CliRunner, Result

from ledger import principals as repo
from ledger.schema import PERMISSIONS, PRINCIPAL_KINDS
from ledger.store import Store
from orchestrator import cli
from orchestrator import principals_cli as pcli
from orchestrator.authz import (
    AuthSettings,
    Caller,
    authenticate_api_key,
    authenticate_jwt,
    authorize_step,
    hash_api_key,
    load_principal,
)
from orchestrator.errors import PrincipalNotAuthorized

if TYPE_CHECKING:
    from tests.conftest import DbUrls

REPO = Path(__file__).resolve().parents[2]
SECRET = "local-test-secret-0123456789abcdef"


def run(*args: str) -> Result:
    env = {k: None for k in os.environ if k.startswith("AGENT_TXN_")}
    return CliRunner().invoke(cli.app, list(args), env=env)


def ok(*args: str) -> str:
    result = run(*args)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result.stdout


def prun(db: str, *args: str) -> Result:
    """``agent-txn principals *args --db db``."""
    return run("principals", *args, "--db", db)


def pc(db: str, *args: str) -> str:
    """``agent-txn principals *args --db db``, which must succeed; its stdout."""
    return ok("principals", *args, "--db", db)


def clean_failure(result: Result, code: int = 2) -> str:
    """Exit ``code`` with a one-line ``error:`` on stderr and no traceback; returns the line."""
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def with_store(url: str, job: Any) -> Any:
    async def main() -> Any:
        store = await Store.open(url, auto_upgrade="never")
        try:
            return await job(store)
        finally:
            await store.close()

    return asyncio.run(main())


@pytest.fixture
def db(db_urls: DbUrls) -> str:
    """A migrated database on the parametrized backend, as ``db upgrade`` leaves it."""
    ok("db", "upgrade", "--db", db_urls.store)
    return db_urls.store


def test_a_principal_from_the_cli_can_act(db: str) -> None:
    out = pc(db, "add", "u1", "--kind", "user", "--name", "Ann", "--tenant", "acme")
    assert out.strip() == "added user u1 in tenant acme (verified)"
    out = pc(
        db,
        "grant",
        "u1",
        "shop",
        "charge",
        "--max-amount",
        "100",
        "--readable",
        "id",
        "--readable",
        "status",
    )
    assert out.startswith("granted execute on shop.charge to u1 (grant ")
    assert pc(db, "join", "u1", "room-1", "--language", "zh-TW").strip() == "u1 joined room-1"
    token = pc(db, "token", "u1", "--secret", SECRET, "--room", "room-1")

    caller = authenticate_jwt(token.strip(), AuthSettings(jwt_secret=SECRET, tenant="acme"))
    assert caller == Caller("u1", "user", "jwt", room_id="room-1")

    async def job(store: Store) -> None:
        async with store.read() as conn:
            principal = await load_principal(
                conn, caller, tenant="acme", scope_kind="room", scope_id="room-1"
            )
        assert principal.membership is not None and principal.membership.language == "zh-TW"
        (grant,) = principal.grants
        assert grant.readable_fields == ("id", "status")
        authorize_step(principal, provider="shop", action="charge", payload={"amount": 100})
        with pytest.raises(PrincipalNotAuthorized):
            authorize_step(principal, provider="shop", action="charge", payload={"amount": 101})

    with_store(db, job)


def test_api_key_is_printed_once_and_stored_as_its_hash(db: str) -> None:
    out = pc(db, "add", "bot", "--kind", "client", "--name", "Bot", "--api-key")
    key_line = next(line for line in out.splitlines() if line.startswith("api key"))
    key = key_line.rsplit(" ", 1)[1]
    assert key.startswith(pcli.API_KEY_PREFIX) and len(key) > 40

    async def job(store: Store) -> tuple[Caller, repo.PrincipalRow | None]:
        async with store.read() as conn:
            row = await repo.get_principal(conn, "bot")
            return await authenticate_api_key(conn, key), row

    caller, row = with_store(db, job)
    assert caller == Caller("bot", "client", "api_key")
    assert row is not None and row.api_key_sha256 == hash_api_key(key)
    listing = pc(db, "list")
    assert key not in listing and hash_api_key(key) not in listing
    assert "api-key" in listing
    # Two principals never share a key: a second add generates another one.
    again = pc(db, "add", "bot2", "--kind", "client", "--name", "B", "--api-key")
    assert key not in again


def test_flags_and_list(db: str) -> None:
    pc(db, "add", "u1", "--kind", "user", "--name", "Ann Lee", "--unverified")
    pc(db, "add", "u2", "--kind", "user", "--name", "Bo")
    pc(db, "grant", "u1", "shop", "*", "--permission", "manage")
    pc(db, "join", "u1", "room-1")
    pc(db, "leave", "u1", "room-1")
    text = pc(db, "list")
    assert 'u1 user tenant=default name="Ann Lee" [unverified]' in text
    assert "  grant manage shop.*" in text
    assert "  room room-1 left" in text

    assert pc(db, "verify", "u1").strip() == "u1 verified"
    assert pc(db, "disable", "u1").strip() == "u1 disabled"
    pc(db, "delete", "u2")
    data = {p["principal_id"]: p for p in json.loads(pc(db, "list", "--json"))}
    assert (data["u1"]["verified"], data["u1"]["disabled"], data["u1"]["deleted"]) == (
        True,
        True,
        False,
    )
    assert data["u2"]["deleted"] is True
    assert data["u1"]["rooms"] == [{"room_id": "room-1", "language": None, "current": False}]
    pc(db, "enable", "u1")
    data = {p["principal_id"]: p for p in json.loads(pc(db, "list", "--json"))}
    assert data["u1"]["disabled"] is False

    async def job(store: Store) -> None:
        async with store.read() as conn:
            with pytest.raises(PrincipalNotAuthorized):  # deleted
                await load_principal(
                    conn, Caller.user("u2"), tenant="default", scope_kind="company", scope_id="x"
                )
            await load_principal(
                conn, Caller.user("u1"), tenant="default", scope_kind="company", scope_id="x"
            )

    with_store(db, job)


def test_revoke_and_regrant(db: str) -> None:
    pc(db, "add", "u1", "--kind", "user", "--name", "Ann")
    first = pc(db, "grant", "u1", "shop", "charge", "--max-amount", "5")
    second = pc(db, "grant", "u1", "shop", "charge")
    assert first.split("(grant ")[1] == second.split("(grant ")[1]  # upsert keeps the id
    grants = json.loads(pc(db, "list", "--json"))[0]["grants"]
    assert [(g["action"], g["max_amount"]) for g in grants] == [("charge", None)]
    assert pc(db, "revoke", "u1", "shop", "charge").strip() == (
        "revoked execute on shop.charge from u1"
    )
    line = clean_failure(prun(db, "revoke", "u1", "shop", "charge"))
    assert line == "error: 'u1' has no execute grant on shop.charge"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["disable", "ghost"], "error: no principal 'ghost'"),
        (["delete", "ghost"], "error: no principal 'ghost'"),
        (["grant", "ghost", "shop", "charge"], "error: no principal 'ghost'"),
        (["join", "ghost", "room-1"], "error: no principal 'ghost'"),
        (["leave", "u1", "room-9"], "error: 'u1' is not a member of 'room-9'"),
        (["token", "ghost", "--secret", SECRET], "error: no principal 'ghost'"),
        (["add", "u1", "--kind", "user", "--name", "X"], "error: principal 'u1' already exists"),
    ],
)
def test_unknown_ids_are_one_clean_line(db: str, args: list[str], message: str) -> None:
    pc(db, "add", "u1", "--kind", "user", "--name", "Ann")
    assert clean_failure(prun(db, *args)) == message


@pytest.mark.parametrize(
    ("args", "blamed"),
    [
        (["add", "u1", "--kind", "robot", "--name", "X"], "--kind"),
        (["add", " u1", "--kind", "user", "--name", "X"], "PRINCIPAL_ID"),
        (["add", "x" * 65, "--kind", "user", "--name", "X"], "PRINCIPAL_ID"),
        (["add", "u1", "--kind", "user", "--name", ""], "--name"),
        (["grant", "u1", "shop", "charge", "--permission", "admin"], "--permission"),
        (["grant", "u1", "shop", "charge", "--amount-field", "cents"], "--amount-field"),
        (["grant", "u1", "shop", "charge", "--max-amount", "-1"], "--max-amount"),
        # Past the BIGINT column: the driver's OverflowError (or the statement) before.
        (["grant", "u1", "shop", "charge", "--max-amount", str(2**63)], "--max-amount"),
        (["grant", "u1", "shop", "charge", "--readable", ""], "--readable"),
        (["grant", "u1", "shop", "charge", "--readable", " total"], "--readable"),
        (["join", "u1", "room-1", "--language", "fr"], "--language"),
        (["token", "u1", "--secret", "too-short"], "--secret"),
        (["token", "u1", "--secret", "s" * 32, "--audience", ""], "--audience"),
        (["token", "u1", "--secret", "s" * 32, "--issuer", " x"], "--issuer"),
        # A tenant no principal can have listed nothing, as if it were right and empty.
        (["list", "--tenant", ""], "--tenant"),
    ],
)
def test_bad_values_are_usage_errors(tmp_path: Path, args: list[str], blamed: str) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path / 'agent.db'}"
    result = prun(db, *args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert blamed in result.stderr
    assert not (tmp_path / "agent.db").exists()  # refused before touching the database


@pytest.mark.parametrize("state", ["disable", "delete"])
def test_no_token_for_a_principal_every_request_would_refuse(db: str, state: str) -> None:
    pc(db, "add", "u1", "--kind", "user", "--name", "Ann")
    assert pc(db, "token", "u1", "--secret", SECRET).count(".") == 2  # a JWT while it is live
    pc(db, state, "u1")
    line = clean_failure(prun(db, "token", "u1", "--secret", SECRET))
    assert line == f"error: principal 'u1' is {state}d: its tokens would be refused"


def test_missing_database_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "absent.db"
    line = clean_failure(run("principals", "list", "--db", f"sqlite:///{path}"))
    assert "db upgrade" in line
    assert not path.exists()


def test_token_claims(db: str) -> None:
    import jwt

    pc(db, "add", "c1", "--kind", "client", "--name", "Bot", "--tenant", "t2")
    token = pc(
        db,
        "token",
        "c1",
        "--secret",
        SECRET,
        "--ttl-seconds",
        "60",
        "--ai",
        "--audience",
        "agent-txn",
    ).strip()
    claims = jwt.decode(token, SECRET, algorithms=["HS256"], audience="agent-txn")
    assert claims["exp"] - claims["iat"] == 60
    assert (claims["sub"], claims["kind"], claims["tenant"], claims["ai"]) == (
        "c1",
        "client",
        "t2",
        True,
    )
    assert "room" not in claims
    strict = AuthSettings(jwt_secret=SECRET, tenant="t2", audience="agent-txn")
    assert authenticate_jwt(token, strict) == Caller("c1", "client", "jwt", ai=True)
    with pytest.raises(PrincipalNotAuthorized):  # minted for tenant t2, not the default one
        authenticate_jwt(token, AuthSettings(jwt_secret=SECRET, audience="agent-txn"))


def test_options_match_the_rest_of_the_cli_and_the_schema() -> None:
    assert (pcli.DB_ENV, pcli.DEFAULT_DB) == (cli.DB_ENV, cli.DEFAULT_DB)
    assert [c.value for c in pcli.PermissionChoice] == list(PERMISSIONS)
    assert [c.value for c in pcli.KindChoice] == list(PRINCIPAL_KINDS)


def test_installed_cli_has_principals_and_fails_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_TXN_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))

    def agent_txn(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )

    helped = agent_txn("principals", "--help")
    assert helped.returncode == 0 and "token" in helped.stdout and "grant" in helped.stdout
    bad = agent_txn("principals", "list", "--db", "mysql://root@localhost/x")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: --db: unsupported database 'mysql'")
    assert len(bad.stderr.strip().splitlines()) == 1
