"""End-to-end demo: train a small GPT with fsdp_wrap, checkpoint, resume, compare.

Run it with::

    python -m fsdp_wrap.demo                 # 2 local CPU ranks (gloo), spawned here
    python -m fsdp_wrap.demo --nprocs 4 --strategy SHARD_GRAD_OP --use-orig-params
    python -m fsdp_wrap.demo --device cuda --mixed-precision bf16   # one rank per GPU (NCCL)
    torchrun --nproc-per-node 2 -m fsdp_wrap.demo   # uses torchrun's process group

With ``--device cuda`` rank ``r`` computes on GPU ``r % device_count`` over
NCCL; with more ranks than GPUs they share the GPUs over gloo (fine for a
check, not for speed).

What it does, on every rank:

1. builds a GPT-style decoder (token + position embeddings, pre-LN blocks,
   an output head tied to the token embedding) and wraps it with
   ``FullyShardedDataParallel(auto_wrap_policy=ModuleWrapPolicy({Block}))``:
   one FSDP unit per block, and the root unit holds the embeddings, the final
   LayerNorm and the tied head;
2. trains it on a built-in synthetic task (arithmetic sequences: each sequence
   counts from a random start with a random stride, modulo the vocabulary), so
   the loss visibly falls within a few steps and nothing is downloaded;
3. prints one progress line per step (rank 0), then each rank's sharded vs.
   full parameter bytes and peak RSS;
4. at step ``k`` saves a checkpoint: the full model state dict and the full
   optimizer state dict (``FULL_STATE_DICT``, ``rank0_only``, offloaded to
   CPU, written by rank 0; ``FSDP.optim_state_dict`` keys the optimizer state
   by parameter name, like the model's);
5. keeps training to step ``N``; then builds a fresh model and optimizer,
   loads the step-``k`` checkpoint, trains ``k+1 .. N`` again and checks that
   every loss matches the uninterrupted run.  Exit code 0 means it did.

``--optim-state per-rank`` saves each rank's local ``optim.state_dict()``
(its flat-parameter shards) in a file of its own instead: cheaper, no
collective, but only resumable with the same world size, sharding strategy,
``use_orig_params`` and model (the demo checks that).

This module is an application of the library; nothing in ``fsdp_wrap``
imports it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_wrap.comm.teardown import exit_now

MODEL_SIZES: dict[str, tuple[int, int]] = {  # name -> (layers, width)
    "tiny": (2, 64),
    "small": (4, 128),
    "base": (6, 256),
}
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
RESUME_TOLERANCE = 1e-5


# ------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """One pre-LN transformer block: the unit the wrap policy makes."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, layers: int, width: int, heads: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: both live in the root unit
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# -------------------------------------------------------------------- data


