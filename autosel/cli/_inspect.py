"""`autosel show`, `doctor` and `report`: what is stored, what this machine makes of it, and why."""

from __future__ import annotations

import datetime
import importlib
import os
from dataclasses import replace
from typing import Any

import click

from autosel import config
from autosel.cli import main
from autosel.cli._common import (MEDIAN_NOTE, check_globs, counted, db_option, decision_summary, echo_json,
                                 force_option, json_option, make_console, make_table, matches, op_option, out_option,
                                 read_db, refuse_overwrite, runner_up_text, settings_for)
from autosel.decisions import OP_LEVEL_BUCKET, bucket_order
from autosel.errors import ConfigError, TuningError
from autosel.inventory import Entry, Inventory, unregistered
from autosel.formatting import format_lead, format_us
from autosel.report import candidate_median_us, first_call_s, plan_us


# --- show -------------------------------------------------------------------------------------------------

def _entries(db, ops: tuple[str, ...], *, layers: str = "all", match: str = "exact") -> tuple[Any, list[Entry]]:
    from autosel import platforms, tuning

    platform = platforms.current_platform()
    tuning.load_plugins()  # doctor reads plugin_errors afterwards
    stored = db.decisions()
    check_globs(ops, set(tuning.registry.ops()) | {d.op for d, _ in stored}, "registered op or stored decision")
    pairs = [(d, layer) for d, layer in stored
             if matches(d.op, ops) and (layers == "all" or layer.kind != "shipped")]
    return platform, Inventory(platform, tuning.registry, match).entries(pairs)


def _entry_json(entry: Entry) -> dict[str, Any]:
    d = entry.decision
    return {"op": d.op, "mode": d.mode, "bucket": d.bucket, "status": entry.status, "status_detail": entry.detail,
            "near_match": entry.near, "layer": {"path": entry.layer_path, "kind": entry.layer_kind},
            **decision_summary(d),
            "decision": d.to_dict()}


def _evidence(d) -> str:
    lines = []
    for c in d.candidates:
        mark = " *" if c.backend == d.winner else ""
        if c.ok or c.status == "dropped":
            score = "" if c.score is None else f", {c.score:.2f}x"
            first = first_call_s(c)
            compile_note = "" if first is None else f", first call {first:.2f} s"
            if (plan := plan_us(c)) is not None:  # a planned op: built once per batch, outside the timed runs
                compile_note += f", plan {format_us(plan)}"
            lines.append(f"{c.backend}{mark}: {format_us(candidate_median_us(c))}{score}{compile_note}"
                         + (f" ({c.status})" if not c.ok else ""))
        else:
            lines.append(f"{c.backend}: {c.status}: {c.reason}")
    return "\n".join(lines)


def _forcing(op: str, specs: list, platform, forced: config.Settings | None) -> tuple[str, str | None] | None:
    """What AUTOSEL_BACKEND makes selection of `op` do, in select_kernel's order: (what selection does, the error it
    raises or None), or None where it forces nothing for `op`. Doctor and show ignored the force and named the
    stored winner, while get_kernel returned the forced kernel (or one that failed at its first call)."""
    from autosel.selector import forced_unusable

    if forced is None or len(specs) < 2:  # one registered spec is returned before any force is read
        return None
    backend, per_op = forced.forced_backend_for(op)
    match = next((s for s in specs if s.backend == backend), None)
    if backend is None or (match is None and not per_op):  # a force for every op passes over an op without it
        return None
    if match is None:
        return (f"AUTOSEL_BACKEND forces {backend.value}, which is not registered for this op: selection raises "
                "KeyError", f"No '{backend.value}' backend registered for op {op!r}, which AUTOSEL_BACKEND forces")
    if (unusable := forced_unusable(op, match, specs, platform)) is not None:
        return f"AUTOSEL_BACKEND forces {backend.value}, which cannot run here: selection raises ValueError", unusable
    return f"{backend.value}, forced by AUTOSEL_BACKEND (no stored decision is read, nothing is measured)", None


def _forced_settings() -> config.Settings | None:
    """AUTOSEL_BACKEND alone, for the commands that read DBs only; a bad value is warned of by settings_for."""
    try:
        return config.read_settings({"AUTOSEL_BACKEND": os.environ.get("AUTOSEL_BACKEND", "")})
    except ConfigError:
        return None


