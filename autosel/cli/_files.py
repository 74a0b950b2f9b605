"""`autosel export`, `merge` and `prune`: moving decisions between DBs for images, and clearing stale rows."""

from __future__ import annotations

from pathlib import Path

import click

from autosel.cli import main
from autosel.cli._common import (check_globs, counted, db_option, echo_json, force_option, format_option,
                                 json_option, matches, op_option, out_option, read_db, refuse_overwrite, require_file,
                                 settings_for, writable_db)
from autosel.decisions import OP_LEVEL_BUCKET
from autosel.inventory import Inventory

FILE_FORMATS = {".db": "sqlite", ".sqlite": "sqlite", ".sqlite3": "sqlite", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def _format_of(out: Path, fmt: str | None = None) -> str:
    """--format, else the format --out's suffix names; an unknown suffix (d.json) is a usage error, not SQLite."""
    if fmt:
        return fmt
    if out.suffix.lower() in FILE_FORMATS:
        return FILE_FORMATS[out.suffix.lower()]
    raise click.BadParameter(f"cannot tell the format from the suffix of {out} (.db/.sqlite: SQLite, .jsonl: JSON "
                             "Lines); name the file so, or pass --format sqlite|jsonl", param_hint="--out")


# --- export, merge, prune ---------------------------------------------------------------------------------

@main.command()
@out_option("The file to write.")
@format_option()
@op_option()
@db_option("Export this DB instead of the default user DB.")
@click.option("--all-layers", is_flag=True, help="Also export rows of the read-only shipped layers.")
@force_option()
@json_option("a summary")
def export(out, fmt, ops, db, all_layers, force, as_json):
    """Export the user DB's decisions to a SQLite file or JSON Lines text.

    \b
    Examples:
      autosel export --db build.db --out tuning_db/nvidia-h200-sm_90.db
      autosel export --out decisions.jsonl --op 'gemm.*'
    """
    from autosel import tuning
    from autosel.db.tools import export_decisions, first_tables, output_file

    fmt = _format_of(out, fmt)
    output_file(out)  # a FIFO or a device is refused as such, not as "exists; pass --force"
    refuse_overwrite(out, force)
    settings = settings_for(db, full=False, match=False)  # which rows are in use is not asked
    stored = read_db(settings, db, default_too=True).decisions()  # the user DB is the source: unread is an error
    tuning.load_plugins()
    check_globs(ops, set(tuning.registry.ops()) | {d.op for d, _ in stored}, "registered op or stored decision")
    pairs = [(d, layer) for d, layer in stored if matches(d.op, ops) and (all_layers or layer.kind != "shipped")]
    if not pairs:
        nothing = f"no decisions{' for ' + ', '.join(ops) if ops else ''}"
        if all_layers:
            raise click.ClickException(f"{nothing} in any layer, so {out} was not written; run `autosel tune` first")
        from autosel import platforms

        raise click.ClickException(f"{nothing} in the user DB {settings.db}, so {out} was not written; " + _elsewhere(
            [(layer.path, d.platform_key) for d, layer in stored if matches(d.op, ops)],
            platforms.current_platform().key, db))
    layers = list(dict.fromkeys(layer.path for _, layer in pairs))  # the user layer first, as selection reads them
    chosen = first_tables([[d for d, layer in pairs if layer.path == path] for path in layers])
    if not chosen:
        raise click.ClickException(f"the rows found are bucket rows without their op-level row, which selection "
                                   f"never reads, so {out} was not written; re-tune those ops")
    rows = export_decisions(chosen, out, fmt=fmt, overwrite=force)
    bucket_rows = sum(d.bucket != OP_LEVEL_BUCKET for d in chosen)  # export_decisions writes `chosen`, whole tables
    if as_json:
        echo_json({"out": str(out), "format": fmt, "rows": rows, "bucket_rows": bucket_rows})
    else:
        click.echo(f"Exported {counted(rows, bucket_rows)} to {out} ({fmt}).")


def _elsewhere(shipped: list[tuple[str, str]], here: str, db: str | None) -> str:
    """What to do when the user DB holds none of the decisions to export, given (shipped layer's path, platform key)
    of each matching row and this machine's key: a tune reuses shipped decisions of this platform and copies them
    only into a --db, so a tune into the default user DB puts nothing there; other platforms' it never uses."""
    tune = f"run `autosel tune{' --db ' + db if db else ''}` first"
    usable = [path for path, key in shipped if key == here]
    if not usable:
        if not shipped:
            return tune
        other = ", ".join(dict.fromkeys(path for path, _ in shipped))
        return (f"the shipped DBs hold {len(shipped)} made for other platforms ({other}), which a tune here does not "
                f"use: pass --all-layers to export them too, or {tune}")
    held = f"the shipped DBs hold {len(usable)} ({', '.join(dict.fromkeys(usable))})"
    if db:
        return (f"{held}: pass --all-layers to export them too, or run `autosel tune --db {db}` first, which copies "
                "them into it")
    return (f"{held}, which `autosel tune` reuses without copying them into the user DB: pass --all-layers to export "
            "them too, or run `autosel tune --db FILE`, which copies them into FILE, and `autosel export --db FILE`")


@main.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@out_option("The merged file (.db, .sqlite: SQLite; .jsonl: JSON Lines).")
@format_option()
@click.option("--prefer", type=click.Choice(["newest", "first"]),
              help="Keep one table of each conflict: the newest, or the first input's. Default: leave conflicts out.")
@force_option()
@json_option("the merge report")
def merge(inputs, out, fmt, prefer, force, as_json):
    """Merge tuning DBs or JSON Lines exports into one file.

    Tables (an op and mode's op-level row and bucket rows, per platform and versions) are merged whole. A
    conflict is one key (platform, op, mode, bucket, versions) whose winners differ between two inputs' tables
    ('-': no such row). Without --prefer, a table with conflicts is left out of --out whole and the command
    exits 1 after writing the rest (no file if nothing is left).

    \b
    Examples:
      autosel merge host1.db host2.db --out fleet.db
      autosel merge a.jsonl b.jsonl --out merged.jsonl --prefer newest
    """
    from autosel.db.tools import merge as merge_files, output_file

    fmt = _format_of(out, fmt)
    output_file(out)  # a FIFO or a device is refused as such, not as "exists; pass --force"
    refuse_overwrite(out, force)
    report = merge_files(list(inputs), out, prefer=prefer, overwrite=force, fmt=fmt)
    conflicts = [{"op": c.key.op, "mode": c.key.mode, "bucket": c.key.bucket, "platform_key": c.key.platform_key,
                  "versions_hash": c.key.versions_hash,
                  "winners": [{"source": src, "winner": w} for src, w in c.winners]} for c in report.conflicts]
    left_out = bool(report.conflicts) and prefer is None
    # Only conflicts, all left out: merge wrote nothing, and an existing --out (--force) is left as it was.
    unwritten = not report.written
    if as_json:
        echo_json({"out": str(out), "written": not unwritten, "rows": report.rows, "bucket_rows": report.bucket_rows,
                   "sources": list(report.sources),
                   "prefer": prefer, "conflicts": conflicts, "conflicts_left_out": left_out})
    else:
        click.echo(f"Merged {len(report.sources)} input(s): no decision besides the conflicts below, so {out} was not "
                   "written." if unwritten else
                   f"Merged {len(report.sources)} input(s) into {out}: {counted(report.rows, report.bucket_rows)}.")
        action = "left out" if prefer is None else f"kept the {prefer} row"
        for c in conflicts:
            winners = ", ".join(f"{w['source']} -> {w['winner']}" for w in c["winners"])
            bucket = "" if c["bucket"] == OP_LEVEL_BUCKET else f", bucket {c['bucket']}"
            click.echo(f"Conflict: {c['op']} ({c['mode']}{bucket}, {c['platform_key']}): {winners}; {action}")
    if unwritten:
        raise click.ClickException(f"{len(conflicts)} conflicting decision(s) were left out, so {out} was not "
                                   "written; pass --prefer newest or --prefer first to keep one of each, or re-tune "
                                   "those ops")
    if left_out:
        raise click.ClickException(f"{len(conflicts)} conflicting decision(s) were left out of {out}; to keep one of "
                                   "each, run the same command with --prefer newest or --prefer first and --force (to "
                                   f"replace {out}), or re-tune those ops")


@main.command()
@db_option("Prune this DB instead of the default user DB.")
@click.option("--dry-run", is_flag=True, help="List what would be removed, remove nothing.")
@json_option("the removed (or would-be removed) rows")
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
    from autosel import platforms, tuning

    settings = settings_for(db, full=False, match=False)  # which rows are in use is not asked
    require_file(settings, db)  # else the write below would create it, and its folders, to remove nothing
    platform = platforms.current_platform()
    tuning.load_plugins()
    stale = Inventory(platform, tuning.registry).prunable
    database = read_db(settings, db) if dry_run else writable_db(settings, db, undone="nothing was removed")
    found = [(d, layer, reason) for d, layer in database.decisions()
             if layer.writable and (reason := stale(d))]
    removed = 0 if dry_run else database.prune(lambda d: stale(d) is None)
    if as_json:
        echo_json({"dry_run": dry_run, "removed": removed, "rows": [
            {"op": d.op, "mode": d.mode, "bucket": d.bucket, "winner": d.winner, "layer": layer.path,
             "reason": reason}
            for d, layer, reason in found]})
        return
    verb = "Would remove" if dry_run else "Removed"
    for d, layer, reason in found:
        bucket = "" if d.bucket == OP_LEVEL_BUCKET else f", bucket {d.bucket}"
        click.echo(f"{verb}: {d.op} ({d.mode}{bucket}) winner {d.winner} from {layer.path}: {reason}")
    count = len(found) if dry_run else removed
    buckets = sum(d.bucket != OP_LEVEL_BUCKET for d, _, _ in found) if count == len(found) else 0
    click.echo(f"{verb} {counted(count, buckets, 'stale ')}" + (" (run without --dry-run to remove them)."
                                                                 if dry_run and count else "."))
