"""The `autosel` command line; the only package that prints or exits (exit 0 ok, 1 error, 2 usage).

The group and what the commands share live here; the commands live in _tune (tune), _inspect (show, doctor, report),
_files (export, merge, prune) and _check (check), imported at the end so that they register on `main`.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import os
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import click

from autosel import config
from autosel.errors import AutoselError, ConfigError
from autosel.chart import format_us
from autosel.report import candidate_median_us

# Heavy modules (torch, rich, the DB) are imported inside the commands that need them: `autosel --help`, export
# and merge never import torch (show, doctor, check, report and prune do, to detect this machine).

RECORD_EXAMPLE = '{"op": "layernorm.rmsnorm", "shape": {"tokens": 64, "hidden": 4096}, "mode": "eager"}'
MEDIAN_NOTE = "median: geometric mean over the shapes of each shape's median time per call"
MARGIN_NOTE = ("margin: how much slower the runner-up is than the winner; \"default kept\": the runner-up was faster "
               "but not by more than the noise in every round")


class _Group(click.Group):
    """Library errors become `Error: ...` with exit 1; the messages already say what to do next."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except AutoselError as exc:
            raise click.ClickException(str(exc)) from exc


class _WarningLines(logging.Handler):
    """The library's logged warnings (without -v) as `Warning: ...` lines on stderr, each text once."""

    def __init__(self, shown: set[str]) -> None:
        super().__init__(logging.WARNING)
        self.shown = shown

    def emit(self, record: logging.LogRecord) -> None:
        if not any(isinstance(h, config.StderrHandler) for h in logging.getLogger("autosel").handlers):  # -v shows it
            text, exc = record.getMessage(), record.exc_info[1] if record.exc_info else None
            if exc is not None:  # log.exception: what was raised, on one line; -v shows the traceback
                text += ": " + ": ".join([type(exc).__name__, *str(exc).splitlines()[:1]])
            _warn_once(self.shown, text)


def _warn_once(shown: set[str], text: str) -> None:
    if text not in shown:
        shown.add(text)
        click.echo(f"Warning: {text}", err=True)


@contextmanager
def _warnings_as_messages() -> Iterator[None]:
    """The library warns for degraded-but-working paths (warnings and logged warnings); show each as one plain
    line, once per command, not with a traceback and not again when a second code path meets the same file."""
    shown: set[str] = set()
    logger = logging.getLogger("autosel")
    handler = _WarningLines(shown)
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *args, **kwargs: _warn_once(shown, str(message))
        logger.addHandler(handler)
        try:
            yield
        finally:
            logger.removeHandler(handler)


# Piped or captured output is not wrapped at all (a row stays one line for grep and diff): rich would wrap at 80.
UNWRAPPED_WIDTH = 100_000
# Columns of names and short values: never split ("activa/tion.g/elu_an/d_mul"); the other columns wrap instead.
WHOLE_COLUMNS = frozenset({"op", "mode", "bucket", "winner", "runner-up", "median", "backend", "kind",
                           "access", "schema", "rows", "variable", "platform"})


def _console(*, stderr: bool = False):
    """A terminal gets tables sized to it; piped output gets its rows unwrapped, unless COLUMNS says a width."""
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, highlight=False, width=UNWRAPPED_WIDTH)
    return console


