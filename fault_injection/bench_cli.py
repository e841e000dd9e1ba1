"""``agent-txn bench``: throughput, latency and commit economy of the order saga.

::

    agent-txn bench [--db URL] [--sagas N] [--concurrency C|auto] [--workers W] [--recovery]
        [--provider memory|fake|http] [--latency-ms L] [--warmup W] [--json PATH]
        [--compare dbos [--pairs P] [--dbos-concurrency K|auto] [--dbos-sqlite fast|default]
        [--match-time]]
        [--sqlite-synchronous FULL|NORMAL] [--driver-seconds S]

``--db`` omitted runs on fresh SQLite files in a temporary folder, and a SQLite URL on fresh
files in the folder of the file it names (the disk is what a SQLite figure under ``FULL``
measures); a PostgreSQL URL names the *server*: fresh databases are created there and dropped
after. Either way each run's databases are removed after it. Modes: in-process ``execute``
(sequential, or C in flight), ``--workers W`` (W worker processes drain sagas the bench
prepared; PostgreSQL), ``--recovery`` (N sagas left in doubt by a crash, W fresh worker
processes timed until all are terminal). ``--compare dbos`` alternates ours and DBOS's, pair by
pair (in-process modes only). ``--concurrency auto`` (in-process modes) first runs ours alone
at each setting of :data:`~fault_injection.sweep.OURS_SWEEP_CONCURRENCY` and measures at the
fastest; with ``--compare dbos`` it makes DBOS's half ``auto`` too unless
``--dbos-concurrency`` says otherwise, so that each engine runs at its own fastest setting
(:mod:`fault_injection.sweep`). Exit status: 0 when the bench's checker found exactly one effect
per intent, 1 otherwise, 2 on bad usage or a database that cannot be reached (one ``error:``
line, as every ``agent-txn`` command). Every run first prints what it runs on
(:mod:`fault_injection.bench_environment`).

Lives in ``fault_injection`` (not ``orchestrator``) because it needs the shops and the suite's
order saga, which the orchestrator layer must not import; it is plugged in through the
``agent_txn.cli`` entry-point group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fault_injection.bench import (
    PROVIDERS,
    UNGROUPED_COMMITS_PER_SAGA,
    BenchConfig,
    BenchResult,
    run_bench,
)
from fault_injection.bench_environment import describe, memory_files_note, one_line
from fault_injection.cli import MAX_SAGAS, FreshDatabasesOption
from fault_injection.harness import scratch_folder
from fault_injection.steal import (
    ALIKE_STEAL_POINTS,
    STEAL_CAUTION_SHARE,
    alike,
    read_cpu_times,
    steal_caution,
    stolen_share,
)
from fault_injection.sweep import (
    OURS_SWEEP_CONCURRENCY,
    OURS_SWEEP_SAGAS,
    SWEEP_ROUNDS,
    Sweep,
    run_sweep,
)
from ledger.store import SQLITE_WRITERS

if TYPE_CHECKING:  # the DBOS side is imported only when a comparison runs
    from fault_injection.bench_dbos import ComparePair, DbosResult, SqliteTuning
    from ledger.pg_room import ConnectionRoom

#: Sagas (or workflows) in flight: a number, or ``"auto"`` for the fastest of a sweep.
InFlight = int | Literal["auto"]

#: The most sagas (or DBOS workflows) in flight the options take.
MAX_IN_FLIGHT = 1024
#: The driver loop's length in a run of our sweep (its reading is not used there).
SWEEP_DRIVER_SECONDS = 0.1
#: The longest ``--latency-ms``. Why a bound: ``inf`` passed the option's ``min`` and made
#: every provider call sleep for ever; and a call that sleeps past the engine's call timeout
#: (``EngineSettings.call_timeout_seconds``, 10 s) is cut as unknown and looked up (which
#: sleeps as long), so the saga never ends. Half of it leaves a call and its lookup room.
MAX_LATENCY_MS = 5_000.0
#: The longest ``--driver-seconds`` (``inf`` ran the driver loop for ever).
MAX_DRIVER_SECONDS = 60.0
#: The most ``--warmup`` sagas (it had no bound, and a typo ran for ever before measuring).
#: A warm-up fills the caches and the pool; a few hundred sagas do, this many is generous.
MAX_WARMUP = 100_000

app = typer.Typer(
    help="Benchmark the order saga end to end.",
    invoke_without_command=True,
    pretty_exceptions_show_locals=False,
)


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def render(result: BenchResult, out: Console) -> None:
    """The human report: one table, then the checker's verdict."""
    if result.mode == "workers":
        how = f"{result.workers} worker processes x {result.concurrency} in hand"
    elif result.mode == "recovery":
        how = f"recovery by {result.workers} worker processes x {result.concurrency} in hand"
    else:
        how = f"concurrency {result.concurrency}"
    table = Table(
        title=f"order saga · {result.backend} · {result.provider} provider · "
        f"{result.sagas} sagas · {how}"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("sagas/s", _num(result.sagas_per_s, ",.1f")),
        ("p50 latency (ms)", _num(result.p50_ms, ".2f")),
        ("p99 latency (ms)", _num(result.p99_ms, ".2f")),
        ("commits / saga", _num(result.commits_per_saga, ".2f")),
        ("statements / saga", _num(result.statements_per_saga, ".2f")),
        ("client CPU ms / saga", _num(result.cpu_ms_per_saga, ".2f")),
        ("server CPU ms / saga", _num(result.server_cpu_ms_per_saga, ".2f")),
        ("provider calls / saga", _num(result.provider_calls_per_saga, ".2f")),
        (
            f"driver commits/s ({result.driver_connections} conn)",
            _num(result.driver_commits_per_s, ",.0f"),
        ),
        (
            f"raw driver commits/s ({result.driver_connections} conn)",
            _num(result.raw_driver_commits_per_s, ",.0f"),
        ),
        ("efficiency", _num(result.efficiency, ".2f")),
        (
            f"efficiency at {UNGROUPED_COMMITS_PER_SAGA} commits / saga",
            _num(result.efficiency_ungrouped, ".2f"),
        ),
    ]
    if result.prepare_s is not None:
        rows.append(("prepare (s, not in sagas/s)", _num(result.prepare_s, ".2f")))
        rows.append(
            ("end-to-end sagas/s", _num(result.extra.get("end_to_end_sagas_per_s"), ",.1f"))
        )
    if result.mode == "recovery":
        rows.append(("seconds to settle", _num(result.elapsed_s, ".2f")))
    for name, value in rows:
        table.add_row(name, value)
    out.print(table)
    check = result.check
    if check.ok:
        out.print(
            f"[green]check OK[/]: exactly one reserve, charge and email per intent "
            f"({check.expected} each, warm-up included), nothing in flight"
        )
    else:
        out.print("[red]check FAILED[/]:")
        for problem in check.problems:
            out.print(f"  - {problem}")


