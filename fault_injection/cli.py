"""``agent-txn fault-inject``: run the suite, replay a schedule, check a pair of databases.

::

    agent-txn fault-inject run --suite seed|faults|concurrency|matrix|random|all
        [--schedules N] [--seed S] [--workers K] [--db URL] [--report PATH] [--only NAME]
    agent-txn fault-inject replay FILE [--db URL] [--report PATH]

A random schedule that fails is shrunk to a minimal failing one, saved as
``shrunk-SEED-INDEX.json`` in ``--report``'s folder (else the current directory), and
``replay`` runs that file again alone on fresh databases.

``--db`` picks the backend: omitted (or a SQLite URL) runs on fresh SQLite files in a work
folder; a PostgreSQL URL names the *server* — the suite creates fresh databases there and drops
them afterwards. Exit status: 0 when every scenario passed, 1 on any failure or invariant
violation, 2 on bad usage.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Coroutine
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fault_injection.report import report_paths, write_report
from fault_injection.results import RunSummary, ScenarioResult
from ledger.dialects import dialect_of, normalize_url

app = typer.Typer(
    help="Fault-injection suite: crashes, provider faults, races.", no_args_is_help=True
)
SUITES = ("seed", "faults", "concurrency", "matrix", "random", "all")


#: The most sagas ``fleet`` and ``bench`` take. Why a bound: the option had none, and a typo
#: of a few digits too many started a run that never ended (prepared in the database, too).
#: At the bench's one to a few thousand sagas a second, this many take hours.
MAX_SAGAS = 10_000_000
#: ``fleet`` gives up waiting for its sagas after this many seconds; a ``--kill-one-after``
#: or ``--restart-after`` later than that (``inf`` was accepted) could never happen.
FLEET_DEADLINE_S = 3600.0


#: ``--db`` of the commands that make fresh databases for each run (:func:`checked_scratch`).
FreshDatabasesOption = Annotated[
    str | None,
    typer.Option(
        help="A PostgreSQL server URL (fresh databases are made there), or a SQLite URL "
        "(fresh files in its file's folder; default: a temporary folder)."
    ),
]


def checked_db(url: str | None, option: str = "--db", *, must_exist: bool = False) -> None:
    """Refuse an unsupported or malformed URL with one line and exit code 2; with
    ``must_exist``, a SQLite file that is not there too (connecting would create an empty one
    and leave it behind, as ``orchestrator.cli._require_existing`` says for read commands)."""
    if url is None:
        return
    try:
        dialect_of(normalize_url(url))
    except Exception as exc:  # ArgumentError, ValueError: both are the user's typo
        _refuse(f"{option}: {exc}")
    if must_exist:
        from orchestrator import cli

        path = cli._sqlite_path(normalize_url(url))
        if path is not None and not path.exists():
            _refuse(f"{option}: no database at {path}")


def checked_scratch(url: str | None) -> None:
    """For a command that makes fresh databases: a SQLite ``--db`` says where their files go, the
    folder of the file it names (:func:`fault_injection.harness.scratch_folder`). Refuse, with
    one line and exit code 2, an in-memory URL or a folder that is not there or not writable,
    before anything runs."""
    from fault_injection.harness import sqlite_folder

    try:
        folder = sqlite_folder(url)
    except ValueError as exc:
        _refuse(f"--db: {exc}")
    if folder is None:
        return
    if not folder.is_dir():
        _refuse(
            f"--db: no folder {folder} for the run's SQLite files (a SQLite URL says where they "
            "go: fresh files in the folder of the file it names, removed after)"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        _refuse(f"--db: cannot make the run's SQLite files in {folder} (no write permission)")
    # A folder may say it is writable and still refuse new entries (/proc and /sys, a read-only
    # mount, seen by root): make what the run makes there, a folder with a file in it, and
    # remove it again. Else the run failed on it with a traceback (run, replay) or as
    # "database unreachable" (bench, fleet).
    try:
        probe = Path(tempfile.mkdtemp(prefix=".agent-txn-probe-", dir=folder))
        try:
            (probe / "probe.db").touch()
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as exc:
        _refuse(f"--db: cannot make the run's SQLite files in {folder}: {exc.strerror or exc}")


def prepared_output(path: Path | None, option: str) -> None:
    """Make sure a results file can be written at ``path`` before a run of minutes starts,
    without writing anything: a path that is a folder, or anything else that is not a regular
    file (a FIFO hung the check, which opened it), and a folder that could not be made or
    written in, are refused with one line and exit code 2 instead of a traceback after the run.
    The missing folders are made only when the results are written (:func:`write_output`,
    :func:`~fault_injection.report.write_report`): a run refused after this check left them
    behind."""
    if path is None:
        return
    if path.is_dir():
        _refuse(f"{option}: {path} is a folder")
    if path.exists() and not path.is_file():
        _refuse(f"{option}: {path} is not a regular file")
    folder = _nearest_existing(path.parent)
    if not folder.is_dir():
        _refuse(f"{option}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        _refuse(f"{option}: cannot write in {folder}")
    # A folder may say it is writable and still refuse a file (/proc, a read-only mount seen
    # by root): open the file the run will write (a regular file, checked above), or make a
    # file of our own where the first missing folder or the file would go, and remove it.
    try:
        if path.exists():
            with path.open("a", encoding="utf-8"):
                pass
        else:
            handle, probe = tempfile.mkstemp(prefix=".agent-txn-probe-", dir=folder)
            os.close(handle)
            os.unlink(probe)
    except OSError as exc:
        _refuse(f"{option}: cannot write {path}: {exc.strerror or exc}")


def _nearest_existing(folder: Path) -> Path:
    """``folder``, or its nearest ancestor that exists (where a missing one would be made)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def write_output(path: Path, text: str, option: str) -> None:
    """Write a results file :func:`prepared_output` checked before the run; a failure now (the
    disk filled during the run, say) is one line and exit code 2, not a traceback."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        _refuse(f"{option}: cannot write {path}: {exc.strerror or exc}")


def prepared_report(report: Path | None) -> None:
    """:func:`prepared_output` for the two files ``--report`` writes
    (:func:`~fault_injection.report.report_paths`): checking ``PATH`` itself let a folder named
    ``PATH.json`` through to fail after the run, and one named ``PATH.md`` after ``PATH.json``
    was written."""
    if report is None:
        return
    if report.is_dir():  # PATH.json beside a folder PATH was surely not what was meant
        _refuse(f"--report: {report} is a folder (the report is PATH.json and PATH.md)")
    for target in report_paths(report):
        prepared_output(target, "--report")


def written_report(summary: RunSummary, report: Path) -> list[Path]:
    """:func:`~fault_injection.report.write_report`, with a failure to write after the run
    (checked before it by :func:`prepared_output`) as one line and exit code 2, as
    :func:`write_output` does for the bench's results."""
    try:
        return write_report(summary, report)
    except OSError as exc:
        _refuse(f"--report: cannot write {exc.filename or report}: {exc.strerror or exc}")


