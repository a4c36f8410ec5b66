"""``fsdp-wrap ckpt inspect|consolidate|convert``: checkpoints offline (:mod:`fsdp_wrap.checkpoint.offline`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Iterator
from typing import Any

import fsdp_wrap.checkpoint.offline as offline
from fsdp_wrap.cli._common import CommandError, add_command, usage_error

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


DESCRIPTION = """\
Inspect, consolidate or convert checkpoints offline: no process group, no GPU,
one tensor in memory at a time.  Reads torch.distributed.checkpoint (DCP)
directories written by fsdp_wrap or torch's FSDP1, torch.save files and
Hugging Face safetensors directories.

examples:
  fsdp-wrap ckpt inspect ckpt/step-1000
  fsdp-wrap ckpt consolidate ckpt/step-1000 model.pt
  fsdp-wrap ckpt consolidate ckpt/step-1000 hf-out --format safetensors --no-optim
  fsdp-wrap ckpt convert model.pt dcp-out
"""

COMMANDS = ("inspect", "consolidate", "convert")


def add_parser(sub: Any) -> None:
    p = add_command(sub, "ckpt", help="inspect, consolidate or convert checkpoints offline",
                    description=DESCRIPTION)
    cmds = p.add_subparsers(dest="ckpt_command", metavar="CKPT_COMMAND", title="commands")
    p.set_defaults(func=lambda args: usage_error(
        f"choose what to do: {', '.join(COMMANDS)} ('fsdp-wrap ckpt --help' says what each does)"))

    ins = add_command(cmds, "inspect", help="what a checkpoint is and what it holds",
                      description="Print what a checkpoint is (its format, world size, "
                      "state-dict kind) and the tensors it holds.")
    ins.add_argument("path", help="a DCP directory, a torch.save file, or a safetensors "
                     "directory or file")
    ins.add_argument("--json", action="store_true", help="print JSON instead of text")
    ins.add_argument("--all", action="store_true",
                     help="list every tensor (without it: the first 50)")
    _trust_pickle(ins)
    ins.set_defaults(func=_inspect)

    for name, help_text, fmt_help in (
        ("consolidate", "a DCP directory -> one torch.save file or Hugging Face safetensors",
         "what to write: torch (one torch.save file) or safetensors (a directory in the "
         "Hugging Face layout)"),
        ("convert", "between DCP, torch.save and Hugging Face safetensors",
         "what to write: dcp, torch or safetensors (default: torch for a DCP source, dcp "
         "otherwise)"),
    ):
        c = add_command(cmds, name, help=help_text, description=help_text[0].upper()
                        + help_text[1:] + ", streamed: one tensor in memory at a time.")
        c.add_argument("src", help="the checkpoint to read")
        c.add_argument("out", help="the file or directory to write (must not exist)")
        formats = ["torch", "safetensors"] + (["dcp"] if name == "convert" else [])
        c.add_argument("--format", choices=formats,
                       default="torch" if name == "consolidate" else None, help=fmt_help)
        c.add_argument("--no-optim", action="store_true", help="leave the optimizer state out")
        c.add_argument("--max-shard-size", type=parse_size, default="5GiB",
                       help="the largest safetensors file, e.g. 500MiB or 5GB")
        bar = c.add_mutually_exclusive_group()
        bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                         help="show a progress bar (default: when stderr is a terminal)")
        bar.add_argument("--quiet", dest="progress", action="store_false",
                         help="no progress bar")
        _trust_pickle(c)
        c.set_defaults(func=_consolidate if name == "consolidate" else _convert)


def _trust_pickle(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-pickle", action="store_true",
                   help="torch.load with weights_only=False (only for files you trust)")


def _inspect(args: argparse.Namespace) -> int:
    with _data_errors():
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
        usage_error(
            f"{out}: safetensors output is a directory in the Hugging Face layout "
            "(model-0000x-of-0000n.safetensors + model.safetensors.index.json); give a "
            "directory name and --format safetensors"
            + ("" if fmt == "safetensors" else f" (the format now is {fmt or 'the default'})"))


def _consolidate(args: argparse.Namespace) -> int:
    _check_out_name(args.out, args.format)
    with _data_errors():
        print(offline.consolidate(args.src, args.out, fmt=args.format, **_kwargs(args)))
    return 0


def _convert(args: argparse.Namespace) -> int:
    _check_out_name(args.out, args.format)
    with _data_errors():
        print(offline.convert(args.src, args.out, fmt=args.format, **_kwargs(args)))
    return 0


@contextlib.contextmanager
def _data_errors() -> Iterator[None]:
    """A checkpoint that cannot be read or written is a failure (exit 1), said in one line."""
    try:
        yield
    except (FileNotFoundError, FileExistsError, ValueError, TypeError, RuntimeError) as e:
        raise CommandError(str(e)) from e
