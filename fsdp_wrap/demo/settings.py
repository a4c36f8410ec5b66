"""The demo's :class:`Settings` (filled by :mod:`fsdp_wrap.cli.demo` from the command
line) and its output helpers."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

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
