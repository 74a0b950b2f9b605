"""The benchmarks page (docs/BENCHMARKS.md), rendered from the result files alone, so that every figure on it
has a file with its command, commit and platform; `autosel bench page --check` fails when the page and the
files differ (CI runs it through tests/test_bench.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autosel.bench.results import current

PAGE = Path("docs") / "BENCHMARKS.md"


@dataclass(frozen=True)
class Kind:
    title: str
    measures: str   # one sentence: what the figure is, so a reader can judge it
    command: str    # how a user runs it on their own machine


#: The benchmarks in the page's order. A result file of a kind not listed here still renders, after these.
KINDS = {
    "hot_path": Kind("Hot path", "What autosel adds to each kernel call: a bucket dispatcher over a direct call of "
                     "its winner, and a warm `get_kernel(op)`. The kernels return at once, so the figures are "
                     "autosel's own cost.", "autosel bench hot-path"),
    "heldout": Kind("Held-out quality", "On shapes that were not tuned (token counts and widths of other models, "
                    "drawn before any run), the time of the dispatcher's pick and of every fixed backend over the "
                    "per-shape best: geometric mean and worst shape, per op and mode. 1.000 is the best possible.",
                    "autosel tune && autosel bench heldout"),
    "tuning": Kind("Tuning time and stability", "Two fresh tunes of every contested op in every mode: the wall time "
                   "of each, and how many op-level and per-bucket decisions the two made alike.",
                   "autosel bench stability"),
    "model_step": Kind("A model step", "The time of a transformers model's prefill and decode step with autosel's "
                       "picks patched in, over the same model with each backend forced everywhere and over the "
                       "unpatched model.", "autosel bench model"),
    "model_check": Kind("A patched model's accuracy", "A patched transformers model's logits and greedy tokens against "
                        "transformers' own, and both against float32, at real model dimensions with random weights.",
                        "python tools/hf_check.py --out DIR"),
    "ranks_check": Kind("Many ranks run rank 0's decisions", "Every contested op selected on two ranks under "
                        "torchrun: whether each rank runs rank 0's whole table, and warns where its own DB disagrees.",
                        "torchrun --nproc-per-node 2 tools/ranks_check.py --out DIR"),
    "startup": Kind("Cold start", "What a fresh process pays on stored decisions (AUTOSEL_TUNE=off, the shipped "
                    "DBs): each contested op's first `get_kernel` beyond `import torch; import autosel`, with the "
                    "modules it imported, and `autosel show` beyond `import torch`; medians of interleaved rounds of "
                    "fresh processes, with the load average they ran under.", "autosel bench startup"),
    "reliability": Kind("The tuning DB under stress", "Many writers at once, writers killed with SIGKILL while they write "
                        "and while they create the DB, a hung lease holder, many processes selecting the same ops, a "
                        "FIFO where a file is read, and `autosel tune --isolate` stopped by SIGTERM or SIGHUP: rows "
                        "lost, errors and the DB's integrity. [RELIABILITY.md](RELIABILITY.md) says what each phase "
                        "does.", "python tools/db_stress.py --create-kills 100 --hang-waiters 8 --special-files "
                        "--signals 4 --out results"),
    "attention_heldout": Kind("Paged attention on held-out batches", "On decode and extend batches the tune never "
                              "timed (a seeded generator, mixed lengths included), the time of autosel's choice and of "
                              "every fixed attention backend over the per-batch best, per op and mode, and where a "
                              "backend led another beyond the noise margin in every round, whether autosel ran one "
                              "that none led.", "autosel tune --op 'attention.*' && AUTOSEL_TUNE=off autosel bench "
                              "attention-heldout"),
    "attention_step": Kind("Paged attention in a model step", "Llama-3-8B's attention blocks (random weights) with one "
                           "plan per step: step time on autosel's choice and on each fixed attention backend.",
                           "autosel tune --op 'attention.*' && AUTOSEL_TUNE=off autosel bench attention-step"),
    "attention_resolution": Kind("How finely decode's fastest backend changes", "From held-out attention runs: a "
                                 "held-out decode batch's time on the backend fastest on another batch, by the "
                                 "distance between their buckets, and what that gives with more or fewer "
                                 "representative batches, against their tune time. Made from result files, no GPU.",
                                 "python dev/attention_resolution.py --tune-db TUNE.db HELDOUT.json..."),
}

#: What no result file covers yet, by design of the status table: listed until a result file of that kind exists.
NOT_RUN = {
    "parallel_tune": "tuning spread over two or more GPUs of one host (`autosel tune` with several visible GPUs): "
                     "implemented and tested on CPU workers, never timed on GPUs",
}
GPU_FAMILIES = ("NVIDIA (CUDA)", "AMD (ROCm)", "CPU")


def family(platform_key: str) -> str:
    device = platform_key.split("/", 1)[0]
    return {"cuda": "NVIDIA (CUDA)", "hip": "AMD (ROCm)", "cpu": "CPU"}.get(device, device)


def device_name(platform_key: str) -> str:
    parts = platform_key.split("/")
    return parts[2].replace("_", " ") if len(parts) > 2 and parts[0] != "cpu" else "CPU"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows)]


def status(records: list[dict[str, Any]]) -> list[str]:
    """Which benchmark ran on which GPU (newest run per device), and what never ran."""
    kinds = list(KINDS) + sorted({r["kind"] for r in records} - set(KINDS))
    rows = []
    for kind in kinds:
        cells = []
        for fam in GPU_FAMILIES:
            ran = sorted({f"{device_name(r['platform_key'])}"
                          f"{', ' + r['results']['subject'] if r['results'].get('subject') else ''}"
                          f" ({r['date'][:10]}{', carried' if r.get('carried') else ''})"
                          for r in records if r["kind"] == kind and family(r["platform_key"]) == fam})
            cells.append(", ".join(ran) or "never ran")
        rows.append([KINDS[kind].title if kind in KINDS else kind, *cells])
    for kind, what in NOT_RUN.items():
        if not any(r["kind"] == kind for r in records):
            rows.append([what, "never ran", "never ran", "never ran"])
    lines = table(["benchmark", *GPU_FAMILIES], rows)
    gpus = sorted({device_name(r["platform_key"]) for r in records if family(r["platform_key"]) != "CPU"})
    lines += ["", "GPUs the result files come from: " + (", ".join(gpus) or "none") + "."]
    return [line.rstrip() for line in lines]


def section(record: dict[str, Any]) -> list[str]:
    results = record["results"]
    subject = f", {results['subject']}" if results.get("subject") else ""
    head = (f"### {device_name(record['platform_key'])}{subject}\n\n- platform `{record['platform_key']}`\n"
            f"- command: `{record['command']}`\n- commit {record['commit'] or 'unknown'}, autosel "
            f"{record['autosel_version']}, {record['date']}; versions: "
            + ", ".join(f"{k} {v}" for k, v in sorted(record["versions"].items())) + f"\n- file: "
            f"[results/{record['file']}](../results/{record['file']})")
    lines = [head]
    if record.get("carried"):
        lines.append(f"- carried, not re-measured: {record['carried']}")
    lines.append("")
    for part in results.get("tables", []):
        if part.get("title"):
            lines += [part["title"], ""]
        lines += table(part["columns"], part["rows"]) + [""]
    lines += [f"- {note}" for note in results.get("notes", [])]
    return lines + ([""] if results.get("notes") else [])


def render(records: list[dict[str, Any]]) -> str:
    """The whole page from every result file's record (autosel.bench.results.read_results)."""
    standing = current(records)
    lines = ["<!-- Rendered by `autosel bench page` from results/*.json: edit those files, not this page. -->",
             "# Benchmarks", "",
             "For: anyone judging what autosel buys on their GPU, and anyone checking a figure. Every figure here "
             "comes from a result file in [results/](../results/) that names the command, commit, versions and "
             "platform that made it; only the newest run of each benchmark on each platform is shown (git "
             "history keeps the others). Run the same benchmarks on your own machine with the commands below; "
             "each writes a result file you can compare with these. The figures behind autosel's rules and its "
             "own kernels' plans, measured before result files existed, are carried in "
             "[results/carried/](../results/carried/README.md) and cited where the docs quote them.", "",
             "## Status", "", *status(records), ""]
    kinds = list(KINDS) + sorted({r["kind"] for r in standing} - set(KINDS))
    for kind in kinds:
        mine = [r for r in standing if r["kind"] == kind]
        if not mine:
            continue
        info = KINDS.get(kind, Kind(kind, "", f"autosel bench {kind}"))
        lines += [f"## {info.title}", "", f"{info.measures} Run it: `{info.command}`.".strip(), ""]
        for record in mine:
            lines += section(record)
    return "\n".join(lines).rstrip() + "\n"
