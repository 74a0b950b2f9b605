"""`autosel tune`: offline pre-warm of the tuning DB, from representative, given or recorded shapes."""

from __future__ import annotations

import fnmatch
import glob
import importlib.util
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any

import click

from autosel import config
from autosel.cli import main
from autosel.cli._common import (MEDIAN_NOTE, db_option, decision_summary, echo_json, json_option, make_console,
                                 make_table, matches, op_option, refuse_unwritable, runner_up_text, settings_for,
                                 stdout_to_stderr, writable_db)
from autosel.files import open_regular
from autosel.formatting import format_lead, format_us
from autosel.report import candidate_median_us

RECORD_EXAMPLE = '{"op": "layernorm.rmsnorm", "shape": {"tokens": 64, "hidden": 4096}, "mode": "eager"}'
MARGIN_NOTE = ("margin: how much slower the runner-up is than the winner; \"default kept\": the runner-up was faster "
               "but not by more than the noise in every round")

# An op registered by a script at run time is not in `autosel tune`'s process: say where its ops must come from.
SCRIPT_OPS = ("; the command line sees the ops that autosel and its plug-ins register (an `autosel.ops` entry "
              "point, README), not those a script registers")


# --- tune -------------------------------------------------------------------------------------------------

class Seconds(click.FloatRange):
    """A positive, finite number of seconds: FloatRange lets nan and inf through (a budget that never ends)."""

    name = "seconds"

    def __init__(self) -> None:
        super().__init__(min=0, min_open=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return seconds


def _torch_missing() -> bool:
    return importlib.util.find_spec("torch") is None


def read_shapes_file(path: Path) -> dict[str, list[dict]]:
    """{op: [shape, ...]} from a JSON file, or a ClickException that says what is wrong and how it should look."""
    try:
        with open_regular(path, encoding="utf-8") as f:
            data = json.loads(f.read())
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"cannot read {path} ({exc}); pass a JSON file of shapes") from None
    except json.JSONDecodeError as exc:
        raise click.ClickException(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                                   'write it as {"op": [{"tokens": 64, "hidden": 4096}, ...]}') from None
    if not isinstance(data, dict) or not data:
        raise click.ClickException(f"{path} must hold a JSON object mapping op names to lists of shapes, e.g. "
                                   '{"layernorm.rmsnorm": [{"tokens": 64, "hidden": 4096}]}')
    for op, shapes in data.items():
        if not isinstance(shapes, list) or not shapes or not all(isinstance(s, dict) for s in shapes):
            raise click.ClickException(f"{path}: op {op!r} must map to a non-empty list of shape objects, "
                                       'e.g. [{"tokens": 64, "hidden": 4096}]')
    return data


def read_record(path: Path) -> dict[str, dict[str, list[dict]]]:
    """An AUTOSEL_RECORD file as {mode: {op: [shape, ...]}}, grouped by op and deduplicated, in file order."""
    from autosel.config import EXECUTION_MODES

    grouped: dict[str, dict[str, list[dict]]] = {}
    seen: set[tuple[str, str, str]] = set()
    try:
        with open_regular(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"cannot read {path} ({exc}); pass the file AUTOSEL_RECORD wrote") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            problem = f"not valid JSON ({exc.msg} at column {exc.colno})"
        else:
            problem = None
            if not isinstance(item, dict):
                problem = "not a JSON object"
            elif not isinstance(item.get("op"), str) or not item["op"]:
                problem = "'op' is missing or not a string"
            elif not isinstance(item.get("shape"), dict):
                problem = "'shape' is missing or not an object"
            elif item.get("mode", "eager") not in EXECUTION_MODES:
                problem = f"'mode' is {item.get('mode')!r}, not one of {', '.join(EXECUTION_MODES)}"
        if problem:
            raise click.ClickException(f"{path}:{number}: {problem}; each line must be a JSON object like "
                                       f"{RECORD_EXAMPLE} (as AUTOSEL_RECORD writes them)")
        mode = item.get("mode", "eager")
        text = json.dumps(item["shape"], sort_keys=True)
        if (mode, item["op"], text) not in seen:
            seen.add((mode, item["op"], text))
            grouped.setdefault(mode, {}).setdefault(item["op"], []).append(item["shape"])
    if not grouped:
        raise click.ClickException(f"{path} records no shapes; run the engine with AUTOSEL_RECORD={path} first")
    return grouped


