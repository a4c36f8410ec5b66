"""The ``fsdp-wrap`` command.

* ``fsdp-wrap plan ...``: what FSDP would build and hold (:mod:`fsdp_wrap.planning.cli`);
* ``fsdp-wrap ckpt ...``: inspect, consolidate and convert checkpoints offline
  (:mod:`fsdp_wrap.checkpoint.cli`);
* ``fsdp-wrap run CMD ...``: run a command (``torchrun train.py``, ``accelerate
  launch ...``) with torch's FSDP1 names pointing at fsdp_wrap in every Python
  process it starts (:mod:`fsdp_wrap.installer`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import fsdp_wrap.checkpoint.cli as ckpt_cli
import fsdp_wrap.planning.cli as plan_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-wrap", description="fsdp_wrap's tools")
    sub = parser.add_subparsers(dest="command", required=True)
    plan_cli.add_parser(sub)
    ckpt_cli.add_parser(sub)
    run = sub.add_parser(
        "run", help="run a command with fsdp_wrap installed in every Python process",
        description="Run CMD with FSDP_WRAP_INSTALL=1: every Python process it starts "
        "(torchrun's workers included) calls fsdp_wrap.install() at start-up.")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments")
    run.set_defaults(func=_run)
    args = parser.parse_args(argv)
    if args.command == "ckpt":
        return ckpt_cli.run(args)
    return int(args.func(args))


def _run(args: argparse.Namespace) -> int:
    import fsdp_wrap.installer as installer

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("fsdp-wrap run: give the command to run, e.g. fsdp-wrap run torchrun "
              "--nproc-per-node 8 train.py", file=sys.stderr)
        return 2
    hook = installer.startup_hook_path()
    if hook is None:
        print(f"fsdp-wrap run: the start-up hook ({installer.PTH_NAME}) is not in this Python's "
              "site-packages, so new processes would not install fsdp_wrap. Install the "
              "package with pip (pip install fsdp_wrap, or pip install -e . from a checkout).",
              file=sys.stderr)
        return 2
    env = dict(os.environ, **{installer.ENV_VAR: "1"})
    try:
        os.execvpe(cmd[0], cmd, env)
    except FileNotFoundError:
        print(f"fsdp-wrap run: command not found: {cmd[0]}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
