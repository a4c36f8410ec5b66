"""End-to-end demo: train a small GPT with fsdp_wrap, checkpoint, resume, compare.

Run it with ``fsdp-wrap demo`` (``python -m fsdp_wrap demo``; the older
``fsdp-wrap-demo`` and ``python -m fsdp_wrap.demo`` are aliases)::

    fsdp-wrap demo                       # 2 local CPU ranks (gloo), spawned here
    fsdp-wrap demo --nprocs 4 --strategy SHARD_GRAD_OP --use-orig-params
    fsdp-wrap demo --device cuda --mixed-precision bf16   # one rank per GPU (NCCL)
    torchrun --nproc-per-node 2 -m fsdp_wrap demo         # torchrun's process group

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

This package is an application of the library; nothing in ``fsdp_wrap``
imports it.  Its modules, each importing only those listed before it:

* ``settings``: :class:`Settings` (the command line that fills it is
  :mod:`fsdp_wrap.cli.demo`) and output helpers;
* ``model``: the GPT and the synthetic data;
* ``training``: building the wrapped model, the training steps, the memory report;
* ``checkpoint``: saving and loading the checkpoint;
* ``launch``: the demo on one rank (:func:`run`) and the processes that run it
  (:func:`main`).
"""

from fsdp_wrap.demo.checkpoint import load_checkpoint, save_checkpoint
from fsdp_wrap.demo.launch import RESUME_TOLERANCE, main, run
from fsdp_wrap.demo.model import Block, CausalSelfAttention, TinyGPT, make_batch
from fsdp_wrap.demo.settings import (
    MODEL_SIZES,
    STRATEGIES,
    Printer,
    Settings,
    fmt_bytes,
    peak_rss_bytes,
    progress_line,
)
from fsdp_wrap.demo.training import (
    LOW_PRECISION,
    build,
    compute_device,
    lr_at,
    make_scaler,
    memory_report,
    run_steps,
    train_step,
)

__all__ = [
    "LOW_PRECISION",
    "MODEL_SIZES",
    "RESUME_TOLERANCE",
    "STRATEGIES",
    "Block",
    "CausalSelfAttention",
    "Printer",
    "Settings",
    "TinyGPT",
    "build",
    "compute_device",
    "fmt_bytes",
    "load_checkpoint",
    "lr_at",
    "main",
    "make_batch",
    "make_scaler",
    "memory_report",
    "peak_rss_bytes",
    "progress_line",
    "run",
    "run_steps",
    "save_checkpoint",
    "train_step",
]