def _made_elsewhere(entry: Entry, platform_key: str) -> bool:
    """A shipped DB's row for another platform: it can never be used here, and an image ships such rows by the
    hundred (one DB per machine type), which buried this machine's own rows in `show`."""
    return (entry.layer_kind == "shipped" and entry.decision.platform_key != platform_key
            and entry.status != "in use")  # AUTOSEL_MATCH=arch may use a near match of another device


@main.command()
@op_option()
@db_option()
@click.option("--all", "include_all", is_flag=True,
              help="Also list the shipped DBs' rows for other platforms (hidden by default: never used here).")
@json_option("the decisions and their evidence")
def show(ops, db, include_all, as_json):
    """Show stored decisions, which layer each came from, and their evidence.

    Status per row: "in use" (what selection on this machine uses), "overridden" (it would be, but AUTOSEL_BACKEND
    forces a backend for its op), "shadowed" (an earlier layer has the same key), "stale" (tuned on another
    platform or with other versions), "unusable" (its winner is not eligible here), "unknown op" (not registered
    in this process). Rows of shipped DBs made for other platforms are counted, not
    listed, unless --all is given; the user DB's rows are always listed.

    \b
    Examples:
      autosel show
      autosel show --op 'layernorm.*' --json
      autosel show --all
    """
    settings = settings_for(db, full=False)
    platform, entries = _entries(read_db(settings, db), ops, match=settings.match)
    entries = _overridden(entries, platform, _forced_settings())
    listed = entries if include_all else [e for e in entries if not _made_elsewhere(e, platform.key)]
    hidden, entries = len(entries) - len(listed), listed
    hidden_note = (f"{hidden} row(s) of shipped DBs made for other platforms not listed (`autosel show --all` lists "
                   "them)." if hidden else "")
    if as_json:
        echo_json({"platform_key": platform.key, "match": settings.match, "median": MEDIAN_NOTE,
                   "hidden_other_platforms": hidden, "decisions": [_entry_json(e) for e in entries]})
        return
    console = make_console()
    if not entries:
        console.print(f"No stored decisions{' for ' + ', '.join(ops) if ops else ''}"
                      f"{' for this machine' if hidden else ''}; run `autosel tune` to make some. {hidden_note}"
                      .rstrip(), markup=False)
        return
    table = make_table("op", "mode", "bucket", "status", "winner", "runner-up", "margin", "evidence (median, score)",
                       "layer")
    for e in sorted(entries, key=lambda e: (e.decision.op, e.decision.mode, bucket_order(e.decision.bucket))):
        d = e.decision
        status = e.status + (f": {e.detail}" if e.detail else "")
        table.add_row(d.op, d.mode, d.bucket, status, d.winner, runner_up_text(d), format_lead(d), _evidence(d),
                      f"{e.layer_kind} {e.layer_path}")
    console.print(table)
    near = (f" AUTOSEL_MATCH={settings.match}: rows \"in use: near match\" were tuned with other versions"
            + (" or on another model of this arch" if settings.match == "arch" else "") + "; what differs is named."
            if settings.match != "exact" else "")
    console.print(f"This machine: {platform.key}. {MEDIAN_NOTE}; score: time relative to the fastest per shape "
                  f"(geometric mean); * marks the winner.{near} {hidden_note}".rstrip(), markup=False)


def _overridden(entries: list[Entry], platform, forced: config.Settings | None) -> list[Entry]:
    """Rows that selection would use but for AUTOSEL_BACKEND: "overridden", with what selection does instead."""
    from autosel import tuning

    out = []
    for e in entries:
        if e.status == "in use" and (found := _forcing(e.decision.op, tuning.registry.get(e.decision.op), platform,
                                                      forced)) is not None:
            e = replace(e, status="overridden", detail=found[0])
        out.append(e)
    return out


# --- doctor -----------------------------------------------------------------------------------------------

def _environment() -> list[dict[str, Any]]:
    return [{"name": name, "value": os.environ.get(name), "description": text}
            for name, text in config.VARIABLES.items()]


