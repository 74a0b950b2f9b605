"""What the `autosel` commands share: their common options, the DB and settings they open, and how they print."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import click

from autosel import config
from autosel.formatting import format_us
from autosel.errors import ConfigError
from autosel.report import candidate_median_us

MEDIAN_NOTE = "median: geometric mean over the shapes of each shape's median time per call"


# --- options that several commands take -------------------------------------------------------------------
# Each is a factory, called as @db_option() or @json_option("the report"), so that the help can say what this
# command does with the option while the name, type and metavar are declared once.

READ_DB_HELP = "Read this DB as the user layer instead of the default user DB."


def _db_path(ctx, param, value: str | None) -> str | None:
    """An empty --db is a usage error: `--db "$BUILD_DB"` with the variable unset would otherwise mean the default
    user DB, and prune, tune or export it instead of the DB the script named."""
    if value is not None and not value.strip():
        raise click.BadParameter(f"{value!r} names no file; give a DB file path, or leave --db out to use the default "
                                 "user DB")
    return value


def db_option(help: str = READ_DB_HELP):
    """--db PATH: the user layer in place of AUTOSEL_DB; help says what the command does with it."""
    return click.option("--db", metavar="PATH", help=help, callback=_db_path)


def json_option(what: str):
    """--json: write `what` ("the report") as JSON on stdout instead of the table or text."""
    return click.option("--json", "as_json", is_flag=True, help=f"Write {what} as JSON on stdout.")


def op_option(help: str = "Only ops matching this glob (repeatable)."):
    """--op GLOB (repeatable), as the tuple `ops`."""
    return click.option("--op", "ops", multiple=True, metavar="GLOB", help=help)


def out_option(help: str):
    """--out FILE (required) for a command that writes a file; help says which file."""
    return click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help=help)


def format_option():
    """--format for a command that writes a tuning DB or a JSON Lines file to --out."""
    return click.option("--format", "fmt", type=click.Choice(["sqlite", "jsonl"]),
                        help="sqlite (to ship) or jsonl (to review in a pull request); default: from --out's suffix "
                             "(.db, .sqlite: sqlite; .jsonl: jsonl).")


def force_option():
    """--force that overwrites an existing --out (see refuse_overwrite); `tune --force` means re-tune instead."""
    return click.option("--force", is_flag=True, help="Overwrite --out if it exists.")


# --- output -----------------------------------------------------------------------------------------------

# Piped or captured output is not wrapped at all (a row stays one line for grep and diff): rich would wrap at 80.
UNWRAPPED_WIDTH = 100_000
# Columns of names and short values: never split ("activa/tion.g/elu_an/d_mul"); the other columns wrap instead.
WHOLE_COLUMNS = frozenset({"op", "mode", "bucket", "winner", "runner-up", "median", "backend", "kind",
                           "access", "schema", "rows", "variable", "platform"})


def make_console(*, stderr: bool = False):
    """A terminal gets tables sized to it; piped output gets its rows unwrapped, unless COLUMNS says a width."""
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, highlight=False, width=UNWRAPPED_WIDTH)
    return console


def make_table(*columns: str, title: str | None = None):
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


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While kernels run, what they print goes to stderr, Python's print and a C library's printf alike (file
    descriptor 1 is pointed at 2), so that stdout carries the command's table or JSON alone: a candidate that
    printed a line made `autosel tune --json` invalid JSON."""
    sys.stdout.flush()
    try:
        saved_fd = os.dup(1)
    except OSError:  # no stdout at all: nothing to keep clean
        saved_fd = None
    if saved_fd is not None:
        os.dup2(2, 1)
    saved = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = saved
        _flush_c_stdio()  # what a C library buffered for its stdout still goes to stderr
        if saved_fd is not None:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)


def _flush_c_stdio() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to ask (Windows): Python's own streams are flushed
        pass
    sys.stderr.flush()


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


# --- settings and the DB ------------------------------------------------------------------------------------

def counted(rows: int, bucket_rows: int, kind: str = "") -> str:
    """Rows in the words every command uses, "3 decision(s) and 12 bucket row(s)": export, merge and prune called
    op-level and bucket rows together "decisions" where report told them apart. kind: "stale ", say."""
    return f"{rows - bucket_rows} {kind}decision(s)" + (f" and {bucket_rows} bucket row(s)" if bucket_rows else "")


