"""``fsdp-wrap ckpt inspect|consolidate|convert`` (also ``python -m fsdp_wrap.ckpt``)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

import fsdp_wrap.checkpoint.offline as offline

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000 bytes."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
    unit = (m.group(2) or "").upper().rstrip("B")
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown unit in {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "ckpt",
        help="inspect, consolidate or convert checkpoints offline (no process group, CPU)",
        description="Inspect, consolidate or convert checkpoints offline (no process group, CPU).",
    )
    fill_parser(p)


def fill_parser(p: argparse.ArgumentParser) -> None:
    cmds = p.add_subparsers(dest="ckpt_command", required=True)

    ins = cmds.add_parser("inspect", help="what a checkpoint is and what it holds")
    ins.add_argument("path", help="DCP directory, torch.save file or safetensors directory/file")
    ins.add_argument("--json", action="store_true", help="print JSON instead of text")
    ins.add_argument("--all", action="store_true", help="list every tensor (default: first 50)")
    ins.add_argument("--trust-pickle", action="store_true",
                     help="torch.load with weights_only=False (only for files you trust)")
    ins.set_defaults(func=_inspect)

    for name, help_text in (
        ("consolidate", "DCP directory -> one torch.save file or HF safetensors, streaming"),
        ("convert", "between DCP, torch.save and HF safetensors (full -> DCP by default)"),
    ):
        c = cmds.add_parser(name, help=help_text, description=help_text)
        c.add_argument("src", help="the checkpoint to read")
        c.add_argument("out", help="the file or directory to write (must not exist)")
        formats = ["torch", "safetensors"] + (["dcp"] if name == "convert" else [])
        c.add_argument(
            "--format", choices=formats, default="torch" if name == "consolidate" else None,
            help="output format (convert: torch for a DCP source, dcp otherwise)",
        )
        c.add_argument("--no-optim", action="store_true", help="leave the optimizer state out")
        c.add_argument("--max-shard-size", type=parse_size, default=offline.DEFAULT_MAX_SHARD,
                       help="largest safetensors file (default 5GiB)")
        bar = c.add_mutually_exclusive_group()
        bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                         help="show a progress bar (default: when stderr is a terminal)")
        bar.add_argument("--quiet", dest="progress", action="store_false")
        c.add_argument("--trust-pickle", action="store_true",
                       help="torch.load with weights_only=False (only for files you trust)")
        c.set_defaults(func=_consolidate if name == "consolidate" else _convert)


def _inspect(args: argparse.Namespace) -> int:
    info = offline.inspect(args.path, trust_pickle=args.trust_pickle)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(offline.format_inspection(info, limit=None if args.all else 50))
    return 0


def _kwargs(args: argparse.Namespace) -> dict[str, Any]:
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    return {
        "include_optim": not args.no_optim,
        "max_shard_size": args.max_shard_size,
        "progress": progress,
        "trust_pickle": args.trust_pickle,
    }


def _check_out_name(out: str, fmt: str | None) -> None:
    """A ``.safetensors`` name for what would be a torch.save file or a directory
    of shards is a mistake a user would only find out later: say it now."""
    if out.endswith(".safetensors"):
        raise ValueError(
            f"{out}: safetensors output is a directory in the Hugging Face layout "
            "(model-0000x-of-0000n.safetensors + model.safetensors.index.json); give a "
            "directory name and --format safetensors"
            + ("" if fmt == "safetensors" else f" (the format now is {fmt or 'the default'})"))


def _consolidate(args: argparse.Namespace) -> int:
    _check_out_name(args.out, args.format)
    print(offline.consolidate(args.src, args.out, fmt=args.format, **_kwargs(args)))
    return 0


def _convert(args: argparse.Namespace) -> int:
    _check_out_name(args.out, args.format)
    print(offline.convert(args.src, args.out, fmt=args.format, **_kwargs(args)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_wrap.ckpt",
        description="Inspect, consolidate or convert checkpoints offline (no process group, CPU).",
    )
    fill_parser(parser)
    args = parser.parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; a bad checkpoint is a one-line error and exit status 2."""
    try:
        return int(args.func(args))
    except (FileNotFoundError, FileExistsError, ValueError, TypeError, RuntimeError) as e:
        print(f"fsdp-wrap ckpt: error: {e}", file=sys.stderr)
        return 2
