"""The model step: prefill and decode steps of a Llama-3-8B-sized model (random weights, a few layers) timed per
variant: transformers unpatched, autosel's measured decisions, and each backend forced.

A prefill step is one eager forward of a prompt (batch 1, the last position's logits, as generate's prefill). A
decode step is one new token per sequence against a static KV cache (transformers' StaticCache) already holding
--kv tokens, replayed from a CUDA graph (on a CPU, called eagerly). autosel patches prefill with mode="eager" and
decode with mode="graph"; a forced variant sets AUTOSEL_BACKEND. The variants take turns round by round (A B C,
then B C A, ...), as autosel's tuner interleaves its candidates, so what the machine does meanwhile falls on all.
--graph-from-tokens N patches autosel's prefill with patch_model's graph_from_tokens=N and adds "autosel-eager",
the prefill on the eager decisions alone, beside it. A variant named again with a suffix ("--backends
triton,triton#2,autosel#2") runs once more on its own copy of the model: how far two copies of one variant read
apart (a copy of autosel is not a fixed backend). A variant "autosel:OP=BACKEND" ("autosel:gemm.mm=torch") is
autosel's measured decisions with that one op forced: what autosel adds at OP over hard-coding BACKEND there, in a
whole step (not a fixed backend either). --compile runs every variant's step, unpatched transformers' too,
under torch.compile (inductor, default mode, static shapes; decode steps are captured after it compiled): whether
patching a model one compiles still pays, against inductor fusing transformers' own norms, rope and activations.
Writes a result file (autosel.bench.results); --plot adds a PNG of it (matplotlib).

    autosel bench model                                     # Llama-3-8B's dimensions, 4 layers, on the GPU
    autosel bench model --device cpu --tiny                 # the benchmark's logic on a CPU, in seconds
    autosel bench model --plot-from results/model_step-....json    # the PNG from a result file (matplotlib)
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import transformers

import autosel
from autosel import config, platforms, selector, tuning
from autosel.bench.results import BenchError
from autosel.bench.models import MODELS, build
from autosel.checks import TOLERANCES
from autosel.decisions import OP_LEVEL_BUCKET
from autosel.integrations.transformers import KINDS, OPS, patch_model
from autosel.inventory import Inventory
from autosel.registry import registry

log = logging.getLogger(__name__)

UNPATCHED, MEASURED = "transformers", "autosel"
MEASURED_EAGER = "autosel-eager"  # with --graph-from-tokens: autosel's prefill on the eager decisions alone, beside it
BACKENDS = ("torch", "torch_compile", "triton", "flashinfer", "sgl_kernel")
PHASES = {"prefill": "eager", "decode": "graph"}  # the mode autosel patches each phase's model with


@dataclass(frozen=True)
class Plan:
    model: str
    layers: int
    device: str
    dtype: str
    prefill_tokens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    kv: int  # tokens already in the KV cache of each sequence when the decode step runs
    backends: tuple[str, ...]  # the fixed backends forced, one variant each ("triton#2": a second copy of triton)
    rounds: int
    block_ms: float  # about how long one round's block of back-to-back steps of one variant takes
    projections: bool = False  # also route the linear layers through gemm.mm
    graph: bool = True  # replay decode steps from a CUDA graph (cuda only)
    prefill_mode: str = "eager"  # the decisions autosel's prefill runs on (graph: device time alone)
    graph_from_tokens: int | None = None  # eager prefill: from this many tokens on, the graph decisions (patch_model)
    compile: bool = False  # every variant's step under torch.compile (transformers' too: inductor's own fusions)

    @property
    def variants(self) -> tuple[str, ...]:
        return (UNPATCHED, MEASURED, *((MEASURED_EAGER,) if self.graph_from_tokens else ()), *self.backends)

    @property
    def fixed(self) -> tuple[str, ...]:
        """The variants that force one backend ("autosel#2" in backends is a second copy of autosel, not one, and
        "autosel:gemm.mm=torch" forces one op only)."""
        return tuple(b for b in self.backends if b.split("#")[0] not in (MEASURED, MEASURED_EAGER) and ":" not in b)

    def sizes(self, phase: str) -> tuple[int, ...]:
        return self.prefill_tokens if phase == "prefill" else self.decode_batches


# --- which kernels a variant runs ------------------------------------------------------------------------------

def patched_ops(projections: bool) -> list[str]:
    return [OPS[kind] for kind in KINDS if kind != "gemm" or projections]


def resolved_backends(op: str, fn: Callable, platform) -> list[str]:
    """The backends a kernel get_kernel returned runs: a dispatcher's bucket winners, else the spec it is."""
    parts = getattr(fn, "parts", None)  # autosel.by_tokens (graph_from_tokens): (eager kernel, graph kernel, threshold)
    if parts is not None:
        return sorted({b for kernel in parts[:2] for b in resolved_backends(op, kernel, platform)})
    table = getattr(fn, "table", None)
    if table is not None:
        return sorted({table.default, *table.winners.values()})
    for spec in registry.get(op):
        if spec.is_available(platform) and spec.load() is fn:
            return [spec.backend.value]
    return ["unknown"]


