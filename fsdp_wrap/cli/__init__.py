"""The ``fsdp-wrap`` program; ``python -m fsdp_wrap`` is the same program.

* ``fsdp-wrap demo``: train a small GPT on local ranks, checkpoint, resume, compare
  (:mod:`fsdp_wrap.cli.demo`, the demo itself in :mod:`fsdp_wrap.demo`);
* ``fsdp-wrap plan``: the FSDP units and per-rank memory of a model, before launch
  (:mod:`fsdp_wrap.cli.plan`);
* ``fsdp-wrap ckpt``: inspect, consolidate and convert checkpoints offline
  (:mod:`fsdp_wrap.cli.ckpt`);
* ``fsdp-wrap run CMD ...``: run a command (``torchrun train.py``, ``accelerate
  launch ...``) with torch's FSDP1 names pointing at fsdp_wrap in every Python
  process it starts (:mod:`fsdp_wrap.cli.run`);
* ``fsdp-wrap cluster -- CMD ...``: run a command on N nodes made on this
  machine (network namespaces, a rate-limited link, torchrun's multi-node
  rendezvous) (:mod:`fsdp_wrap.cli.cluster`, the test bed in
  :mod:`fsdp_wrap.cli.testbed`);
* ``fsdp-wrap trace [-- CMD ...]``: profile a few steps of a script (or of the
  demo) and draw each unit's gathers and reductions per rank on a time axis
  (:mod:`fsdp_wrap.cli.trace`, the analysis in :mod:`fsdp_wrap.cli.timeline`).

Exit codes and error lines are shared (:mod:`fsdp_wrap.cli._common`).  This
package is an application of the library; nothing in the library imports it.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

import torch

import fsdp_wrap.cli.ckpt as ckpt_cmd
import fsdp_wrap.cli.cluster as cluster_cmd
import fsdp_wrap.cli.demo as demo_cmd
import fsdp_wrap.cli.plan as plan_cmd
import fsdp_wrap.cli.run as run_cmd
import fsdp_wrap.cli.trace as trace_cmd
from fsdp_wrap import __version__
from fsdp_wrap.cli._common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    CommandError,
    HelpFormatter,
    UsageError,
    add_debug,
)

__all__ = ["build_parser", "demo_entry", "main"]

PROG = "fsdp-wrap"


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: the program, its options and its subcommands."""
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=HelpFormatter,
        description="fsdp_wrap's command line: a demo, a memory planner, an offline checkpoint "
        "tool, a launcher that switches torch's FSDP1 to fsdp_wrap, a multi-node test bed "
        "on one machine, and a step timeline.",
        epilog="Run 'fsdp-wrap COMMAND --help' for a command's options.")
    parser.add_argument(
        "--version", action="version",
        version=f"{PROG} {__version__} (torch {torch.__version__}, "
        f"Python {platform.python_version()})")
    add_debug(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for cmd in (demo_cmd, plan_cmd, ckpt_cmd, run_cmd, cluster_cmd, trace_cmd):
        cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fsdp-wrap`` with ``argv`` (default ``sys.argv[1:]``); return the exit code.

    Usage errors exit 2, failures 1; a failure is one line on stderr unless
    ``--debug`` is given (then its traceback is raised).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: choose a command: demo, plan, ckpt, run, cluster or trace "
              f"('{PROG} --help' says what each does)", file=sys.stderr)
        return EXIT_USAGE
    prog = f"{PROG} {args.command}"
    try:
        return int(args.func(args))
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        message = str(e) or type(e).__name__
        hint = "" if isinstance(e, CommandError) else f" ({type(e).__name__}; --debug shows where)"
        print(f"{prog}: error: {message}{hint}", file=sys.stderr)
        return EXIT_FAILURE


def entry() -> None:
    """The ``fsdp-wrap`` console script and ``python -m fsdp_wrap``."""
    sys.exit(main())


def demo_entry() -> None:
    """``fsdp-wrap-demo`` and ``python -m fsdp_wrap.demo``: ``fsdp-wrap demo``'s aliases."""
    demo_cmd.entry(sys.argv[1:])
