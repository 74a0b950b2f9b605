"""What a fresh process pays to start on stored decisions: `import torch`, `import autosel`, the first get_kernel of
each contested op (plain-torch winners apart from torch.compile ones), and `autosel show`; fresh processes side by
side in interleaved rounds, medians, as the body of a result file (autosel.bench.results).

    autosel bench startup                                  # every contested op, 7 rounds
    autosel bench startup --op gemm.mm --rounds 5
    autosel bench startup --baseline ../autosel-main       # another commit's checkout, timed in the same rounds

Each process runs with AUTOSEL_TUNE=off on an empty user DB and the shipped DBs (those of the checkout the package is
imported from, else the package's), so it reads what a worker restarted from an image reads. One round before the
timed ones is discarded: it writes the user DB and the bytecode a deployed image holds."""

from __future__ import annotations

import fnmatch
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from autosel.bench.results import BenchError, source_commit

# Run in each fresh process: the seconds of each step and which heavy modules the first get_kernel imported.
PATCH = "transformers patch"  # the ops patch_model resolves, together in one process (no model is built)
CHILD = r"""
import json, sys, time
PATCH = %r
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import autosel
t2 = time.perf_counter()
op = sys.argv[1]
result = {"import_torch_s": t1 - t0, "import_autosel_s": t2 - t1}
if op:
    before = set(sys.modules)
    if op == PATCH:  # what patching a transformers model resolves: its module, then one kernel per op it replaces
        from autosel.integrations.transformers import OPS
        names = list(OPS.values())
    else:
        names = [op]
    kernels = {name: autosel.get_kernel(name) for name in names}
    result["get_kernel_s"] = time.perf_counter() - t2
    result["imported"] = sorted(m for m in set(sys.modules) - before if not m.startswith("autosel"))
    winners = set()
    for name, kernel in kernels.items():
        table = getattr(kernel, "table", None)  # a bucket dispatcher; else the op-level winner runs every call
        winners |= ({table.default, *table.winners.values()} if table
                    else {autosel.select_kernel(name).backend.value})
    result["winners"] = sorted(winners)
print(json.dumps(result))
""" % PATCH
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


def _contested_ops(patterns: tuple[str, ...] = ()) -> list[str]:
    """The contested ops here matching `patterns` (all of them without one); BenchError for a pattern that
    matches none, before anything is timed."""
    from autosel.platforms import current_platform
    from autosel.tuning import contested_ops

    known = [op for op, _ in contested_ops(current_platform())]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(op, pattern) for op in known):
            raise BenchError(f"no op matches --op {pattern!r}; the ops with several backends here: "
                             f"{', '.join(known) or 'none'}")
    return [op for op in known if not patterns or any(fnmatch.fnmatchcase(op, p) for p in patterns)]


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 1)


def winner_kind(winners: list[str]) -> str:
    """What loading the winners costs a fresh process: plain torch (the target's case), a torch.compile winner, a
    Triton winner (triton and its compiler's imports), or a vendor's library."""
    if set(winners) <= {"torch"}:
        return "plain-torch winner"
    for backend, kind in (("torch_compile", "torch.compile winner"), ("triton", "Triton winner")):
        if backend in winners:
            return kind
    return "vendor winner"


def _summary(runs: list[dict]) -> dict:
    winners = sorted({w for r in runs for w in r["winners"]})
    return {
        "winners": winners,
        "kind": winner_kind(winners),
        "import_torch_ms": _median_ms([r["import_torch_s"] for r in runs]),
        "import_autosel_ms": _median_ms([r["import_autosel_s"] for r in runs]),
        "first_get_kernel_ms": _median_ms([r["get_kernel_s"] for r in runs]),
        "first_get_kernel_ms_all": [round(r["get_kernel_s"] * 1e3, 1) for r in runs],
        "heavy_modules_imported": sorted({m for r in runs for m in r["imported"] if m in HEAVY}),
        "modules_imported": statistics.median(len(r["imported"]) for r in runs),
    }


#: The start-up targets: a plain-torch winner costs a fresh process little beyond its imports, and `autosel show`
#: answers within a second of what torch itself takes to import.
GET_KERNEL_TARGET_MS, SHOW_TARGET_MS = 50, 1000


def run(*, ops: tuple[str, ...] = (), rounds: int = 7, baseline: Path | None = None, patch: bool | None = None,
        on_step: Callable[[str], None] = lambda step: None,
        on_round: Callable[[int], None] = lambda done: None) -> dict:
    """The medians over `rounds` interleaved rounds (each round one fresh process per measurement) of the contested
    ops matching the globs `ops` (every contested op without one); with a `baseline` checkout (another commit's),
    its processes take their turns in the same rounds; with `patch` (by default where no `ops` narrow the run),
    also the ops a transformers patch resolves, together in one process. Returns the result file's body."""
    patch = not ops if patch is None else patch
    if rounds < 5:
        raise BenchError(f"rounds={rounds}: the medians need at least 5 rounds")
    chosen = _contested_ops(tuple(ops))
    checkouts = {"this": Path(__file__).resolve().parents[2], **({"baseline": Path(baseline)} if baseline else {})}
    with tempfile.TemporaryDirectory() as tmp:
        envs = {name: _env(path, Path(tmp) / f"{name}.db") for name, path in checkouts.items()}
        samples: dict[tuple, list] = {}
        for round_index in range(rounds + 1):  # the first round is the discarded warm-up
            for name, env in envs.items():
                label = f"round {round_index}/{rounds}" if round_index else "warm-up round"
                taken = {}
                for op in [*chosen, *([PATCH] if patch else [])]:
                    on_step(f"{label}: {name} {op}")
                    taken[op] = _child(op, env)
                for what, argv in (("show", [sys.executable, "-m", "autosel", "show"]),
                                   ("import_torch", [sys.executable, "-c", "import torch"])):
                    on_step(f"{label}: {name} {what.replace('_', ' ')}")
                    taken[what] = _wall_s(argv, env)
                for what, sample in taken.items() if round_index else ():
                    samples.setdefault((name, what), []).append(sample)
            on_round(round_index + 1)
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    results = summarize(samples, ops=[*chosen, *([PATCH] if patch else [])], rounds=rounds,
                        baseline={"checkout": str(checkouts["baseline"]),
                                  "commit": source_commit(checkouts["baseline"])} if baseline else None)
    results.update(load_average=load, cpus=os.cpu_count(), python=sys.version.split()[0])
    results["tables"], results["notes"] = tables(results), notes(results)
    return results