def make_batch(
    step: int, rank: int, world_size: int, batch: int, seq_len: int, vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step``: a pure function, so a resumed run sees the same data.

    Each sequence is ``start, start + d, start + 2d, ... (mod vocab)`` with a
    random start and a stride ``d`` in 1..4: the first token is a guess, the
    second narrows ``d`` down, the rest are predictable, so the loss falls
    well below ``ln(vocab)`` as the model learns to read the stride.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * world_size + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 5, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    return seq[:, :-1], seq[:, 1:]


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


# ---------------------------------------------------------------- training


def build(s: Settings, init_seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A fresh FSDP-wrapped model, its optimizer (it sees the shards) and loss scaler."""
    import fsdp_wrap as fsdp
    from fsdp_wrap.wrap import ModuleWrapPolicy

    torch.manual_seed(init_seed)
    dtype = LOW_PRECISION.get(s.mixed_precision)
    model = fsdp.FullyShardedDataParallel(
        TinyGPT(s.vocab, s.seq_len, s.layers, s.width, s.heads),  # built on the CPU
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=fsdp.ShardingStrategy[s.strategy],
        use_orig_params=s.use_orig_params,
        device_id=compute_device(s),  # each unit moves to it as it is wrapped
        mixed_precision=fsdp.MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)
        if dtype is not None else None,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)
    return model, optim, make_scaler(s)


LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_device(s: Settings) -> torch.device:
    if s.device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return torch.device("cuda", local % torch.cuda.device_count())


def make_scaler(s: Settings) -> Any:
    """fp16 needs loss scaling; bf16 and fp32 do not (a disabled scaler is a no-op)."""
    from fsdp_wrap.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=s.device, enabled=s.mixed_precision == "fp16")


def lr_at(step: int, s: Settings) -> float:
    """Linear warm-up over 3 steps, then constant: a pure function of the step."""
    return s.lr * min(1.0, step / 3)


def train_step(
    model: nn.Module, optim: torch.optim.Optimizer, scaler: Any, step: int, s: Settings,
    rank: int, ws: int,
) -> float:
    """One optimizer step; returns the loss averaged over all ranks."""
    x, y = make_batch(step, rank, ws, s.batch, s.seq_len, s.vocab, s.seed)
    device = compute_device(s)
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    for group in optim.param_groups:
        group["lr"] = lr_at(step, s)
    logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, s.vocab), y.reshape(-1))
    scaler.scale(loss).backward()
    scaler.unscale_(optim)
    model.clip_grad_norm_(1.0)  # type: ignore[operator]
    scaler.step(optim)
    scaler.update()
    optim.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / ws


def run_steps(
    model: nn.Module, optim: torch.optim.Optimizer, scaler: Any, first: int, last: int,
    s: Settings,
    out: Printer, tag: str, on_step: Any = None,
) -> dict[int, float]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens = s.batch * s.seq_len * ws
    losses: dict[int, float] = {}
    for step in range(first, last + 1):
        t0 = time.perf_counter()
        losses[step] = train_step(model, optim, scaler, step, s, rank, ws)
        dt = time.perf_counter() - t0
        if not math.isfinite(losses[step]):
            raise FloatingPointError(f"[rank {rank}] loss is {losses[step]} at step {step}")
        out(progress_line(step, s.steps, losses[step], tokens / dt, tag))
        if on_step is not None:
            on_step(step)
    return losses


def memory_report(model: nn.Module, out: Printer) -> None:
    """Each rank's sharded vs. full parameter bytes, from the FSDP units' handles."""
    import fsdp_wrap as fsdp

    units = fsdp.FullyShardedDataParallel.fsdp_modules(model)
    sharded = full = 0
    for unit in units:
        handle = unit._handle
        if handle is None:
            continue
        itemsize = handle.flat_param.element_size()
        sharded += handle.flat_param.numel() * itemsize  # between steps: the local shard
        full += sum(info.numel for info in handle.infos) * itemsize
    mine = {"rank": dist.get_rank(), "sharded": sharded, "full": full, "rss": peak_rss_bytes(),
            "gpu": torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out(f"memory ({len(units)} FSDP units; parameters held between steps vs. unsharded):")
    for r in everyone:
        out(
            f"  rank {r['rank']}: params {fmt_bytes(r['sharded']):>10} sharded / "
            f"{fmt_bytes(r['full']):>10} full ({r['sharded'] / max(r['full'], 1):6.1%})   "
            f"peak RSS {fmt_bytes(r['rss'])}"
            + ("" if r["gpu"] is None else f"   peak GPU {fmt_bytes(r['gpu'])}")
        )


# -------------------------------------------------------------- checkpoint


def save_checkpoint(
    model: nn.Module, optim: torch.optim.Optimizer, scaler: Any, step: int, s: Settings,
    ckpt_dir: str,
) -> None:
    """Full model state dict and optimizer state (rank 0 writes, or one file per rank)."""
    import fsdp_wrap as fsdp

    FSDP = fsdp.FullyShardedDataParallel
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg = fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_cfg = fsdp.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT, cfg, optim_cfg):
        model_sd = model.state_dict()  # collectives: every rank calls both
        full_osd = FSDP.optim_state_dict(model, optim) if s.optim_state == "full" else None
    if rank == 0:
        torch.save(model_sd, os.path.join(ckpt_dir, "model.pt"))
        if full_osd is not None:
            torch.save(full_osd, os.path.join(ckpt_dir, "optim.pt"))
        if scaler.is_enabled():  # fp16: the loss scale, the same on every rank
            torch.save(scaler.state_dict(), os.path.join(ckpt_dir, "scaler.pt"))
        meta = {"step": step, "world_size": ws, "settings": asdict(s)}
        with open(os.path.join(ckpt_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    if s.optim_state == "per-rank":
        # This rank's optimizer state over its own shards, as the optimizer sees it.
        torch.save(optim.state_dict(), os.path.join(ckpt_dir, f"optim_rank{rank}.pt"))
    dist.barrier()


def load_checkpoint(
    model: nn.Module, optim: torch.optim.Optimizer, scaler: Any, s: Settings, ckpt_dir: str
) -> int:
    import fsdp_wrap as fsdp

    FSDP = fsdp.FullyShardedDataParallel
    rank, ws = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(ckpt_dir, "meta.json")) as f:
        meta = json.load(f)
    saved = meta["settings"]
    for key in ("layers", "width", "optim_state", "mixed_precision"):
        if saved[key] != getattr(s, key):
            raise RuntimeError(f"[rank {rank}] checkpoint has {key}={saved[key]!r}, "
                               f"this run has {getattr(s, key)!r}")
    per_rank = s.optim_state == "per-rank"
    for key in ("strategy", "use_orig_params") if per_rank else ():
        if saved[key] != getattr(s, key):
            raise RuntimeError(
                f"[rank {rank}] per-rank optimizer state was saved with {key}={saved[key]!r}, "
                f"this run has {getattr(s, key)!r}"
            )
    if per_rank and meta["world_size"] != ws:
        raise RuntimeError(
            f"[rank {rank}] the checkpoint's optimizer state was saved per rank by "
            f"{meta['world_size']} ranks; it can only be resumed with that many (got {ws})"
        )
    # Every rank reads the full model state dict and keeps its own shard of it.
    model_sd = torch.load(os.path.join(ckpt_dir, "model.pt"), weights_only=True)
    with FSDP.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT):
        model.load_state_dict(model_sd)
        if per_rank:
            osd = torch.load(os.path.join(ckpt_dir, f"optim_rank{rank}.pt"), weights_only=True)
        else:
            # Every rank reads the full optimizer state; each keeps its shard of it.
            full_osd = torch.load(os.path.join(ckpt_dir, "optim.pt"), weights_only=True)
            osd = FSDP.optim_state_dict_to_load(model, optim, full_osd)
    optim.load_state_dict(osd)
    if scaler.is_enabled():
        scaler.load_state_dict(torch.load(os.path.join(ckpt_dir, "scaler.pt"), weights_only=True))
    return int(meta["step"])


# ------------------------------------------------------------------ worker


def run(s: Settings, ckpt_dir: str) -> int:
    """The demo on one rank of an initialised process group; returns the exit code."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    out = Printer(rank, s.quiet)
    n, k = s.steps, s.checkpoint_step

    model, optim, scaler = build(s, init_seed=s.seed)
    n_params = sum(p.numel() for p in TinyGPT(s.vocab, s.seq_len, s.layers, s.width,
                                              s.heads).parameters())
    where = "CPU" if s.device == "cpu" else torch.cuda.get_device_name(compute_device(s))
    out(f"fsdp_wrap demo: {ws} rank(s), {dist.get_backend()} on {where}, {s.strategy}, "
        f"use_orig_params={s.use_orig_params}, mixed precision {s.mixed_precision}", always=True)
    out(f"model: GPT {s.layers} blocks x width {s.width}, {n_params:,} parameters "
        f"(tied embedding/head in the root unit); data: {s.batch}x{s.seq_len} tokens "
        f"per rank per step", always=True)

    def maybe_save(step: int) -> None:
        if step == k:
            save_checkpoint(model, optim, scaler, step, s, ckpt_dir)
            what = (
                "model + optimizer state dicts from rank 0"
                if s.optim_state == "full"
                else f"model state dict from rank 0 + {ws} per-rank optimizer files"
            )
            out(f"checkpoint: saved step {k} to {ckpt_dir} (full {what})")

    t0 = time.perf_counter()
    baseline = run_steps(model, optim, scaler, 1, n, s, out, "train ", on_step=maybe_save)
    train_s = time.perf_counter() - t0
    memory_report(model, out)

    # A fresh model (different init, so only the checkpoint can make it match)
    # and a fresh optimizer, resumed from step k.
    del model, optim, scaler
    model, optim, scaler = build(s, init_seed=s.seed + 1)
    start = load_checkpoint(model, optim, scaler, s, ckpt_dir) + 1
    out(f"resume: fresh model + optimizer loaded step {start - 1}; training {start}..{n}")
    resumed = run_steps(model, optim, scaler, start, n, s, Printer(rank, quiet=True), "resume")

    diffs = {i: abs(resumed[i] - baseline[i]) for i in resumed}
    max_diff = max(diffs.values())
    out("step   uninterrupted   resumed       |diff|")
    for i in resumed:
        out(f"{i:>4}   {baseline[i]:13.6f}   {resumed[i]:13.6f}   {diffs[i]:.2e}")
    first, last = baseline[1], baseline[n]
    tokens = s.batch * s.seq_len * ws * n
    out(f"loss: {first:.4f} (step 1) -> {last:.4f} (step {n}); "
        f"{tokens / train_s:,.0f} tok/s over the first run", always=True)
    ok = max_diff <= RESUME_TOLERANCE and last < first
    if max_diff <= RESUME_TOLERANCE:
        out(f"resume: OK (max |diff| = {max_diff:.2e} over steps {start}..{n})", always=True)
    else:
        out(f"resume: FAILED (max |diff| = {max_diff:.2e} > {RESUME_TOLERANCE:.0e})", always=True)
    if last >= first:
        out("training: FAILED (the loss did not fall)", always=True)
    return 0 if ok else 1


def _init_process(nprocs: int) -> None:
    # torch 2.13 deprecates the c10d names fsdp_wrap calls; that is not the user's concern.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    # --strategy NO_SHARD is a choice made on purpose here; torch's deprecation notice is noise.
    warnings.filterwarnings("ignore", message="The `NO_SHARD` sharding strategy is deprecated")
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(nprocs, 1)))


