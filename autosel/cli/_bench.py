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
    """A rich progress bar on stderr; yields advance(description=None) for the benchmark's callback."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  console=console, transient=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total)

        def advance(step: str | None = None, *, total: int | None = None) -> None:
            if total is not None:
                bar.update(task, total=total)
            if step is not None:
                bar.update(task, description=step)
            else:
                bar.advance(task)

        yield advance


def _written(path: Path) -> None:
    click.echo(f"wrote {path}")


@main.group("bench")
def bench() -> None:
    """Measure autosel on this machine; each benchmark writes a result file with its provenance.

    \b
    Examples:
      autosel bench hot-path
      autosel bench heldout --op 'layernorm.*'
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
    _written(write_result("hot_path", result, folder=folder))


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
    _written(write_result("heldout", result, folder=folder))