def _refuse(message: str) -> NoReturn:
    Console(stderr=True, highlight=False).print(f"error: {escape(message)}", soft_wrap=True)
    raise typer.Exit(2) from None


T = TypeVar("T")


def run_job(job: Coroutine[Any, Any, T]) -> T:
    """Run ``job`` as every ``agent-txn`` command does (``orchestrator.cli``): a database that
    cannot be reached, or any other expected failure, ends as one line on stderr and exit code
    2, not a traceback. A scenario's own failures are its result, not this."""
    from orchestrator import cli

    return cli._run(job)


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


#: ``run``'s defaults. Its options default to ``None`` so that one given for a suite that does
#: not use it can be told from one left alone (:func:`_check_run_options`).
DEFAULT_SCHEDULES = 200
DEFAULT_WORKERS = 4
DEFAULT_MODES = "inprocess,kill"
#: The most random schedules a run takes, and one more than the highest ``--only`` index.
#: Why a bound: ``--schedules`` had none (a typo of twenty digits ran for ever), and an
#: ``--only`` of thousands of digits passed the digit check and then failed in ``int()`` with
#: a traceback. A schedule takes a second or so: this many take a day.
MAX_SCHEDULES = 100_000
#: The largest ``--seed``. Why a bound: a schedule's transaction ids embed the seed
#: (``r{seed}-{index}-{n}``), and a seed of 200 digits made ids past the store's length limit,
#: so every schedule FAILED, falsely, and was shrunk. Any 64-bit seed fits.
MAX_SEED = 2**63 - 1
#: The largest schedule file ``replay`` reads (a shrunk schedule is a few kB): ``/dev/zero``
#: was read until memory ran out.
MAX_SCHEDULE_FILE_BYTES = 10_000_000


