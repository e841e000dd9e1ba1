"""``agent-txn principals …``: who may run commands, with which grants, in which rooms.

Commands run with their caller's own rights (no definer rights), so an operator needs a way to
create principals, shape their grants and room memberships, and mint a token for local testing.
Every subcommand takes ``--db`` like the rest of the CLI and fails the same way: one ``error:``
line on stderr, exit code 2. The store is opened with ``auto_upgrade="never"``: a missing schema
is reported (run ``agent-txn db upgrade``), never created behind the operator's back.

API keys are generated here, printed once, and stored only as their SHA-256.

The shared CLI plumbing (error reporting, URL checks) is imported from :mod:`orchestrator.cli`
inside the functions: ``cli`` imports this module to register it, so a module-level import back
would be circular.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from enum import StrEnum
from typing import Annotated, Any, Final, TypeVar

import typer
from rich.markup import escape

from ledger import principals as repo
from ledger.schema import NAME_LENGTH, SAGA_NAME_LENGTH, TENANT_LENGTH
from ledger.store import Store, Work
from orchestrator.authz import MIN_HS256_SECRET_BYTES, hash_api_key

T = TypeVar("T")

#: Same default and environment variable as every other ``--db`` option of the CLI.
DEFAULT_DB: Final = "sqlite+aiosqlite:///agent.db"
DB_ENV: Final = "AGENT_TXN_DB"
SECRET_ENV: Final = "AGENT_TXN_JWT_SECRET"
#: Prefix of generated API keys, so a leaked one is recognisable in logs and secret scanners.
API_KEY_PREFIX: Final = "atk_"

principals_app = typer.Typer(
    help="Principals, their grants and their room memberships.", no_args_is_help=True
)

DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        envvar=DB_ENV,
        help="agent-txn database URL (sqlite+aiosqlite:///path.db or postgresql+asyncpg://…).",
        show_envvar=True,
    ),
]


class KindChoice(StrEnum):
    """Principal kinds."""

    user = "user"
    client = "client"


class PermissionChoice(StrEnum):
    """Grant permissions."""

    execute = "execute"
    read = "read"
    manage = "manage"
    approve = "approve"


class LanguageChoice(StrEnum):
    """Room languages with guidance strings."""

    en = "en"
    zh_tw = "zh-TW"


def generate_api_key() -> str:
    """A fresh API key: 256 random bits, URL-safe."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


@asynccontextmanager
async def _store(url: str) -> AsyncIterator[Store]:
    from orchestrator import cli

    url = cli._checked_url(url)
    cli._require_existing(url)
    store = await Store.open(url, auto_upgrade="never")
    try:
        yield store
    finally:
        await store.close()


def _run(db: str, job: Callable[[Store], Awaitable[T]]) -> T:
    """Open the store and run ``job``; expected failures end as one line on stderr (exit 2)."""
    from orchestrator import cli

    async def main() -> T:
        async with _store(db) as store:
            return await job(store)

    return cli._run(main())


def _refuse(message: str) -> Exception:
    """A clean one-line failure, raised inside a job (``cli._run`` reports it)."""
    from orchestrator import cli

    return cli.CliFailure(message)


def _print(text: str) -> None:
    from orchestrator import cli

    cli._stdout().print(text, soft_wrap=True)


def checked_text(value: str, hint: str, longest: int) -> str:
    """Refuse values the columns cannot hold, before PostgreSQL does it with a traceback.

    Also used for names that only select (``list --tenant``, ``ops deliveries ROOM``): a value
    no row can have would answer with nothing, as if the name were right and simply empty."""
    if not 0 < len(value) <= longest or value.strip() != value:
        raise typer.BadParameter(
            f"1 to {longest} characters, no surrounding spaces", param_hint=hint
        )
    return value


async def _require_principal(store: Store, principal_id: str) -> repo.PrincipalRow:
    async with store.read() as conn:
        row = await repo.get_principal(conn, principal_id)
    if row is None:
        raise _refuse(f"no principal {principal_id!r}")
    return row


async def _require_live(work: Work, principal_id: str) -> repo.PrincipalRow:
    """The principal, read inside the changing transaction; a deleted one is refused.

    A deleted principal is refused by every request whatever its flags, grants or rooms, so
    enabling, verifying, granting or joining it only printed a success that changed nothing an
    operator could use (and ``list`` then showed it ``[verified,deleted]``)."""
    row = await repo.get_principal(work.conn, principal_id)
    if row is None:
        raise _refuse(f"no principal {principal_id!r}")
    if not row.alive:
        raise _refuse(f"principal {principal_id!r} is deleted: it can no longer be changed")
    return row


