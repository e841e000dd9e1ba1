"""The ``agent-txn`` command line: ``demo``, ``db upgrade|current``, ``ledger show|verify``.

Every command that reads opens the store with ``auto_upgrade="never"``: a missing or outdated
schema is reported (``run agent-txn db upgrade``), never silently created. Errors the engine
raises on purpose (:class:`~orchestrator.errors.AgentTxnError`, storage errors, bad URLs) end as
one line on stderr with exit code 2; exit code 1 means the command ran and found a problem
(ledger verification failed, a demo order did not end as expected).

Sub-apps are plain :class:`typer.Typer` instances added with ``app.add_typer``, so later
commands (``worker``, ``review``, ``fault-inject``, ``bench``, ``serve``) slot in the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, Final, NoReturn, TypeVar
from urllib.parse import unquote

import typer
from pydantic import ValidationError
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text
from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from ledger import dialects, migrate
from ledger.errors import ForeignDatabase, StorageError
from ledger.schema import ledger as ledger_table
from ledger.schema import transactions as transactions_table
from ledger.store import SQLITE_WRITERS, SqliteWriter
from orchestrator.config import MAX_POLL_SECONDS, EngineSettings
from orchestrator.demo import (
    DemoError,
    compact_json,
    require_fresh,
    run_demo,
    same_database,
    subject_labels,
    transition,
    utc_iso,
)
from orchestrator.engine import Orchestrator
from orchestrator.errors import AgentTxnError, SchemaOutdatedError
from orchestrator.logging import LEVELS, configure_logging, level_number
from orchestrator.mcp_server import mcp as mcp_command
from orchestrator.ops_cli import ops_app
from orchestrator.principals_cli import principals_app
from orchestrator.serve import SqliteWriterOption
from orchestrator.serve import serve as serve_command
from providers.fake.store import ShopDatabaseError, shop_url

T = TypeVar("T")

DEFAULT_DB: Final = "sqlite+aiosqlite:///agent.db"
DB_ENV: Final = "AGENT_TXN_DB"
LOG_LEVEL_ENV: Final = "AGENT_TXN_LOG_LEVEL"
#: Exit code for "could not run" (bad input, missing schema, unknown id); 1 is "ran, found a
#: problem", as with grep and diff.
EXIT_USAGE: Final = 2
EXIT_PROBLEM: Final = 1
#: Below this many columns ``ledger show`` puts each row's detail on a line of its own.
WIDE_TABLE: Final = 130

app = typer.Typer(
    name="agent-txn",
    help="A saga engine for the side effects of AI agents.",
    no_args_is_help=True,
    add_completion=False,
    # Locals would print database URLs with their passwords.
    pretty_exceptions_show_locals=False,
)
db_app = typer.Typer(help="Schema migrations.", no_args_is_help=True)
ledger_app = typer.Typer(help="Read and verify the append-only ledger.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(ledger_app, name="ledger")
review_app = typer.Typer(help="Parked transactions: evidence and decisions.", no_args_is_help=True)
app.add_typer(review_app, name="review")
app.add_typer(principals_app, name="principals")
app.add_typer(ops_app, name="ops")
app.command("serve")(serve_command)
app.command("mcp")(mcp_command)

DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        envvar=DB_ENV,
        help="agent-txn database URL (sqlite+aiosqlite:///path.db or postgresql+asyncpg://…).",
        show_envvar=True,
    ),
]


class CliFailure(Exception):
    """A clean, expected failure: one message line and an exit code, no traceback."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def _stdout() -> Console:
    # Built per call, not at import: test runners swap sys.stdout after this module is loaded.
    # emoji=False: rich would draw ":x:" in an id, a reason or a module name as an emoji.
    console = Console(highlight=False, emoji=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        # Piped into a file or CI log, rich would wrap at 80 columns and split remote ids
        # and ledger details; a log has no edge to fit.
        console = Console(highlight=False, emoji=False, width=140)
    return console


def _say_error(message: str) -> None:
    Console(stderr=True, highlight=False, emoji=False).print(
        f"error: {escape(message)}", soft_wrap=True
    )


def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    _say_error(message)
    raise typer.Exit(code)


def _describe(exc: AgentTxnError) -> str:
    text = f"{exc.code}: {exc.message}"
    if exc.details:
        text += f" {compact_json(exc.details)}"
    cause = exc.__cause__
    # The engine hides storage details from API callers; an operator at a terminal wants the
    # (already sanitised) reason, e.g. "database unreachable".
    if isinstance(cause, StorageError) and str(cause) and str(cause) not in exc.message:
        text += f" ({cause})"
    return text


def _run(job: Coroutine[Any, Any, T]) -> T:
    """Run ``job``; expected failures become one line on stderr and exit code 2."""
    try:
        return asyncio.run(job)
    except Exception as exc:
        # A job that runs tasks in a TaskGroup (the bench's sagas in flight) fails with an
        # ExceptionGroup; what the operator needs is its first failure, said as if alone.
        first = _first_leaf(exc)
        failure = _expected_failure(first)
        if failure is None:
            raise  # a real bug keeps its traceback
        _fail(*failure)


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _expected_failure(exc: BaseException) -> tuple[str, int] | None:
    """The line and exit code for a failure a user can act on (``None``: a bug)."""
    if isinstance(exc, CliFailure):
        return exc.message, exc.code
    refusal = _server_refusal(exc)
    if refusal is not None:
        # Before the store's own wording: "refused the connection (3D000)" hid the server's
        # "database "x" does not exist", which names what to fix.
        return refusal, EXIT_USAGE
    if isinstance(exc, AgentTxnError):
        return _describe(exc), EXIT_USAGE
    if isinstance(exc, DemoError):
        return str(exc), EXIT_USAGE
    if isinstance(exc, StorageError):
        return f"{type(exc).__name__}: {exc}", EXIT_USAGE
    if isinstance(exc, ShopDatabaseError):  # --fake-shop / --provider-db: the user's URL
        return str(exc), EXIT_USAGE
    if isinstance(exc, Exception):
        message = _driver_message(exc)
        return None if message is None else (message, EXIT_USAGE)
    return None


#: SQLSTATE classes of PostgreSQL's refusals to let a session start: 28 (authorization: bad
#: user or password), 3D (invalid catalog name: no such database). Their text names what to fix
#: and holds no row data, unlike the messages of failed statements.
_SERVER_REFUSAL_CLASSES: Final = ("28", "3D")


def _server_refusal(exc: BaseException) -> str | None:
    """The server's own line when ``exc`` was caused (however wrapped: SQLAlchemy, the store's
    translation, an engine error) by PostgreSQL refusing the session; ``None`` otherwise."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        sqlstate = getattr(current, "sqlstate", None)
        driver = type(current).__module__.partition(".")[0] == "asyncpg"
        if driver and isinstance(sqlstate, str) and sqlstate[:2] in _SERVER_REFUSAL_CLASSES:
            return f"PostgreSQL: {current} ({type(current).__name__})"
        pending += [current.__cause__, current.__context__, getattr(current, "orig", None)]
    return None


def _driver_message(exc: Exception) -> str | None:
    """One line for a raw driver error, or ``None`` when ``exc`` is not one."""
    # asyncpg raises its server errors unwrapped while connecting (unknown database, bad
    # password); the server's text names the problem and holds no row data. Checked before
    # the translation, which knows only the SQLSTATE class ("refused the connection (3D000)").
    if type(exc).__module__.partition(".")[0] == "asyncpg":
        return f"PostgreSQL: {exc} ({type(exc).__name__})"
    # ``db upgrade`` talks to the engine without the store, so nothing translated its errors.
    translated = dialects.translate(exc)
    if translated is not None:
        return f"{type(translated).__name__}: {translated}"
    return None


def _checked_url(url: str, option: str = "--db") -> str:
    """``url`` normalised to its async driver; unsupported or malformed URLs fail cleanly."""
    try:
        normalized = dialects.normalize_url(url)
        dialects.dialect_of(normalized)
        make_url(normalized).get_dialect()  # is the driver installed?
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise CliFailure(f"{option}: {exc}") from None
    _check_sqlite_location(normalized, option)
    return normalized


def _check_sqlite_location(url: str, option: str) -> None:
    """Refuse a SQLite file SQLite cannot open or create, naming the option: the driver said
    only "StoreUnavailable: database operational error" for a folder given as the file or a
    file in a folder that does not exist, which left the operator guessing which URL."""
    path = _sqlite_path(url)
    if path is None:
        return
    if path.is_dir():
        raise CliFailure(f"{option}: {path} is a directory, not a SQLite database file")
    if not path.parent.is_dir():
        raise CliFailure(
            f"{option}: {path} does not exist and cannot be made: "
            f"directory {path.parent} does not exist"
        )


def engine_settings(**options: Any) -> EngineSettings:
    """:class:`EngineSettings` from command-line options, each passed under its field's name.

    A value the settings refuse (``--lease-seconds 5000`` past its 3 600, a ``--worker-id`` too
    long) is a :class:`CliFailure` naming the option and the bound, as a usage error says it,
    instead of pydantic's traceback. Only the validators' messages are shown, not the input.
    """
    try:
        return EngineSettings(**options)
    except ValidationError as exc:
        reasons = "; ".join(
            f"--{str(error['loc'][0]).replace('_', '-')}: {error['msg']}" for error in exc.errors()
        )
        raise CliFailure(reasons) from None


def _checked_sqlite_writer(value: str | None) -> SqliteWriter | None:
    """``--sqlite-writer`` (or ``AGENT_TXN_SQLITE_WRITER``): ``None`` leaves the engine's
    default."""
    if value is None:
        return None
    if value not in SQLITE_WRITERS:
        raise CliFailure(f"--sqlite-writer must be inline or process, not {value!r}")
    return value


def _sqlite_path(url: str) -> Path | None:
    """The file a SQLite URL opens, or ``None`` (not SQLite, or in memory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or dialects.in_memory(url):
        return None
    database = parsed.database or ""
    if database.startswith("file:") and parsed.query.get("uri") == "true":
        return _sqlite_uri_path(database, parsed.query.get("mode"))
    return Path(database)  # without uri=true, SQLite takes "file:x.db" as a plain file name


def _sqlite_uri_path(uri: str, mode: Any) -> Path | None:
    """The file of a SQLite ``file:`` URI (``file:x.db``, ``file:/abs/x.db``, ``file:///abs``),
    ``None`` for ``mode=memory``: skipping every ``file:`` name let each read command create
    the empty file it then refused as having no schema."""
    if mode == "memory":
        return None
    rest = uri.removeprefix("file:")
    if rest.startswith("//"):  # file://[localhost]/path: an authority, then an absolute path
        rest = "/" + rest[2:].partition("/")[2]
    return Path(unquote(rest))


def _refuse_in_memory(url: str) -> None:
    """An in-memory SQLite database is made empty for this command and gone after it: ``db
    upgrade`` said "schema upgraded" for it, and the read commands advised ``db upgrade``."""
    if dialects.in_memory(url):
        raise CliFailure(
            "an in-memory SQLite database lasts only as long as this command: give a file "
            "(sqlite:///path/agent.db)"
        )


def _require_existing(url: str) -> None:
    _refuse_in_memory(url)
    # SQLite would create an empty file on connect; a read command must not leave one behind.
    path = _sqlite_path(url)
    if path is not None and not path.exists():
        raise CliFailure(f"no agent-txn database at {path}; run `agent-txn db upgrade --db {url}`")
    if path is not None:
        _refuse_foreign_sqlite(path)


def _refuse_foreign_sqlite(path: Path) -> None:
    """Refuse another application's SQLite file before the engine opens it: its first connection
    switches the file to WAL, so a read-only command (``db current``, ``principals list``)
    changed a database it then refused as not agent-txn's. Read through a read-only connection,
    which changes nothing; a file it cannot read is left to the engine to report."""
    try:
        peek = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = peek.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        finally:
            peek.close()
    except sqlite3.Error:
        return
    tables = {str(name) for (name,) in rows}
    others = sorted(t for t in tables - {migrate.VERSION_TABLE} if not t.startswith("sqlite_"))
    if migrate.VERSION_TABLE not in tables and others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        foreign = ForeignDatabase(
            f"database holds other tables ({shown}) and no agent-txn schema: is it agent-txn's "
            "database? Nothing was changed; run `agent-txn db upgrade` to add its tables beside "
            "them on purpose"
        )
        # The registered code the engine gives the same refusal (Orchestrator.open).
        raise SchemaOutdatedError(str(foreign)) from foreign


async def _open_for_reading(url: str) -> Orchestrator:
    url = _checked_url(url)
    _require_existing(url)
    return await Orchestrator.open(url, auto_upgrade="never")


# -- root ---------------------------------------------------------------------------------------


@app.callback()
def _root(
    log_level: Annotated[
        str,
        typer.Option(
            "--log-level",
            envvar=LOG_LEVEL_ENV,
            show_envvar=True,
            help=f"Engine log level ({', '.join(LEVELS)}); logs go to stderr.",
        ),
    ] = "WARNING",
    log_json: Annotated[
        bool,
        typer.Option("--log-json/--log-text", help="JSON log lines (default) or plain text."),
    ] = True,
) -> None:
    """A saga engine for the side effects of AI agents."""
    try:
        level_number(log_level)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--log-level") from None
    configure_logging(log_level, json=log_json)


# -- demo ---------------------------------------------------------------------------------------


#: Left in the demo's folder beside its files. The demo recreates ``agent.db`` and
#: ``provider.db`` on every run, so it deletes them first, but only where it made them: a
#: folder without this mark may hold a real store (``agent.db`` is every other command's default
#: ``--db``; ``--dir .`` or ``--dir ""`` named the working folder and deleted it).
DEMO_MARK: Final = ".agent-txn-demo"
_SQLITE_SUFFIXES: Final = ("", "-wal", "-shm", "-journal")


def _sqlite_files(path: Path) -> list[Path]:
    return [path.with_name(path.name + suffix) for suffix in _SQLITE_SUFFIXES]


def _remove_sqlite_files(path: Path, directory: Path) -> None:
    """Delete the SQLite file ``path`` and its journals; a folder in the way (``agent.db/``)
    is refused before any is deleted, and a file that cannot be deleted is one line, not a
    traceback (``IsADirectoryError`` was one)."""
    files = _sqlite_files(path)
    for file in files:
        if file.is_dir() and not file.is_symlink():
            _fail(f"--dir {directory}: its {file.name} is a folder, not the demo's file")
    for file in files:
        try:
            file.unlink(missing_ok=True)
        except OSError as exc:
            _fail(f"--dir {directory}: cannot delete {file.name}: {exc.strerror or exc}")


def _demo_folder(directory: Path, names: list[str]) -> Path:
    """``directory``, made if need be and marked as the demo's, with the demo's files ``names``
    gone. Refused (nothing deleted) where one of them is there and the folder is not marked."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _fail(f"--dir {directory}: {exc.strerror or exc}")
    base = directory.resolve()
    if not (base / DEMO_MARK).is_file():
        for name in names:
            if any(base.joinpath(name + suffix).exists() for suffix in _SQLITE_SUFFIXES):
                _fail(
                    f"--dir {directory}: its {name} was not made by the demo, which would "
                    f"delete it; give a new or empty folder"
                )
        try:
            (base / DEMO_MARK).write_text("agent-txn demo: its files here are recreated\n")
        except OSError as exc:
            _fail(f"--dir {directory}: {exc.strerror or exc}")
    for name in names:
        _remove_sqlite_files(base / name, directory)
    return base


@app.command()
def demo(
    directory: Annotated[
        Path,
        typer.Option(
            "--dir",
            help="Where the demo's two SQLite files go (recreated on every run; a folder "
            "holding an agent.db or provider.db the demo did not make is refused).",
            file_okay=False,
        ),
    ] = Path("agent-txn-demo"),
    db: Annotated[
        str | None,
        typer.Option("--db", help="Our database instead of <dir>/agent.db (must be empty)."),
    ] = None,
    provider_db: Annotated[
        str | None,
        typer.Option(
            "--provider-db",
            help="The fake provider's database instead of <dir>/provider.db; required with a "
            "PostgreSQL --db.",
        ),
    ] = None,
) -> None:
    """Three orders against two databases: happy path, lost charge response, rejected charge."""
    # AGENT_TXN_DB is deliberately not read here: the demo must never run on a real store.
    if db is not None:
        db = _checked_url_or_exit(db, "--db")
    if provider_db is not None:
        provider_db = _checked_url_or_exit(provider_db, "--provider-db")
        try:
            shop_url(provider_db)  # the shop's own refusal, before the demo's folder is made
        except ShopDatabaseError as exc:
            _fail(f"--provider-db: {exc}")
    if db is not None and provider_db is None and dialects.dialect_of(db) == "postgresql":
        _fail(
            "--provider-db is required with a PostgreSQL --db: the fake provider needs a "
            "database of its own (e.g. --provider-db postgresql+asyncpg://…/agent_txn_provider)"
        )
    # Only the demo's own files in its folder are ours to delete; an explicit --db is not.
    names = [name for name, given in (("agent.db", db), ("provider.db", provider_db)) if not given]
    base = directory.resolve()  # where its files will be, before the folder is made
    store_url = db or f"sqlite+aiosqlite:///{base / 'agent.db'}"
    shop_db = provider_db or f"sqlite+aiosqlite:///{base / 'provider.db'}"
    if same_database(store_url, shop_db):  # resolved paths: one.db and $PWD/one.db are one
        _fail("--db and --provider-db must be two different databases")
    # The databases the user named are read before anything is written: the folder and its
    # mark, the shop's tables and stock were left behind by a refusal of either.
    _run(require_fresh(db, provider_db))
    if names:
        _demo_folder(directory, names)
    report = _run(run_demo(store_url, shop_db, out=_stdout()))
    if not report.ok:
        raise typer.Exit(EXIT_PROBLEM)


def _checked_url_or_exit(url: str, option: str) -> str:
    try:
        return _checked_url(url, option)
    except CliFailure as exc:
        _fail(exc.message, exc.code)


# -- db -----------------------------------------------------------------------------------------


async def _revisions(url: str, *, apply: bool) -> tuple[str | None, str | None]:
    url = _checked_url(url)
    _refuse_in_memory(url)
    if not apply:
        _require_existing(url)
    engine = dialects.create_engine(url)
    try:
        before = await migrate.current_revision(engine)
        if not apply:
            return before, before
        await migrate.upgrade(engine)
        return before, await migrate.current_revision(engine)
    finally:
        await engine.dispose()


@db_app.command("upgrade")
def db_upgrade(db: DbOption = DEFAULT_DB) -> None:
    """Apply the packaged migrations (safe to run concurrently and repeatedly)."""
    before, after = _run(_revisions(db, apply=True))
    out = _stdout()
    if before == after:
        out.print(f"schema already at {after} (head)")
    else:
        out.print(f"schema upgraded: {before or '(empty)'} → {after}")


@db_app.command("current")
def db_current(db: DbOption = DEFAULT_DB) -> None:
    """Print the schema revision; exit 1 when it is not the newest this package ships."""
    current, _ = _run(_revisions(db, apply=False))
    _stdout().print(f"schema at {current or '(empty)'}; this agent-txn needs {migrate.HEAD}")
    if current != migrate.HEAD:
        raise typer.Exit(EXIT_PROBLEM)


# -- ledger -------------------------------------------------------------------------------------


async def _show(url: str, tx_id: str, as_json: bool) -> None:
    orch = await _open_for_reading(url)
    try:
        view = await orch.get(tx_id)  # TransactionNotFound -> exit 2
        entries = await orch.ledger(tx_id)
    finally:
        await orch.close()
    out = _stdout()
    if as_json:
        records = [
            {
                "seq": e.seq,
                "time": utc_iso(e.created_at),
                "subject": e.subject,
                "action": e.action,
                "from": e.from_state,
                "to": e.to_state,
                "detail": e.detail,
                "hash": e.hash,
            }
            for e in entries
        ]
        # Plain print, not rich: the output is for machines and must not be wrapped.
        print(json.dumps(records, sort_keys=True, ensure_ascii=False))
        return
    tx = view.tx
    business = f" · {tx.business_key}" if tx.business_key else ""
    out.print(
        f"[bold]{escape(tx.tx_id)}[/] · {escape(tx.saga_name)}{escape(business)} · "
        f"{tx.status.value} · {len(entries)} ledger rows"
    )
    labels = subject_labels(view)
    rows = [
        (
            str(e.seq),
            utc_iso(e.created_at),
            _subject(labels, e.subject),
            e.action,
            transition(e),
            compact_json(e.detail),
        )
        for e in entries
    ]
    if out.width >= WIDE_TABLE:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for name in ("seq", "time (UTC)", "subject", "action", "from → to"):
            table.add_column(name, no_wrap=True, justify="right" if name == "seq" else "left")
        table.add_column("detail", overflow="fold")
        for row in rows:
            table.add_row(*(escape(cell) for cell in row))
        out.print(table)
        return
    # Too narrow for six columns: the detail (the evidence) would shrink to nothing, so each
    # row becomes a line, with its detail on an indented line of its own.
    for seq, time, subject, action, change, detail in rows:
        out.print(
            f"{seq:>4}  {time}  [bold]{escape(subject)}[/]  {escape(action)}  {escape(change)}"
        )
        out.print(Padding(Text(detail, style="dim", overflow="fold"), (0, 0, 0, 6)))


def _subject(labels: dict[str | None, str], subject: str | None) -> str:
    """``charge 7f1dc7ee`` for an effect (name and short key), ``saga`` for the transaction."""
    if subject is None:
        return labels[None]
    return f"{labels.get(subject, '?')} {subject[:8]}"


@ledger_app.command("show")
def ledger_show(
    tx_id: Annotated[str, typer.Argument(metavar="TX", help="Transaction id.")],
    db: DbOption = DEFAULT_DB,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON.")] = False,
) -> None:
    """A transaction's ledger, oldest row first."""
    _run(_show(db, tx_id, as_json))


async def _verify(url: str, tx_id: str | None) -> tuple[list[str], int, int]:
    orch = await _open_for_reading(url)
    try:
        if tx_id is not None:
            await orch.get(tx_id)  # an unknown id is a usage error, not an empty "OK"
        problems = await orch.verify_ledger(tx_id)
        count_tx = select(func.count()).select_from(transactions_table)
        count_rows = select(func.count()).select_from(ledger_table)
        if tx_id is not None:
            count_tx = count_tx.where(transactions_table.c.tx_id == tx_id)
            count_rows = count_rows.where(ledger_table.c.tx_id == tx_id)
        async with orch.store.read() as conn:
            n_tx = int((await conn.execute(count_tx)).scalar_one())
            n_rows = int((await conn.execute(count_rows)).scalar_one())
    finally:
        await orch.close()
    lines = [
        f"{p.tx_id}" + (f" seq {p.seq}" if p.seq is not None else "") + f": {p.problem}"
        for p in problems
    ]
    return lines, n_tx, n_rows


@ledger_app.command("verify")
def ledger_verify(
    db: DbOption = DEFAULT_DB,
    tx_id: Annotated[
        str | None, typer.Option("--tx", metavar="TX", help="Verify one transaction only.")
    ] = None,
) -> None:
    """Check every hash chain and replay the ledger against the stored state; exit 1 on problems."""
    problems, n_tx, n_rows = _run(_verify(db, tx_id))
    out = _stdout()
    if not problems:
        out.print(f"ledger OK: {n_tx} transactions, {n_rows} rows verified")
        return
    for line in problems:
        out.print(escape(line), soft_wrap=True)
    out.print(
        f"[red]ledger verification FAILED: {len(problems)} problem(s) "
        f"in {n_tx} transactions, {n_rows} rows[/]"
    )
    raise typer.Exit(EXIT_PROBLEM)


def _print_parked(out: Console, parked: Any) -> None:
    reason = parked.reason or {}
    if parked.status == "manual_review":
        why = (
            f"{escape(str(reason.get('reason') or reason.get('code') or 'parked'))}"
            f" at {escape(str(reason.get('step') or '?'))}"
        )
    else:
        why = f"{escape(parked.status)}; an outbox event is parked"
    out.print(f"[bold]{parked.tx_id}[/] ({escape(parked.saga)}): {why}")
    for e in parked.parked:
        out.print(
            f"  {e.kind} {escape(e.name)} ({e.provider}.{e.action}) key {e.key}: "
            f"attempts {e.attempts}, lookups {e.lookups}, last answer {escape(str(e.last_error))}"
        )
        out.print(f"    decide: --op {escape(e.name)} --as {'|'.join(e.decisions)}")
    if not parked.parked:
        out.print("  no effect waits for a decision here")
    for entry in parked.ledger:
        out.print(
            f"    #{entry.seq} {utc_iso(entry.created_at)} {escape(entry.action)} "
            f"{transition(entry)} {escape(compact_json(entry.detail))}",
            soft_wrap=True,
        )


@review_app.command("list")
def review_list(
    db: DbOption = DEFAULT_DB,
    limit: Annotated[int, typer.Option(help="How many to show (1-200).")] = 50,
    skip: Annotated[int, typer.Option(help="How many to skip (oldest first).")] = 0,
) -> None:
    """Transactions parked in manual_review (and committed ones whose outbox event is parked),
    why, their evidence, and what can be decided."""
    from orchestrator import review

    async def job() -> Any:
        orch = await _open_for_reading(db)
        try:
            return await review.list_parked(orch, limit=limit, skip=skip)
        finally:
            await orch.close()

    page = _run(job())
    out = _stdout()
    if not page.items:
        out.print("nothing is waiting for review" if page.total == 0 else "nothing on this page")
    for p in page.items:
        _print_parked(out, p)
    if page.more:
        out.print(f"{page.more} more: --skip {page.skip + len(page.items)}")


@review_app.command("show")
def review_show(tx: str, db: DbOption = DEFAULT_DB) -> None:
    """One transaction's evidence."""
    from orchestrator import review

    async def job() -> Any:
        orch = await _open_for_reading(db)
        try:
            return await review.show(orch, tx)
        finally:
            await orch.close()

    _print_parked(_stdout(), _run(job()))


@review_app.command("resolve")
def review_resolve(
    tx: str,
    op: Annotated[str, typer.Option("--op", help="Step/event name or key of the parked effect.")],
    as_state: Annotated[str, typer.Option("--as", help="confirmed | failed")],
    reason: Annotated[str, typer.Option(help="Why: recorded in the ledger.")],
    operator: Annotated[
        str, typer.Option(envvar="USER", help="Who decides (recorded).", show_envvar=True)
    ] = "operator",
    remote_id: Annotated[str | None, typer.Option(help="The provider's id, if confirmed.")] = None,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Decide a parked effect; the saga then commits or compensates on the next worker pass."""
    from orchestrator import review

    async def job() -> Any:
        orch = await _open_for_reading(db)
        try:
            return await review.resolve(
                orch,
                tx,
                op,
                as_state=as_state,
                reason=reason,
                operator=operator,
                remote_id=remote_id,
            )
        finally:
            await orch.close()

    status = _run(job())
    _stdout().print(f"{tx}: {op} resolved as {as_state}; transaction is now {status.value}")


@app.command("status")
def status(
    db: DbOption = DEFAULT_DB,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Transactions by status, effects by state, manual-review count, outbox lag."""

    async def job() -> dict[str, Any]:
        orch = await _open_for_reading(db)
        try:
            return await orch.status()
        finally:
            await orch.close()

    data = _run(job())
    out = _stdout()
    if as_json:
        out.print(json.dumps(data, indent=2, sort_keys=True), soft_wrap=True)
        return
    tx = data["transactions"]
    out.print("transactions: " + (", ".join(f"{k}={v}" for k, v in sorted(tx.items())) or "none"))
    for kind, states in data["effects"].items():
        shown = ", ".join(f"{k}={v}" for k, v in sorted(states.items())) or "none"
        out.print(f"{kind}: {shown}")
    out.print(f"manual review: {data['manual_review']}")
    out.print(f"outbox lag: {data['outbox_lag_seconds']:.1f}s")


@app.command("worker")
def worker(
    db: DbOption = DEFAULT_DB,
    concurrency: Annotated[int, typer.Option(min=1, max=1024, help="Sagas in hand.")] = 8,
    lease_seconds: Annotated[float, typer.Option(min=1, help="Lease length.")] = 30.0,
    once: Annotated[bool, typer.Option(help="Exit when nothing is due.")] = False,
    poll_seconds: Annotated[
        float, typer.Option(min=0.01, max=MAX_POLL_SECONDS, help="Idle poll interval.")
    ] = 0.5,
    worker_id: Annotated[str | None, typer.Option(help="Lease owner name.")] = None,
    fake_shop: Annotated[
        str | None, typer.Option(help="Serve the fake shop's providers from this database.")
    ] = None,
    app_ref: Annotated[
        str | None, typer.Option("--app", help="module:attribute giving your providers.")
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="Serve Prometheus /metrics here.")
    ] = None,
    sqlite_writer: SqliteWriterOption = None,
) -> None:
    """Recovery loops: resume due transactions, compensate, dispatch the outbox (on a store
    made by ``agent-txn db upgrade``: the worker never creates one)."""
    from orchestrator.workerproc import run_worker_process

    # ``is not None``: an empty --worker-id is refused by the settings, not taken as unset.
    extra = {"worker_id": worker_id} if worker_id is not None else {}

    async def job() -> tuple[EngineSettings, Any]:
        # Validated inside _run so a bad URL or setting is one clean line, not a traceback.
        if worker_id and not worker_id.strip():
            # Blank: every lease, ledger row and log line would name an owner no one can read.
            raise CliFailure("--worker-id must not be blank")
        settings = engine_settings(lease_seconds=lease_seconds, **extra)
        shop = _checked_url(fake_shop, "--fake-shop") if fake_shop is not None else None
        writer = _checked_sqlite_writer(sqlite_writer)
        stats = await run_worker_process(
            _checked_url(db),
            # Only when given: unset, worker_settings keeps a worker's groups inline.
            settings=settings
            if writer is None
            else settings.model_copy(update={"sqlite_writer": writer}),
            concurrency=concurrency,
            once=once,
            poll_seconds=poll_seconds,
            fake_shop=shop,
            app_ref=app_ref,
            metrics_port=metrics_port,
        )
        return settings, stats

    settings, stats = _run(job())
    _stdout().print(
        f"worker {settings.worker_id}: claimed {stats.claimed}, finished {stats.finished}, "
        f"outbox {stats.events}, lease lost {stats.lease_lost}, errors {stats.errors}"
    )


#: Entry-point group through which upper layers add commands (``fault-inject`` lives in
#: ``fault_injection``, which this layer must not import).
PLUGIN_GROUP: Final = "agent_txn.cli"


def load_plugins() -> None:
    """Add the sub-apps that installed packages declare under :data:`PLUGIN_GROUP`."""
    from importlib.metadata import entry_points

    registered = {info.name for info in app.registered_groups}
    for ep in entry_points(group=PLUGIN_GROUP):
        if ep.name not in registered:
            app.add_typer(ep.load(), name=ep.name)


def _refuse_undecodable_arguments(arguments: list[str]) -> None:
    """One line for an argument that is not UTF-8. Python keeps such bytes as lone surrogates,
    which no store can hold: ids and names failed deep in the driver with a traceback."""
    for position, argument in enumerate(arguments, start=1):
        try:
            argument.encode("utf-8")
        except UnicodeEncodeError:
            shown = repr(os.fsencode(argument))[2:-1]  # the bytes as given: \xff\xfe
            _say_error(f"argument {position} ({shown}) is not valid UTF-8 text")
            # Not typer.Exit: this runs before the app, which is what turns it into a code.
            raise SystemExit(EXIT_USAGE) from None


def main() -> None:
    """Entry point of the ``agent-txn`` console script."""
    _refuse_undecodable_arguments(sys.argv[1:])
    load_plugins()
    app()


if __name__ == "__main__":
    # Run as ``python -m orchestrator.cli`` (the fleet's and the scenarios' worker processes),
    # this file is ``__main__``: a second copy of the module, whose ``CliFailure`` is not the
    # class other modules raise (they import ``orchestrator.cli``), so their refusals escaped
    # ``_run`` as tracebacks. The one importable copy runs instead.
    from orchestrator.cli import main as _main

    _main()