def cannot_force(backend: str, ops: list[str], platform) -> str | None:
    """Why AUTOSEL_BACKEND=backend cannot run every op the patch calls (a global force falls back to the measured
    winner for an op without that backend, so the variant would not be that backend alone), else None."""
    for op in ops:
        spec = next((s for s in registry.get(op) if s.backend.value == backend), None)
        if spec is None:
            return f"{op} has no {backend} kernel"
        why = spec.unavailable_reason(platform)
        if why:
            return f"{op}'s {backend} kernel cannot run here: {why}"
    return None


@contextlib.contextmanager
def forced(backend: str | None):
    """AUTOSEL_BACKEND=backend (unset for None) while a model is patched. get_kernel's cache is keyed by its
    arguments (op, backend, mode), not by AUTOSEL_BACKEND, so it is cleared on both sides: else the next variant
    would get the kernels the previous one resolved."""
    before = os.environ.get("AUTOSEL_BACKEND")
    os.environ.pop("AUTOSEL_BACKEND", None)
    if backend is not None:
        os.environ["AUTOSEL_BACKEND"] = backend
    selector.clear_cache()
    try:
        yield
    finally:
        os.environ.pop("AUTOSEL_BACKEND", None)
        if before is not None:
            os.environ["AUTOSEL_BACKEND"] = before
        selector.clear_cache()


@dataclass
class Patched:
    """One variant's model in one phase: its patch (None for transformers and for a skipped variant)."""

    name: str
    model: Any
    handle: Any = None
    resolved: dict[str, list[str]] | None = None  # op -> backends its kernel runs
    skipped: str = ""  # why the variant did not run


def patch_variant(name: str, model, *, mode: str, projections: bool, platform,
                  graph_from_tokens: int | None = None) -> Patched:
    """`model` patched as variant `name`, with the backends it resolved checked against the forced one."""
    if name == UNPATCHED:
        return Patched(name, model)
    if name == MEASURED_EAGER and graph_from_tokens is None:
        return Patched(name, model, skipped="the same as autosel here (graph_from_tokens applies to eager prefill)")
    base = name.split("#")[0]  # "triton#2": triton again, on its own copy of the model
    ops = patched_ops(projections)
    # What AUTOSEL_BACKEND says: "triton" for every op, "gemm.mm=torch" (variant "autosel:gemm.mm=torch") for one.
    force = None if base in (MEASURED, MEASURED_EAGER) else base.removeprefix(f"{MEASURED}:")
    pinned_op, pinned = force.split("=") if force and "=" in force else ("", None)
    wanted = {pinned_op: pinned} if pinned else {op: force for op in ops} if force else {}
    if pinned_op not in ("", *ops):
        return Patched(name, model, skipped=f"the patch does not call {pinned_op} (gemm.mm needs --projections)")
    why = next(filter(None, (cannot_force(backend, [op], platform) for op, backend in wanted.items())), None)
    if why:
        return Patched(name, model, skipped=why)
    with forced(force):
        try:
            handle = patch_model(model, mode=mode, projections=projections,
                                 graph_from_tokens=graph_from_tokens if base == MEASURED else None)
        except Exception as exc:  # patch_model resolves every kernel before changing anything: the model is as it was
            return Patched(name, model, skipped=f"patch_model raised {type(exc).__name__}: {exc}")
    resolved = {op: resolved_backends(op, fn, platform) for op, fn in handle.kernels.items()}
    unpatched = [kind for kind in KINDS if (kind != "gemm" or projections) and not handle.counts[kind]]
    wrong = {op: got for op, got in resolved.items() if op in wanted and got != [wanted[op]]}
    if unpatched or wrong or sorted(resolved) != sorted(ops):
        handle.undo()
        return Patched(name, model, resolved=resolved, skipped=(
            f"the patch is not the variant: kinds left unpatched {unpatched} ({handle.skipped}); ops resolved to "
            f"another backend than {force}: {wrong}"))
    return Patched(name, model, handle, resolved)


