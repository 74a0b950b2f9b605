"""Renders the two reference pages that are generated, never written by hand: docs/cli.md from the commands' own
--help, docs/configuration.md from autosel.config.VARIABLES. tests/test_docs.py fails when either is not current.

  python tools/render_docs.py             # rewrite both pages
  python tools/render_docs.py --check     # exit 1 if a page is not what the code renders
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import click

DOCS = Path(__file__).resolve().parent.parent / "docs"
WIDTH = 110  # the CLI's own max_content_width, so the page does not depend on the terminal that renders it


def _commands(command: click.Command, path: list[str], parent: click.Context | None = None):
    """(path, command, context) for `command` and every subcommand under it, in the order the help lists them; the
    contexts chain as when the command runs, so usage lines and -h come out as a user sees them."""
    settings = {"terminal_width": WIDTH, **command.context_settings} if parent is None else {}
    ctx = click.Context(command, info_name=path[-1], parent=parent, **settings)
    yield path, command, ctx
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            yield from _commands(command.get_command(ctx, name), [*path, name], ctx)


def cli_reference() -> str:
    from autosel.cli import main

    lines = ["<!-- Rendered by `python tools/render_docs.py` from the commands' own --help: edit the help, not this "
             "page. -->", "# CLI reference", "",
             "For: operators and engine developers who run `autosel` from a shell or a build script. Every command "
             "below prints this same text with `--help`; exit codes are 0 (ok), 1 (error, message on stderr) and 2 "
             "(usage).", ""]
    for path, command, ctx in _commands(main, ["autosel"]):
        lines += [f"{'##' if len(path) < 2 else '###'} `{' '.join(path)}`", "", "```text",
                  command.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def configuration_reference() -> str:
    from autosel.config import VARIABLES

    lines = ["<!-- Rendered by `python tools/render_docs.py` from autosel/config.py's VARIABLES: edit that table, "
             "not this page. -->", "# Configuration", "",
             "For: anyone running autosel in a process they do not start by hand (an engine, a container, CI). "
             "autosel reads these environment variables, all in one module (autosel/config.py), at first use; a "
             "value it does not accept is an error that names the allowed values. `autosel doctor` shows the values "
             "in effect.", "", "| variable | what it sets |", "|---|---|"]
    lines += [f"| `{name}` | {text.replace('|', '/')} |" for name, text in VARIABLES.items()]
    return "\n".join(lines) + "\n"


PAGES = {"cli.md": cli_reference, "configuration.md": configuration_reference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is not current")
    args = parser.parse_args(argv)
    stale = []
    for name, render in PAGES.items():
        text, page = render(), DOCS / name
        if args.check:
            if not page.is_file() or page.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            page.write_text(text, encoding="utf-8")
            print(f"wrote {page}")
    if stale:
        print(f"not current: {', '.join(f'docs/{n}' for n in stale)}; run python tools/render_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
