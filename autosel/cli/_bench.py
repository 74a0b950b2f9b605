"""`autosel bench`: the benchmarks a user runs on their own machine, each with a progress display on stderr and
one result file (autosel.bench.results) as its output, and `autosel bench page`, which renders the benchmarks
page from result files."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import click

from autosel.cli import main
from autosel.cli._common import op_option

RESULTS_HELP = "Folder to write the result file into (created if missing; no file is overwritten)."


def results_option():
    return click.option("--results", "folder", default="results", show_default=True,
                        type=click.Path(file_okay=False, path_type=Path), help=RESULTS_HELP)


@contextmanager
def progress_bar(description: str, total: int | None) -> Iterator:
    """A rich progress bar on stderr; yields advance(step=None): a step names what runs now, no step counts one done."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  console=console, transient=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total)

        def advance(step: str | None = None) -> None:
            if step is not None:
                bar.update(task, description=step)
            else:
                bar.advance(task)

        yield advance


def command_line() -> str:
    """This command as typed again: `autosel bench NAME` and every option whose value is not its default, so the
    result file names the command that reproduces it however autosel was started."""
    import shlex

    ctx = click.get_current_context()
    words = ["autosel", *ctx.command_path.split()[1:]]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if not isinstance(param, click.Option) or param.name == "verbose" or value in (None, False, ()) \
                or value == param.default or (isinstance(param.default, str) and str(value) == param.default):
            continue
        flag = param.opts[0]
        if param.is_flag:
            words.append(flag)
        else:
            for item in value if param.multiple else (value,):
                words += [flag, ",".join(map(str, item)) if isinstance(item, tuple) else str(item)]
    return shlex.join(words)


def _written(path: Path) -> None:
    click.echo(f"wrote {path}")


def _stopped(body: dict) -> None:
    """Exit 1 naming the CUDA error that stopped an attention benchmark, once its result file is written."""
    if body.get("device_error"):
        raise click.ClickException(f"stopped by a CUDA error: {body['device_error']}. The result file above holds the "
                                   f"{len(body['rows'])} row(s) up to it")


@main.group("bench")
def bench() -> None:
    """Measure autosel on this machine; each benchmark writes a result file with its provenance.

    \b
    Examples:
      autosel bench hot-path
      autosel bench heldout --op 'layernorm.*'
      autosel bench startup --op gemm.mm
      autosel bench page --check"""


@bench.command("hot-path")
@click.option("--repeats", type=click.IntRange(min=2), default=21, show_default=True,
              help="Interleaved repeats of every case (the p10-p90 spread needs two).")
@click.option("--number", type=click.IntRange(min=1), default=20000, show_default=True,
              help="Calls per timed block.")
@results_option()
def hot_path(repeats: int, number: int, folder: Path) -> None:
    """What a bucket dispatcher and a warm get_kernel(op) add to a kernel call, in ns.

    \b
    Example:
      autosel bench hot-path --repeats 41"""
    from autosel.bench import hot_path as bench_hot_path
    from autosel.bench.results import write_result

    with progress_bar("hot path", repeats) as advance:
        result = bench_hot_path.run(repeats=repeats, number=number, on_repeat=lambda done: advance())
    _written(write_result("hot_path", result, folder=folder, command=command_line()))


@bench.command("page")
@click.option("--results", "folder", default="results", show_default=True,
              type=click.Path(file_okay=False, exists=True, path_type=Path), help="Folder of result files to read.")
@click.option("--out", default="docs/BENCHMARKS.md", show_default=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The page to write (or, with --check, to compare).")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if the page differs from what the files render.")
def page(folder: Path, out: Path, check: bool) -> None:
    """Render the benchmarks page from the result files (current figures only, and a status table).

    \b
    Example:
      autosel bench page --check"""
    from autosel.bench.page import render
    from autosel.bench.results import read_results

    text = render(read_results(folder))
    if check:
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            raise click.ClickException(f"{out} is not what {folder}/ renders; run `autosel bench page` and commit it")
        click.echo(f"{out} matches {folder}/")
        return
    out.write_text(text, encoding="utf-8")
    _written(out)


@bench.command("heldout")
@op_option("Only ops matching this glob (repeatable); default every op with several backends here.")
@click.option("--mode", "modes", multiple=True, type=click.Choice(["eager", "graph"]),
              help="Only this execution mode (repeatable); default every mode this machine runs.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Which held-out shapes to draw; report it with the figures.")