# --- the steps ------------------------------------------------------------------------------------------------

class DecodeState:
    """The inputs of one decode step for `batch` sequences, and a StaticCache they share across variants, filled
    with `kv` tokens by transformers' own prefill. Each step first sets the cache's length back to `kv`, so every
    step (and replay) writes slot `kv` and attends to the same `kv + 1` keys."""

    def __init__(self, base, *, batch: int, kv: int, device: str) -> None:
        self.kv = kv
        # 16 spare slots keep the mask's length a multiple of 16 for kv = 512 (an aligned bool mask for sdpa).
        self.cache = transformers.StaticCache(config=base.config, max_cache_len=kv + 16)
        generator = torch.Generator(device="cpu").manual_seed(2)
        prompt = torch.randint(0, base.config.vocab_size, (batch, kv + 1), generator=generator).to(device)
        base(input_ids=prompt[:, :kv], cache=self.cache, use_cache=True, logits_to_keep=1)
        self.ids = prompt[:, kv:].contiguous()
        self.positions = torch.full((batch, 1), kv, dtype=torch.long, device=device)

    def step(self, model) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(self.kv)  # a device tensor the update advances in place
            return model(input_ids=self.ids, position_ids=self.positions, cache=self.cache, use_cache=True).logits
        return run


def prefill_step(model, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: model(input_ids=ids, logits_to_keep=1).logits


def captured(step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """`step` captured in a CUDA graph after warm-up calls on a side stream (which also compile torch_compile's
    kernels and JIT-build flashinfer's for these shapes): (replay, the graph's output tensor)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize()
    return graph.replay, out


# --- timing ---------------------------------------------------------------------------------------------------

def time_block(fn: Callable[[], Any], calls: int, device: str) -> float:
    """Milliseconds per call of `calls` back-to-back calls, from an idle device (CUDA events on cuda)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) * 1e3 / calls


def time_interleaved(calls: dict[str, Callable[[], Any]], *, rounds: int, block_ms: float,
                     device: str) -> dict[str, list[float]]:
    """Per variant, one time (ms per call) per round: each round times a block of about block_ms of each variant's
    calls, the variants in turn, the order rotated by one each round."""
    size = {name: max(1, round(block_ms / max(time_block(fn, 1, device), 1e-3))) for name, fn in calls.items()}
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(time_block(calls[name], size[name], device))
    return times


def summary(rounds_ms: list[float]) -> dict:
    median = statistics.median(rounds_ms)
    return {"rounds_ms": [round(t, 5) for t in rounds_ms], "median_ms": median,
            "spread_pct": 100 * (max(rounds_ms) - min(rounds_ms)) / median}


# --- one phase ------------------------------------------------------------------------------------------------

def run_phase(phase: str, models: dict[str, Any], base, plan: Plan, platform) -> dict:
    """Patch every variant's model for `phase`, check each one's step against transformers', time them together
    at each size, undo the patches."""
    mode = plan.prefill_mode if phase == "prefill" else PHASES[phase]
    rtol = TOLERANCES[plan.dtype][0]
    graph = plan.graph and plan.device.startswith("cuda") and phase == "decode"
    log.info("%s: patching %s (mode=%r)", phase, ", ".join(plan.variants[1:]), mode)
    from_tokens = plan.graph_from_tokens if phase == "prefill" and mode == "eager" else None
    patched = {name: patch_variant(name, models[name], mode=mode, projections=plan.projections, platform=platform,
                                   graph_from_tokens=from_tokens) for name in plan.variants}
    for name, p in patched.items():
        log.info("%s: %s %s", phase, name, f"skipped: {p.skipped}" if p.skipped else p.resolved or "unpatched")
    ready = [name for name in plan.variants if not patched[name].skipped]
    out = {"mode": mode, "graph": graph,
           "variants": {name: {"skipped": p.skipped, "resolved": p.resolved,
                               "counts": p.handle.counts if p.handle else None,
                               "patched_mode": p.handle.mode if p.handle else None} for name, p in patched.items()},
           "sizes": []}
    try:
        with torch.no_grad():
            for size in plan.sizes(phase):
                out["sizes"].append(run_size(phase, size, patched, ready, base, plan, graph, rtol))
                log.info("%s %s: %s", phase, size, {n: round(r["median_ms"], 4) for n, r in
                                                    out["sizes"][-1]["results"].items() if "median_ms" in r})
    finally:
        for p in patched.values():
            if p.handle is not None:
                p.handle.undo()
    return out


def run_size(phase: str, size: int, patched: dict[str, Patched], ready: list[str], base, plan: Plan, graph: bool,
             rtol: float) -> dict:
    if phase == "prefill":
        generator = torch.Generator(device="cpu").manual_seed(1)
        ids = torch.randint(0, base.config.vocab_size, (1, size), generator=generator).to(plan.device)
        steps = {name: prefill_step(patched[name].model, ids) for name in ready}
        label = f"{size} tokens"
    else:
        state = DecodeState(base, batch=size, kv=plan.kv, device=plan.device)
        steps = {name: state.step(patched[name].model) for name in ready}
        label = f"batch {size}"
    expected = steps[UNPATCHED]().float()  # transformers' own step, run eagerly
    if plan.compile:
        # dynamic=False: a graph of its own per size, as an engine captures one per batch size (at the default the
        # second size recompiles with dynamic shapes, and read the same times that way: commit c07c7c4).
        steps = {name: torch.compile(step, dynamic=False) for name, step in steps.items()}
    scale = float(expected.abs().max())
    calls, results = {}, {}
    for name in ready:
        log.info("%s %s: %s, first calls (compiles and JIT builds land here)%s", phase, label, name,
                 ", then capture" if graph else "")
        try:
            if graph:
                replay, output = captured(steps[name])
                replay()
            else:
                replay = steps[name]
                output = replay()
            diff = float((output.float() - expected).abs().max())
        except Exception as exc:  # one variant's failure (a capture, a kernel) is a row, not the end of the run
            log.exception("%s %s: %s failed", phase, label, name)
            results[name] = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
            if plan.device.startswith("cuda"):
                torch.cuda.synchronize()
            continue
        calls[name] = replay
        # bf16 spaces values near the largest logit 2^-8 of it apart: the rule hf_check.py calls within_scale.
        results[name] = {"max_abs_diff": diff, "logit_scale": scale, "matches": diff <= rtol * scale}
    times = time_interleaved(calls, rounds=plan.rounds, block_ms=plan.block_ms, device=plan.device)
    for name, rounds_ms in times.items():
        results[name].update(summary(rounds_ms))
    fixed = {name: results[name]["median_ms"] for name in calls if name in plan.fixed}
    best = min(fixed, key=fixed.get) if fixed else None
    reference = results[UNPATCHED].get("median_ms")
    for name in calls:
        r = results[name]
        r["ratio_to_best_fixed"] = r["median_ms"] / fixed[best] if best else None
        # Round k of two variants was timed close in time: the per-round ratios show whether a gap is noise.
        paired = sorted(a / b for a, b in zip(times[name], times[best])) if best else []
        r["paired_ratio"] = (statistics.median(paired), paired[0], paired[-1]) if paired else None
        r["speedup_vs_transformers"] = reference / r["median_ms"] if reference else None
    return {"size": size, "label": label, "best_fixed": best, "results": results}


# --- where the measured decisions came from ---------------------------------------------------------------------

def provenance(ops: list[str], modes: set[str], platform, since: str) -> list[dict]:
    """Per (op, mode) that selection decided from the DB: the op-level row in use, its layer, its bucket rows."""
    settings = config.settings()
    entries = Inventory(platform, registry, settings.match).entries(tuning.database(settings).decisions())
    rows = []
    for e in entries:
        d = e.decision
        if e.status != "in use" or d.bucket != OP_LEVEL_BUCKET or d.op not in ops or d.mode not in modes:
            continue
        buckets = Counter(x.decision.winner for x in entries if x.status == "in use" and x.layer_path == e.layer_path
                          and x.decision.bucket != OP_LEVEL_BUCKET and x.decision.key == replace(d.key, bucket=x.decision.bucket))
        rows.append({"op": d.op, "mode": d.mode, "winner": d.winner, "bucket_winners": dict(buckets),
                     "layer": e.layer_kind, "path": e.layer_path, "created_at": d.created_at,
                     "tuned_by_this_run": e.layer_kind == "user" and d.created_at >= since, "near": e.detail if e.near else ""})
    return sorted(rows, key=lambda r: (r["mode"], r["op"]))


def versions() -> dict[str, str | None]:
    found = {"transformers": transformers.__version__, "torch": torch.__version__, "autosel": autosel.__version__}
    for name in ("triton", "flashinfer", "sgl_kernel"):
        found[name] = platforms.installed_version(name)
    return found


def bench(plan: Plan) -> dict:
    """The whole run as the JSON the report and the plot are made from."""
    since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    platform = platforms.current_platform()
    base = build(plan.model, plan.layers, plan.device, getattr(torch, plan.dtype))
    # One model per variant (the same weights), so every variant's patch stays in place while the variants take
    # turns; a captured graph also keeps pointing at its patch's fused gate/up weight.
    models = {name: base if name == UNPATCHED else copy.deepcopy(base) for name in plan.variants}
    phases = {phase: run_phase(phase, models, base, plan, platform) for phase in PHASES}
    modes = {v["patched_mode"] for p in phases.values() for v in p["variants"].values() if v["patched_mode"]}
    settings = config.settings()
    return {"plan": asdict(plan), "versions": versions(), "platform": platform.key,
            "device_name": torch.cuda.get_device_name() if plan.device.startswith("cuda") else platform.key,
            "db_layers": [{"kind": layer.kind, "path": layer.path, "rows": layer.rows}
                          for layer in tuning.database(settings).layers],
            "match": settings.match, "decisions": provenance(patched_ops(plan.projections), modes, platform, since),
            "phases": phases}


# --- report ---------------------------------------------------------------------------------------------------

def kernels_text(variant: dict) -> str:
    if variant["skipped"]:
        return f"skipped: {variant['skipped']}"
    if not variant["resolved"]:
        return "transformers' own code"
    return ", ".join(f"{op.split('.')[-1]} {'+'.join(b)}" for op, b in variant["resolved"].items())


def report(result: dict) -> str:
    plan, v = result["plan"], result["versions"]
    clock = "CUDA events, from an idle GPU" if plan["device"].startswith("cuda") else "time.perf_counter"
    lines = [f"# Model step: {plan['model']}, {plan['layers']} layers, {plan['dtype']}, {result['device_name']}", "",
             ", ".join(f"{k} {val}" for k, val in v.items() if val), "",
             f"Platform key `{result['platform']}`; AUTOSEL_MATCH={result['match']}; DB layers: "
             + "; ".join(f"{layer['kind']} {layer['path']} ({layer['rows']} rows)" for layer in result["db_layers"]), "",
             f"Timing: {plan['rounds']} rounds; in each, every variant times a block of about {plan['block_ms']:g} ms "
             f"of back-to-back steps ({clock}), the variants in turn, the order rotated each round. ms: median of the rounds; spread: (slowest round - fastest) / median. x best fixed: the "
             "variant's median over the fastest forced backend's; x transformers: unpatched transformers' median "
             "over the variant's (above 1 is faster); in brackets the range of the per-round ratios to it (round k "
             "of every variant is timed close in time), which says whether a gap is noise. drift: the step's largest logit difference from transformers' "
             "eager step, over transformers' largest logit (worst size), marked * beyond "
             f"{TOLERANCES[plan['dtype']][0]:g}; over several layers bf16 rounding in another order than "
             "transformers' drifts that far with any backend (compare the torch row: the same math as the "
             "reference), so accuracy is tools/hf_check.py's figure, against float32.", ""]
    titles = {"prefill": "Prefill: one eager forward, batch 1, the last position's logits "
                         f"(autosel: mode=\"{plan.get('prefill_mode', 'eager')}\""
                         + (f", graph decisions from {plan['graph_from_tokens']} tokens"
                            if plan.get("graph_from_tokens") else "") + ")",
              "decode": f"Decode: one token per sequence, {plan['kv']} tokens in a StaticCache (autosel: mode=\"graph\")"}
    for phase, data in result["phases"].items():
        patched = {v["patched_mode"] for v in data["variants"].values() if v["patched_mode"]}
        if phase == "decode" and patched == {"eager"}:  # a CPU has no graph mode: the patch took eager
            titles[phase] = titles[phase].replace('mode="graph"', 'mode="eager", this device\'s only mode')
        how = "replayed from a CUDA graph" if data["graph"] else "called eagerly (no CUDA graph)"
        how += ", every variant under torch.compile" if plan.get("compile") else ""
        lines += [f"## {titles[phase]}, {how}", ""]
        head = ["variant"] + [f"{s['label']}: ms (spread) | x best fixed | x transformers" for s in data["sizes"]]
        lines.append("| " + " | ".join(head) + " | drift | kernels |")
        lines.append("|" + "---|" * (1 + 3 * len(data["sizes"]) + 2))
        for name, variant in data["variants"].items():
            cells, worst, failures = [], None, []
            for s in data["sizes"]:
                r = s["results"].get(name)
                if r is None or "failed" in r:
                    cells += ["failed" if r else "-", "-", "-"]
                    failures += [f"failed at {s['label']}: {r['failed']}"] if r else []
                    continue
                ratio, speedup = r["ratio_to_best_fixed"], r["speedup_vs_transformers"]
                paired = r.get("paired_ratio")
                rounds = "" if not paired or s["best_fixed"] == name else f" (rounds {paired[1]:.3f}-{paired[2]:.3f})"
                cells += [f"{r['median_ms']:.4g} ({r['spread_pct']:.1f}%)",
                          "-" if ratio is None else f"{ratio:.3f}" + (" (best)" if s["best_fixed"] == name else rounds),
                          "-" if speedup is None else f"{speedup:.3f}"]
                rel = r["max_abs_diff"] / max(r["logit_scale"], 1e-30)
                worst = rel if worst is None else max(worst, rel)
            ok = all(s["results"][name].get("matches") for s in data["sizes"] if name in s["results"])
            match = "-" if worst is None else f"{worst:.2g}{'' if ok else ' *'}"
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {match} | "
                         + "; ".join([kernels_text(variant), *failures]) + " |")
        lines.append("")
    lines += ["## autosel's decisions (the measured variant)", "",
              "| op | mode | op-level winner | bucket rows' winners | from | tuned at | by this run |", "|---|---|---|---|---|---|---|"]
    for d in result["decisions"]:
        buckets = ", ".join(f"{b} {n}" for b, n in sorted(d["bucket_winners"].items())) or "-"
        source = f"{d['layer']} {d['path']}" + (f" ({d['near']})" if d["near"] else "")
        lines.append(f"| {d['op']} | {d['mode']} | {d['winner']} | {buckets} | {source} | {d['created_at']} "
                     f"| {'yes' if d['tuned_by_this_run'] else 'no'} |")
    if not result["decisions"]:
        lines.append("| (none: every op had one eligible backend, or nothing is stored) | | | | | | |")
    return "\n".join(lines) + "\n"


