"""The ``fsdp-wrap`` command: ``fsdp-wrap plan ...`` (see :mod:`fsdp_wrap.planning.cli`) and
``fsdp-wrap ckpt ...`` (see :mod:`fsdp_wrap.checkpoint.cli`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .checkpoint import cli as ckpt_cli
from .planning import cli as plan_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-wrap", description="fsdp_wrap's tools")
    sub = parser.add_subparsers(dest="command", required=True)
    plan_cli.add_parser(sub)
    ckpt_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "ckpt":
        return ckpt_cli.run(args)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