@app.command("run")
def run(
    suite: Annotated[
        str, typer.Option(help="seed | faults | concurrency | matrix | random | all")
    ] = "seed",
    schedules: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_SCHEDULES,
            help="Random schedules to run.",
            show_default=str(DEFAULT_SCHEDULES),
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(min=0, max=MAX_SEED, help="Seed of the random suite (printed)."),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1, max=64, help="Concurrent recovering workers.", show_default=str(DEFAULT_WORKERS)
        ),
    ] = None,
    db: FreshDatabasesOption = None,
    report: Annotated[Path | None, typer.Option(help="Write PATH.json and PATH.md.")] = None,
    only: Annotated[str | None, typer.Option(help="One matrix cell or random index.")] = None,
    modes: Annotated[
        str | None, typer.Option(help="Matrix crash modes.", show_default=DEFAULT_MODES)
    ] = None,
    allow_server_restart: Annotated[
        bool, typer.Option(help="Concurrency suite on PostgreSQL: restart the server once.")
    ] = False,
) -> None:
    """Run a suite; print PASS/FAIL per scenario and a summary."""
    checked_db(db)
    checked_scratch(db)
    from fault_injection.harness import scratch_folder

    out = _console()
    if suite not in SUITES:
        _refuse(f"--suite must be one of {', '.join(SUITES)}")
    chosen = ["seed", "faults", "concurrency", "matrix", "random"] if suite == "all" else [suite]
    _check_run_options(
        chosen,
        schedules=schedules,
        seed=seed,
        workers=workers,
        only=only,
        modes=modes,
        allow_server_restart=allow_server_restart,
    )
    if allow_server_restart:
        _check_restartable(db, "--allow-server-restart")
    prepared_report(report)
    # Options left alone take their defaults only now: the check above had to tell them apart.
    schedules = schedules or DEFAULT_SCHEDULES
    workers = workers or DEFAULT_WORKERS
    crash_modes = _split_modes(DEFAULT_MODES if modes is None else modes)
    run_seed = seed if seed is not None else random.SystemRandom().randrange(1, 2**31)
    summary = RunSummary(seed=run_seed if "random" in chosen else None)
    if "random" in chosen:
        out.print(f"random suite seed: {run_seed}")
    started = time.monotonic()
    with scratch_folder(db, "agent-txn-fi-") as tmp, _progress(out) as progress:
        workdir = Path(tmp)
        for name in chosen:
            total = schedules if name == "random" and only is None else None
            task = progress.add_task(name, total=total)

            def done(result: ScenarioResult, task: Any = task) -> None:
                progress.advance(task)
                colour = "green" if result.passed else "red"
                progress.console.print(f"[{colour}]{escape(result.line)}[/]")
                if not result.passed and result.repro:
                    progress.console.print(f"  reproduce: {escape(result.repro)}")
                if "shrunk_repro" in result.detail:
                    minimal = result.detail.get("shrunk_describe", "")
                    progress.console.print(f"  minimal: {escape(str(minimal))}")
                    progress.console.print(f"  replay: {escape(result.detail['shrunk_repro'])}")

            results = run_job(
                _run_one(
                    name,
                    db,
                    workdir,
                    schedules=schedules,
                    seed=run_seed,
                    workers=workers,
                    only=only,
                    modes=crash_modes,
                    allow_server_restart=allow_server_restart,
                    progress=done,
                    # Shrunk schedules outlive the run's work folder, so replay can find them.
                    shrunk_dir=report.parent if report is not None else Path.cwd(),
                )
            )
            summary.results.extend(results)
    _print_summary(out, summary, time.monotonic() - started)
    if report is not None:
        paths = written_report(summary, report)
        out.print("report: " + ", ".join(str(p) for p in paths))
    raise typer.Exit(0 if summary.ok else 1)


#: The suites each of ``run``'s options applies to.
_OPTION_SUITES: dict[str, tuple[str, ...]] = {
    "--schedules": ("random",),
    "--seed": ("random",),
    "--workers": ("seed", "faults", "concurrency", "random"),
    "--modes": ("matrix",),
    "--allow-server-restart": ("concurrency",),
}