def variant_colors(phases: dict, palette: list[str]) -> dict[str, str]:
    """One colour per variant for the whole figure, so that a variant skipped in one phase (autosel-eager in
    decode) does not shift the others' colours there."""
    variants = dict.fromkeys(name for data in phases.values() for name in data["variants"])
    return {name: palette[i % len(palette)] for i, name in enumerate(variants)}


def plot(result: dict, path: Path) -> None:
    """Per phase, each variant's speedup over unpatched transformers at each size (grouped bars, whiskers from the
    variant's slowest to its fastest round)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = result["phases"]
    colors = variant_colors(phases, plt.rcParams["axes.prop_cycle"].by_key()["color"])
    figure, axes = plt.subplots(1, len(phases), figsize=(6.5 * len(phases), 4.5), squeeze=False)
    for ax, (phase, data) in zip(axes[0], phases.items()):
        names = [n for n in data["variants"] if all(s["results"].get(n, {}).get("speedup_vs_transformers")
                                                    for s in data["sizes"])]
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            heights, low, high = [], [], []
            for s in data["sizes"]:
                r, reference = s["results"][name], s["results"][UNPATCHED]["median_ms"]
                heights.append(r["speedup_vs_transformers"])  # the bar; the whisker: its slowest and fastest round
                low.append(heights[-1] - reference / max(r["rounds_ms"]))
                high.append(reference / min(r["rounds_ms"]) - heights[-1])
            ax.bar([k + (i - (len(names) - 1) / 2) * width for k in range(len(heights))], heights, width,
                   yerr=[low, high], label=name, capsize=2, color=colors[name])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(data["sizes"])), [s["label"] for s in data["sizes"]])
        ax.set_ylabel("speedup over unpatched transformers")
        ax.set_title(f"{phase} ({'CUDA graph' if data['graph'] else 'eager'})")
        ax.legend(fontsize=7)
    plan = result["plan"]
    figure.suptitle(f"{plan['model']}, {plan['layers']} layers, {plan['dtype']}, {result['device_name']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def tables(result: dict) -> list[dict]:
    """Per phase, each variant's median step time at each size over unpatched transformers' (above 1: faster)
    and over the best fixed backend's, for the benchmarks page; report() has every detail."""
    out = []
    for phase, data in result["phases"].items():
        rows = []
        for name in data["variants"]:
            cells = []
            for s in data["sizes"]:
                r = s["results"].get(name)
                if r is None or "failed" in r:
                    cells.append("failed" if r else "-")
                    continue
                speedup, ratio = r["speedup_vs_transformers"], r["ratio_to_best_fixed"]
                cells.append(f"{r['median_ms']:.4g} ms" + ("" if speedup is None else f", {speedup:.3f}x tf")
                             + ("" if ratio is None else f", {ratio:.3f} of best fixed"))
            rows.append([name, *cells])
        out.append({"title": f"{phase.capitalize()} ({data['mode']} decisions"
                             f"{', replayed from a CUDA graph' if data['graph'] else ''}): median step time, "
                             "unpatched transformers' time over it (x tf), and it over the fastest forced backend's.",
                    "columns": ["variant", *(s["label"] for s in data["sizes"])], "rows": rows})
    return out