#: ``--pairs`` left alone with ``--compare dbos`` (the option defaults to ``None`` so that one
#: given without ``--compare`` can be refused).
DEFAULT_PAIRS = 3
#: ``--warmup`` left alone (``None`` as the option's default, so that one given with
#: ``--recovery``, which runs no warm-up, can be refused).
DEFAULT_WARMUP = 20


def _usage(out: Console, message: str) -> typer.Exit:
    """The usage error ``message``, on stderr as every ``agent-txn`` command's (it went to
    stdout, into the report a caller keeps); ``out`` is the report's console, unused."""
    del out
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    err.print(f"[red]error:[/] {escape(message)}")
    return typer.Exit(2)


@app.callback()
def bench(
    db: FreshDatabasesOption = None,
    sagas: Annotated[int, typer.Option(min=1, max=MAX_SAGAS, help="Measured sagas.")] = 1000,
    concurrency: Annotated[
        str,
        typer.Option(
            metavar="C|auto",
            help="Sagas in flight (per worker with --workers); auto (in-process modes): run "
            "ours alone at 1 to 64 first and measure at its fastest.",
        ),
    ] = "1",
    workers: Annotated[
        int, typer.Option(min=0, max=64, help="Worker processes (PostgreSQL); 0: in-process.")
    ] = 0,
    recovery: Annotated[
        bool, typer.Option(help="Recovery mode: N in-doubt sagas, W fresh workers.")
    ] = False,
    provider: Annotated[str, typer.Option(help="memory | fake | http")] = "memory",
    latency_ms: Annotated[
        float,
        typer.Option(
            min=0, max=MAX_LATENCY_MS, help="Added to every provider call (asyncio.sleep)."
        ),
    ] = 0.0,
    warmup: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=MAX_WARMUP,
            help="Sagas run before measuring (per worker with --workers).",
            show_default=str(DEFAULT_WARMUP),
        ),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the results as JSON to PATH.")
    ] = None,
    sqlite_synchronous: Annotated[
        str | None,
        typer.Option(
            help="SQLite synchronous pragma (engine and driver loop).", show_default="FULL"
        ),
    ] = None,
    sqlite_writer: Annotated[
        str | None,
        typer.Option(
            help="SQLite: where the engine commits groups of sagas' transactions: inline (on "
            "the event loop) | process (a writer process). Default: the engine's."
        ),
    ] = None,
    driver_seconds: Annotated[
        float,
        typer.Option(
            min=0.1, max=MAX_DRIVER_SECONDS, help="Length of the driver's small-commit loop."
        ),
    ] = 1.5,
    compare: Annotated[
        str | None, typer.Option(help="dbos: run DBOS's version alternately with ours.")
    ] = None,
    pairs: Annotated[
        int | None,
        typer.Option(min=1, max=20, help="Pairs with --compare.", show_default=str(DEFAULT_PAIRS)),
    ] = None,
    dbos_concurrency: Annotated[
        str | None,
        typer.Option(
            metavar="K|auto",
            help="With --compare: DBOS's workflows in flight (default: --concurrency, auto "
            "included), so that each engine can run at its own fastest setting; auto: run DBOS "
            "alone at 1 to 32 first and take its fastest.",
        ),
    ] = None,
    dbos_sqlite: Annotated[
        str | None,
        typer.Option(
            help="With --compare, DBOS on SQLite: fast (WAL + NORMAL) | default (as DBOS sets it).",
            show_default="fast",
        ),
    ] = None,
    match_time: Annotated[
        bool,
        typer.Option(
            "--match-time",
            help="With --compare: from the second pair on, our half runs as many sagas as fit "
            "in DBOS's last half (at most 20 x --sagas), so both halves last about as long.",
        ),
    ] = False,
) -> None:
    """Run the order saga (reserve + charge, receipt via the outbox) and report its costs."""
    from fault_injection.cli import (
        checked_db,
        checked_scratch,
        prepared_output,
        run_job,
        write_output,
    )

    checked_db(db)
    checked_scratch(db)
    out = Console(highlight=False, soft_wrap=True)
    if provider not in PROVIDERS:
        raise _usage(out, f"--provider must be one of {', '.join(PROVIDERS)}")
    synchronous = (sqlite_synchronous or "FULL").upper()
    if synchronous not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
        raise _usage(out, "--sqlite-synchronous must be OFF, NORMAL, FULL or EXTRA")
    if sqlite_writer is not None and sqlite_writer not in SQLITE_WRITERS:
        raise _usage(out, "--sqlite-writer must be inline or process")
    postgres = db is not None and db.startswith("postgres")
    if postgres:
        # SQLite's settings did nothing on a PostgreSQL run, so the run was not the one asked
        # for: refused, as DBOS's options are without --compare.
        for name, given in (
            ("--sqlite-synchronous", sqlite_synchronous),
            ("--sqlite-writer", sqlite_writer),
            ("--dbos-sqlite", dbos_sqlite),
        ):
            if given is not None:
                raise _usage(out, f"{name} is for a SQLite --db; this one is PostgreSQL")
    if workers and not recovery and not postgres:
        raise _usage(out, "--workers needs a PostgreSQL --db (SQLite has one writer)")
    if recovery:
        if provider != "fake":
            raise _usage(out, "--recovery runs the fleet's fake shop: add --provider fake")
        if latency_ms:
            raise _usage(out, "--recovery adds no --latency-ms: its workers call the fake shop")
        # Its workers are `agent-txn worker` processes, which run no warm-up and keep their
        # own SQLite settings: these were ignored (only the driver loop took them), and the
        # JSON said the run had the --sqlite-synchronous it did not have.
        ignored: dict[str, object] = {
            "--warmup": warmup,
            "--sqlite-synchronous": sqlite_synchronous,
            "--sqlite-writer": sqlite_writer,
        }
        for option, value in ignored.items():
            if value is not None:
                raise _usage(
                    out,
                    f"--recovery takes no {option}: its `agent-txn worker` processes run "
                    "with their own defaults",
                )
        workers = workers or 1
    if match_time and compare is None:
        raise _usage(out, "--match-time sizes the halves of --compare dbos pairs: add --compare")
    if dbos_concurrency is not None and compare is None:
        raise _usage(out, "--dbos-concurrency sets DBOS's half of --compare dbos: add --compare")
    # The options of DBOS's half, refused without it as above rather than silently ignored.
    if pairs is not None and compare is None:
        raise _usage(out, "--pairs counts the pairs of --compare dbos: add --compare")
    if dbos_sqlite is not None and compare is None:
        raise _usage(out, "--dbos-sqlite sets DBOS's SQLite in --compare dbos: add --compare")
    ours_in_flight = _option_in_flight(out, "--concurrency", concurrency)
    dbos_in_flight = (
        None
        if dbos_concurrency is None
        else _option_in_flight(out, "--dbos-concurrency", dbos_concurrency)
    )
    if ours_in_flight == "auto" and (workers or recovery):
        raise _usage(
            out,
            "--concurrency auto finds the fastest setting of the in-process modes: give "
            "--workers and --recovery a number",
        )
    if dbos_in_flight is None and compare is not None:
        dbos_in_flight = ours_in_flight  # each engine's own fastest, when ours is auto
    sweep_settings = OURS_SWEEP_CONCURRENCY
    if compare is not None:
        if compare != "dbos":
            raise _usage(out, "--compare takes one value: dbos")
        if workers or recovery:
            raise _usage(out, "--compare dbos runs the in-process modes only (no --workers)")
        # DBOS's half always calls its in-memory dict provider, with no added latency: these
        # applied to our half only, and the ratio compared unlike runs (0.01x at 200 ms).
        if provider != "memory":
            raise _usage(
                out,
                "--compare dbos takes --provider memory only: DBOS's half has only its "
                "in-memory dict provider",
            )
        if latency_ms:
            raise _usage(
                out,
                "--compare dbos takes no --latency-ms: DBOS's half calls its in-memory "
                "dict provider with none",
            )
        if dbos_sqlite not in (None, "fast", "default"):
            raise _usage(out, "--dbos-sqlite must be fast or default")
        from fault_injection.bench_dbos import dbos_available

        if not dbos_available():
            raise _usage(
                out, "--compare dbos needs the bench extra: pip install 'agent-txn[bench]'"
            )
    if postgres:
        dbos_peak = None
        if compare is not None:
            from fault_injection.bench_dbos import SWEEP_CONCURRENCY

            dbos_peak = max(SWEEP_CONCURRENCY) if dbos_in_flight == "auto" else dbos_in_flight
        room = _room(db)
        if ours_in_flight == "auto":
            sweep_settings = sweep_settings_that_fit(room, provider)
        peak = max(sweep_settings) if ours_in_flight == "auto" else ours_in_flight
        refusal = _connections_refusal(
            room, concurrency=peak, workers=workers, provider=provider, dbos=dbos_peak
        )
        if refusal is not None:
            raise _usage(out, refusal)
    # Checked last, and nothing made: a refused run left the --json folders behind.
    prepared_output(json_path, "--json")
    config = BenchConfig(
        sagas=sagas,
        concurrency=1 if ours_in_flight == "auto" else ours_in_flight,
        provider=provider,
        latency_ms=latency_ms,
        warmup=DEFAULT_WARMUP if warmup is None else warmup,
        driver_seconds=driver_seconds,
        sqlite_synchronous=synchronous,
        sqlite_writer=sqlite_writer,
        workers=workers,
        recovery=recovery,
    )
    environment = asyncio.run(describe(db, compare=compare))
    out.print(one_line(environment))
    note = memory_files_note(environment)
    if note is not None:
        out.print(f"[yellow]{escape(note)}[/]")
    ours_sweep = None
    if ours_in_flight == "auto":
        ours_sweep = _sweep_ours(config, db, sweep_settings, out, match_time=match_time)
        config = dataclasses.replace(config, concurrency=ours_sweep.fastest)
    if compare is None:
        start = read_cpu_times()
        result = run_job(run_bench(config, db=db))
        steal = stolen_share(start, read_cpu_times())
        render(result, out)
        _print_steal_caution(out, [steal])
        data = result.as_json()
        data["steal_share"] = steal
        ok = result.check.ok
    else:
        data, ok = _compare(
            config,
            db,
            DEFAULT_PAIRS if pairs is None else pairs,
            dbos_sqlite or "fast",
            out,
            match_time=match_time,
            dbos_concurrency=dbos_in_flight,
        )
    data["concurrency_sweep"] = None if ours_sweep is None else ours_sweep.as_json("sagas_per_s")
    if ours_sweep is not None and ours_sweep.problems:
        # A sweep run is not the measured run, and its checker still counts.
        ok = data["check_ok"] = False
    data["environment"] = environment
    if json_path is not None:
        write_output(json_path, json.dumps(data, indent=2) + "\n", "--json")
    if not ok:
        raise typer.Exit(1)


