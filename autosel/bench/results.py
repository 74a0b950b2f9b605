"""Result files: one JSON file per benchmark run, with the provenance that lets anyone reproduce the figure
(the command line, the commit, autosel's version, the platform key and version vector, the date).

Every benchmark writes through write_result(); the benchmarks page (autosel.bench.page) reads them back with
read_results(). A file made by hand from figures measured before these files existed says so in "carried".
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import autosel
from autosel.errors import AutoselError

#: The folder of the repository's own result files, and the default of `autosel bench ... --results`.
RESULTS_DIR = Path("results")
#: The keys every result file has; "kind" names the benchmark, "carried" is only in files carried over.
PROVENANCE = ("kind", "command", "commit", "autosel_version", "platform_key", "versions", "date", "results")


class ResultFileError(AutoselError):
    """A result file that cannot be read back: not JSON, or without the provenance keys."""


def source_commit(root: Path | None = None) -> str | None:
    """The commit of the autosel source tree that runs (or of the checkout at `root`), with "-dirty" where its
    autosel/ has uncommitted changes; AUTOSEL_COMMIT where the caller sets it (a tree copied to a GPU machine, whose
    .git, if any, is not the tree's); None where there is no git checkout (autosel installed from a wheel)."""
    if root is None and os.environ.get("AUTOSEL_COMMIT"):  # said by the caller: a copied tree's .git may be stale
        return os.environ["AUTOSEL_COMMIT"]
    root = Path(autosel.__file__).resolve().parent.parent if root is None else Path(root)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "autosel"], cwd=root,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it again: `autosel ...` for the console script or `-m autosel`, `python
    tools/x.py ...` for a script."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name in ("autosel", "__main__.py"):
        argv[0] = "autosel"
    elif argv and argv[0].endswith(".py"):
        argv.insert(0, "python")
    return shlex.join(argv)


def provenance(kind: str, *, platform=None, command: str | None = None) -> dict[str, Any]:
    """The provenance of a run made now on `platform` (detected when None)."""
    if platform is None:
        from autosel.platforms import current_platform

        platform = current_platform()
    return {"kind": kind, "command": command if command is not None else command_line(),
            "commit": source_commit(), "autosel_version": autosel.__version__, "platform_key": platform.key,
            "versions": platform.version_map,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def write_result(kind: str, results: dict[str, Any], *, folder: Path = RESULTS_DIR, platform=None,
                 command: str | None = None) -> Path:
    """Write one run's results with its provenance to FOLDER/<kind>-<platform>-<date>.json and return the path.
    A file of that name is never overwritten: a second run within the same second gets a numbered name."""
    return write_record({**provenance(kind, platform=platform, command=command), "results": results}, folder)


def write_record(record: dict[str, Any], folder: Path = RESULTS_DIR) -> Path:
    """Write a whole record (provenance and results) as write_result names it, never over another file; for a run
    whose provenance is not now's (one carried from another format keeps its own command, commit and date)."""
    missing = [k for k in PROVENANCE if k not in record]
    if missing:
        raise ResultFileError(f"a result record needs {', '.join(PROVENANCE)}; this one has no {', '.join(missing)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = _stem(record)
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


def _stem(record: dict[str, Any]) -> str:
    return f"{slug(record['kind'])}-{slug(record['platform_key'])}-{record['date'][:19].replace(':', '')}"


class WorkingCopy:
    """A long run's results so far, rewritten after every step as FOLDER/<kind>-<platform>-<start>.partial.json in
    the result file's format (the page renders it), so that a run killed midway (`timeout`, out of memory) leaves
    what it measured; finish() writes the result file and removes the copy. Each run's copy has a name of its own,
    and each write replaces the file whole, so a kill during a write leaves the previous copy, never half a file."""

    def __init__(self, kind: str, *, folder: Path = RESULTS_DIR, platform=None, command: str | None = None):
        self.kind, self.folder, self.platform, self.command = kind, Path(folder), platform, command
        self.record = provenance(kind, platform=platform, command=command)
        stem, n = _stem(self.record), 1
        self.path = self.folder / f"{stem}.partial.json"
        while self.path.exists():  # another run that started in the same second
            n += 1
            self.path = self.folder / f"{stem}-{n}.partial.json"

    def update(self, results: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        staged = self.path.with_name(self.path.name + ".tmp")
        staged.write_text(json.dumps({**self.record, "results": results}, indent=1) + "\n", encoding="utf-8")
        os.replace(staged, self.path)

    def finish(self, results: dict[str, Any]) -> Path:
        path = write_result(self.kind, results, folder=self.folder, platform=self.platform, command=self.command)
        self.path.unlink(missing_ok=True)
        return path


def read_result(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ResultFileError(f"{path}: not a readable result file ({exc}); remove it or write it again with "
                              f"`autosel bench ...`") from exc
    missing = [k for k in PROVENANCE if k not in record] if isinstance(record, dict) else list(PROVENANCE)
    if missing:
        raise ResultFileError(f"{path}: no {', '.join(missing)}; a result file has {', '.join(PROVENANCE)} "
                              f"(write it with autosel.bench.results.write_result)")
    return record


def read_results(folder: Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """Every result file in FOLDER, each with its file name under "file", in name order."""
    return [{**read_result(p), "file": p.name} for p in sorted(Path(folder).glob("*.json"))]


def current(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest record of each (kind, platform key, subject): the figures that stand. A benchmark whose runs
    measure different things on one platform (the model step of two models) names each in results["subject"]."""
    newest: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in records:
        key = (r["kind"], r["platform_key"], str(r["results"].get("subject", "")))
        if key not in newest or r["date"] > newest[key]["date"]:
            newest[key] = r
    return sorted(newest.values(), key=lambda r: (r["kind"], r["platform_key"], str(r["results"].get("subject", ""))))


class BenchError(AutoselError):
    """A benchmark asked to measure nothing, or something this machine cannot run; nothing was timed."""