@main.command()
@db_option("Check this DB as the user layer instead of the default user DB.")  # reported if bad, not refused
@json_option("the report")
def doctor(db, as_json):
    """Check the platform, each op's backends, the DB layers, plug-ins and AUTOSEL_* variables.

    Exits 1 when something blocks selection: an AUTOSEL_* variable with a bad value (every selection raises
    on it) or an `autosel.ops` plug-in that failed to load (its ops are missing). A plug-in registration that
    conflicted with another is skipped and named, not blocking. An op with no eligible backend is reported but not
    blocking: callers that pass backend=... still work, and select_kernel explains itself. Nor is an op whose
    shapes= function fails: its row names the error and what to do.

    \b
    Examples:
      autosel doctor
      autosel doctor --json | jq '.ops[] | select(.eligible == [])'
    """
    from autosel import tuning

    registry_module = importlib.import_module("autosel.registry")  # `autosel.registry` the name is the object

    blocking = []
    forced = None
    try:
        forced = settings_for(db, full=True)
        config_error = None
    except ConfigError as exc:
        config_error = str(exc)
        blocking.append(f"{exc}; fix or unset the variable")
    try:
        match = settings_for(db, full=False, warn=False).match
    except ConfigError:  # a bad AUTOSEL_MATCH is reported above as blocking; show what exact matching finds
        match = "exact"
    read_only = settings_for(db, full=False, match=False, warn=False)
    database = read_db(read_only, db, refuse_unread=False)  # its layers say why
    platform, entries = _entries(database, (), match=match)
    plugin_errors, plugin_conflicts = dict(registry_module.plugin_errors), dict(registry_module.plugin_conflicts)
    blocking += [f"plug-in {name!r} failed to load ({error}); a plug-in that raised registers nothing. Reinstall or "
                 "fix the package that declares it" for name, error in plugin_errors.items()]
    in_use = {(e.decision.op, e.decision.mode): e for e in entries
              if e.status == "in use" and e.decision.bucket == OP_LEVEL_BUCKET}
    other_buckets: dict[tuple, list[str]] = {}  # (op, mode) -> the winners of bucket rows in use that differ
    for e in entries:
        parent = in_use.get((e.decision.op, e.decision.mode))
        if e.status == "in use" and e.decision.bucket != OP_LEVEL_BUCKET and parent is not None \
                and e.decision.winner != parent.decision.winner:
            other_buckets.setdefault((e.decision.op, e.decision.mode), []).append(e.decision.winner)
    ops = []
    for op in tuning.registry.ops():
        specs = tuning.registry.get(op)
        backends = [{"backend": s.backend.value, "target": s.target, "reason": s.unavailable_reason(platform)}
                    for s in specs]
        eligible = [b["backend"] for b in backends if b["reason"] is None]
        definition = tuning.registry.definition(op)
        shapes, shapes_error = _count_shapes(op, definition, platform)
        if len(specs) == 1:
            selection = f"the only registered backend, {specs[0].backend.value}, is used without checks"
        elif not eligible:
            selection = "no backend eligible here: only explicit backend=... calls work"
        elif len(eligible) == 1:
            selection = f"{eligible[0]} (the only eligible backend)"
        else:
            selection = _contested_selection(op, eligible, shapes, tuning.modes_for(platform), in_use, other_buckets,
                                             shapes_failed=shapes_error is not None)
        if (found := _forcing(op, specs, platform, forced)) is not None:
            selection, problem = found
            blocking += [problem] if problem else []
        if shapes_error is not None:
            selection += f"; problem: {shapes_error}"
        stored = {mode: {"winner": e.decision.winner, "layer": e.layer_path, "layer_kind": e.layer_kind,
                         "near_match": e.detail if e.near else None}
                  for (name, mode), e in in_use.items() if name == op}
        ops.append({"op": op, "signature": definition.signature if definition else "", "eligible": eligible,
                    "shapes": shapes, "shapes_error": shapes_error, "selection": selection, "stored": stored,
                    "backends": backends})
    layers = [vars(layer) for layer in database.layers]
    notes = _record_notes() + _bytecode_notes()
    ok = not blocking
    if as_json:
        echo_json({"ok": ok, "blocking": blocking, "config_error": config_error, "match": match,
                   "platform": {"key": platform.key, "device": platform.device.value, "arch": platform.arch,
                                "device_name": platform.device_name,
                                "multiprocessor_count": platform.multiprocessor_count,
                                "versions": platform.version_map},
                   "ops": ops, "layers": layers, "plugin_errors": plugin_errors, "plugin_conflicts": plugin_conflicts,
                   "environment": _environment(),
                   "notes": notes})
    else:
        _print_doctor(platform, ops, layers, plugin_errors, plugin_conflicts, blocking, notes)
    if not ok:
        raise click.ClickException("selection is blocked: " + "; ".join(blocking))