def sweep_settings_that_fit(room: ConnectionRoom | None, provider: str) -> tuple[int, ...]:
    """The settings of :data:`~fault_injection.sweep.OURS_SWEEP_CONCURRENCY` the PostgreSQL
    server has connections for (all of them when its room is not known). When not even the
    smallest fits, the smallest: the run's own check then refuses it with the numbers."""
    fitting = tuple(
        c
        for c in OURS_SWEEP_CONCURRENCY
        if _connections_refusal(room, concurrency=c, workers=0, provider=provider) is None
    )
    return fitting or (min(OURS_SWEEP_CONCURRENCY),)


def _room(db: str | None) -> ConnectionRoom | None:
    """The PostgreSQL server's room for connections now (``None``: it could not be read). The
    bench's first connection: a server it cannot reach ends the command here, in one line
    (:func:`fault_injection.bench_environment.connection_room`)."""
    from fault_injection.bench_environment import connection_room
    from fault_injection.cli import run_job

    assert db is not None
    return run_job(connection_room(db))


def _connections_refusal(
    room: ConnectionRoom | None,
    *,
    concurrency: int,
    workers: int,
    provider: str,
    dbos: int | None = None,
) -> str | None:
    """Why the run cannot fit in the PostgreSQL server's connections (``None``: it can, or
    the room is not known)."""
    from fault_injection.pg_connections import (
        BENCH_OWN_CONNECTIONS,
        PROCESS_OWN_CONNECTIONS,
        connections_needed,
        too_many,
    )

    if room is None:
        return None
    needed = connections_needed(concurrency=concurrency, workers=workers, provider=provider)
    what = f"--concurrency {concurrency}" + (f" with --workers {workers}" if workers else "")
    if dbos is not None:
        # DBOS's half runs alone, on threads of one process and a pool of its own.
        dbos_needed = dbos + PROCESS_OWN_CONNECTIONS + BENCH_OWN_CONNECTIONS
        if dbos_needed > needed:
            needed, what = dbos_needed, f"DBOS's half at {dbos} in flight"
    return too_many(needed, room, what=what)


