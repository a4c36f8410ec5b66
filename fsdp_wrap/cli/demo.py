"""``fsdp-wrap demo`` (also ``fsdp-wrap-demo``, ``python -m fsdp_wrap.demo``): the demo's command line.

The demo itself (train, checkpoint, resume, compare) is :mod:`fsdp_wrap.demo`;
this module turns arguments into its :class:`~fsdp_wrap.demo.Settings`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from fsdp_wrap.cli._common import HelpFormatter, add_command, add_debug, usage_error
from fsdp_wrap.comm.teardown import exit_now
from fsdp_wrap.demo import MODEL_SIZES, STRATEGIES, Settings
from fsdp_wrap.demo.launch import main as launch
from fsdp_wrap.demo.launch import under_torchrun

DESCRIPTION = """\
Train a small GPT with fsdp_wrap on local CPU ranks (gloo) or GPUs (NCCL), save a
checkpoint at step k, resume from it in a fresh model and check that the resumed
losses equal the uninterrupted ones ("resume: OK", exit code 0).  Nothing is
downloaded: the data are synthetic arithmetic sequences.

examples:
  fsdp-wrap demo                                   # 2 CPU ranks, 20 steps
  fsdp-wrap demo --nprocs 4 --strategy SHARD_GRAD_OP --use-orig-params
  fsdp-wrap demo --device cuda --mixed-precision bf16
  torchrun --nproc-per-node 2 -m fsdp_wrap demo    # torchrun's process group
"""


def add_parser(sub: Any) -> None:
    p = add_command(sub, "demo", help="train a small GPT, checkpoint, resume and compare",
                    description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options (shared by ``fsdp-wrap demo`` and its aliases)."""
    p.add_argument("--nprocs", "--ranks", type=int, default=None, dest="nprocs",
                   help="local ranks to spawn; ignored under torchrun "
                   "(default: 2 on CPU, one per GPU with --device cuda)")
    p.add_argument("--steps", type=int, default=20, help="training steps N")
    p.add_argument("--checkpoint-step", type=int, default=None,
                   help="the step k after which the checkpoint is saved (default: N // 2)")
    p.add_argument("--strategy", choices=STRATEGIES, default="FULL_SHARD",
                   help="the sharding strategy")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                   help="tiny = 2 blocks x width 64, small = 4 x 128, base = 6 x 256")
    p.add_argument("--layers", type=int, default=None,
                   help="number of blocks (default: the model size's)")
    p.add_argument("--width", type=int, default=None,
                   help="model width (default: the model size's)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="peak AdamW learning rate (linear warm-up, cosine decay)")
    p.add_argument("--use-orig-params", action="store_true",
                   help="FSDP(use_orig_params=True): the optimizer sees the original parameters")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where to write the checkpoint and the loss plot "
                   "(default: a temporary directory, removed at exit)")
    p.add_argument("--optim-state", choices=("full", "per-rank"), default="full",
                   help="full: FSDP.optim_state_dict, rank 0 writes one file; per-rank: each "
                   "rank's optim.state_dict(), resumable at the same world size only")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's init and the data")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo) or cuda (NCCL, one rank per GPU)")
    p.add_argument("--mixed-precision", choices=("none", "bf16", "fp16"), default="none",
                   help="MixedPrecision(param_dtype=reduce_dtype=this); fp16 also uses a "
                   "ShardedGradScaler")
    p.add_argument("--quiet", action="store_true", help="print only the summary")


def settings_from(a: argparse.Namespace, error: Callable[[str], NoReturn]) -> Settings:
    """The demo's :class:`Settings` from parsed options; ``error`` reports a usage error."""
    layers, width = MODEL_SIZES[a.model_size]
    layers = a.layers if a.layers is not None else layers
    width = a.width if a.width is not None else width
    heads = 4 if width % 4 == 0 else 1
    if a.steps < 2:
        error("--steps must be at least 2 (checkpoint, then at least one resumed step)")
    k = a.checkpoint_step if a.checkpoint_step is not None else a.steps // 2
    if not 1 <= k < a.steps:
        error(f"--checkpoint-step must be in [1, {a.steps - 1}] but got {k}")
    if a.device == "cuda" and not torch.cuda.is_available():
        error("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    nprocs = a.nprocs
    if nprocs is None:
        nprocs = torch.cuda.device_count() if a.device == "cuda" else 2
    if nprocs < 1 or layers < 1 or width < 1:
        error("--nprocs, --layers and --width must be positive")
    return Settings(
        nprocs=nprocs, steps=a.steps, checkpoint_step=k, strategy=a.strategy, layers=layers,
        width=width, heads=heads, vocab=64, seq_len=a.seq_len, batch=a.batch_size, lr=a.lr,
        use_orig_params=a.use_orig_params, checkpoint_dir=a.checkpoint_dir,
        optim_state=a.optim_state, keep_checkpoint=a.checkpoint_dir is not None, seed=a.seed,
        quiet=a.quiet, device=a.device, mixed_precision=a.mixed_precision,
    )


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """The demo's settings from a command line (the aliases' parser; exits 2 on a usage error)."""
    p = argparse.ArgumentParser(prog="fsdp-wrap demo", description=DESCRIPTION,
                                formatter_class=HelpFormatter)
    add_arguments(p)
    add_debug(p, top=True)
    return settings_from(p.parse_args(argv), p.error)


def run(args: argparse.Namespace) -> int:
    """``fsdp-wrap demo``: the demo's exit code (under torchrun this rank exits here)."""
    settings = settings_from(args, usage_error)
    code = launch(settings)
    if under_torchrun():
        exit_now(code)  # this process is a rank: leave without finalising (comm/teardown.py)
    return code


def entry(argv: Sequence[str]) -> NoReturn:
    """The aliases (``fsdp-wrap-demo``, ``python -m fsdp_wrap.demo``)."""
    code = launch(parse_args(argv))
    if under_torchrun():
        exit_now(code)
    sys.exit(code)