def _check_run_options(
    chosen: list[str],
    *,
    schedules: int | None,
    seed: int | None,
    workers: int | None,
    only: str | None,
    modes: str | None,
    allow_server_restart: bool,
) -> None:
    """Refuse, in one line and before anything runs, an option none of the chosen suites uses
    (it was ignored, and the run was not the one asked for) and an ``--only`` that names
    nothing (it was a traceback)."""
    given = {
        "--schedules": schedules is not None,
        "--seed": seed is not None,
        "--workers": workers is not None,
        "--modes": modes is not None,
        "--allow-server-restart": allow_server_restart,
    }
    for option, suites in _OPTION_SUITES.items():
        if given[option] and not set(suites) & set(chosen):
            names = suites[0] if len(suites) == 1 else f"{', '.join(suites[:-1])} and {suites[-1]}"
            plural = "suite" if len(suites) == 1 else "suites"
            _refuse(f"{option} is for the {names} {plural} (or --suite all), not {chosen[0]}")
    from fault_injection.matrix import matrix_cells

    try:
        # Not ``modes or DEFAULT_MODES``: an empty --modes named no mode, as " " and "," do.
        cells = matrix_cells(_split_modes(DEFAULT_MODES if modes is None else modes))
    except ValueError as exc:
        _refuse(f"--modes: {exc}")
    if not cells:
        _refuse("--modes: name at least one of inprocess, kill")
    if only is None:
        return
    if "matrix" in chosen and "random" in chosen:
        _refuse("--only picks one matrix cell or one random index: give --suite matrix or random")
    if "random" in chosen:
        # Not str.isdigit(): it admits superscripts and other digits int() then refuses.
        if not (only.isascii() and only.isdigit()):
            _refuse(f"--only: a random schedule's index is a number from 0, not {only!r}")
        # The digit count first: int() of thousands of digits raises ValueError.
        if len(only) > len(str(MAX_SCHEDULES)) or int(only) >= MAX_SCHEDULES:
            shown = only if len(only) <= 20 else f"{only[:12]}… ({len(only)} digits)"
            _refuse(f"--only: a random schedule's index is below {MAX_SCHEDULES}, not {shown}")
        # The index of a schedule the run would not have: --schedules 5 --only 7 ran schedule
        # 7 and ignored --schedules. (Without --schedules, any index: reproduce lines give none.)
        if schedules is not None and int(only) >= schedules:
            _refuse(
                f"--only {only} is not one of --schedules {schedules}'s indexes "
                f"(0 to {schedules - 1})"
            )
    elif "matrix" in chosen:
        if not any(fnmatchcase(cell.name, only) for cell in cells):
            _refuse(f"--only: no matrix cell matches {only!r} (names look like {cells[0].name!r})")
    else:
        _refuse(f"--only is for the matrix and random suites, not {chosen[0]}")


def _split_modes(modes: str) -> tuple[str, ...]:
    """``--modes`` as the matrix takes it: comma-separated, blanks dropped ("kill," is the
    kill mode alone)."""
    return tuple(m.strip() for m in modes.split(",") if m.strip())


async def _run_one(
    name: str,
    db: str | None,
    workdir: Path,
    *,
    schedules: int,
    seed: int,
    workers: int,
    only: str | None,
    modes: tuple[str, ...],
    allow_server_restart: bool,
    progress: Callable[[ScenarioResult], None],
    shrunk_dir: Path | None = None,
) -> list[ScenarioResult]:
    if name in ("seed", "faults", "concurrency"):
        from fault_injection.scenarios import run_suite

        return await run_suite(
            name,  # type: ignore[arg-type]
            db,
            workdir,
            workers=workers,
            progress=progress,
            allow_server_restart=allow_server_restart,
        )
    if name == "matrix":
        from fault_injection.matrix import run_matrix

        return await run_matrix(
            db,
            workdir,
            modes=modes,
            only=only,
            progress=progress,
        )
    from fault_injection.schedules import run_random

    return await run_random(
        db,
        workdir,
        schedules=schedules,
        seed=seed,
        workers=workers,
        only=int(only) if only is not None else None,
        progress=progress,
        shrunk_dir=shrunk_dir,
    )


def _progress(out: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out,
        transient=True,
    )


def _print_summary(out: Console, summary: RunSummary, seconds: float) -> None:
    data = summary.to_json()
    faults = ", ".join(f"{k}={v}" for k, v in sorted(summary.faults.items())) or "none"
    out.rule("summary")
    out.print(f"scenarios run: {data['scenarios']} ({data['passed']} passed)")
    out.print(f"faults injected: {faults}")
    out.print(f"crashes: {data['crashes']}   sagas: {data['sagas']}   time: {seconds:.1f}s")
    if summary.seed is not None:
        out.print(f"seed: {summary.seed}")
    violations = summary.violations
    if not violations:
        out.print("[green]invariant violations: 0[/]")
        return
    out.print(f"[red]invariant violations: {len(violations)}[/]")
    for v in violations:
        out.print(f"  [{v.invariant}] {escape(v.name)} tx={v.tx_id}: {escape(v.message)}")