@results_option()
def heldout(ops: tuple[str, ...], modes: tuple[str, ...], seed: int, folder: Path) -> None:
    """How close the tuned picks come to the per-shape best on shapes that were not tuned.

    Run `autosel tune` first: this judges the decisions in the DB, as get_kernel uses them.

    \b
    Example:
      autosel bench heldout --op 'layernorm.*' --seed 7"""
    from autosel.bench import heldout as bench_heldout
    from autosel.bench.results import write_result

    with progress_bar("held-out shapes", None) as advance:
        result = bench_heldout.run(seed=seed, ops=ops, modes=modes, on_step=advance)
    _written(write_result("heldout", result, folder=folder, command=command_line()))


@bench.command("stability")
@op_option("Only ops matching this glob (repeatable); default every op with several backends here.")
@click.option("--budget-s", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Time budget per op and mode in each tune, in seconds.")
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the two tunes' DBs (tune1.db, tune2.db) in this folder; default a temporary one.")
@results_option()
def stability(ops: tuple[str, ...], budget_s: float, keep: Path | None, folder: Path) -> None:
    """Tune twice from scratch and count the decisions the two tunes made alike, with each tune's wall time.

    Neither tune reads or writes your DBs: each tunes into an empty DB of its own.

    \b
    Example:
      autosel bench stability --op 'activation.*' --budget-s 20"""
    from autosel.bench import stability as bench_stability
    from autosel.bench.results import write_result

    with progress_bar("tune 1", None) as advance:
        def on_event(event):
            if event.kind in ("started", "chosen"):
                advance(f"{event.op} {event.mode} {event.kind}")

        result = bench_stability.run(ops=ops, budget_s=budget_s, keep=keep, on_event=on_event,
                                     on_tune=lambda index: advance(f"tune {index}"))
    _written(write_result("tuning", result, folder=folder, command=command_line()))


@bench.command("startup")
@op_option("Only ops matching this glob (repeatable); default every op with several backends here.")
@click.option("--rounds", type=click.IntRange(min=5), default=7, show_default=True,
              help="Timed rounds (the medians need five); one untimed round comes first.")
@click.option("--baseline", type=click.Path(file_okay=False, exists=True, path_type=Path), metavar="CHECKOUT",
              help="A checkout of another commit, its processes timed in the same rounds.")
@results_option()
def startup(ops: tuple[str, ...], rounds: int, baseline: Path | None, folder: Path) -> None:
    """What a fresh process pays before its first kernel call, on the stored decisions: each op's first get_kernel
    beyond `import torch; import autosel`, and `autosel show` beyond `import torch`. Without --op, also the ops a
    transformers patch resolves (patch_model), together in one process.

    Every figure is a fresh process with AUTOSEL_TUNE=off, the shipped DBs and an empty user DB: your DBs are not
    read or written.

    \b
    Example:
      autosel bench startup --op gemm.mm --baseline ../autosel-main"""
    from autosel.bench import startup as bench_startup
    from autosel.bench.results import write_result

    with progress_bar("cold start", rounds + 1) as advance:
        result = bench_startup.run(ops=ops, rounds=rounds, baseline=baseline, on_step=advance,
                                   on_round=lambda done: advance())
    _written(write_result("startup", result, folder=folder, command=command_line()))


def _numbers(ctx, param, value: str | None) -> tuple[int, ...]:
    try:
        found = tuple(int(x) for x in value.split(",")) if value else ()
    except ValueError:
        raise click.BadParameter(f"{value!r}: give whole numbers separated by commas, e.g. 512,2048") from None
    if any(n <= 0 for n in found):
        raise click.BadParameter(f"{value!r}: give numbers above 0")
    return found


@bench.command("model")
@click.option("--model", default="llama-3-8b", show_default=True,
              type=click.Choice(["llama-3-8b", "qwen3-8b", "qwen3-32b", "llama-3-70b-tp8", "qwen2.5-32b-tp8"]),
              help="Published dimensions to build with random weights (a -tp8 model: one of 8 ranks' share).")
@click.option("--layers", type=click.IntRange(min=1), help="Decoder layers (default 4; --tiny 2).")
@click.option("--device", help="Torch device (default cuda where there is one, else cpu).")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float16", "float32"]))
@click.option("--tiny", is_flag=True, help="Tiny dimensions and few tokens: the benchmark's logic in seconds.")
@click.option("--prefill-tokens", callback=_numbers,
              help="Prompt lengths, e.g. 512,2048,8192 (the default; --tiny 16,64).")
@click.option("--decode-batches", callback=_numbers, help="Decode batch sizes, e.g. 1,8,64 (the default; --tiny 1,4).")
@click.option("--kv", type=click.IntRange(min=1), help="Tokens already in the KV cache (default 512; --tiny 32).")
@click.option("--backends", default="torch,torch_compile,triton,flashinfer,sgl_kernel", show_default=True,
              help="The fixed backends to force, one variant each; NAME#2 a second copy; autosel:OP=BACKEND autosel "
                   "with one op forced.")
@click.option("--rounds", type=click.IntRange(min=1), help="Timed rounds (default 10; --tiny 3).")
@click.option("--block-ms", type=click.FloatRange(min=0, min_open=True),
              help="About how long one round's block of steps of one variant takes (default 25; --tiny 2).")
@click.option("--projections", is_flag=True, help="Also route the projections through gemm.mm.")
@click.option("--no-graph", is_flag=True, help="Call decode steps eagerly on CUDA too.")
@click.option("--prefill-mode", type=click.Choice(["eager", "graph"]), default="eager", show_default=True,
              help="The decisions autosel's prefill runs on.")
@click.option("--graph-from-tokens", type=click.IntRange(min=1), metavar="N",
              help="Eager prefill: calls of N tokens or more run the graph decisions.")
@click.option("--compile", is_flag=True, help="Every variant's step under torch.compile, transformers' too.")
@click.option("--plot", is_flag=True, help="Also write a PNG beside the result file (needs matplotlib).")
@click.option("--plot-from", type=click.Path(dir_okay=False, exists=True, path_type=Path), metavar="JSON",
              help="Only write the PNG of this result file (needs matplotlib).")
@results_option()
def model(plot: bool, plot_from: Path | None, folder: Path, device: str | None, backends: str, no_graph: bool,
          **options) -> None:
    """Time a transformers model's prefill and decode steps: unpatched, autosel's picks, each backend forced.

    Needs transformers (pip install 'autosel[hf]'). Run `autosel tune` first, or the first patched step tunes.

    \b
    Example:
      autosel bench model --device cpu --tiny"""
    import json

    from autosel.bench.results import read_result, write_result

    if plot_from is not None:
        _plot(read_result(plot_from)["results"], plot_from.with_suffix(".png"))
        return
    import torch

    from autosel.bench import model as bench_model

    plan = bench_model.make_plan(device=device or ("cuda" if torch.cuda.is_available() else "cpu"),
                                 backends=tuple(filter(None, backends.split(","))), graph=not no_graph,
                                 **options)
    with progress_bar(f"{plan.model} on {plan.device}", None):
        result = bench_model.run(plan)
    path = write_result("model_step", json.loads(json.dumps(result)), folder=folder,
                        command=command_line())
    _written(path)
    path.with_suffix(".md").write_text(bench_model.report(result), encoding="utf-8")  # every variant's detail
    _written(path.with_suffix(".md"))
    if plot:
        _plot(result, path.with_suffix(".png"))


def _plot(result: dict, png: Path) -> None:
    from autosel.bench.model import plot

    try:
        plot(result, png)
    except ImportError:
        raise click.ClickException("the plot needs matplotlib (pip install matplotlib)") from None
    _written(png)


def _device(device: str | None) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("cuda: this machine has no CUDA device; pass --device cpu (eager only, to check the "
                                 "benchmark)", param_hint="--device")
    return device


def _skip(value: str) -> tuple[str, ...]:
    """--skip's backends, each registered for attention (a typo would time what it meant to leave out)."""
    from autosel.bench.attention_heldout import backends_to_time

    names = tuple(filter(None, (n.strip() for n in value.split(","))))
    known = backends_to_time()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: not an attention backend here; known: {', '.join(known)}",
                                 param_hint="--skip")
    return names