def _record_notes() -> list[str]:
    """An AUTOSEL_RECORD path no call can append to (a missing folder is created at the first call): doctor passed it,
    and the first kernel call warned."""
    from autosel.db.tools import nearest_existing

    try:
        path = config.record_path()
    except ConfigError:  # reported among the blocking problems
        return []
    if path is None:
        return []
    folder = path if path.exists() else nearest_existing(path)
    problem = (f"{path} is a folder" if path.is_dir() else
               None if folder is None else
               f"{folder} is a file, not a folder" if not path.exists() and not folder.is_dir() else
               f"{folder} is not writable" if not os.access(folder, os.W_OK) else None)
    return [] if problem is None else [
        f"AUTOSEL_RECORD={path}: {problem}, so no kernel call can record its shape (the kernels run all the same); "
        "choose a path in a writable folder"]


def _bytecode_notes() -> list[str]:
    """What slows every process here without blocking anything: packages whose source each process compiles."""
    from autosel.platforms import missing_bytecode

    missing = missing_bytecode()
    if not missing:
        return []
    return [f"{', '.join(missing)}: no Python bytecode is cached and Python writes none (PYTHONDONTWRITEBYTECODE "
            "is set or the folder is read-only), so every process compiles their source again: every `autosel "
            "tune`, and each worker of `--devices`, starts seconds later (about 10 s on the H200 machine's image). "
            "Compile it when building the image (`python -m compileall -q <site-packages>`, or `uv pip install "
            "--compile-bytecode`), or unset PYTHONDONTWRITEBYTECODE and set PYTHONPYCACHEPREFIX to a writable "
            "folder."]


def _count_shapes(op: str, definition, platform) -> tuple[int, str | None]:
    """How many representative shapes `op` has here, and why none could be read when its shapes= function raised or
    returned shapes that cannot be stored (tuning.representative_shapes, as `autosel tune` reads them): doctor names
    that on the op's row and goes on to the next op."""
    from autosel import tuning

    if definition is None:
        return 0, None
    try:
        return len(tuning.representative_shapes(definition, platform)), None
    except TuningError as exc:
        return 0, f"{exc}; until then this op cannot be tuned, by `autosel tune` or at first use"


def _contested_selection(op: str, eligible: list[str], shapes: int, modes: list[str], in_use: dict,
                         other_buckets: dict, *, shapes_failed: bool = False) -> str:
    """Per mode: the stored decision selection uses (with its buckets that run another winner), or that the
    backends are measured at first use."""
    parts = []
    for mode in modes:
        entry = in_use.get((op, mode))
        if entry is not None:
            text = f"{entry.decision.winner}, the stored decision in use ({entry.layer_kind} DB {entry.layer_path})"
            if other := other_buckets.get((op, mode)):
                text += (f", but {len(other)} bucket(s) run {', '.join(sorted(set(other)))} (`autosel show --op "
                         f"{op}` lists them)")
            text += f", a {entry.detail}" if entry.near else ""
        elif shapes:
            text = (f"none stored: measured among {', '.join(eligible)} on {shapes} shapes at first use "
                    "(or by `autosel tune`)")
        elif shapes_failed:
            text = "several eligible, none stored, no usable shapes: selection raises unless backend=..."
        else:
            text = "several eligible, none stored and no representative shapes: selection raises unless backend=..."
        parts.append(text if len(modes) == 1 else f"{mode}: {text}")
    return "; ".join(parts)