def settings_for(db: str | None, *, full: bool, match: bool = True, warn: bool = True) -> config.Settings:
    """Settings with --db as the user layer. Commands that only read DBs look at AUTOSEL_DB/AUTOSEL_DB_PATH and
    AUTOSEL_MATCH (which rows count as in use; not match: export and prune, which never ask) only, so a bad
    AUTOSEL_TUNE does not stop `autosel show`: it warns (unless not warn: doctor reports it)."""
    env = dict(os.environ)
    if db:
        env["AUTOSEL_DB"] = db
    if full:
        settings = config.read_settings(env)
    else:
        settings = config.read_settings({k: v for k, v in env.items()
                                         if k in ("AUTOSEL_DB", "AUTOSEL_DB_PATH") + ("AUTOSEL_MATCH",) * match})
        try:  # the variables this command does not read: a bad one is said, not passed over in silence
            config.read_settings(env)
            config.log_level(env)
        except ConfigError as exc:
            if warn:
                click.echo(f"Warning: {exc}; `autosel {click.get_current_context().info_name}` does not read it "
                           "and goes on, but get_kernel and `autosel tune` stop on it", err=True)
    if full and settings.forced_per_op:  # parsing cannot know the registry: a misspelt op forced nothing, silently
        from autosel import tuning

        config.check_forced_ops(settings, tuning.registry.ops())
    return settings


def writable_db(settings: config.Settings, db: str | None, *, undone: str):
    """The DB layers opened for writing, for a command that writes (tune, prune); exit 1 before any work when the
    user DB cannot be written, rather than keep the command's changes in memory and lose them at exit.
    undone: what the command did not do ("nothing was timed")."""
    from autosel import tuning

    with warnings.catch_warnings(record=True) as caught:  # the error below says it, naming --db where given
        warnings.simplefilter("always")
        database = tuning.database(settings)
    refuse_unwritable(database, settings, db, undone=undone)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return database


def refuse_unwritable(database, settings: config.Settings, db: str | None, *, undone: str) -> None:
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


def read_db(settings: config.Settings, db: str | None, *, refuse_unread: bool = True, default_too: bool = False):
    """The DB layers as a command that only reads sees them: nothing is created, migrated or moved aside.
    An explicit --db that does not exist, or that cannot be read as a tuning DB, is an error naming it (rather
    than a listing of the shipped rows alone, or advice to tune a file that is there); with default_too (export,
    whose source it is) so is a default user DB that is there but cannot be read. `autosel doctor`, whose listing
    of the layers names the file's problem (a missing --db's too), passes refuse_unread=False."""
    from autosel.db import TuningDB

    if refuse_unread:
        require_file(settings, db)
    with warnings.catch_warnings(record=True) as caught:  # the error below says the user DB's: not twice
        warnings.simplefilter("always")
        database = TuningDB.open(settings.db, settings.db_path, read_only=True)
    user = database.layers[0]
    named = db or (default_too and settings.db.exists())
    refused = refuse_unread and named and user.kind == "user" and user.schema_version is None  # there, but not read
    for w in caught:
        if not (refused and str(settings.db) in str(w.message)):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if refused:
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


def require_file(settings: config.Settings, db: str | None) -> None:
    """An explicit --db that does not exist is an error naming it, for a command that reads or prunes a DB."""
    if db and not settings.db.exists():
        raise click.ClickException(f"--db {db}: no such file ({settings.db}); check the path, or create the DB "
                                   f"with `autosel tune --db {db}`")


# --- ops, files and decisions -------------------------------------------------------------------------------

def matches(op: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(op, p) for p in patterns)


def check_globs(patterns: tuple[str, ...], known: set[str], what: str) -> None:
    """An --op glob that matches no registered op and no stored decision is a mistake, as in `tune`: exit 1."""
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(op, pattern) for op in known):
            hint = config.nearest_ops(pattern, sorted(known))
            raise click.ClickException(f"no {what} matches --op {pattern!r}; {hint + ' ' if hint else ''}known ops: "
                                       f"{', '.join(sorted(known)) or 'none'}")


def refuse_overwrite(out, force: bool) -> None:
    if out.exists() and not force:
        raise click.ClickException(f"{out} already exists; not overwriting it. Choose another --out, or pass --force "
                                   "to overwrite it")


def decision_summary(decision) -> dict[str, Any]:
    return {
        "winner": decision.winner,
        "median_us": candidate_median_us(decision.candidate(decision.winner)),
        "runner_up": decision.runner_up,
        "runner_up_median_us": candidate_median_us(decision.candidate(decision.runner_up or "")),
        "lead_over_runner_up": decision.lead_over_runner_up,
        "rejected": [{"backend": c.backend, "status": c.status, "reason": c.reason}
                     for c in decision.candidates if not c.ok],
    }


def runner_up_text(decision) -> str:
    if not decision.runner_up:
        return "-"
    return f"{decision.runner_up} ({format_us(candidate_median_us(decision.candidate(decision.runner_up)))})"