def attention_options(skip_default: str):
    """The options both attention benchmarks share: --rounds, --skip, --deadline-s, --device."""
    def decorate(fn):
        for option in reversed([
            click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
                         help="Interleaved rounds; every round each backend takes one turn."),
            click.option("--skip", default=skip_default, show_default=True, metavar="BACKENDS",
                         help="Backends not to time, comma-separated."),
            click.option("--deadline-s", type=click.FloatRange(min=0), metavar="SECONDS",
                         help="Start nothing more after this many seconds; what was measured is written."),
            click.option("--device", type=click.Choice(["cuda", "cpu"]),
                         help="cuda (eager and CUDA graph; the default where there is one), or cpu (eager only: a "
                              "check of the benchmark)."),
            results_option()]):
            fn = option(fn)
        return fn
    return decorate


@bench.command("attention-heldout")
@click.option("--decode", type=click.IntRange(min=0), default=24, show_default=True, help="Decode batches to draw.")
@click.option("--extend", type=click.IntRange(min=0), default=12, show_default=True, help="Extend batches to draw.")
@click.option("--seed", type=int, default=47, show_default=True,
              help="Which held-out batches to draw; report it with the figures.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=262144, show_default=True,
              help="Decode: KV tokens per batch at most.")
@click.option("--max-work", type=click.IntRange(min=1), default=2 ** 26, show_default=True,
              help="Extend: query x KV positions per batch at most.")
