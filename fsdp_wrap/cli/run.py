"""``fsdp-wrap run CMD ...``: run a command with fsdp_wrap installed in every Python process.

The command runs with ``FSDP_WRAP_INSTALL=1``: the start-up hook the package
puts in site-packages (``fsdp_wrap-install.pth``) then calls
:func:`fsdp_wrap.install` in every Python process it starts, torchrun's workers
included, so ``torch.distributed.fsdp``'s FSDP1 names point at fsdp_wrap's
without changing a line of the training script or the framework.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from fsdp_wrap.cli._common import CommandError, add_command, usage_error

DESCRIPTION = """\
Run CMD with FSDP_WRAP_INSTALL=1: every Python process it starts (torchrun's
workers included) calls fsdp_wrap.install() at start-up, so torch's FSDP1
names point at fsdp_wrap without a change to the script or the framework.

examples:
  fsdp-wrap run torchrun --nproc-per-node 8 train.py
  fsdp-wrap run accelerate launch --config_file fsdp.yaml train.py
  fsdp-wrap run -- python train.py --lr 1e-4
"""


def add_parser(sub: Any) -> None:
    p = add_command(sub, "run", help="run a command with fsdp_wrap installed in every Python "
                    "process", description=DESCRIPTION)
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD ...",
                   help="the command and its arguments ('--' before it is optional)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import fsdp_wrap.frameworks.installer as installer

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        usage_error("give the command to run, e.g. fsdp-wrap run torchrun "
                    "--nproc-per-node 8 train.py")
    hook = installer.startup_hook_path()
    if hook is None:
        raise CommandError(
            f"the start-up hook ({installer.PTH_NAME}) is not in this Python's site-packages, "
            "so new processes would not install fsdp_wrap; install the package with pip "
            "(from a checkout: pip install -e .) into the Python that runs the command")
    env = dict(os.environ, **{installer.ENV_VAR: "1"})
    try:
        os.execvpe(cmd[0], cmd, env)
    except FileNotFoundError:
        raise CommandError(f"command not found: {cmd[0]}") from None
    return 0  # not reached: exec replaced this process
