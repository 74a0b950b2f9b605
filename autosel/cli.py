"""The `autosel` command line; the only module that prints or exits (exit 0 ok, 1 error, 2 usage)."""

from __future__ import annotations

import datetime
import fnmatch
import glob
import importlib
import importlib.util
import json
import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import click

from autosel import config
from autosel.errors import AutoselError, ConfigError
from autosel.report import Entry, candidate_median_us, format_lead, format_us

# Heavy modules (torch, rich, the DB) are imported inside the commands: `autosel show` must not pay for torch.

RECORD_EXAMPLE = '{"op": "layernorm.rmsnorm", "shape": {"tokens": 64, "hidden": 4096}, "mode": "eager"}'
MEDIAN_NOTE = "median: geometric mean over the shapes of each shape's median time per call"
MARGIN_NOTE = "margin: how much slower the runner-up is than the winner (negative: a tie inside the noise, default kept)"


class _Group(click.Group):
    """Library errors become `Error: ...` with exit 1; the messages already say what to do next."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except AutoselError as exc:
            raise click.ClickException(str(exc)) from exc


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test runner swaps it)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


@contextmanager
def _warnings_as_messages() -> Iterator[None]:
    """The library warns for degraded-but-working paths; show them as one plain line each, not with a traceback."""
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *args, **kwargs: click.echo(f"Warning: {message}", err=True)
        yield


def _console(*, stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:  # piped or captured: do not wrap at 80
        console = Console(stderr=stderr, highlight=False, width=160)
    return console


def _table(*columns: str, title: str | None = None):
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", show_edge=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def _settings(db: str | None, *, full: bool) -> config.Settings:
    """Settings with --db as the user layer. Commands that only read DBs look at AUTOSEL_DB/AUTOSEL_DB_PATH only,
    so a bad AUTOSEL_TUNE does not stop `autosel show` (doctor reports it)."""
    env = dict(os.environ)
    if not full:
        env = {k: v for k, v in env.items() if k in ("AUTOSEL_DB", "AUTOSEL_DB_PATH")}
    if db:
        env["AUTOSEL_DB"] = db
    return config.read_settings(env)


def _matches(op: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(op, p) for p in patterns)


# --- what this machine makes of each stored row -----------------------------------------------------------

def _version_diff(stored: dict[str, str], current: dict[str, str]) -> str:
    changed = [f"{k} {stored.get(k, '(none)')} -> {current.get(k, '(none)')}"
               for k in sorted(set(stored) | set(current)) if stored.get(k) != current.get(k)]
    return ", ".join(changed) or "same versions, different eligible backends"


class _Judge:
    """Classifies stored decisions against this machine: platform key, current version vector, eligibility."""

    def __init__(self, platform) -> None:
        from autosel import selector

        self.platform, self.selector = platform, selector
        self._ops: dict[str, tuple[list, list[str], dict[str, str]]] = {}

    def current(self, op: str) -> tuple[list, list[str], dict[str, str]]:
        from autosel.platforms import version_vector

        if op not in self._ops:
            specs = self.selector.registry.get(op)
            eligible = [s for s in specs if s.is_available(self.platform)]
            self._ops[op] = (specs, [s.backend.value for s in eligible], version_vector(self.platform, eligible))
        return self._ops[op]

    def staleness(self, decision) -> str | None:
        """Why a row no longer matches this machine (platform key or version vector), or None."""
        from autosel.decisions import versions_hash

        if decision.platform_key != self.platform.key:
            return f"tuned on {decision.platform_key}, this machine is {self.platform.key}"
        specs, _, versions = self.current(decision.op)
        if specs and decision.key.versions_hash != versions_hash(versions):
            return f"versions differ: {_version_diff(decision.versions, versions)}"
        return None

    def entries(self, pairs) -> list[Entry]:
        """In layer order: the first current, usable row of a key is "in use"; later ones are "shadowed"."""
        used: dict = {}
        out = []
        for decision, layer in pairs:
            specs, eligible, _ = self.current(decision.op)
            stale = self.staleness(decision)
            if not specs:
                status, detail = "unknown op", f"op {decision.op!r} is not registered here (is its plug-in installed?)"
            elif stale:
                status, detail = "stale", stale
            elif decision.winner not in eligible:
                status, detail = "unusable", f"winner {decision.winner!r} is not eligible here (eligible: {eligible})"
            elif decision.key in used:
                status, detail = "shadowed", f"the {used[decision.key]} layer's row is used instead"
            else:
                status, detail = "in use", ""
                used[decision.key] = layer.kind
            out.append(Entry(decision, layer.path, layer.kind, status, detail))
        return out


def _decision_summary(decision) -> dict[str, Any]:
    return {
        "winner": decision.winner,
        "median_us": candidate_median_us(decision.candidate(decision.winner)),
        "runner_up": decision.runner_up,
        "runner_up_median_us": candidate_median_us(decision.candidate(decision.runner_up or "")),
        "lead_over_runner_up": decision.lead_over_runner_up,
        "rejected": [{"backend": c.backend, "status": c.status, "reason": c.reason}
                     for c in decision.candidates if not c.ok],
    }


def _rejected_text(decision) -> str:
    return "\n".join(f"{c.backend}: {c.reason}" for c in decision.candidates if not c.ok) or "-"


def _runner_up_text(decision) -> str:
    if not decision.runner_up:
        return "-"
    return f"{decision.runner_up} ({format_us(candidate_median_us(decision.candidate(decision.runner_up)))})"


# --- the group --------------------------------------------------------------------------------------------

_EPILOG = """\b
Exit codes: 0 ok, 1 error (message on stderr), 2 usage.
Examples:
  autosel doctor
  autosel tune --op 'layernorm.*'
  autosel show --json"""


@click.group(cls=_Group, epilog=_EPILOG, context_settings={"help_option_names": ["-h", "--help"],
                                                           "max_content_width": 110})
@click.version_option(package_name="autosel", prog_name="autosel")
@click.option("-v", "--verbose", count=True, help="Log what autosel does on stderr (-v info, -vv debug).")
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """Time kernel backends per LLM op on this machine and keep the winners in a layered SQLite DB."""
    ctx.with_resource(_warnings_as_messages())
    if verbose:
        logger = logging.getLogger("autosel")
        if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter("autosel: %(levelname)s: %(message)s"))
            logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)


# --- tune -------------------------------------------------------------------------------------------------

def _torch_missing() -> bool:
    return importlib.util.find_spec("torch") is None


def read_shapes_file(path: Path) -> dict[str, list[dict]]:
    """{op: [shape, ...]} from a JSON file, or a ClickException that says what is wrong and how it should look."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
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
        lines = path.read_text(encoding="utf-8").splitlines()
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
    """A rich progress bar on stderr for the op being tuned; rejections and choices are printed above it."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self.total, self.started, self.task = total, 0, None
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                            TimeElapsedColumn(), console=_console(stderr=True), transient=True)

    def __enter__(self) -> "_TuneProgress":
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def say(self, text: str) -> None:
        self.bar.console.print(text, markup=False, highlight=False)

    def on_event(self, event) -> None:
        if event.kind == "started":
            self.started += 1
            mode = f"{event.mode} mode"
            if self.task is not None:
                self.bar.remove_task(self.task)
            self.task = self.bar.add_task(f"[{self.started}/{self.total}] {event.op} ({mode})", total=1.0)
        elif event.kind == "progress" and self.task is not None:
            self.bar.update(self.task, completed=event.fraction)
        elif event.kind in ("rejected", "dropped"):
            self.say(f"  {event.op}: {event.backend} {event.kind}: {event.detail}")
        elif event.kind == "chosen":
            if self.task is not None:
                self.bar.update(self.task, completed=1.0)
            self.say(f"  {event.op}: {event.backend} chosen ({event.detail})")


def _plan(selector, platform, ops: tuple[str, ...], shapes_by_mode) -> list[tuple[list[str] | None, dict | None,
                                                                                      list[str] | None]]:
    """(patterns, shapes, modes) per tune_ops call; tells the user about ops that cannot be tuned here."""
    available = selector.modes_for(platform)
    contested = {op for op, _ in selector.contested_ops(platform, list(ops) or None)}
    runs = []
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
            if not _matches(op, ops):
                continue
            if op in contested:
                targets.append(op)
            elif not selector.registry.has(op):
                click.echo(f"Warning: op {op!r} is not registered here; its shapes are skipped", err=True)
            else:
                click.echo(f"Warning: op {op!r} has fewer than two backends eligible here; nothing to tune", err=True)
        if targets:
            runs.append(([glob.escape(op) for op in targets], {op: shapes[op] for op in targets},
                         [mode] if mode is not None else None))
    return runs


def _nothing_to_tune(selector, platform, ops: tuple[str, ...]) -> str:
    registered = selector.registry.ops()
    for pattern in ops:
        if not any(fnmatch.fnmatchcase(op, pattern) for op in registered):
            return (f"no registered op matches --op {pattern!r}; registered ops: {', '.join(registered) or 'none'}")
    lone = []
    for op in registered:
        if _matches(op, ops):
            eligible = [s.backend.value for s in selector.registry.get(op) if s.is_available(platform)]
            lone.append(f"{op}: {', '.join(eligible) or 'none'} eligible")
    return ("no matching op has several backends eligible on this machine, so there is nothing to choose between "
            f"({'; '.join(lone)}); run `autosel doctor` to see why backends are not eligible")


@main.command()
@click.option("--op", "ops", multiple=True, metavar="GLOB",
              help="Tune only ops matching this glob (repeatable), e.g. 'layernorm.*'.")
@click.option("--shapes", "shapes_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='Tune only the ops named in this JSON file, on its shapes: {"op": [shape, ...]}.')
@click.option("--from-record", "record_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Tune exactly the shapes an AUTOSEL_RECORD=FILE run recorded (grouped by op, deduplicated).")
@click.option("--db", metavar="PATH", help="Write decisions to this DB instead of the default user DB.")
@click.option("--force", is_flag=True, help="Re-tune ops that already have a stored decision.")
@click.option("--budget-s", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Time budget per op and mode, in seconds.")
@click.option("--isolate", is_flag=True,
              help="Check each candidate first in a child process, so a crash or hang becomes a rejection reason.")
@click.option("--isolate-timeout-s", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="With --isolate: kill a candidate's child process after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Write the outcome as JSON on stdout.")
def tune(ops, shapes_file, record_file, db, force, budget_s, isolate, isolate_timeout_s, as_json):
    """Time the eligible backends of every op that has several, and store the winners.

    Ops already decided for this machine and these versions are reused (status "stored") and not timed again
    unless --force is given. A progress bar runs on stderr; the table or JSON goes to stdout.

    \b
    Examples:
      autosel tune
      autosel tune --op 'activation.*' --budget-s 20 --db build.db
      autosel tune --isolate --isolate-timeout-s 60
      AUTOSEL_RECORD=shapes.jsonl python serve.py ...; autosel tune --from-record shapes.jsonl
    """
    if shapes_file and record_file:
        raise click.UsageError("--shapes and --from-record cannot be combined; pass one of them")
    if _torch_missing():
        raise click.ClickException(f"tuning runs the kernels, which needs PyTorch, and torch is not installed for "
                                   f"{sys.executable}; pip install torch, then run `autosel tune` again")
    from autosel import selector

    settings = _settings(db, full=True)
    platform = selector._platform()
    if record_file:
        shapes_by_mode: dict = read_record(record_file)
    elif shapes_file:
        shapes_by_mode = {None: read_shapes_file(shapes_file)}
    else:
        shapes_by_mode = {None: None}
    runs = _plan(selector, platform, ops, shapes_by_mode)
    total = sum(len(selector.contested_ops(platform, patterns)) * len(modes or selector.modes_for(platform))
                for patterns, _, modes in runs)
    if not total:
        if ops or shapes_file or record_file:
            raise click.ClickException(_nothing_to_tune(selector, platform, ops))
        click.echo("Nothing to tune: no registered op has several backends eligible on this machine "
                   "(run `autosel doctor` to see why).", err=True)
    outcomes = []
    with _TuneProgress(total) as progress:
        for patterns, shapes, modes in runs:
            outcomes += selector.tune_ops(patterns, force=force, budget_s=budget_s, shapes=shapes, modes=modes,
                                          on_event=progress.on_event, settings=settings,
                                          isolate_timeout_s=isolate_timeout_s if isolate else None)
    if as_json:
        _echo_json({"db": str(settings.db), "platform_key": platform.key, "budget_s": budget_s,
                    "median": MEDIAN_NOTE, "outcomes": [
                        {"op": o.op, "mode": o.mode, "status": o.status, "detail": o.detail,
                         **(_decision_summary(o.decision) if o.decision else {}),
                         "decision": o.decision.to_dict() if o.decision else None} for o in outcomes]})
    elif outcomes:
        table = _table("op", "mode", "status", "winner", "median", "runner-up", "margin", "rejected")
        for o in outcomes:
            d = o.decision
            if d is None:
                table.add_row(o.op, o.mode, o.status, "-", "-", "-", "-", o.detail)
                continue
            table.add_row(o.op, o.mode, o.status, d.winner, format_us(candidate_median_us(d.candidate(d.winner))),
                          _runner_up_text(d), format_lead(d), _rejected_text(d))
        console = _console()
        console.print(table)
        console.print(f"{MEDIAN_NOTE}; {MARGIN_NOTE}. DB: {settings.db}", markup=False)
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        listed = "; ".join(f"{o.op} ({o.mode}): {o.detail}" for o in failed)
        raise click.ClickException(f"{len(failed)} of {len(outcomes)} op/mode pairs could not be tuned: {listed}. "
                                   "Fix the kernels or shapes named above, or leave those ops out with --op")


# --- show -------------------------------------------------------------------------------------------------

def _entries(settings: config.Settings, ops: tuple[str, ...], *, layers: str = "all") -> tuple[Any, list[Entry]]:
    from autosel import selector

    platform = selector._platform()
    selector.load_plugins()
    db = selector.database(settings)
    pairs = [(d, layer) for d, layer in db.decisions()
             if _matches(d.op, ops) and (layers == "all" or layer.kind != "shipped")]
    return platform, _Judge(platform).entries(pairs)


def _entry_json(entry: Entry) -> dict[str, Any]:
    d = entry.decision
    return {"op": d.op, "mode": d.mode, "bucket": d.bucket, "status": entry.status, "status_detail": entry.detail,
            "layer": {"path": entry.layer_path, "kind": entry.layer_kind}, **_decision_summary(d),
            "decision": d.to_dict()}


def _evidence(d) -> str:
    lines = []
    for c in d.candidates:
        mark = " *" if c.backend == d.winner else ""
        if c.ok or c.status == "dropped":
            score = "" if c.score is None else f", {c.score:.2f}x"
            lines.append(f"{c.backend}{mark}: {format_us(candidate_median_us(c))}{score}"
                         + (f" ({c.status})" if not c.ok else ""))
        else:
            lines.append(f"{c.backend}: {c.status}: {c.reason}")
    return "\n".join(lines)


@main.command()
@click.option("--op", "ops", multiple=True, metavar="GLOB", help="Only ops matching this glob (repeatable).")
@click.option("--db", metavar="PATH", help="Read this DB as the user layer instead of the default user DB.")
@click.option("--json", "as_json", is_flag=True, help="Write the decisions and their evidence as JSON on stdout.")
def show(ops, db, as_json):
    """Show stored decisions, which layer each came from, and their evidence.

    Status per row: "in use" (what selection on this machine uses), "shadowed" (an earlier layer has the same
    key), "stale" (tuned on another platform or with other versions), "unusable" (its winner is not eligible
    here), "unknown op" (not registered here).

    \b
    Examples:
      autosel show
      autosel show --op 'layernorm.*' --json
    """
    settings = _settings(db, full=False)
    platform, entries = _entries(settings, ops)
    if as_json:
        _echo_json({"platform_key": platform.key, "median": MEDIAN_NOTE,
                    "decisions": [_entry_json(e) for e in entries]})
        return
    console = _console()
    if not entries:
        console.print(f"No stored decisions{' for ' + ', '.join(ops) if ops else ''}; "
                      "run `autosel tune` to make some.", markup=False)
        return
    table = _table("op", "mode", "status", "winner", "runner-up", "margin", "evidence (median, score)", "layer")
    for e in entries:
        d = e.decision
        status = e.status + (f": {e.detail}" if e.detail else "")
        table.add_row(d.op, d.mode, status, d.winner, _runner_up_text(d), format_lead(d), _evidence(d),
                      f"{e.layer_kind} {e.layer_path}")
    console.print(table)
    console.print(f"This machine: {platform.key}. {MEDIAN_NOTE}; score: time relative to the fastest per shape "
                  "(geometric mean); * marks the winner.", markup=False)


# --- doctor -----------------------------------------------------------------------------------------------

def _environment() -> list[dict[str, Any]]:
    return [{"name": name, "value": os.environ.get(name), "description": text}
            for name, text in config.VARIABLES.items()]


@main.command()
@click.option("--db", metavar="PATH", help="Check this DB as the user layer instead of the default user DB.")
@click.option("--json", "as_json", is_flag=True, help="Write the report as JSON on stdout.")
def doctor(db, as_json):
    """Check the platform, each op's backends, the DB layers, plug-ins and AUTOSEL_* variables.

    Exits 1 when something blocks selection: an AUTOSEL_* variable with a bad value (every selection raises
    on it) or an `autosel.ops` plug-in that failed to load (its ops are missing). An op with no eligible backend
    is reported but not blocking: callers that pass backend=... still work, and select_kernel explains itself.

    \b
    Examples:
      autosel doctor
      autosel doctor --json | jq '.ops[] | select(.eligible == [])'
    """
    from autosel import selector

    registry_module = importlib.import_module("autosel.registry")  # `autosel.registry` the name is the object

    blocking = []
    try:
        _settings(db, full=True)
        config_error = None
    except ConfigError as exc:
        config_error = str(exc)
        blocking.append(f"{exc}; fix or unset the variable")
    platform = selector._platform()
    selector.load_plugins()
    plugin_errors = dict(registry_module.plugin_errors)
    blocking += [f"plug-in {name!r} failed to load ({error}); its ops are not registered. Reinstall or fix "
                 "the package that declares it" for name, error in plugin_errors.items()]
    ops = []
    for op in selector.registry.ops():
        specs = selector.registry.get(op)
        backends = [{"backend": s.backend.value, "target": s.target, "reason": s.unavailable_reason(platform)}
                    for s in specs]
        eligible = [b["backend"] for b in backends if b["reason"] is None]
        definition = selector.registry.definition(op)
        shapes = len(definition.shapes_for(platform)) if definition else 0
        if len(specs) == 1:
            selection = f"the only registered backend, {specs[0].backend.value}, is used without checks"
        elif not eligible:
            selection = "no backend eligible here: only explicit backend=... calls work"
        elif len(eligible) == 1:
            selection = f"{eligible[0]} (the only eligible backend)"
        elif shapes:
            selection = f"measured among {', '.join(eligible)} on {shapes} shapes"
        else:
            selection = "several eligible but no representative shapes: selection raises unless backend=..."
        ops.append({"op": op, "eligible": eligible, "shapes": shapes, "selection": selection, "backends": backends})
    layers = [vars(layer) for layer in selector.database(_settings(db, full=False)).layers]
    ok = not blocking
    if as_json:
        _echo_json({"ok": ok, "blocking": blocking, "config_error": config_error,
                    "platform": {"key": platform.key, "device": platform.device.value, "arch": platform.arch,
                                 "device_name": platform.device_name,
                                 "multiprocessor_count": platform.multiprocessor_count,
                                 "versions": platform.version_map},
                    "ops": ops, "layers": layers, "plugin_errors": plugin_errors, "environment": _environment()})
    else:
        _print_doctor(platform, ops, layers, plugin_errors, blocking)
    if not ok:
        raise click.ClickException("selection is blocked: " + "; ".join(blocking))


def _print_doctor(platform, ops, layers, plugin_errors, blocking) -> None:
    console = _console()
    facts = _table("platform", "")
    for label, value in [("device", platform.device.value), ("arch", platform.arch or "-"),
                         ("device name", platform.device_name or "-"),
                         ("multiprocessors", platform.multiprocessor_count), ("key", platform.key),
                         ("versions", ", ".join(f"{k} {v}" for k, v in platform.versions) or "-")]:
        facts.add_row(label, str(value))
    console.print(facts)
    table = _table("op", "backend", "eligible here", "selection", title="Ops and backends (registration order)")
    for item in ops:
        for n, b in enumerate(item["backends"]):
            table.add_row(item["op"] if n == 0 else "", b["backend"],
                          "yes" if b["reason"] is None else f"no: {b['reason']}", item["selection"] if n == 0 else "")
    console.print(table if ops else "No ops are registered.", markup=False)
    layer_table = _table("kind", "path", "access", "schema", "rows", "problem", title="Tuning DB layers (read in order)")
    for layer in layers:
        layer_table.add_row(layer["kind"], layer["path"], "writable" if layer["writable"] else "read-only",
                            str(layer["schema_version"]), str(layer["rows"]), layer["problem"] or "-")
    console.print(layer_table)
    if plugin_errors:
        for name, error in plugin_errors.items():
            console.print(f"Plug-in {name!r} failed to load: {error}", markup=False)
    else:
        console.print("Plug-ins: every autosel.ops entry point loaded.", markup=False)
    env = _table("variable", "value", "meaning", title="Environment")
    for item in _environment():
        env.add_row(item["name"], "(unset)" if item["value"] is None else item["value"], item["description"])
    console.print(env)
    console.print("OK: nothing blocks selection." if not blocking else f"{len(blocking)} problem(s) block selection.",
                  markup=False)


# --- export, merge, prune ---------------------------------------------------------------------------------

@main.command()
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="The file to write.")
@click.option("--format", "fmt", type=click.Choice(["sqlite", "jsonl"]),
              help="sqlite (to ship) or jsonl (to review in a pull request); default: from --out's suffix.")
@click.option("--op", "ops", multiple=True, metavar="GLOB", help="Only ops matching this glob (repeatable).")
@click.option("--db", metavar="PATH", help="Export this DB instead of the default user DB.")
@click.option("--all-layers", is_flag=True, help="Also export rows of the read-only shipped layers.")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Write a summary as JSON on stdout.")
def export(out, fmt, ops, db, all_layers, force, as_json):
    """Export the user DB's decisions to a SQLite file or JSON Lines text.

    \b
    Examples:
      autosel export --db build.db --out tuning_db/nvidia-h200-sm_90.db
      autosel export --out decisions.jsonl --op 'gemm.*'
    """
    from autosel import selector
    from autosel.db_tools import export_decisions

    fmt = fmt or ("jsonl" if out.suffix == ".jsonl" else "sqlite")
    settings = _settings(db, full=False)
    pairs = [(d, layer) for d, layer in selector.database(settings).decisions()
             if _matches(d.op, ops) and (all_layers or layer.kind != "shipped")]
    if not pairs:
        where = "any layer" if all_layers else f"the user DB {settings.db}"
        raise click.ClickException(f"no decisions{' for ' + ', '.join(ops) if ops else ''} in {where}, so {out} "
                                   "was not written; run `autosel tune` first (or pass --all-layers)")
    rows = export_decisions([d for d, _ in pairs], out, fmt=fmt, overwrite=force)
    if as_json:
        _echo_json({"out": str(out), "format": fmt, "rows": rows})
    else:
        click.echo(f"Exported {rows} decision(s) to {out} ({fmt}).")


@main.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The merged file (.jsonl: JSON Lines, else SQLite).")
@click.option("--prefer", type=click.Choice(["newest", "first"]),
              help="Keep one row of each conflict: the newest, or the first input's. Default: leave conflicts out.")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Write the merge report as JSON on stdout.")
def merge(inputs, out, prefer, force, as_json):
    """Merge tuning DBs or JSON Lines exports into one file.

    A conflict is one key (platform, op, mode, versions) with different winners. Without --prefer conflicts
    are left out of --out and the command exits 1 after writing the rest.

    \b
    Examples:
      autosel merge host1.db host2.db --out fleet.db
      autosel merge a.jsonl b.jsonl --out merged.jsonl --prefer newest
    """
    from autosel.db_tools import merge as merge_files, read_decisions

    if not any(read_decisions(p) for p in inputs):
        raise click.ClickException(f"none of {', '.join(map(str, inputs))} holds a decision, so {out} was not "
                                   "written; check the inputs (autosel export writes them)")
    report = merge_files(list(inputs), out, prefer=prefer, overwrite=force)
    conflicts = [{"op": c.key.op, "mode": c.key.mode, "bucket": c.key.bucket, "platform_key": c.key.platform_key,
                  "versions_hash": c.key.versions_hash,
                  "winners": [{"source": src, "winner": w} for src, w in c.winners]} for c in report.conflicts]
    left_out = bool(report.conflicts) and prefer is None
    if as_json:
        _echo_json({"out": str(out), "rows": report.rows, "sources": list(report.sources), "prefer": prefer,
                    "conflicts": conflicts, "conflicts_left_out": left_out})
    else:
        click.echo(f"Merged {len(report.sources)} input(s) into {out}: {report.rows} decision(s).")
        action = "left out" if prefer is None else f"kept the {prefer} row"
        for c in conflicts:
            winners = ", ".join(f"{w['source']} -> {w['winner']}" for w in c["winners"])
            click.echo(f"Conflict: {c['op']} ({c['mode']}, {c['platform_key']}): {winners}; {action}")
    if left_out:
        raise click.ClickException(f"{len(conflicts)} conflicting decision(s) were left out of {out}; pass "
                                   "--prefer newest or --prefer first to keep one of each, or re-tune those ops")


@main.command()
@click.option("--db", metavar="PATH", help="Prune this DB instead of the default user DB.")
@click.option("--dry-run", is_flag=True, help="List what would be removed, remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Write the removed (or would-be removed) rows as JSON.")
def prune(db, dry_run, as_json):
    """Remove user-DB decisions whose versions no longer match this machine's.

    A row of this machine's platform is stale when its version vector differs from the current one for its
    op (torch, triton, CUDA, the backends' packages). Rows of other platforms and of ops not registered here
    are kept: they cannot be judged from this machine. Shipped layers are read-only and never pruned.

    \b
    Examples:
      autosel prune --dry-run
      autosel prune --db build.db
    """
    from autosel import selector

    settings = _settings(db, full=False)
    platform = selector._platform()
    selector.load_plugins()
    judge = _Judge(platform)
    database = selector.database(settings)

    def stale(decision) -> str | None:
        if decision.platform_key != platform.key or not judge.current(decision.op)[0]:
            return None
        return judge.staleness(decision)

    found = [(d, layer, reason) for d, layer in database.decisions()
             if layer.writable and (reason := stale(d))]
    removed = 0 if dry_run else database.prune(lambda d: stale(d) is None)
    if as_json:
        _echo_json({"dry_run": dry_run, "removed": removed, "rows": [
            {"op": d.op, "mode": d.mode, "winner": d.winner, "layer": layer.path, "reason": reason}
            for d, layer, reason in found]})
        return
    verb = "Would remove" if dry_run else "Removed"
    for d, layer, reason in found:
        click.echo(f"{verb}: {d.op} ({d.mode}) winner {d.winner} from {layer.path}: {reason}")
    count = len(found) if dry_run else removed
    click.echo(f"{verb} {count} stale decision(s)" + (" (run without --dry-run to remove them)." if dry_run and count
                                                       else "."))


# --- report -----------------------------------------------------------------------------------------------

@main.command()
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="The HTML file to write.")
@click.option("--op", "ops", multiple=True, metavar="GLOB", help="Only ops matching this glob (repeatable).")
@click.option("--db", metavar="PATH", help="Read this DB as the user layer instead of the default user DB.")
@click.option("--all", "include_all", is_flag=True, help="Also include stale and shadowed rows (badged).")
def report(out, ops, db, include_all):
    """Write a self-contained HTML page of the decisions in use: plots, per-shape winners, rejections.

    The page has no scripts and loads nothing from the network; plots are inline SVG.

    \b
    Examples:
      autosel report --out report.html
      autosel report --out activation.html --op 'activation.*' --db build.db
    """
    from autosel import __version__
    from autosel import selector
    from autosel.report import render_report

    settings = _settings(db, full=False)
    platform, entries = _entries(settings, ops)
    chosen = entries if include_all else [e for e in entries if e.status == "in use"]
    if not chosen:
        raise click.ClickException(f"no decisions in use on this machine{' for ' + ', '.join(ops) if ops else ''}; "
                                   "run `autosel tune` first, or pass --all to include stale rows")
    layers = [(layer.kind, f"{layer.path} ({'writable' if layer.writable else 'read-only'}, {layer.rows} rows"
               + (f"; {layer.problem}" if layer.problem else "") + ")")
              for layer in selector.database(settings).layers]
    facts = [("key", platform.key), ("device", platform.device.value), ("arch", platform.arch or "-"),
             ("device name", platform.device_name or "-"), ("multiprocessors", str(platform.multiprocessor_count)),
             ("versions", ", ".join(f"{k} {v}" for k, v in platform.versions) or "-")]
    page = render_report(chosen, platform_facts=facts, layers=layers, autosel_version=__version__,
                         generated_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"cannot write {out} ({exc.strerror or exc}); choose a writable path") from None
    click.echo(f"Wrote {out}: {len(chosen)} decision(s).")
