"""`autosel check`: does the DB hold a usable decision for every op an engine needs, on the target platform?"""

from __future__ import annotations

import fnmatch

import click

from autosel.cli import main
from autosel.cli._common import db_option, echo_json, json_option, make_console, make_table, read_db, settings_for


def _require(ctx, param, values: tuple[str, ...]) -> list[str]:
    """--require values split at commas; none left is a usage error: an image built with an empty REQUIRE argument
    (`--require "${REQUIRE}"`) would otherwise pass with nothing checked."""
    items = [part.strip() for value in values for part in value.split(",") if part.strip()]
    if not items:
        raise click.BadParameter(f"{', '.join(map(repr, values))} names no op; pass op names or globs, e.g. "
                                 "--require 'layernorm.*,gemm.mm'")
    return items


def _required(items: list[str], registered: list[str]) -> list[str]:
    """--require names or globs over the registered ops (a glob matching none stays, and is reported as not
    registered)."""
    ops: list[str] = []
    for item in items:
        matched = [op for op in registered if fnmatch.fnmatchcase(op, item)] or [item]
        ops += [op for op in matched if op not in ops]
    return ops


def _platform_key(ctx, param, value: str | None) -> str | None:
    if value is not None and (len(value.split("/")) != 4 or not all(value.split("/"))):
        raise click.BadParameter(f"{value!r} is not a platform key device/arch/name/multiprocessors, e.g. "
                                 "cuda/sm_90/NVIDIA_H200/132 (`autosel doctor` on the target prints its key)")
    return value


@main.command()
@click.option("--require", "required", multiple=True, required=True, metavar="OP[,OP...]", callback=_require,
              help="Ops that must have a usable decision: names or globs, comma-separated or repeated.")
@click.option("--mode", "modes", multiple=True, type=click.Choice(["eager", "graph"]),
              help="Modes to require (repeatable). Default: the target's: eager and graph on a GPU, eager on a CPU.")
@click.option("--platform", "platform_key", metavar="KEY", callback=_platform_key,
              help="The target's platform key (default: this machine's), for an image built without its GPU.")
@click.option("--buckets", is_flag=True,
              help="Also require the per-bucket rows beside each decision of an op that declares buckets.")
@db_option()
@json_option("what was found per op and mode")
def check(required, modes, platform_key, buckets, db, as_json):
    """Exit 1 unless every required op has a usable decision for the target platform.

    Reads every layer (--db or AUTOSEL_DB, then AUTOSEL_DB_PATH, then the package's shipped DBs) as selection
    does, with AUTOSEL_MATCH. On this machine a decision is usable when selection would take it (platform key,
    versions, eligible winner). With --platform for another machine, its rows must agree with the versions of
    the packages installed here (CUDA and driver versions are the target's own and are not checked). An op
    with one usable backend needs no decision. Meant for an image build: refuse to ship an empty or mismatched DB.

    \b
    Examples:
      autosel check --require 'layernorm.*,activation.*' --buckets
      AUTOSEL_DB_PATH=/opt/tuning autosel check --require 'gemm.mm' --platform cuda/sm_90/NVIDIA_H200/132
    """
    from autosel import coverage, platforms, tuning

    settings = settings_for(db, full=False)
    database = read_db(settings, db)
    tuning.load_plugins()
    platform = platforms.current_platform()
    target = platform_key or platform.key
    ops = _required(required, tuning.registry.ops())
    if set(modes) - set(coverage.modes_of(target)):  # no tune could ever store it: the advice below would go round
        raise click.BadParameter(f"{target} has no graph mode (selection there runs eager mode only)",
                                 param_hint="--mode")
    results = coverage.check(ops, db=database, registry=tuning.registry, platform=platform, target=target,
                             modes=list(modes) or None, match=settings.match, buckets=buckets)
    missing = [r for r in results if not r.ok]
    if as_json:
        echo_json({"ok": not missing, "platform_key": target, "this_machine": target == platform.key,
                   "match": settings.match, "buckets": buckets, "checked": [vars(r) for r in results],
                   "missing": [{"op": r.op, "mode": r.mode, "detail": r.detail} for r in missing]})
    else:
        table = make_table("op", "mode", "status", "winner", "buckets", "detail", title=f"Decisions for {target}")
        for r in results:
            detail = r.detail + (f"; {r.near}" if r.near else "")
            table.add_row(r.op, r.mode, "ok" if r.ok else "MISSING", r.winner or "-", str(r.buckets), detail)
        make_console().print(table)
    if missing:
        listed = "; ".join(f"{r.op} ({r.mode}): {r.detail}" for r in missing)
        unknown = list(dict.fromkeys(r.op for r in missing if not tuning.registry.get(r.op)))
        advice = []
        if unknown:
            advice.append(f"Install the package that registers {', '.join(unknown)} or fix the name (`autosel "
                          "doctor` lists the ops)")
        if len(unknown) < len({r.op for r in missing}):
            advice.append(f"Tune {'the others' if unknown else 'them'} on the target (`autosel tune --db build.db`) "
                          "and ship that DB, or point AUTOSEL_DB_PATH at one that holds them")
        raise click.ClickException(f"{len(missing)} of {len(results)} required (op, mode) pairs have no usable "
                                   f"decision for {target}: {listed}. {'. '.join(advice)}")
    if not as_json:
        click.echo(f"OK: {len(results)} required (op, mode) pair(s) have a usable decision for {target}.")