def _in_flight(value: str) -> InFlight:
    """``--concurrency``'s or ``--dbos-concurrency``'s value: a number in flight, or
    ``"auto"``; :class:`ValueError` when it is neither."""
    if value.strip().lower() == "auto":
        return "auto"
    number = int(value)
    if not 1 <= number <= MAX_IN_FLIGHT:
        raise ValueError(f"{number} is out of range")
    return number


def _option_in_flight(out: Console, option: str, value: str) -> InFlight:
    """:func:`_in_flight` of ``option``'s ``value``, or the usage error that names it."""
    try:
        return _in_flight(value)
    except ValueError:
        raise _usage(out, f"{option} must be a number from 1 to {MAX_IN_FLIGHT}, or auto") from None


def _server(ms: float | None) -> str:
    # The local PostgreSQL server's CPU a saga during one half (fault_injection.server_cpu).
    return "" if ms is None else f", server {ms:.1f} ms"


def _steal(share: float | None) -> str:
    # The machine's stolen CPU time during one half of a pair (fault_injection.steal).
    return "" if share is None else f", steal {share:.0%}"


def _compare(
    config: BenchConfig,
    db: str | None,
    pairs: int,
    dbos_sqlite: str,
    out: Console,
    *,
    match_time: bool = False,
    dbos_concurrency: InFlight | None = None,
) -> tuple[dict[str, Any], bool]:
    """Ours, then DBOS's, ``pairs`` times in this process; the ratio printed per pair.
    ``match_time``: our half's size follows DBOS's last half (:func:`matched_sagas`).
    ``dbos_concurrency``: DBOS's workflows in flight (``None``: as ours; ``"auto"``: the
    fastest of a sweep of DBOS alone, :func:`~fault_injection.bench_dbos.sweep_dbos`). Why
    apart: the two engines are fastest at different settings (on PostgreSQL DBOS peaks near 4
    in flight, ours near 16), and the issue's target is against DBOS in its fastest settings."""
    from fault_injection.bench_dbos import ComparePair, compare_json, matched_sagas, run_dbos
    from fault_injection.cli import run_job

    tuning: SqliteTuning = "fast" if dbos_sqlite == "fast" else "default"
    done: list[ComparePair] = []
    ours_sagas = config.sagas
    with scratch_folder(db, "bench-dbos-") as tmp:
        sweep = None
        if dbos_concurrency == "auto":
            sweep = _sweep_dbos(config, db, Path(tmp), tuning, out)
            theirs_in_flight = sweep.fastest
        else:
            theirs_in_flight = dbos_concurrency or config.concurrency
        in_flight = f"C={config.concurrency}"
        if theirs_in_flight != config.concurrency:
            in_flight += f" vs DBOS C={theirs_in_flight}"

        def run_pair(sagas: int) -> ComparePair:
            start = read_cpu_times()
            ours = run_job(run_bench(dataclasses.replace(config, sagas=sagas), db=db))
            middle = read_cpu_times()
            theirs = run_dbos(
                db,
                Path(tmp),
                sagas=config.sagas,
                concurrency=theirs_in_flight,
                warmup=config.warmup,
                sqlite_tuning=tuning,
            )
            return ComparePair(
                ours,
                theirs,
                steal=stolen_share(start, middle),
                dbos_steal=stolen_share(middle, read_cpu_times()),
            )

        pilot = None
        if match_time:
            # A pair that is not counted, run only to size the first counted pair's half of
            # ours: without it that half was --sagas long, a tenth of DBOS's, and the first
            # ratio stood apart from the others in every run (docs/benchmarks-log.md, item 63).
            pilot = run_pair(config.sagas)
            ours_sagas = matched_sagas(config.sagas, pilot.dbos.elapsed_s, pilot.ours.sagas_per_s)
            out.print(
                f"pilot (not counted; sizes the first pair) · {in_flight}: ours "
                f"{pilot.ours.sagas_per_s:,.1f} sagas/s over {pilot.ours.sagas:,} sagas"
                f"{_steal(pilot.steal)} · DBOS {pilot.dbos.sagas_per_s:,.1f} workflows/s over "
                f"{pilot.dbos.elapsed_s:.1f} s{_steal(pilot.dbos_steal)}"
            )
            _print_problems(out, [*pilot.ours.check.problems, *pilot.dbos.problems])
        for i in range(pairs):
            pair = run_pair(ours_sagas)
            ours, theirs = pair.ours, pair.dbos
            done.append(pair)
            if match_time:
                ours_sagas = matched_sagas(config.sagas, theirs.elapsed_s, ours.sagas_per_s)
            size = f" over {ours.sagas:,} sagas" if match_time else ""
            out.print(
                f"pair {i + 1}/{pairs} · {ours.backend} · {in_flight}: "
                f"ours {ours.sagas_per_s:,.1f} sagas/s{size} ({ours.cpu_ms_per_saga:.1f} ms CPU"
                f"{_server(ours.server_cpu_ms_per_saga)}, "
                f"{_num(ours.commits_per_saga, '.2f')} commits{_steal(pair.steal)}) · DBOS "
                f"{theirs.sagas_per_s:,.1f} workflows/s ({theirs.cpu_ms_per_saga:.1f} ms CPU"
                f"{_server(theirs.server_cpu_ms_per_saga)}, "
                f"{theirs.commits_per_saga:.2f} commits, {theirs.settings}"
                f"{_steal(pair.dbos_steal)}) · ratio {pair.ratio:.2f}x"
            )
            _print_problems(out, [*ours.check.problems, *theirs.problems])
    median = sorted(done, key=lambda p: p.ours.sagas_per_s)[len(done) // 2].ours
    render(median, out)
    data = compare_json(done)
    out.print(
        f"median over {pairs} pairs ({in_flight}): ours {median.sagas_per_s:,.1f} sagas/s · DBOS "
        f"{data['dbos_sagas_per_s']:,.1f} workflows/s · ratio {data['ratio_vs_dbos']:.2f}x"
    )
    out.print(_median_interval_line(data))
    halves = [share for p in done for share in (p.steal, p.dbos_steal)]
    if _print_steal_caution(out, halves, of="halves"):
        out.print(_alike_steal_line(done))
    data["dbos_concurrency_sweep"] = None if sweep is None else sweep.as_json("workflows_per_s")
    data["match_time_pilot"] = None if pilot is None else _pilot_json(pilot)
    # The runs that are not pairs count for the checks too: a failure anywhere fails the bench.
    dbos_ok = (sweep is None or not sweep.problems) and (pilot is None or pilot.dbos.check_ok)
    ours_ok = pilot is None or pilot.ours.check.ok
    data["dbos_check_ok"] = bool(data["dbos_check_ok"]) and dbos_ok
    data["check_ok"] = bool(data["check_ok"]) and dbos_ok and ours_ok
    return data, data["check_ok"]


def _print_steal_caution(
    out: Console, shares: list[float | None], *, of: str | None = None
) -> bool:
    """A caution under figures the hypervisor's other guests took part in
    (:func:`fault_injection.steal.steal_caution`); whether there was one."""
    caution = steal_caution(shares, of=of)
    if caution is not None:
        out.print(f"[yellow]{escape(caution)}[/]")
    return caution is not None


def _alike_steal_line(pairs: list[ComparePair]) -> str:
    """The pairs whose two halves lost alike shares (:func:`fault_injection.steal.alike`), and
    their median ratio: the like-with-like reading a disturbed comparison still has."""
    ratios = sorted(p.ratio for p in pairs if alike(p.steal, p.dbos_steal))
    head = (
        f"{len(ratios)} of {len(pairs)} pairs lost alike shares in both halves "
        f"(within {ALIKE_STEAL_POINTS:.0%} of each other)"
    )
    if not ratios:
        return head
    spread = f" ({ratios[0]:.2f}x to {ratios[-1]:.2f}x)" if len(ratios) > 1 else ""
    return f"{head}: their median ratio {statistics.median(ratios):.2f}x{spread}"


def _print_problems(out: Console, problems: list[str]) -> None:
    """What a checker found wrong, one line each."""
    for problem in problems:
        out.print(f"  [red]check FAILED[/]: {problem}")


def _pilot_json(pilot: ComparePair) -> dict[str, Any]:
    """The JSON's ``match_time_pilot``: what sized the first counted pair."""
    return {
        "sagas": pilot.ours.sagas,
        "dbos_sagas": pilot.dbos.sagas,
        "sagas_per_s": pilot.ours.sagas_per_s,
        "dbos_sagas_per_s": pilot.dbos.sagas_per_s,
        "dbos_elapsed_s": pilot.dbos.elapsed_s,
        # A disturbed pilot sizes the first pair from a slowed half: the reader should see it.
        "steal_share": pilot.steal,
        "dbos_steal_share": pilot.dbos_steal,
        "check_ok": pilot.ours.check.ok and pilot.dbos.check_ok,
    }


def _sweep_ours(
    config: BenchConfig,
    db: str | None,
    settings: tuple[int, ...],
    out: Console,
    *,
    match_time: bool = False,
) -> Sweep:
    """``--concurrency auto``: ours alone at each of ``settings``, printed as it goes; the
    measured run (or the pairs) then runs at the fastest. Each run is a whole bench run on
    fresh databases, its checker included, with the shortest driver loop: only its sagas/s
    ranks the settings. Each runs as many sagas as the measured runs will (with
    ``match_time``, up to :data:`~fault_injection.bench_dbos.MATCH_CAP` times ``--sagas``), at
    most :data:`~fault_injection.sweep.OURS_SWEEP_SAGAS`: shorter runs misread the higher
    settings."""
    from fault_injection.bench_dbos import MATCH_CAP
    from fault_injection.cli import run_job

    measured = config.sagas * (MATCH_CAP if match_time else 1)
    sagas = min(measured, OURS_SWEEP_SAGAS)
    out.print(
        f"ours alone first, to find its fastest setting ({sagas:,} sagas a run, "
        f"{SWEEP_ROUNDS} rounds):"
    )

    def run_one(concurrency: int) -> BenchResult:
        trial = dataclasses.replace(
            config, sagas=sagas, concurrency=concurrency, driver_seconds=SWEEP_DRIVER_SECONDS
        )
        return run_job(run_bench(trial, db=db))

    def show(round_: int, concurrency: int, result: BenchResult, steal: float | None) -> None:
        out.print(
            f"  round {round_ + 1} · ours C={concurrency}: {result.sagas_per_s:,.1f} sagas/s "
            f"({result.cpu_ms_per_saga:.1f} ms CPU{_server(result.server_cpu_ms_per_saga)}"
            f"{_steal(steal)})"
        )

    sweep = run_sweep(
        run_one,
        rate=lambda result: result.sagas_per_s,
        problems=lambda result: result.check.problems,
        who="ours",
        sagas=sagas,
        concurrencies=settings,
        on_run=show,
        on_rerun=lambda _round, _c, steal: _print_rerun(out, steal),
    )
    means = " · ".join(f"C={c} {mean:,.1f}" for c, mean in sweep.means.items())
    out.print(f"our fastest here: C={sweep.fastest} (mean sagas/s: {means})")
    _print_steal_caution(out, sweep.steal_shares, of="sweep runs")
    _print_problems(out, sweep.problems)
    return sweep


def _sweep_dbos(
    config: BenchConfig, db: str | None, workdir: Path, tuning: SqliteTuning, out: Console
) -> Sweep:
    """``--dbos-concurrency auto``: DBOS alone at each setting, printed as it goes; the
    pairs then give DBOS the fastest."""
    from fault_injection.bench_dbos import SWEEP_SAGAS, sweep_dbos

    sagas = min(config.sagas, SWEEP_SAGAS)
    out.print(
        f"DBOS alone first, to find its fastest setting ({sagas:,} workflows a run, "
        f"{SWEEP_ROUNDS} rounds):"
    )

    def show(round_: int, concurrency: int, result: DbosResult, steal: float | None) -> None:
        out.print(
            f"  round {round_ + 1} · DBOS C={concurrency}: {result.sagas_per_s:,.1f} workflows/s "
            f"({result.cpu_ms_per_saga:.1f} ms CPU{_server(result.server_cpu_ms_per_saga)}"
            f"{_steal(steal)})"
        )

    sweep = sweep_dbos(
        db,
        workdir,
        sagas=sagas,
        warmup=config.warmup,
        sqlite_tuning=tuning,
        on_run=show,
        on_rerun=lambda _round, _c, steal: _print_rerun(out, steal),
    )
    means = " · ".join(f"C={c} {mean:,.1f}" for c, mean in sweep.means.items())
    out.print(f"DBOS's fastest here: C={sweep.fastest} (mean workflows/s: {means})")
    _print_steal_caution(out, sweep.steal_shares, of="sweep runs")
    _print_problems(out, sweep.problems)
    return sweep


def _print_rerun(out: Console, steal: float) -> None:
    """Under a sweep run set aside (``fault_injection.sweep.SWEEP_RERUNS``)."""
    out.print(
        f"    set aside: the hypervisor took {steal:.0%} of the machine's CPU "
        f"(from {STEAL_CAUTION_SHARE:.0%} on, a sweep run is run once more)"
    )


def _median_interval_line(data: dict[str, Any]) -> str:
    """How sure the median ratio is (``fault_injection.median_interval``)."""
    low, high = data["ratio_vs_dbos_ci95_low"], data["ratio_vs_dbos_ci95_high"]
    if low is None or high is None:
        return "the median ratio's 95 % interval needs six pairs or more: run more with --pairs"
    return (
        f"the true median ratio lies in {low:.2f}x to {high:.2f}x "
        f"(sign-test interval, {100 * data['ratio_vs_dbos_ci95_coverage']:.1f} % coverage)"
    )