def _table(*columns: str, title: str | None = None):
    """Names and short values never wrap; long text (reasons, evidence, paths) folds to fit the width.
    Cells are plain text: a reason such as "cache rows [cos | sin]" is not rich markup. A terminal too narrow
    for the names gets one record per row ("  column: value" lines) instead of a table of cut names. Unwrapped
    (piped) output keeps each row on one line: a cell's lines (show's evidence, one per candidate) are joined
    by "; "."""
    from rich import box
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

    def new_table(table_class):
        table = table_class(title=title, box=box.SIMPLE_HEAD, title_justify="left", show_edge=False)
        for column in columns:
            if column in WHOLE_COLUMNS:
                table.add_column(column, no_wrap=True, min_width=len(column))
            else:
                table.add_column(column, overflow="fold")
        return table

    class PlainTable(Table):
        records: list[list[str]]  # the cells as text, for the one-record-per-row and one-line layouts

        def add_row(self, *cells, **kwargs):
            self.records.append([str(c) for c in cells])
            super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **kwargs)

        def __rich_console__(self, console, options):
            if options.max_width >= UNWRAPPED_WIDTH:  # piped: a row is one line, for grep and diff
                one_line = new_table(Table)
                for record in self.records:
                    one_line.add_row(*(Text("; ".join(value.splitlines())) for value in record))
                yield one_line
                return
            needed = Measurement.get(console, options.update_width(UNWRAPPED_WIDTH), self).minimum
            if needed <= options.max_width:
                yield from super().__rich_console__(console, options)
                return
            if self.title:
                yield Text(str(self.title))
            names = [str(c.header) for c in self.columns]
            for first, *rest in self.records:
                if first:
                    yield Text(first)
                for name, value in zip(names[1:], rest):
                    if value:
                        yield Text(f"  {name}: " + value.replace("\n", "\n    "))

    table = new_table(PlainTable)
    table.records = []
    return table


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def _settings(db: str | None, *, full: bool, match: bool = True) -> config.Settings:
    """Settings with --db as the user layer. Commands that only read DBs look at AUTOSEL_DB/AUTOSEL_DB_PATH and
    AUTOSEL_MATCH (which rows count as in use) only, so a bad AUTOSEL_TUNE does not stop `autosel show` (doctor
    reports it)."""
    env = dict(os.environ)
    if not full:
        env = {k: v for k, v in env.items() if k in ("AUTOSEL_DB", "AUTOSEL_DB_PATH") + ("AUTOSEL_MATCH",) * match}
    if db:
        env["AUTOSEL_DB"] = db
    settings = config.read_settings(env)
    if full and settings.forced_per_op:  # parsing cannot know the registry: a misspelt op forced nothing, silently
        from autosel import tuning

        config.check_forced_ops(settings, tuning.registry.ops())
    return settings


def _writable_db(settings: config.Settings, db: str | None, *, undone: str):
    """The DB layers opened for writing, for a command that writes (tune, prune); exit 1 before any work when the
    user DB cannot be written, rather than keep the command's changes in memory and lose them at exit.
    undone: what the command did not do ("nothing was timed")."""
    from autosel import tuning

    with warnings.catch_warnings(record=True) as caught:  # the error below says it, naming --db where given
        warnings.simplefilter("always")
        database = tuning.database(settings)
    _refuse_unwritable(database, settings, db, undone=undone)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return database


def _refuse_unwritable(database, settings: config.Settings, db: str | None, *, undone: str) -> None:
    """A ClickException when the first layer is not the user DB, writable: writes then go to memory only."""
    layers = database.layers
    if layers[0].kind == "user" and layers[0].writable:
        return
    problem = next((layer.problem for layer in layers if layer.kind == "user" and layer.problem), layers[0].problem)
    problem = (problem or "no writable layer").removesuffix("; decisions kept in memory")
    where = f"--db {db}" if db else f"the user tuning DB {settings.db}"
    remedy = ("Pass --db a file path this process can write (a new file is created)" if db
              else "Set AUTOSEL_DB to a file path this process can write, or pass --db PATH")
    raise click.ClickException(f"{where} cannot be written ({problem}); {undone}. {remedy}")


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


