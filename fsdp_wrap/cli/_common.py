"""What every ``fsdp-wrap`` subcommand shares: help layout, errors, exit codes.

Exit codes: 0 success; 1 a failure (bad data, a model that cannot be built or
wrapped, a failed run); 2 a usage error (a wrong or missing argument: argparse's
own, or :func:`usage_error`).  A user's mistake is one line on stderr,
``fsdp-wrap <command>: error: ...``, with no traceback unless ``--debug``.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

EXIT_FAILURE = 1
EXIT_USAGE = 2


class CommandError(Exception):
    """A failure to report as one line (exit code 1): the message says what to fix."""


class UsageError(Exception):
    """A wrong combination of arguments argparse cannot see (exit code 2)."""


def usage_error(message: str) -> NoReturn:
    raise UsageError(message)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (plain text, paragraphs kept), and every option's
    default said one way: ``(default: X)`` at the end of its help, unless the
    help already says it (where the default is computed, e.g. ``N // 2``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default:" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        if action.option_strings or action.nargs in ("?", "*"):
            return f"{text} (default: %(default)s)"
        return text


def add_debug(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--debug``: show the traceback of a failure instead of one line."""
    parser.add_argument("--debug", action="store_true",
                        default=False if top else argparse.SUPPRESS,
                        help="on failure, print the full traceback instead of one line")


def add_command(sub: Any, name: str, *, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand with the shared formatter and ``--debug``."""
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=description, formatter_class=HelpFormatter)
    add_debug(p)
    return p