@app.command("replay")
def replay(
    schedule_file: Annotated[
        Path,
        typer.Argument(
            metavar="FILE",
            help="A random schedule's JSON: a shrunk failure's file, or a report's "
            "'shrunk' object saved as one.",
        ),
    ],
    db: FreshDatabasesOption = None,
    report: Annotated[Path | None, typer.Option(help="Write PATH.json and PATH.md.")] = None,
) -> None:
    """Run one saved schedule alone on fresh databases; print PASS/FAIL and the summary."""
    checked_db(db)
    checked_scratch(db)
    prepared_report(report)
    from fault_injection.harness import scratch_folder
    from fault_injection.schedules import run_fresh, schedule_from_json

    _check_schedule_file(schedule_file)
    try:
        text = schedule_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _refuse(f"{schedule_file}: cannot be read ({getattr(exc, 'strerror', None) or exc})")
    try:
        schedule = schedule_from_json(text)
    except ValueError as exc:  # json.JSONDecodeError is one too
        _refuse(f"{schedule_file}: not a schedule: {exc}")
    out = _console()
    started = time.monotonic()
    with scratch_folder(db, "agent-txn-fi-") as tmp:
        result = run_job(run_fresh(schedule, db, Path(tmp), repro_db=db, replay_file=schedule_file))
    out.print(f"[{'green' if result.passed else 'red'}]{escape(result.line)}[/]")
    summary = RunSummary(results=[result])
    _print_summary(out, summary, time.monotonic() - started)
    if report is not None:
        paths = written_report(summary, report)
        out.print("report: " + ", ".join(str(p) for p in paths))
    raise typer.Exit(0 if summary.ok else 1)


def _check_schedule_file(path: Path) -> None:
    """Refuse a ``replay`` input that is not a regular file (a FIFO hung the read) or is too
    large to be a schedule (``/dev/zero`` read until a MemoryError traceback). A missing or
    unreadable file is left to the read, which says why."""
    try:
        status = path.stat()
    except OSError:
        return
    if not stat.S_ISREG(status.st_mode):
        _refuse(f"{path}: not a regular file (give a schedule's JSON file)")
    if status.st_size > MAX_SCHEDULE_FILE_BYTES:
        _refuse(
            f"{path}: not a schedule: {status.st_size:,} bytes, more than "
            f"{MAX_SCHEDULE_FILE_BYTES:,} (a shrunk schedule is a few kB)"
        )


@app.command("check")
def check(
    db: Annotated[str, typer.Option(help="Our database URL.")],
    provider_db: Annotated[str, typer.Option(help="The fake provider's database URL.")],
    settled: Annotated[bool, typer.Option(help="Require every transaction settled.")] = True,
) -> None:
    """Run the invariant checker over an existing pair of databases."""
    checked_db(db, must_exist=True)
    checked_db(provider_db, "--provider-db", must_exist=True)
    from fault_injection.invariants import CheckReport, check_invariants

    async def job() -> CheckReport:
        await _check_pair(normalize_url(db), normalize_url(provider_db))
        return await check_invariants(db, provider_db, require_settled=settled)

    out = _console()
    report = run_job(job())
    out.print(json.dumps(report.to_json(), indent=2, default=str))
    raise typer.Exit(0 if report.ok else 1)


async def _check_pair(db: str, provider_db: str) -> None:
    """Refuse, in one line, a ``--provider-db`` without the fake shop's tables (the checker's
    first query failed on it: a driver traceback on PostgreSQL, "database operational error"
    on SQLite), and say so when the two URLs were given the wrong way round."""
    from fault_injection._evidence import OUR_TABLES, SHOP_TABLES, table_names
    from orchestrator.cli import CliFailure

    theirs = await table_names(provider_db)
    missing = SHOP_TABLES - theirs
    if not missing:
        return
    if theirs.issuperset(OUR_TABLES) and (await table_names(db)).issuperset(SHOP_TABLES):
        raise CliFailure(
            "--db and --provider-db are the wrong way round: --provider-db holds agent-txn's "
            "tables and --db the fake shop's"
        )
    raise CliFailure(
        f"--provider-db has no fake-shop tables ({', '.join(sorted(missing))}): give the "
        "database the fake provider wrote to"
    )