def _spawned_worker(rank: int, s: Settings, port: int, ckpt_dir: str) -> None:
    """Entry point of a spawned rank: join the group, run, exit with the result."""
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        if any(name == "lo" for _, name in socket.if_nameindex()):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    _init_process(s.nprocs)
    _use_gpu(s, rank)
    dist.init_process_group(
        _backend(s), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=s.nprocs
    )
    try:
        code = run(s, ckpt_dir)
        dist.barrier()  # nobody tears the group down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    exit_now(code)  # no interpreter shutdown racing gloo's threads (see _teardown)


def _backend(s: Settings) -> str:
    """NCCL when every rank has a GPU of its own, else gloo (CPU, or ranks sharing GPUs)."""
    if s.device != "cuda":
        return "gloo"
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", s.nprocs))
    return "gloo" if ranks_here > torch.cuda.device_count() else "nccl"


def _use_gpu(s: Settings, local_rank: int) -> None:
    if s.device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _under_torchrun() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _main_torchrun(s: Settings) -> int:
    """torchrun set up the rendezvous: join it (gloo, or NCCL on GPUs); share one checkpoint dir."""
    _init_process(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    _use_gpu(s, int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(_backend(s))
    made: str | None = None
    try:
        path = [s.checkpoint_dir]
        if dist.get_rank() == 0 and path[0] is None:
            made = path[0] = tempfile.mkdtemp(prefix="fsdp_wrap_demo_")
        # One directory for every rank (it must be on a file system they all see).
        dist.broadcast_object_list(path, src=0)
        if path[0] is not None:
            os.makedirs(path[0], exist_ok=True)
        dist.barrier()
        code = run(s, str(path[0]))
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        return code
    finally:
        dist.destroy_process_group()
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    if _under_torchrun():
        return _main_torchrun(s)
    import torch.multiprocessing as mp

    ckpt_dir = s.checkpoint_dir or tempfile.mkdtemp(prefix="fsdp_wrap_demo_")
    os.makedirs(ckpt_dir, exist_ok=True)
    t0 = time.perf_counter()
    try:
        mp.spawn(_spawned_worker, args=(s, _free_port(), ckpt_dir), nprocs=s.nprocs, join=True)
    except mp.ProcessExitedException as err:
        print(f"demo: FAILED (rank {err.error_index} exited with code {err.exit_code})",
              file=sys.stderr, flush=True)
        return 1
    except mp.ProcessRaisedException as err:
        print(f"demo: FAILED\n{err}", file=sys.stderr, flush=True)
        return 1
    finally:
        if not s.keep_checkpoint:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    if not s.quiet:
        print(f"done in {time.perf_counter() - t0:.1f} s (including start-up of "
              f"{s.nprocs} rank(s))", flush=True)
    return 0


def entry() -> None:
    """``python -m fsdp_wrap`` and ``python -m fsdp_wrap.demo``."""
    code = main()
    if _under_torchrun():
        exit_now(code)  # this process is a rank: leave without finalising (see _teardown)
    sys.exit(code)


if __name__ == "__main__":
    entry()