def summarize(samples: dict[tuple[str, str], list], *, ops: list[str], rounds: int,
              baseline: dict | None = None) -> dict:
    """The medians of `samples` ({(checkout name, op or "show" or "import_torch"): the rounds' samples}) and the
    targets met or missed; `baseline` names the other checkout ("checkout", "commit") where there is one."""
    results: dict = {"rounds": rounds}
    for name in ("this", "baseline") if baseline else ("this",):
        show_ms, torch_ms = _median_ms(samples[name, "show"]), _median_ms(samples[name, "import_torch"])
        part = {"ops": {op: _summary(samples[name, op]) for op in ops},
                "show": {"wall_ms": show_ms, "import_torch_wall_ms": torch_ms,
                         "beyond_import_torch_ms": round(show_ms - torch_ms, 1)}}
        if name == "this":
            results.update(part)
        else:
            results[name] = {**baseline, **part}
    plain = [v["first_get_kernel_ms"] for op, v in results["ops"].items()
             if op != PATCH and v["kind"] == "plain-torch winner"]
    beyond = results["show"]["beyond_import_torch_ms"]
    results["targets"] = {
        f"plain-torch first get_kernel <= {GET_KERNEL_TARGET_MS} ms beyond import torch; import autosel": (
            {"worst_ms": max(plain), "met": max(plain) <= GET_KERNEL_TARGET_MS} if plain
            else "no op with plain-torch winners"),
        f"autosel show <= {SHOW_TARGET_MS / 1000:g} s beyond import torch": {"beyond_ms": beyond,
                                                                            "met": beyond <= SHOW_TARGET_MS},
    }
    return results


def _ms(value: float) -> str:
    return f"{value:,.1f}"


def _count(value: float) -> str:
    return f"{value:g}"


def tables(results: dict) -> list[dict]:
    """The page's tables of one run (autosel.bench.page renders them): per op its winner kind, first get_kernel
    beyond `import torch; import autosel` and modules imported; `autosel show` beyond `import torch`; the targets."""
    other = results.get("baseline")
    columns = ["op", "winner kind (winners)", "first get_kernel, ms beyond import torch; import autosel",
               "modules imported (heavy ones)"]
    if other:
        columns += ["baseline: first get_kernel, ms", "baseline: modules imported"]
    rows = []
    for op, mine in results["ops"].items():
        heavy = ", ".join(mine["heavy_modules_imported"])
        row = [op, f"{mine['kind']} ({', '.join(mine['winners'])})", _ms(mine["first_get_kernel_ms"]),
               _count(mine["modules_imported"]) + (f" ({heavy})" if heavy else "")]
        if other:
            theirs = other["ops"].get(op)
            row += [_ms(theirs["first_get_kernel_ms"]), _count(theirs["modules_imported"])] if theirs else ["", ""]
        rows.append(row)
    show_rows = [["this checkout", _ms(results["show"]["wall_ms"]), _ms(results["show"]["import_torch_wall_ms"]),
                  _ms(results["show"]["beyond_import_torch_ms"])]]
    if other:
        show_rows.append(["baseline", _ms(other["show"]["wall_ms"]), _ms(other["show"]["import_torch_wall_ms"]),
                          _ms(other["show"]["beyond_import_torch_ms"])])
    target_rows = [[target, "no figure", "n/a"] if isinstance(v, str) else
                   [target, _ms(v.get("worst_ms", v.get("beyond_ms"))), "met" if v["met"] else "missed"]
                   for target, v in results["targets"].items()]
    return [{"title": f"Medians of {results['rounds']} interleaved rounds, one fresh process per figure, "
                      f"AUTOSEL_TUNE=off on the shipped DBs and an empty user DB:", "columns": columns, "rows": rows},
            {"title": "`autosel show`, wall time of the whole process:",
             "columns": ["", "ms", "`python -c 'import torch'`, ms", "beyond import torch, ms"], "rows": show_rows},
            {"title": "Targets:", "columns": ["target", "ms", "met"], "rows": target_rows}]


def notes(results: dict) -> list[str]:
    """The page's notes of one run: the load it ran under (a host time read at a load above the CPUs is not one)
    and the baseline's checkout."""
    found = [f"load average (1-minute first): {results.get('load_average')}; {results.get('cpus')} CPUs"]
    if results.get("baseline"):
        found.append(f"baseline: {results['baseline']['checkout']} at commit "
                     f"{results['baseline']['commit'] or 'unknown'}, timed in the same rounds")
    return found
