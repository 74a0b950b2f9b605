"""Builds the shipped tuning DBs (tuning_db/*.db) from their reviewable text (tuning_db/*.jsonl), byte for byte.

Shipped rows carry the fingerprint of what they were measured on (autosel.staleness), so that reading one at start-up
compares hashes. A row tuned before fingerprints were kept gets today's, here, once it passes the older rule that
selection would otherwise apply at every start-up (its bucket rows keyed as the op's bucket function keys their shapes
today); one that fails it is left without, and --check names it: re-tune it.

The JSON Lines file is what a pull request reviews: one decision with its evidence per line, keys sorted, lines
sorted by (platform, op, mode, bucket, versions). The .db beside it is built from it alone, so the same text
gives the same bytes (with the same SQLite library; the file's meta table names the one that built it).

  python tools/build_tuning_db.py                       # fingerprint rows stored without one (in the .jsonl),
                                                        # then rebuild every tuning_db/<name>.db from <name>.jsonl
  python tools/build_tuning_db.py --check               # exit 1 if a .db is not what its .jsonl builds, or a row
                                                        # has no fingerprint
  python tools/build_tuning_db.py --from tune.db --name nvidia-h200-sm_90 [--platform KEY]
                                                        # write tuning_db/<name>.jsonl from a tune, then build
"""

from __future__ import annotations

import argparse
import dataclasses
import filecmp
import sys
import tempfile
from pathlib import Path

from autosel import staleness
from autosel.db.tools import build_reproducible, export_decisions, read_decisions, tables
from autosel.decisions import OP_LEVEL_BUCKET, Decision
from autosel.errors import DatabaseError
from autosel.registry import load_plugins, registry

FOLDER = Path(__file__).resolve().parent.parent / "tuning_db"


def build(jsonl: Path, out: Path) -> int:
    """The .db of one .jsonl; a line that is not a decision is an error, not a skipped row."""
    decisions = read_decisions(jsonl)
    lines = sum(1 for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip())
    if len(decisions) != lines:
        raise SystemExit(f"{jsonl}: {lines - len(decisions)} of {lines} lines are not decisions (see the warnings); "
                         "fix or remove them, the text must be what ships")
    return build_reproducible(decisions, out, overwrite=True)


def fingerprinted(decisions: list[Decision]) -> list[Decision]:
    """The decisions, each table stored without a fingerprint given today's where the older rule keeps it."""
    load_plugins()
    stamped: dict[tuple, dict] = {}
    for key, rows in tables(decisions).items():
        top = rows.get(OP_LEVEL_BUCKET)
        definition = registry.definition(key[1])
        if top is None or top.fingerprint or definition is None:
            continue
        if definition.bucket is not None and any(staleness.keyed_today(row, definition) for row in rows.values()):
            continue  # keyed otherwise than today: selection passes it over, and so --check will
        timed = {c.backend for c in top.candidates}
        specs = [s for s in registry.get(key[1]) if s.backend.value in timed]
        stamped[key] = staleness.fingerprint(definition, specs, staleness.platform_of_key(top.platform_key))
    return [dataclasses.replace(d, fingerprint=stamped[(d.platform_key, d.op, d.mode, d.key.versions_hash)])
            if (d.platform_key, d.op, d.mode, d.key.versions_hash) in stamped else d for d in decisions]


def import_tune(source: Path, jsonl: Path, platform: str | None) -> int:
    """The canonical text of a tune's decisions (of one platform key, when given)."""
    try:
        decisions = [d for d in read_decisions(source) if platform is None or d.platform_key == platform]
    except DatabaseError as exc:  # a missing or unreadable --from: its message names the file and what to check
        raise SystemExit(f"--from: {exc}") from None
    if not decisions:
        raise SystemExit(f"{source} holds no decisions{' for ' + platform if platform else ''}; nothing written")
    return export_decisions(decisions, jsonl, fmt="jsonl", overwrite=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=FOLDER, help="where the .jsonl and .db files live")
    parser.add_argument("--check", action="store_true", help="build into a temporary folder and compare bytes")
    parser.add_argument("--from", dest="source", type=Path, help="a tuning DB (or export) to write as text first")
    parser.add_argument("--name", help="with --from: the file name to write, without suffix")
    parser.add_argument("--platform", help="with --from: keep only this platform key's rows")
    args = parser.parse_args(argv)
    if args.source:
        if not args.name:
            parser.error("--from needs --name (e.g. --name nvidia-h200-sm_90)")
        rows = import_tune(args.source, args.folder / f"{args.name}.jsonl", args.platform)
        print(f"wrote {args.folder / args.name}.jsonl: {rows} decision(s) from {args.source}")
    sources = sorted(args.folder.glob("*.jsonl"))
    if not sources:
        raise SystemExit(f"no *.jsonl in {args.folder}; nothing to build")
    differ, unstamped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for jsonl in sources:
            decisions = read_decisions(jsonl)
            if not args.check and (stamped := fingerprinted(decisions)) != decisions:
                export_decisions(stamped, jsonl, fmt="jsonl", overwrite=True)
                print(f"fingerprinted {sum(a != b for a, b in zip(stamped, decisions))} row(s) of {jsonl.name}")
            unstamped += [f"{jsonl.name}: {d.op} ({d.mode}, {d.platform_key})" for d in read_decisions(jsonl)
                          if not d.fingerprint and d.bucket == OP_LEVEL_BUCKET]
            target = jsonl.with_suffix(".db")
            out = Path(tmp) / target.name if args.check else target
            rows = build(jsonl, out)
            if args.check and not (target.exists() and filecmp.cmp(out, target, shallow=False)):
                differ.append(target)
            print(f"{'checked' if args.check else 'built'} {target}: {rows} decision(s) from {jsonl.name}")
    if unstamped:
        print(f"rows without a fingerprint (re-tune them, or run python tools/build_tuning_db.py): "
              f"{'; '.join(unstamped)}", file=sys.stderr)
    if differ:
        print(f"not what their text builds: {', '.join(map(str, differ))}; run python tools/build_tuning_db.py",
              file=sys.stderr)
    return 1 if differ or unstamped else 0


if __name__ == "__main__":
    sys.exit(main())
