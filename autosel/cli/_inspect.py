"""`autosel show`, `doctor` and `report`: what is stored, what this machine makes of it, and why."""

from __future__ import annotations

import datetime
import importlib
import os
from pathlib import Path
from typing import Any

import click

from autosel import config
from autosel.cli import (MEDIAN_NOTE, _console, _decision_summary, _echo_json, _matches, _read_db, _runner_up_text,
                         _settings, _table, main)
from autosel.errors import ConfigError
from autosel.inventory import Entry, Inventory
from autosel.report import candidate_median_us, first_call_s, format_lead, format_us


# --- show -------------------------------------------------------------------------------------------------

def _entries(db, ops: tuple[str, ...], *, layers: str = "all") -> tuple[Any, list[Entry]]:
    from autosel import selector

    platform = selector._platform()
    selector.load_plugins()
    pairs = [(d, layer) for d, layer in db.decisions()
             if _matches(d.op, ops) and (layers == "all" or layer.kind != "shipped")]
    return platform, Inventory(platform, selector.registry).entries(pairs)


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
            first = first_call_s(c)
            compile_note = "" if first is None else f", first call {first:.2f} s"
            lines.append(f"{c.backend}{mark}: {format_us(candidate_median_us(c))}{score}{compile_note}"
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
    platform, entries = _entries(_read_db(_settings(db, full=False), db), ops)
    if as_json:
        _echo_json({"platform_key": platform.key, "median": MEDIAN_NOTE,
                    "decisions": [_entry_json(e) for e in entries]})
        return
    console = _console()
    if not entries:
        console.print(f"No stored decisions{' for ' + ', '.join(ops) if ops else ''}; "
                      "run `autosel tune` to make some.", markup=False)
        return
    table = _table("op", "mode", "bucket", "status", "winner", "runner-up", "margin", "evidence (median, score)",
                   "layer")
    for e in entries:
        d = e.decision
        status = e.status + (f": {e.detail}" if e.detail else "")
        table.add_row(d.op, d.mode, d.bucket, status, d.winner, _runner_up_text(d), format_lead(d), _evidence(d),
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
    layers = [vars(layer) for layer in _read_db(_settings(db, full=False), db).layers]
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
    from autosel.report import render_report

    database = _read_db(_settings(db, full=False), db)
    platform, entries = _entries(database, ops)
    chosen = entries if include_all else [e for e in entries if e.status == "in use"]
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
        raise click.ClickException(f"cannot write {out} ({exc.strerror or exc}); choose a writable path") from None
    click.echo(f"Wrote {out}: {len(chosen)} decision(s).")