def _print_doctor(platform, ops, layers, plugin_errors, plugin_conflicts, blocking, notes) -> None:
    console = make_console()
    facts = make_table("platform", "")
    for label, value in [("device", platform.device.value), ("arch", platform.arch or "-"),
                         ("device name", platform.device_name or "-"),
                         ("multiprocessors", platform.multiprocessor_count), ("key", platform.key),
                         ("versions", ", ".join(f"{k} {v}" for k, v in platform.versions) or "-")]:
        facts.add_row(label, str(value))
    console.print(facts)
    table = make_table("op", "backend", "eligible here", "selection", title="Ops and backends (registration order)")
    for item in ops:
        for n, b in enumerate(item["backends"]):
            table.add_row(item["op"] if n == 0 else "", b["backend"],
                          "yes" if b["reason"] is None else f"no: {b['reason']}", item["selection"] if n == 0 else "")
    console.print(table if ops else "No ops are registered.", markup=False)
    calls = make_table("op", "call (every backend takes these arguments)", title="How each op is called")
    for item in ops:
        if item["signature"]:
            calls.add_row(item["op"], item["signature"])
    if calls.rows:
        console.print(calls)
    layer_table = make_table("kind", "path", "access", "schema", "rows", "problem",
                             title="Tuning DB layers (read in order)")
    for layer in layers:
        layer_table.add_row(layer["kind"], layer["path"], "writable" if layer["writable"] else "read-only",
                            str(layer["schema_version"]), str(layer["rows"]), layer["problem"] or "-")
    console.print(layer_table)
    for name, error in plugin_errors.items():
        console.print(f"Plug-in {name!r} failed to load: {error}", markup=False)
    for name, conflict in plugin_conflicts.items():
        console.print(f"Plug-in {name!r}: a registration conflicted and was skipped, its others are kept: {conflict}",
                      markup=False)
    if not plugin_errors and not plugin_conflicts:
        console.print("Plug-ins: every autosel.ops entry point loaded.", markup=False)
    env = make_table("variable", "value", "meaning", title="Environment")
    for item in _environment():
        env.add_row(item["name"], "(unset)" if item["value"] is None else item["value"], item["description"])
    console.print(env)
    for note in notes:
        console.print(f"Note: {note}", markup=False)
    console.print("OK: nothing blocks selection." if not blocking else f"{len(blocking)} problem(s) block selection.",
                  markup=False)


# --- report -----------------------------------------------------------------------------------------------

@main.command()
@out_option("The HTML file to write.")
@op_option()
@db_option()
@click.option("--all", "include_all", is_flag=True, help="Also include stale and shadowed rows (badged).")
@force_option()
def report(out, ops, db, include_all, force):
    """Write a self-contained HTML page of the decisions in use: plots, per-shape and per-bucket winners,
    rejections.

    One section per op and mode; an op tuned with shape buckets also gets a table of each bucket's winner, and
    its plot marks where the bucket changes. The page has no scripts and loads nothing from the network; plots
    are inline SVG.

    \b
    Examples:
      autosel report --out report.html
      autosel report --out activation.html --op 'activation.*' --db build.db
    """
    from autosel.version import __version__
    from autosel.report import render_report

    refuse_overwrite(out, force)
    settings = settings_for(db, full=False)
    database = read_db(settings, db)
    platform, entries = _entries(database, ops, match=settings.match)  # "in use" as selection, show and doctor say
    chosen = entries if include_all else [e for e in entries if e.status == "in use"]
    if not chosen and (unknown := sorted({e.decision.op for e in entries if e.status == "unknown op"})):
        # It said "run `autosel tune` first" for the decisions of an op a script had registered, which the DB held.
        rows = sum(e.decision.op in unknown for e in entries)
        raise click.ClickException(f"no decisions in use on this machine: the DB holds {rows} row(s), but the "
                                   f"{unregistered(*unknown)}; or pass --all to include their rows")
    if not chosen:
        raise click.ClickException(f"no decisions in use on this machine{' for ' + ', '.join(ops) if ops else ''}; "
                                   "run `autosel tune` first, or pass --all to include stale rows")
    layers = [(layer.kind, f"{layer.path} ({'writable' if layer.writable else 'read-only'}, {layer.rows} rows"
               + (f"; {layer.problem}" if layer.problem else "") + ")")
              for layer in database.layers]
    facts = [("key", platform.key), ("device", platform.device.value), ("arch", platform.arch or "-"),
             ("device name", platform.device_name or "-"), ("multiprocessors", str(platform.multiprocessor_count)),
             ("versions", ", ".join(f"{k} {v}" for k, v in platform.versions) or "-")]
    page = render_report(chosen, platform_facts=facts, layers=layers, autosel_version=__version__,
                         generated_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        from autosel.db.tools import why_unwritable

        raise click.ClickException(f"cannot write {out} ({why_unwritable(out, exc)}); choose a writable path") from None
    click.echo(f"Wrote {out}: {counted(len(chosen), sum(e.decision.bucket != OP_LEVEL_BUCKET for e in chosen))}.")
