"""The `autosel` command line; the only package that prints or exits (exit 0 ok, 1 error, 2 usage).

The group and what the commands share live here; the commands live in _tune, _inspect (show, doctor, report)
and _files (export, merge, prune), imported at the end so that they register on `main`.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import os
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import click

from autosel import config
from autosel.errors import AutoselError
from autosel.report import candidate_median_us, format_us

# Heavy modules (torch, rich, the DB) are imported inside the commands: `autosel show` must not pay for torch.

RECORD_EXAMPLE = '{"op": "layernorm.rmsnorm", "shape": {"tokens": 64, "hidden": 4096}, "mode": "eager"}'
MEDIAN_NOTE = "median: geometric mean over the shapes of each shape's median time per call"
MARGIN_NOTE = "margin: how much slower the runner-up is than the winner (negative: a tie inside the noise, default kept)"


class _Group(click.Group):
    """Library errors become `Error: ...` with exit 1; the messages already say what to do next."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except AutoselError as exc:
            raise click.ClickException(str(exc)) from exc


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test runner swaps it)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


@contextmanager
def _warnings_as_messages() -> Iterator[None]:
    """The library warns for degraded-but-working paths; show them as one plain line each, not with a traceback."""
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *args, **kwargs: click.echo(f"Warning: {message}", err=True)
        yield


def _console(*, stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:  # piped or captured: do not wrap at 80
        console = Console(stderr=stderr, highlight=False, width=160)
    return console


def _table(*columns: str, title: str | None = None):
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", show_edge=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def _settings(db: str | None, *, full: bool) -> config.Settings:
    """Settings with --db as the user layer. Commands that only read DBs look at AUTOSEL_DB/AUTOSEL_DB_PATH only,
    so a bad AUTOSEL_TUNE does not stop `autosel show` (doctor reports it)."""
    env = dict(os.environ)
    if not full:
        env = {k: v for k, v in env.items() if k in ("AUTOSEL_DB", "AUTOSEL_DB_PATH")}
    if db:
        env["AUTOSEL_DB"] = db
    return config.read_settings(env)


class Seconds(click.FloatRange):
    """A positive, finite number of seconds: FloatRange lets nan and inf through (a budget that never ends)."""

    name = "seconds"

    def __init__(self) -> None:
        super().__init__(min=0, min_open=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return seconds


def _read_db(settings: config.Settings, db: str | None):
    """The DB layers as a command that only reads sees them: nothing is created, migrated or moved aside.
    An explicit --db that does not exist is an error naming it."""
    from autosel.db import TuningDB

    if db and not settings.db.exists():
        raise click.ClickException(f"--db {db}: no such file ({settings.db}); check the path, or create the DB "
                                   f"with `autosel tune --db {db}`")
    return TuningDB.open(settings.db, settings.db_path, read_only=True)


def _matches(op: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(op, p) for p in patterns)


def _decision_summary(decision) -> dict[str, Any]:
    return {
        "winner": decision.winner,
        "median_us": candidate_median_us(decision.candidate(decision.winner)),
        "runner_up": decision.runner_up,
        "runner_up_median_us": candidate_median_us(decision.candidate(decision.runner_up or "")),
        "lead_over_runner_up": decision.lead_over_runner_up,
        "rejected": [{"backend": c.backend, "status": c.status, "reason": c.reason}
                     for c in decision.candidates if not c.ok],
    }


def _rejected_text(decision) -> str:
    return "\n".join(f"{c.backend}: {c.reason}" for c in decision.candidates if not c.ok) or "-"


def _runner_up_text(decision) -> str:
    if not decision.runner_up:
        return "-"
    return f"{decision.runner_up} ({format_us(candidate_median_us(decision.candidate(decision.runner_up)))})"


# --- the group --------------------------------------------------------------------------------------------

_EPILOG = """\b
Exit codes: 0 ok, 1 error (message on stderr), 2 usage.
Examples:
  autosel doctor
  autosel tune --op 'layernorm.*'
  autosel show --json"""


@click.group(cls=_Group, epilog=_EPILOG, context_settings={"help_option_names": ["-h", "--help"],
                                                           "max_content_width": 110})
@click.version_option(package_name="autosel", prog_name="autosel")
@click.option("-v", "--verbose", count=True, help="Log what autosel does on stderr (-v info, -vv debug).")
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """Time kernel backends per LLM op on this machine and keep the winners in a layered SQLite DB."""
    ctx.with_resource(_warnings_as_messages())
    if verbose:
        logger = logging.getLogger("autosel")
        if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter("autosel: %(levelname)s: %(message)s"))
            logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)


from autosel.cli import _files, _inspect, _tune  # noqa: E402,F401  (registers the commands)
