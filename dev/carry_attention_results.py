"""Carries a run of the former attention tools (tools/attention_heldout.py, tools/attention_model_step.py: their
attention_heldout.json or attention_model_step.json) into a result file the benchmarks page renders, of the kind
`autosel bench attention-heldout` or `attention-step` writes, keeping the run's own command, commit and date, with
"carried" saying so and "carried_from" naming the file.

    python dev/carry_attention_results.py results/attention_h200/attention_heldout.json --results results
    python -m autosel bench page

The figures are the run's rows as it wrote them; the summary, tables and notes are computed again from those rows
by the package's code (autosel.bench.attention_heldout.finish, attention_step.finish), as a new run's would be.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

import autosel
from autosel.bench import attention_heldout, attention_step
from autosel.bench.results import write_record
from autosel.platforms import PlatformInfo

TOOLS = {"attention_heldout": "tools/attention_heldout.py", "attention_step": "tools/attention_model_step.py"}


class NotARun(ValueError):
    """A file that is not one of the former attention tools' JSON."""


def platform_of(text: str) -> PlatformInfo:
    """The PlatformInfo the tools wrote as its repr ("PlatformInfo(device_type='cuda', ...)"), read back as data:
    every argument must be a literal, nothing is evaluated."""
    try:
        call = ast.parse(text, mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "PlatformInfo"
                and not call.args):
            raise ValueError("not a PlatformInfo(...) call with keyword arguments")
        return PlatformInfo(**{k.arg: ast.literal_eval(k.value) for k in call.keywords})
    except (SyntaxError, ValueError, TypeError) as exc:
        raise NotARun(f"its \"platform\" is not the PlatformInfo the tools wrote ({exc}): {text[:120]!r}") from exc


def kind_of(native: dict) -> str:
    if "layers" in native and "rows" in native:
        return "attention_step"
    if "margins" in native and "seed" in native and "rows" in native:
        return "attention_heldout"
    raise NotARun("neither tool's JSON: attention_heldout.json has seed, margins and rows; attention_model_step.json "
                  "has layers and rows")


def _planned(native: dict, default: int) -> int:
    """How many batches or rows the run meant to time: its cut at the deadline says "N of M ...", else all ran."""
    found = re.search(r"of (\d+)", str(native.get("cut_at_deadline", "")))
    return int(found.group(1)) if found else default


def body_of(kind: str, native: dict) -> dict:
    """The result file's body of a native run: its settings and rows, and the summary, tables and notes of now."""
    platform = platform_of(native["platform"])
    common = {"rounds": native["rounds"], "backends": native["backends"], "device": platform.torch_device,
              "db": native.get("db", "not recorded"), "tune": native.get("tune") or "not recorded",
              "rows": native["rows"], "wall_s": native.get("wall_s")}
    if native.get("cut_at_deadline"):
        common["cut_at_deadline"] = native["cut_at_deadline"]
    if kind == "attention_heldout":
        body = {"seed": native["seed"], "margins": native["margins"], "batches": _planned(native, len(native["rows"])),
                **common}
        return attention_heldout.finish(body)
    body = {"layers": native["layers"], "planned_rows": _planned(native, len(native["rows"])), **common}
    return attention_step.finish(body)


def record_of(native: dict, source: str) -> dict:
    """The whole result record: the run's own command, commit and date; the platform key and version vector of the
    PlatformInfo it wrote, with the backends' versions it recorded beside them."""
    kind = kind_of(native)
    platform = platform_of(native["platform"])
    recorded = {k: str(v) for k, v in (native.get("versions") or {}).items()
                if v and k != "python" and not str(v).startswith("unavailable")}
    return {"kind": kind, "command": native["command"], "commit": native["commit"],
            "autosel_version": autosel.__version__, "platform_key": platform.key,
            "versions": {**recorded, **platform.version_map}, "date": native["date"],
            "carried": f"a run of {TOOLS[kind]}, the command before `autosel bench {kind.replace('_', '-')}`, "
                       f"converted from its own JSON ({source}) by dev/carry_attention_results.py: its rows, "
                       "command, commit and date as it wrote them",
            "carried_from": source, "results": body_of(kind, native)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("native", type=Path, help="attention_heldout.json or attention_model_step.json")
    parser.add_argument("--results", type=Path, default=Path("results"), help="folder of result files")
    args = parser.parse_args(argv)
    try:
        native = json.loads(args.native.read_text(encoding="utf-8"))
        record = record_of(native, args.native.as_posix())
    except (OSError, ValueError, KeyError) as exc:
        print(f"{args.native}: cannot carry it ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    print(f"wrote {write_record(record, args.results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