@click.option("--check-tokens", type=click.IntRange(min=0), default=65536, show_default=True,
              help="Compare every backend's output with torch's where the batch holds at most this many KV tokens.")
@click.option("--list", "list_only", is_flag=True, help="Print the batches and their buckets; time nothing.")
@attention_options(skip_default="")
def attention_heldout(decode: int, extend: int, seed: int, max_tokens: int, max_work: int, check_tokens: int,
                      list_only: bool, rounds: int, skip: str, deadline_s: float | None, device: str | None,
                      folder: Path) -> None:
    """Paged attention on batches the tune never timed: autosel's choice and every fixed backend, each over the
    per-batch best, per op and mode, and the batches where a backend led autosel's choice beyond the noise margin in
    every round.

    Run `autosel tune --op 'attention.*'` first (and this with AUTOSEL_TUNE=off): this judges the decisions in the
    DB, as get_kernel uses them. The result file is kept up to date after every batch as
    <kind>-<platform>-<start>.partial.json, so a run killed midway leaves what it measured.

    \b
    Example:
      AUTOSEL_TUNE=off autosel bench attention-heldout --decode 32 --extend 16 --rounds 7"""
    import math

    from autosel.bench import attention_heldout as bench_attention
    from autosel.bench.results import WorkingCopy

    batches = bench_attention.held_out_batches(decode=decode, extend=extend, seed=seed, max_tokens=max_tokens,
                                               max_work=max_work)
    if list_only:
        for op, spec in batches:
            click.echo(f"{op} {bench_attention.describe(spec)} {bench_attention.bucket_of(op.split('.')[1], spec)}")
        return
    if not batches:
        raise click.UsageError("no batch to time: give --decode or --extend above 0")
    device, skipped = _device(device), _skip(skip)
    copy = WorkingCopy("attention_heldout", folder=folder, command=command_line())
    with progress_bar("attention held-out batches", len(batches)) as advance:
        def on_batch(body):
            copy.update(body)
            advance()

        with _autosel_must_choose():
            body = bench_attention.run(batches, seed=seed, rounds=rounds, check_tokens=check_tokens, skip=skipped,
                                       deadline_s=math.inf if deadline_s is None else deadline_s, device=device,
                                       on_step=advance, on_batch=on_batch)
    _written(copy.finish(body))
    _stopped(body)


@contextmanager
def _autosel_must_choose() -> Iterator[None]:
    """The attention benchmarks compare every row with autosel's choice: where it cannot be made (the benchmark
    raises its ValueError before any row), the command fails once with it."""
    try:
        yield
    except ValueError as exc:
        raise click.ClickException(f"autosel cannot choose a backend, so no row was run: {exc}") from exc


@bench.command("attention-step")
@click.option("--layers", type=click.IntRange(min=1), default=32, show_default=True,
              help="Attention blocks per step (Llama-3-8B has 32).")
@click.option("--slow-max-tokens", type=click.IntRange(min=1), default=65536, show_default=True,
              help="Time torch and torch_compile only where the batch holds at most this many KV tokens.")
@attention_options(skip_default="torch_compile")
def attention_step(layers: int, slow_max_tokens: int, rounds: int, skip: str, deadline_s: float | None,
                   device: str | None, folder: Path) -> None:
    """A Llama-3-8B step's attention blocks with one plan per step: step time on autosel's choice and on each fixed
    backend; decode (batch 1-256, KV 1k-32k) replayed from a CUDA graph, extend (512-8192 new tokens) eager.

    Run `autosel tune --op 'attention.*'` first (and this with AUTOSEL_TUNE=off). The result file is kept up to
    date after every row as <kind>-<platform>-<start>.partial.json, so a run killed midway leaves what it measured.

    \b
    Example:
      AUTOSEL_TUNE=off autosel bench attention-step --rounds 7"""
    import math

    from autosel.bench import attention_step as bench_step
    from autosel.bench.results import WorkingCopy

    device, skipped = _device(device), _skip(skip)
    copy = WorkingCopy("attention_step", folder=folder, command=command_line())
    with progress_bar("attention step", len(bench_step.rows_to_run(device))) as advance:
        def on_row(body):
            copy.update(body)
            advance()

        with _autosel_must_choose():
            body = bench_step.run(layers=layers, rounds=rounds, skip=skipped, slow_max_tokens=slow_max_tokens,
                                  deadline_s=math.inf if deadline_s is None else deadline_s, device=device,
                                  on_step=advance, on_row=on_row)
    _written(copy.finish(body))
    _stopped(body)
