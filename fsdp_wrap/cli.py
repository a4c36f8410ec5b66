"""The ``fsdp-wrap`` command: ``fsdp-wrap plan ...`` (see :mod:`fsdp_wrap.planning.cli`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .planning import cli as plan_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-wrap", description="fsdp_wrap's tools")
    sub = parser.add_subparsers(dest="command", required=True)
    plan_cli.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
