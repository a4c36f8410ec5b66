"""The demo's command line (:func:`parse_args` -> :class:`Settings`) and its output helpers."""

from __future__ import annotations

import argparse
import resource
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MODEL_SIZES: dict[str, tuple[int, int]] = {  # name -> (layers, width)
    "tiny": (2, 64),
    "small": (4, 128),
    "base": (6, 256),
}
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    nprocs: int
    steps: int
    checkpoint_step: int
    strategy: str
    layers: int
    width: int
    heads: int
    vocab: int
    seq_len: int
    batch: int
    lr: float
    use_orig_params: bool
    checkpoint_dir: str | None
    optim_state: str
    keep_checkpoint: bool
    seed: int
    quiet: bool
    device: str = "cpu"
    mixed_precision: str = "none"


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(
        prog="python -m fsdp_wrap.demo",
        description="Train a small GPT with fsdp_wrap on CPU ranks, checkpoint it, resume it "
        "and check the resumed losses equal the uninterrupted ones.",
    )
    p.add_argument("--nprocs", "--ranks", type=int, default=None, dest="nprocs",
                   help="local ranks to spawn (ignored under torchrun) [2 on CPU, one per GPU]")
    p.add_argument("--steps", type=int, default=20, help="training steps N [20]")
    p.add_argument("--checkpoint-step", type=int, default=None,
                   help="step k after which the checkpoint is saved [N // 2]")
    p.add_argument("--strategy", choices=STRATEGIES, default="FULL_SHARD",
                   help="sharding strategy [FULL_SHARD]")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                   help="tiny=2x64, small=4x128, base=6x256 (layers x width) [small]")
    p.add_argument("--layers", type=int, default=None, help="override the number of blocks")
    p.add_argument("--width", type=int, default=None, help="override the model width")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence [32]")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step [16]")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate [3e-3]")
    p.add_argument("--use-orig-params", action="store_true",
                   help="FSDP(use_orig_params=True): the optimizer sees the original parameters")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where to write the checkpoint [a temporary directory, removed at exit]")
    p.add_argument(
        "--optim-state",
        choices=("full", "per-rank"),
        default="full",
        help="full: FSDP.optim_state_dict, rank 0 writes one file; per-rank: each rank's "
        "optim.state_dict(), same world size needed to resume [full]",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of model init and data [0]")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="compute device: cpu (gloo) or cuda (NCCL, one rank per GPU) [cpu]")
    p.add_argument("--mixed-precision", choices=("none", "bf16", "fp16"), default="none",
                   help="MixedPrecision(param_dtype, reduce_dtype) of this dtype; fp16 also "
                   "uses a ShardedGradScaler [none]")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    a = p.parse_args(argv)
    layers, width = MODEL_SIZES[a.model_size]
    layers = a.layers if a.layers is not None else layers
    width = a.width if a.width is not None else width
    heads = 4 if width % 4 == 0 else 1
    if a.steps < 2:
        p.error("--steps must be at least 2 (checkpoint, then at least one resumed step)")
    k = a.checkpoint_step if a.checkpoint_step is not None else a.steps // 2
    if not 1 <= k < a.steps:
        p.error(f"--checkpoint-step must be in [1, {a.steps - 1}] but got {k}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    if a.nprocs is None:
        a.nprocs = torch.cuda.device_count() if a.device == "cuda" else 2
    if a.nprocs < 1 or layers < 1 or width < 1:
        p.error("--nprocs, --layers and --width must be positive")
    return Settings(
        nprocs=a.nprocs, steps=a.steps, checkpoint_step=k, strategy=a.strategy, layers=layers,
        width=width, heads=heads, vocab=64, seq_len=a.seq_len, batch=a.batch_size, lr=a.lr,
        use_orig_params=a.use_orig_params, checkpoint_dir=a.checkpoint_dir,
        optim_state=a.optim_state,
        keep_checkpoint=a.checkpoint_dir is not None, seed=a.seed, quiet=a.quiet,
        device=a.device, mixed_precision=a.mixed_precision,
    )


# ------------------------------------------------------------------ output


class Printer:
    """Rank 0 prints; everything is plain text, one line at a time (fine in logs and pipes)."""

    def __init__(self, rank: int, quiet: bool) -> None:
        self.enabled = rank == 0
        self.quiet = quiet

    def __call__(self, msg: str = "", always: bool = False) -> None:
        if self.enabled and (always or not self.quiet):
            print(msg, flush=True)


def progress_line(step: int, total: int, loss: float, tok_s: float, tag: str) -> str:
    width = 20
    filled = round(width * step / total)
    bar = "#" * filled + "." * (width - filled)
    return f"{tag} [{bar}] step {step:>3}/{total}  loss {loss:7.4f}  {tok_s:>9,.0f} tok/s"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024