def make_plan(*, model: str, layers: int | None, device: str, dtype: str, tiny: bool, prefill_tokens, decode_batches,
              kv: int | None, backends: tuple[str, ...], rounds: int | None, block_ms: float | None,
              projections: bool, graph: bool, prefill_mode: str, graph_from_tokens: int | None,
              compile: bool) -> Plan:
    """The plan from the command's options; --tiny fills what is not given with dimensions a CPU runs in seconds.
    Raises BenchError naming an unknown variant."""
    known = {*BACKENDS, *(f"{MEASURED}:{op}={backend}" for op in OPS.values() for backend in BACKENDS)}
    unknown = [b for b in backends if b.split("#")[0] not in known and not b.startswith(f"{MEASURED}#")]
    if unknown:
        raise BenchError(f"--backends: unknown {', '.join(unknown)}; known: {', '.join(BACKENDS)}, a copy NAME#2 of "
                         f"one, {MEASURED}#2 (a copy of autosel's measured variant), or {MEASURED}:OP=BACKEND "
                         f"(autosel with one op forced, e.g. {MEASURED}:gemm.mm=torch)")
    return Plan(model="tiny-llama" if tiny else model, layers=layers or (2 if tiny else 4), device=device, dtype=dtype,
                prefill_tokens=tuple(prefill_tokens) or ((16, 64) if tiny else (512, 2048, 8192)),
                decode_batches=tuple(decode_batches) or ((1, 4) if tiny else (1, 8, 64)),
                kv=kv or (32 if tiny else 512), backends=backends,
                rounds=rounds or (3 if tiny else 10), block_ms=block_ms or (2 if tiny else 25),
                projections=projections, graph=graph, prefill_mode=prefill_mode,
                graph_from_tokens=graph_from_tokens, compile=compile)


def run(plan: Plan) -> dict:
    """The whole run as the result file's body: bench()'s JSON, its tables and its wall time."""
    if plan.compile:  # one code object for every variant's step: each variant and size is a compile of its own
        name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        needed = 4 * len(plan.variants) * len(plan.sizes("prefill") + plan.sizes("decode"))
        setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), needed))
    began = time.perf_counter()
    result = bench(plan)
    result["wall_s"] = round(time.perf_counter() - began, 1)
    result["tables"] = tables(result)
    return result