# -- principals ---------------------------------------------------------------------------------


@principals_app.command("add")
def add(
    principal_id: Annotated[str, typer.Argument(help="The principal's id.")],
    kind: Annotated[KindChoice, typer.Option("--kind", help="user or client.")],
    name: Annotated[str, typer.Option("--name", help="Display name.")],
    tenant: Annotated[str, typer.Option("--tenant", help="Tenant it belongs to.")] = "default",
    unverified: Annotated[
        bool, typer.Option("--unverified", help="Create it unverified (refused until verified).")
    ] = False,
    api_key: Annotated[
        bool, typer.Option("--api-key", help="Generate an API key and print it once.")
    ] = False,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Create a principal (verified unless --unverified)."""
    checked_text(principal_id, "PRINCIPAL_ID", 64)
    checked_text(tenant, "--tenant", TENANT_LENGTH)
    checked_text(name, "--name", SAGA_NAME_LENGTH)
    key = generate_api_key() if api_key else None

    async def job(store: Store) -> None:
        async with store.read() as conn:
            if await repo.get_principal(conn, principal_id) is not None:
                raise _refuse(f"principal {principal_id!r} already exists")
        async with store.transaction() as work:
            await repo.add_principal(
                work,
                principal_id=principal_id,
                tenant=tenant,
                kind=kind.value,
                name=name,
                verified=not unverified,
                api_key_sha256=hash_api_key(key) if key else None,
            )

    _run(db, job)
    state = "unverified" if unverified else "verified"
    _print(f"added {kind.value} {escape(principal_id)} in tenant {escape(tenant)} ({state})")
    if key:
        typer.echo(f"api key (shown once; only its SHA-256 is stored): {key}")


def _flags(row: repo.PrincipalRow) -> str:
    flags = ["verified" if row.verified else "unverified"]
    if row.disabled:
        flags.append("disabled")
    if not row.alive:
        flags.append("deleted")
    if row.api_key_sha256:
        flags.append("api-key")
    return ",".join(flags)


def _grant_text(g: repo.GrantRow) -> str:
    text = f"{g.permission} {g.provider}.{g.action}"
    if g.max_amount is not None:
        text += f" max {g.amount_field or 'amount'} <= {g.max_amount}"
    if g.readable_fields is not None:
        text += f" readable [{', '.join(g.readable_fields)}]"
    return text


@principals_app.command("list")
def list_(
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Every principal with its flags, grants and rooms."""
    if tenant is not None:
        checked_text(tenant, "--tenant", TENANT_LENGTH)  # as add refuses it: '' would list nothing

    async def job(
        store: Store,
    ) -> list[tuple[repo.PrincipalRow, list[repo.GrantRow], list[repo.MembershipRow]]]:
        async with store.read() as conn:
            rows = await repo.list_principals(conn, tenant=tenant)
            return [
                (
                    row,
                    await repo.grants_of(conn, row.principal_id),
                    await repo.memberships_of(conn, row.principal_id),
                )
                for row in rows
            ]

    found = _run(db, job)
    if as_json:
        data: list[dict[str, Any]] = [
            {
                "principal_id": row.principal_id,
                "tenant": row.tenant,
                "kind": row.kind,
                "name": row.name,
                "verified": row.verified,
                "disabled": row.disabled,
                "deleted": not row.alive,
                "api_key": row.api_key_sha256 is not None,
                "grants": [
                    {
                        "grant_id": g.grant_id,
                        "provider": g.provider,
                        "action": g.action,
                        "permission": g.permission,
                        "max_amount": g.max_amount,
                        "amount_field": g.amount_field,
                        "readable_fields": (
                            None if g.readable_fields is None else list(g.readable_fields)
                        ),
                    }
                    for g in grants
                ],
                "rooms": [
                    {"room_id": m.room_id, "language": m.language, "current": m.current}
                    for m in rooms
                ],
            }
            for row, grants, rooms in found
        ]
        typer.echo(json.dumps(data, indent=2, sort_keys=True))  # exact: no markup, no wrapping
        return
    if not found:
        _print("no principals")
        return
    for row, grants, rooms in found:
        _print(
            f"{escape(row.principal_id)} {row.kind} tenant={escape(row.tenant)} "
            f"name={escape(json.dumps(row.name, ensure_ascii=False))} {escape(f'[{_flags(row)}]')}"
        )
        for g in grants:
            _print(f"  grant {escape(_grant_text(g))}")
        for m in rooms:
            state = "member" if m.current else "left"
            language = f" ({escape(m.language)})" if m.language else ""
            _print(f"  room {escape(m.room_id)}{language} {state}")


def _set_flags(db: str, principal_id: str, done: str, **flags: bool) -> None:
    async def job(store: Store) -> None:
        async with store.transaction() as work:
            await _require_live(work, principal_id)
            await repo.set_flags(work, principal_id, **flags)

    _run(db, job)
    _print(f"{escape(principal_id)} {done}")


IdArgument = Annotated[str, typer.Argument(help="The principal's id.")]


@principals_app.command("disable")
def disable(principal_id: IdArgument, db: DbOption = DEFAULT_DB) -> None:
    """Refuse every command of the principal until enabled again."""
    _set_flags(db, principal_id, "disabled", disabled=True)


@principals_app.command("enable")
def enable(principal_id: IdArgument, db: DbOption = DEFAULT_DB) -> None:
    """Lift a disable."""
    _set_flags(db, principal_id, "enabled", disabled=False)


@principals_app.command("verify")
def verify(principal_id: IdArgument, db: DbOption = DEFAULT_DB) -> None:
    """Mark the principal verified (unverified principals are refused)."""
    _set_flags(db, principal_id, "verified", verified=True)


@principals_app.command("delete")
def delete(principal_id: IdArgument, db: DbOption = DEFAULT_DB) -> None:
    """Soft-delete the principal: refused from now on; its audit trail keeps the id."""
    _set_flags(db, principal_id, "deleted", deleted=True)


# -- grants -------------------------------------------------------------------------------------


@principals_app.command("grant")
def grant(
    principal_id: IdArgument,
    provider: Annotated[str, typer.Argument(help="Provider name.")],
    action: Annotated[str, typer.Argument(help="Action name, or * for every action.")],
    permission: Annotated[
        PermissionChoice, typer.Option("--permission", help="What the grant allows.")
    ] = PermissionChoice.execute,
    max_amount: Annotated[
        int | None,
        typer.Option(
            "--max-amount", min=0, max=repo.MAX_AMOUNT, help="Cap on the payload's amount."
        ),
    ] = None,
    amount_field: Annotated[
        str | None, typer.Option("--amount-field", help="Payload key the cap applies to.")
    ] = None,
    readable: Annotated[
        list[str] | None,
        typer.Option("--readable", help="A readable result field (repeat); default: all."),
    ] = None,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Grant a permission on a provider action (granting again replaces cap and fields)."""
    checked_text(provider, "PROVIDER", NAME_LENGTH)
    checked_text(action, "ACTION", NAME_LENGTH)
    for field in readable or ():
        checked_text(field, "--readable", 100)  # an empty or space-padded name was stored as given
    if amount_field is not None:
        checked_text(amount_field, "--amount-field", 100)
        if max_amount is None:
            raise typer.BadParameter(
                "only meaningful with --max-amount", param_hint="--amount-field"
            )

    async def job(store: Store) -> str:
        async with store.transaction() as work:
            await _require_live(work, principal_id)
            return await repo.grant(
                work,
                principal_id=principal_id,
                provider=provider,
                action=action,
                permission=permission.value,
                max_amount=max_amount,
                amount_field=amount_field,
                readable_fields=readable,
            )

    grant_id = _run(db, job)
    _print(
        f"granted {permission.value} on {escape(provider)}.{escape(action)} "
        f"to {escape(principal_id)} (grant {grant_id})"
    )


@principals_app.command("revoke")
def revoke(
    principal_id: IdArgument,
    provider: Annotated[str, typer.Argument(help="Provider name.")],
    action: Annotated[str, typer.Argument(help="Action name, or * (exactly as granted).")],
    permission: Annotated[
        PermissionChoice, typer.Option("--permission", help="Which grant to remove.")
    ] = PermissionChoice.execute,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Remove one grant."""

    async def job(store: Store) -> None:
        async with store.transaction() as work:
            if not await repo.revoke(work, principal_id, provider, action, permission.value):
                raise _refuse(
                    f"{principal_id!r} has no {permission.value} grant on {provider}.{action}"
                )

    _run(db, job)
    what = f"{permission.value} on {escape(provider)}.{escape(action)}"
    _print(f"revoked {what} from {escape(principal_id)}")


# -- rooms --------------------------------------------------------------------------------------

RoomArgument = Annotated[str, typer.Argument(help="The room's id.")]


@principals_app.command("join")
def join(
    principal_id: IdArgument,
    room_id: RoomArgument,
    language: Annotated[
        LanguageChoice | None, typer.Option("--language", help="The member's language.")
    ] = None,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Make the principal a member of the room (again, if it had left)."""
    checked_text(room_id, "ROOM_ID", 64)

    async def job(store: Store) -> None:
        async with store.transaction() as work:
            await _require_live(work, principal_id)
            await repo.join_room(work, room_id, principal_id, language.value if language else None)

    _run(db, job)
    _print(f"{escape(principal_id)} joined {escape(room_id)}")


@principals_app.command("leave")
def leave(principal_id: IdArgument, room_id: RoomArgument, db: DbOption = DEFAULT_DB) -> None:
    """End the principal's membership of the room (room-scoped commands refuse it from now)."""

    async def job(store: Store) -> None:
        async with store.transaction() as work:
            if not await repo.leave_room(work, room_id, principal_id):
                raise _refuse(f"{principal_id!r} is not a member of {room_id!r}")

    _run(db, job)
    _print(f"{escape(principal_id)} left {escape(room_id)}")


# -- tokens -------------------------------------------------------------------------------------


@principals_app.command("token")
def token(
    principal_id: IdArgument,
    secret: Annotated[
        str,
        typer.Option(
            "--secret",
            envvar=SECRET_ENV,
            show_envvar=True,
            help=f"HS256 secret (at least {MIN_HS256_SECRET_BYTES} bytes).",
        ),
    ],
    ttl_seconds: Annotated[
        int, typer.Option("--ttl-seconds", min=1, max=31 * 86400, help="Lifetime.")
    ] = 3600,
    room: Annotated[str | None, typer.Option("--room", help="Bind the token to a room.")] = None,
    audience: Annotated[str | None, typer.Option("--audience", help="aud claim.")] = None,
    issuer: Annotated[str | None, typer.Option("--issuer", help="iss claim.")] = None,
    ai: Annotated[bool, typer.Option("--ai", help="Mark the caller as an AI agent.")] = False,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Print an HS256 JWT for the principal (for local use and tests)."""
    if len(secret.encode()) < MIN_HS256_SECRET_BYTES:
        raise typer.BadParameter(
            f"must be at least {MIN_HS256_SECRET_BYTES} bytes", param_hint="--secret"
        )
    if room is not None:
        checked_text(room, "--room", 64)
    for hint, claim in (("--audience", audience), ("--issuer", issuer)):
        if claim is not None:
            checked_text(claim, hint, 256)  # an empty aud or iss matches no server's setting

    async def job(store: Store) -> tuple[repo.PrincipalRow, repo.MembershipRow | None]:
        row = await _require_principal(store, principal_id)
        if room is None:
            return row, None
        async with store.read() as conn:
            return row, await repo.membership(conn, room, principal_id)

    row, member = _run(db, job)
    # Every request with such a token would be refused (authz.load_principal, in its order):
    # say so now, not there.
    state = next(
        (
            name
            for name, refused in (
                ("deleted", not row.alive),
                ("unverified", not row.verified),
                ("disabled", row.disabled),
            )
            if refused
        ),
        None,
    )
    from orchestrator import cli

    if state is not None:
        cli._fail(f"principal {principal_id!r} is {state}: its tokens would be refused")
    if room is not None and (member is None or not member.current):
        cli._fail(
            f"principal {principal_id!r} is not a member of room {room!r}: "
            "a token bound to it would be refused"
        )
    now = int(time.time())
    claims: dict[str, Any] = {
        "sub": row.principal_id,
        "kind": row.kind,
        "tenant": row.tenant,
        "iat": now,
        "exp": now + ttl_seconds,
    }
    optional = {"room": room, "aud": audience, "iss": issuer}
    claims.update({k: v for k, v in optional.items() if v is not None})
    if ai:
        claims["ai"] = True
    import jwt  # local: only this command signs tokens (PyJWT is a twentieth of start-up)

    typer.echo(jwt.encode(claims, secret, algorithm="HS256"))