def _check_fleet_options(
    db: str | None,
    workers: int,
    kill_one_after: float | None,
    restart_after: float | None,
    faults: str,
) -> None:
    """Refuse in one line what would leave ``fleet`` waiting for sagas no worker can settle
    (its only worker killed; every worker dead at start of a bad fault list) or fail mid-run
    with a traceback (a restart of a server this host cannot restart)."""
    from fault_injection.faulty_shop import parse_faults

    if kill_one_after is not None and workers < 2:
        _refuse("--kill-one-after needs --workers 2 or more: the others recover what it held")
    try:
        parse_faults(faults)
    except ValueError as exc:
        _refuse(f"--faults: {exc}")
    if restart_after is not None:
        _check_restartable(db, "--restart-after")


def _check_restartable(db: str | None, option: str) -> None:
    """Refuse ``option``, which restarts the PostgreSQL server ``db`` names, where this process
    cannot: on SQLite (nothing to restart: it was ignored) or a server that is not local, with
    ``pg_ctlcluster``, to a root process (it failed halfway with a traceback)."""
    if db is None or dialect_of(normalize_url(db)) != "postgresql":
        _refuse(f"{option} restarts the local PostgreSQL server: give a PostgreSQL --db")
    from fault_injection.scenarios_concurrency import local_cluster

    if run_job(local_cluster(normalize_url(db))) is None:
        _refuse(
            f"{option}: this process cannot restart the server --db names (it must be "
            "local, with pg_ctlcluster, and this process root)"
        )


@app.command("fleet")
def fleet(
    db: FreshDatabasesOption = None,
    sagas: Annotated[
        int, typer.Option(min=1, max=MAX_SAGAS, help="In-doubt sagas to recover.")
    ] = 1000,
    workers: Annotated[int, typer.Option(min=1, max=64, help="Worker processes.")] = 4,
    kill_one_after: Annotated[
        float | None,
        typer.Option(min=0, max=FLEET_DEADLINE_S, help="SIGKILL a worker after S s."),
    ] = None,
    restart_after: Annotated[
        float | None,
        typer.Option(min=0, max=FLEET_DEADLINE_S, help="Restart the local PostgreSQL after S s."),
    ] = None,
    faults: Annotated[str, typer.Option(help="kind:provider.action:skip:times,…")] = "",
) -> None:
    """Recovery time of N in-doubt sagas with W real worker processes; invariants checked."""
    checked_db(db)
    checked_scratch(db)
    _check_fleet_options(db, workers, kill_one_after, restart_after, faults)
    from fault_injection.fleet import run_fleet
    from fault_injection.harness import Harness, fresh_databases, scratch_folder
    from fault_injection.invariants import check_invariants

    async def job() -> dict[str, Any]:
        with scratch_folder(db, "agent-txn-fleet-") as tmp:
            async with fresh_databases(db, Path(tmp)) as dbs:
                harness = await Harness.open(dbs)
                try:
                    report = await run_fleet(
                        harness,
                        sagas=sagas,
                        workers=workers,
                        kill_one_after=kill_one_after,
                        restart_after=restart_after,
                        faults=faults,
                        deadline_seconds=FLEET_DEADLINE_S,
                    )
                finally:
                    await harness.close()
                checked = await check_invariants(dbs.store, dbs.provider)
        return {
            "sagas": sagas,
            "workers": workers,
            "seconds_to_settle": round(report.seconds_to_settle, 1),
            "sagas_per_s": round(report.sagas_per_s, 1),
            "statuses": report.statuses,
            "killed": report.killed,
            "restarted": report.restarted,
            "settled": report.settled,
            "workers_gone": report.workers_gone,
            "exit_codes": report.exit_codes,
            "invariant_violations": len(checked.violations),
        }

    result = run_job(job())
    _console().print(json.dumps(result, indent=2))
    if result["workers_gone"]:
        _console().print(
            "[red]every worker process exited before the sagas settled[/] (exit codes "
            f"{result['exit_codes']}): run one alone to see why, `agent-txn worker --db …`"
        )
    ok = result["invariant_violations"] == 0 and result["settled"]
    raise typer.Exit(0 if ok else 1)