def _read_db(settings: config.Settings, db: str | None, *, refuse_unread: bool = True, default_too: bool = False):
    """The DB layers as a command that only reads sees them: nothing is created, migrated or moved aside.
    An explicit --db that does not exist, or that cannot be read as a tuning DB, is an error naming it (rather
    than a listing of the shipped rows alone, or advice to tune a file that is there); with default_too (export,
    whose source it is) so is a default user DB that is there but cannot be read. `autosel doctor`, whose listing
    of the layers names the file's problem (a missing --db's too), passes refuse_unread=False."""
    from autosel.db import TuningDB

    if refuse_unread:
        _require_file(settings, db)
    database = TuningDB.open(settings.db, settings.db_path, read_only=True)
    user = database.layers[0]
    named = db or (default_too and settings.db.exists())
    if refuse_unread and named and user.kind == "user" and user.schema_version is None:  # there, but not read
        prune = f"`autosel prune --db {db}`" if db else "`autosel prune`"
        if user.fix == "recover":
            remedy = f"{prune} opens it for writing, which recovers it (SQLite's crash recovery)"
        elif user.fix == "move_aside":  # an autosel DB, damaged
            remedy = f"{prune} moves it aside (kept, not deleted) and starts an empty one"
        elif db:
            remedy = "pass a tuning DB that `autosel tune --db` or `autosel export` wrote"
        else:
            remedy = "set AUTOSEL_DB to a tuning DB that `autosel tune` wrote, or pass --db PATH"
        where = f"--db {db}" if db else f"the user DB {settings.db}"
        raise click.ClickException(f"{where} cannot be read: {(user.problem or '').removesuffix('; not read')}; "
                                   f"{remedy}")
    return database


def _require_file(settings: config.Settings, db: str | None) -> None:
    """An explicit --db that does not exist is an error naming it, for a command that reads or prunes a DB."""
    if db and not settings.db.exists():
        raise click.ClickException(f"--db {db}: no such file ({settings.db}); check the path, or create the DB "
                                   f"with `autosel tune --db {db}`")


def _matches(op: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(op, p) for p in patterns)


def _check_globs(patterns: tuple[str, ...], known: set[str], what: str) -> None:
    """An --op glob that matches no registered op and no stored decision is a mistake, as in `tune`: exit 1."""
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(op, pattern) for op in known):
            raise click.ClickException(f"no {what} matches --op {pattern!r}; known ops: "
                                       f"{', '.join(sorted(known)) or 'none'}")


FILE_FORMATS = {".db": "sqlite", ".sqlite": "sqlite", ".sqlite3": "sqlite", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def _format_of(out, fmt: str | None = None) -> str:
    """--format, else the format --out's suffix names; an unknown suffix (d.json) is a usage error, not SQLite."""
    if fmt:
        return fmt
    if out.suffix.lower() in FILE_FORMATS:
        return FILE_FORMATS[out.suffix.lower()]
    raise click.BadParameter(f"cannot tell the format from the suffix of {out} (.db/.sqlite: SQLite, .jsonl: JSON "
                             "Lines); name the file so, or pass --format sqlite|jsonl", param_hint="--out")


def _refuse_overwrite(out, force: bool) -> None:
    if out.exists() and not force:
        raise click.ClickException(f"{out} already exists; not overwriting it. Choose another --out, or pass --force "
                                   "to overwrite it")


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
    try:
        config.log_to_stderr(config.log_level())  # AUTOSEL_LOG, as in library use; -v and -vv take precedence
    except ConfigError:
        pass  # `autosel doctor` reports it, and commands that need every variable right stop on it
    _log_verbosely(verbose)


def _log_verbosely(verbose: int) -> None:
    if verbose:
        config.log_to_stderr("debug" if verbose > 1 else "info")


def _verbose_option() -> click.Option:
    """-v / -vv after the command too (`autosel show -v`), as people type it; the same as before the command."""
    return click.Option(["-v", "--verbose"], count=True, expose_value=False, is_eager=True,
                        callback=lambda ctx, param, value: value and _log_verbosely(
                            max(value, ctx.find_root().params.get("verbose") or 0)),  # -vv show -v: debug
                        help="Log what autosel does on stderr (-v info, -vv debug).")


from autosel.cli import _check, _files, _inspect, _tune  # noqa: E402,F401  (registers the commands)

for _command in main.commands.values():
    _command.params.append(_verbose_option())
