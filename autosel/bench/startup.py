"""What a fresh process pays to start on stored decisions: `import torch`, `import autosel`, the first get_kernel of
each contested op (plain-torch winners apart from torch.compile ones), and `autosel show`; fresh processes side by
side in interleaved rounds, medians, written as a JSON result file with its provenance.

    python -m autosel.bench.startup --out results/             # every contested op, 7 rounds
    python -m autosel.bench.startup --out results/ --ops gemm.mm --rounds 5
    python -m autosel.bench.startup --out results/ --baseline ../autosel-main   # another commit, same rounds

Each process runs with AUTOSEL_TUNE=off on an empty user DB and the shipped DBs (those of the checkout the package is
imported from, else the package's), so it reads what a worker restarted from an image reads. One round before the
timed ones is discarded: it writes the user DB and the bytecode a deployed image holds."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as host
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run in each fresh process: the seconds of each step and which heavy modules the first get_kernel imported.
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import autosel
t2 = time.perf_counter()
op = sys.argv[1]
result = {"import_torch_s": t1 - t0, "import_autosel_s": t2 - t1}
if op:
    before = set(sys.modules)
    kernel = autosel.get_kernel(op)
    result["get_kernel_s"] = time.perf_counter() - t2
    result["imported"] = sorted(m for m in set(sys.modules) - before if not m.startswith("autosel"))
    table = getattr(kernel, "table", None)  # a bucket dispatcher; else the op-level winner runs every call
    result["winners"] = (sorted({table.default, *table.winners.values()}) if table
                         else [autosel.select_kernel(op).backend.value])
print(json.dumps(result))
"""
HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "triton", "sqlite_utils")


def _shipped_folder(checkout: Path) -> Path | None:
    from autosel.db import package_folder

    return checkout / "tuning_db" if (checkout / "tuning_db").is_dir() else package_folder()


def _env(checkout: Path, user_db: Path) -> dict[str, str]:
    """A child's environment: `checkout`'s autosel first on the path, its shipped DBs, an empty user DB."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOSEL_") and k != "PYTHONDONTWRITEBYTECODE"}
    shipped = _shipped_folder(checkout)
    env.update(AUTOSEL_TUNE="off", AUTOSEL_DB=str(user_db), AUTOSEL_DB_PATH=str(shipped) if shipped else "")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH", "")]))
    return env


def _child(op: str, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, op], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode:
        raise RuntimeError(f"the process for {op or 'import torch'} failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _wall_s(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {out.stderr.strip()[-2000:]}")
    return time.perf_counter() - start


def _contested_ops() -> list[str]:
    from autosel.platforms import current_platform
    from autosel.tuning import contested_ops

    return [op for op, _ in contested_ops(current_platform())]


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 1)


def _summary(runs: list[dict]) -> dict:
    winners = sorted({w for r in runs for w in r["winners"]})
    return {
        "winners": winners,
        "kind": "torch.compile winner" if "torch_compile" in winners else "plain-torch winner",
        "import_torch_ms": _median_ms([r["import_torch_s"] for r in runs]),
        "import_autosel_ms": _median_ms([r["import_autosel_s"] for r in runs]),
        "first_get_kernel_ms": _median_ms([r["get_kernel_s"] for r in runs]),
        "first_get_kernel_ms_all": [round(r["get_kernel_s"] * 1e3, 1) for r in runs],
        "heavy_modules_imported": sorted({m for r in runs for m in r["imported"] if m in HEAVY}),
        "modules_imported": statistics.median(len(r["imported"]) for r in runs),
    }


def run(ops: list[str], rounds: int, baseline: Path | None = None) -> dict:
    """The medians over `rounds` interleaved rounds (each round one fresh process per measurement); with a
    `baseline` checkout (another commit's), its processes take their turns in the same rounds."""
    checkouts = {"this": Path(__file__).resolve().parents[2], **({"baseline": baseline} if baseline else {})}
    with tempfile.TemporaryDirectory() as tmp:
        envs = {name: _env(path, Path(tmp) / f"{name}.db") for name, path in checkouts.items()}
        samples: dict[tuple, list] = {}
        for round_index in range(rounds + 1):  # the first round is the discarded warm-up
            for name, env in envs.items():
                taken = {op: _child(op, env) for op in ops}
                for what, argv in (("show", [sys.executable, "-m", "autosel", "show"]),
                                   ("import_torch", [sys.executable, "-c", "import torch"])):
                    taken[what] = _wall_s(argv, env)
                for what, sample in taken.items() if round_index else ():
                    samples.setdefault((name, what), []).append(sample)
    results: dict = {"rounds": rounds}
    for name in checkouts:
        show_ms, torch_ms = _median_ms(samples[name, "show"]), _median_ms(samples[name, "import_torch"])
        part = {"ops": {op: _summary(samples[name, op]) for op in ops},
                "show": {"wall_ms": show_ms, "import_torch_wall_ms": torch_ms,
                         "beyond_import_torch_ms": round(show_ms - torch_ms, 1)}}
        if name == "this":
            results.update(part)
        else:
            results[name] = {"checkout": str(checkouts[name]), "commit": _commit(checkouts[name]), **part}
    plain = [v["first_get_kernel_ms"] for v in results["ops"].values() if v["kind"] == "plain-torch winner"]
    results["targets"] = {
        "plain-torch first get_kernel <= 50 ms beyond import torch; import autosel": (
            {"worst_ms": max(plain), "met": max(plain) <= 50} if plain else "no op with plain-torch winners"),
        "autosel show <= 1 s beyond import torch": {"beyond_ms": results["show"]["beyond_import_torch_ms"],
                                                    "met": results["show"]["beyond_import_torch_ms"] <= 1000},
    }
    return results


def _commit(checkout: Path) -> str:
    try:
        commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return f"{commit}{' (with uncommitted changes)' if dirty else ''}" if commit else "unknown (not a checkout)"


def provenance(argv: list[str]) -> dict:
    import autosel
    from autosel.platforms import current_platform

    platform = current_platform()
    commit = _commit(Path(autosel.__file__).resolve().parents[1])
    return {"command": " ".join(["python -m autosel.bench.startup", *argv]), "commit": commit,
            "autosel_version": autosel.__version__, "platform_key": platform.key,
            "versions": {**dict(platform.versions), "python": host.python_version(), "cpus": str(os.cpu_count()),
                         "load_average_1m": f"{os.getloadavg()[0]:.2f}"},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m autosel.bench.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder the JSON result file is written to")
    parser.add_argument("--ops", nargs="+", help="ops whose first get_kernel is timed (default: every contested op)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds, at least 5 (default 7)")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit, timed in the same rounds")
    args = parser.parse_args(argv)
    if args.rounds < 5:
        parser.error(f"--rounds {args.rounds}: the medians need at least 5 rounds")
    meta = provenance(argv)
    results = run(args.ops or _contested_ops(), args.rounds, args.baseline)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    path = args.out / f"startup-{meta['platform_key'].replace('/', '_')}-{stamp}.json"
    path.write_text(json.dumps({**meta, "results": results}, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    print(json.dumps(results["targets"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