class _TuneProgress:
    """A rich progress bar on stderr per op being tuned (several at once with --devices); rejections and choices
    are printed above them."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self.total, self.started, self.tasks = total, 0, {}
        console = make_console(stderr=True)
        # Piped, a transient bar shows nothing, yet rich ends it with an empty line on stderr
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                            TimeElapsedColumn(), console=console, transient=True, disable=not console.is_interactive)

    def __enter__(self) -> "_TuneProgress":
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def say(self, text: str) -> None:
        self.bar.console.print(text, markup=False, highlight=False)

    def on_event(self, event) -> None:
        job, where = (event.op, event.mode, event.device), f" on {event.device}" if event.device else ""
        if event.kind == "started":
            self.started += 1
            self.tasks[job] = self.bar.add_task(f"[{self.started}/{self.total}] {event.op} ({event.mode} mode){where}",
                                                total=1.0)
        elif event.kind == "progress" and job in self.tasks:
            self.bar.update(self.tasks[job], completed=event.fraction)
        elif event.kind in ("rejected", "dropped"):
            self.say(f"  {event.op}{where}: {event.backend} {event.kind}: {event.detail}")
        elif event.kind == "chosen":
            self.say(f"  {event.op}{where}: {event.backend} chosen ({event.detail})")
        if event.kind in ("chosen", "failed") and job in self.tasks:  # the job is over
            self.bar.remove_task(self.tasks.pop(job))


def _plan(tuning, platform, ops: tuple[str, ...], shapes_by_mode) -> tuple[list, list[str]]:
    """([(patterns, shapes, modes) per tune_ops call], notes on the file's ops that cannot be tuned here). The notes
    are for when something else is tuned: with nothing to tune, _nothing_to_tune says the same as an error."""
    available = tuning.modes_for(platform)
    contested = {op for op, _ in tuning.contested_ops(platform, list(ops) or None)}
    runs, notes = [], []
    for mode, shapes in shapes_by_mode.items():
        if shapes is None:
            runs.append((list(ops) or None, None, None))
            continue
        if mode is not None and mode not in available:
            click.echo(f"Warning: {mode}-mode shapes of {', '.join(sorted(shapes))} skipped: this {platform.device.value} "
                       f"machine times {', '.join(available)} mode only", err=True)
            continue
        targets = []
        for op in shapes:
            if not matches(op, ops):
                continue
            if op in contested:
                targets.append(op)
            elif not tuning.registry.has(op):
                notes.append(f"op {op!r} is not registered here; its shapes are skipped (registered ops: "
                             f"{', '.join(tuning.registry.ops()) or 'none'}){SCRIPT_OPS}")
            else:
                notes.append(f"op {op!r} has fewer than two backends eligible here; nothing to tune")
        if targets:
            runs.append(([glob.escape(op) for op in targets], {op: shapes[op] for op in targets},
                         [mode] if mode is not None else None))
    return runs, notes


def _devices(ctx, param, value: str | None) -> str | None:
    """--devices' form, checked on any machine: whether the GPUs exist is known only once torch looks."""
    if value is None or value.strip().lower() == "all" or all(
            part.strip().isascii() and part.strip().isdigit() for part in value.split(",")):
        return value
    raise click.BadParameter(f"{value!r} is not 'all' or GPU indices (whole numbers from 0) separated by "
                             "commas, e.g. 0,1")


def _differ(outcome) -> int:
    """How many of the outcome's buckets have another winner than its op-level decision."""
    return sum(b.winner != outcome.decision.winner for b in outcome.buckets) if outcome.decision else 0


def _rejected_text(decision) -> str:
    return "\n".join(f"{c.backend}: {c.reason}" for c in decision.candidates if not c.ok) or "-"


def _buckets_text(outcome) -> str:
    if not outcome.buckets:
        return "-"
    return f"{len(outcome.buckets)}, {_differ(outcome)} differ"


def _nothing_to_tune(tuning, platform, ops: tuple[str, ...], named: list[str] | None = None, source=None,
                     untimed: list[str] = ()) -> str:
    """Why nothing can be tuned. named: the ops a --shapes or --from-record file (source) gives shapes for, in the
    modes this machine times; untimed: the modes of the file's other shapes."""
    registered = tuning.registry.ops()
    for pattern in ops:
        if not any(fnmatch.fnmatchcase(op, pattern) for op in registered):
            hint = config.nearest_ops(pattern, registered)
            return (f"no registered op matches --op {pattern!r}; {hint + ' ' if hint else ''}registered ops: "
                    f"{', '.join(registered) or 'none'}")
    if named is not None and not named and untimed:
        return (f"every shape in {source} is for {' and '.join(untimed)} mode, which this {platform.device.value} "
                f"machine does not time ({', '.join(tuning.modes_for(platform))} only); tune that file on a machine "
                "that times it")
    if named and not any(matches(op, ops) for op in named):
        return (f"--op {' '.join(map(repr, ops))} matches none of the ops {source} gives shapes for "
                f"({', '.join(named)}); drop --op, or pass a pattern that matches one of them")
    unknown = [op for op in named or () if matches(op, ops) and not tuning.registry.has(op)]
    if unknown:
        return (f"op{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))} in {source} "
                f"{'are' if len(unknown) > 1 else 'is'} not registered here; registered ops: "
                f"{', '.join(registered) or 'none'}{SCRIPT_OPS}")
    lone = []
    for op in registered:
        if matches(op, ops) and (named is None or op in named):
            eligible = [s.backend.value for s in tuning.registry.get(op) if s.is_available(platform)]
            lone.append(f"{op}: {', '.join(eligible) or 'none'} eligible")
    return ("no matching op has several backends eligible on this machine, so there is nothing to choose between "
            f"({'; '.join(lone)}); run `autosel doctor` to see why backends are not eligible")


@main.command()
@op_option("Tune only ops matching this glob (repeatable), e.g. 'layernorm.*'.")
@click.option("--shapes", "shapes_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='Tune only the ops named in this JSON file, on its shapes: {"op": [shape, ...]}.')
@click.option("--from-record", "record_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Tune exactly the shapes an AUTOSEL_RECORD=FILE run recorded (grouped by op, deduplicated).")
@db_option("Write decisions to this DB instead of the default user DB; decisions found in shipped DBs are copied "
           "into it.")
# Not force_option: here --force re-times what is stored; there it overwrites a file.
@click.option("--force", is_flag=True, help="Re-tune ops that already have a stored decision.")
@click.option("--budget-s", type=Seconds(), default=120.0, show_default=True,
              help="Seconds of timing per op and mode; not the wall time: each candidate's checks and first compile "
                   "come on top (torch.compile's first compile of each kernel among them).")
@click.option("--isolate", is_flag=True,
              help="Check each candidate first in a child process, so a crash or hang becomes a rejection reason.")
@click.option("--isolate-timeout-s", type=Seconds(), default=300.0, show_default=True,
              help="With --isolate: kill a candidate's child process after this many seconds.")
@click.option("--devices", metavar="all|0,1,...", callback=_devices,
              help="Spread the tune over these GPUs, longest job first: this process tunes on the first, a "
                   "worker process on each other; GPUs of different models each get their own decisions. "
                   "Default: this process's current device only.")
@json_option("the outcome")
def tune(ops, shapes_file, record_file, db, force, budget_s, isolate, isolate_timeout_s, devices, as_json):
    """Time the eligible backends of every op that has several, and store the winners.

    Ops already decided for this machine and these versions are reused (status "stored") and not timed again
    unless --force is given. With --db, a decision found in a shipped DB is copied into PATH (status "copied"),
    so a DB built for an image holds every decision. A progress bar runs on stderr; the table or JSON goes to stdout.

    \b
    Examples:
      autosel tune
      autosel tune --op 'activation.*' --budget-s 20 --db build.db
      autosel tune --isolate --isolate-timeout-s 60
      autosel tune --devices all --db build.db
      AUTOSEL_RECORD=shapes.jsonl python serve.py ...; autosel tune --from-record shapes.jsonl
    """
    if shapes_file and record_file:
        raise click.UsageError("--shapes and --from-record cannot be combined; pass one of them")
    given = click.get_current_context().get_parameter_source("isolate_timeout_s")
    if not isolate and given is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--isolate-timeout-s limits the child processes of --isolate; add --isolate")
    if _torch_missing():
        raise click.ClickException(f"tuning runs the kernels, which needs PyTorch, and torch is not installed for "
                                   f"{sys.executable}; pip install torch, then run `autosel tune` again")
    from autosel import batch, parallel, platforms, tuning
    from autosel.errors import DeviceError, Terminated

    settings = settings_for(db, full=True)
    platform = platforms.current_platform()
    try:  # every kind of GPU among --devices tunes every job once
        targets = [platform] if devices is None else parallel.kinds(parallel.gpu_workers(devices))
    except DeviceError as exc:
        raise click.ClickException(f"--devices {devices}: {exc}") from None
    if record_file:
        shapes_by_mode: dict = read_record(record_file)
    elif shapes_file:
        shapes_by_mode = {None: read_shapes_file(shapes_file)}
    else:
        shapes_by_mode = {None: None}
    runs, notes = _plan(tuning, platform, ops, shapes_by_mode)
    total = sum(len(tuning.contested_ops(target, patterns)) * len(modes or tuning.modes_for(target))
                for patterns, _, modes in runs for target in targets)
    if not total:
        if ops or shapes_file or record_file:
            timed = {mode: shapes for mode, shapes in shapes_by_mode.items()
                     if mode is None or mode in tuning.modes_for(platform)}
            named = list(dict.fromkeys(op for shapes in timed.values() for op in shapes or ())) \
                if shapes_file or record_file else None
            raise click.ClickException(_nothing_to_tune(tuning, platform, ops, named, shapes_file or record_file,
                                                        [mode for mode in shapes_by_mode if mode not in timed]))
        click.echo("Nothing to tune: no registered op has several backends eligible on this machine "
                   "(run `autosel doctor` to see why).", err=True)
    for note in notes:
        click.echo(f"Warning: {note}", err=True)
    database = writable_db(settings, db, undone="nothing was timed")
    outcomes = []
    try:
        with parallel.termination_raises(), _TuneProgress(total) as progress, stdout_to_stderr():
            for patterns, shapes, modes in runs:
                outcomes += batch.tune_ops(patterns, force=force, budget_s=budget_s, shapes=shapes, modes=modes,
                                            on_event=progress.on_event, settings=settings,
                                            isolate_timeout_s=isolate_timeout_s if isolate else None,
                                            copy_found=bool(db), devices=devices)
    except KeyboardInterrupt as exc:  # each op is recorded when it is done: say what is kept and how to go on
        signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
        how = "Interrupted" if signum == signal.SIGINT else f"Stopped by {signal.Signals(signum).name}"
        kept = f"{how}: the op/mode pairs finished before that are stored in {settings.db}"
        if force:  # without --force, the pairs not reached that have a decision are reused, not timed again
            click.echo(f"{kept}. Run the same command without --force to go on: it reuses every pair that has a "
                       "stored or shipped decision, those included, and tunes the others; to time chosen ops again, "
                       "keep --force and add --op GLOB.", err=True)
        else:
            click.echo(f"{kept}; the same command reuses them and tunes the rest.", err=True)
        click.get_current_context().exit(128 + signum)  # the shell's code for a process ended by that signal
    if as_json:
        echo_json({"db": str(settings.db), "platform_key": platform.key, "budget_s": budget_s,
                   "median": MEDIAN_NOTE, "outcomes": [
                        {"op": o.op, "mode": o.mode, "platform_key": o.platform_key, "status": o.status,
                         "detail": o.detail, "device": o.device or None,
                         **(decision_summary(o.decision) if o.decision else {}),
                         "buckets": [{"bucket": b.bucket, "winner": b.winner} for b in o.buckets],
                         "buckets_differ": _differ(o),
                         "decision": o.decision.to_dict() if o.decision else None} for o in outcomes]})
    elif outcomes:
        kinds = len({o.platform_key for o in outcomes}) > 1  # GPUs of several models: say whose row it is
        spread = devices is not None  # which GPU tuned each pair ("-": stored, nothing tuned)
        table = make_table("op", "mode", *["platform"] * kinds, *["device"] * spread, "status", "winner", "median",
                           "runner-up", "margin", "buckets", "rejected")
        for o in outcomes:
            d, platform_cell = o.decision, [o.platform_key] * kinds + [o.device or "-"] * spread
            if d is None:
                table.add_row(o.op, o.mode, *platform_cell, o.status, "-", "-", "-", "-", "-", o.detail)
                continue
            table.add_row(o.op, o.mode, *platform_cell, o.status, d.winner,
                          format_us(candidate_median_us(d.candidate(d.winner))), runner_up_text(d), format_lead(d),
                          _buckets_text(o), _rejected_text(d))
        console = make_console()
        console.print(table)
        console.print(f"{MEDIAN_NOTE}; {MARGIN_NOTE}; buckets: how many shape buckets have their own decision, "
                      "and how many of them another winner than the op's (`autosel show` lists them). "
                      f"DB: {settings.db}", markup=False)
    refuse_unwritable(database, settings, db, undone="the decisions tuned after that failure are lost at exit: "
                                                     "tune them again once it can be written")
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        several = len({o.platform_key for o in outcomes}) > 1
        listed = "; ".join(f"{o.op} ({o.mode}{f' on {o.platform_key}' * several}): {o.detail}" for o in failed)
        raise click.ClickException(f"{len(failed)} of {len(outcomes)} op/mode pairs could not be tuned: {listed}. "
                                   "Fix the kernels or shapes named above, or leave those ops out with --op")
