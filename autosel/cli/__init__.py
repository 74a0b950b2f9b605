"""The `autosel` command line; the only package that prints or exits (exit 0 ok, 1 error, 2 usage).

The group `main` lives here; what the commands share (options, settings, DB access, tables) in _common; the commands
in _tune (tune), _inspect (show, doctor, report), _files (export, merge, prune), _check (check) and _bench (the bench
group), imported at the end so that they register on `main`.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import click

from autosel import config
from autosel.errors import AutoselError, ConfigError

# Heavy modules (torch, rich, the DB) are imported inside the commands that need them: `autosel --help`, export
# and merge never import torch (show, doctor, check, report and prune do, to detect this machine).

VERBOSE_HELP = "Log what autosel does on stderr (-v info, -vv debug)."


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
@click.option("-v", "--verbose", count=True, help=VERBOSE_HELP)
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
                        help=VERBOSE_HELP)


from autosel.cli import _bench, _check, _files, _inspect, _tune  # noqa: E402,F401  (registers the commands)

for _command in main.commands.values():
    _command.params.append(_verbose_option())
