"""The demo on one rank (:func:`run`: train, checkpoint, resume, compare) and the
processes that run it: spawned local ranks, or the ranks torchrun started.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from fsdp_wrap.comm.teardown import exit_now
from fsdp_wrap.demo.checkpoint import load_checkpoint, save_checkpoint
from fsdp_wrap.demo.model import TinyGPT
from fsdp_wrap.demo.plot import plot_losses
from fsdp_wrap.demo.settings import Printer, Settings
from fsdp_wrap.demo.training import build, compute_device, memory_report, run_steps

RESUME_TOLERANCE = 1e-5


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
    rates: dict[int, float] = {}
    baseline = run_steps(model, optim, scaler, 1, n, s, out, "train ", on_step=maybe_save,
                         rates=rates)
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
    if rank == 0:
        _plot(s, ckpt_dir, baseline, resumed, rates, out)
    ok = max_diff <= RESUME_TOLERANCE and last < first
    if max_diff <= RESUME_TOLERANCE:
        out(f"resume: OK (max |diff| = {max_diff:.2e} over steps {start}..{n})", always=True)
    else:
        out(f"resume: FAILED (max |diff| = {max_diff:.2e} > {RESUME_TOLERANCE:.0e})", always=True)
    if last >= first:
        out("training: FAILED (the loss did not fall)", always=True)
    return 0 if ok else 1


def _plot(s: Settings, ckpt_dir: str, baseline: dict[int, float], resumed: dict[int, float],
          rates: dict[int, float], out: Printer) -> None:
    """The loss curves and tokens/s as ``loss.png`` next to a kept checkpoint."""
    if not s.keep_checkpoint:
        out("plot: give --checkpoint-dir DIR to keep the checkpoint and DIR/loss.png "
            "(the loss curves and tokens/s)")
        return
    path = os.path.join(ckpt_dir, "loss.png")
    try:
        plot_losses(baseline, resumed, rates, path,
                    f"fsdp_wrap demo: GPT {s.layers}x{s.width}, {s.strategy}, "
                    f"{s.nprocs} rank(s)")
    except ImportError as e:
        out(f"plot: skipped ({e})", always=True)
        return
    out(f"plot: wrote {path}", always=True)


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


def under_torchrun() -> bool:
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


def main(s: Settings) -> int:
    """The demo with settings ``s``: ranks spawned here, or this rank under torchrun.

    Returns the exit code (0: the resumed losses matched).  The command line is
    :mod:`fsdp_wrap.cli.demo`'s.
    """
    if under_torchrun():
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


