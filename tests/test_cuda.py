"""The CUDA path, run for real; every test here skips cleanly without a GPU.

A test machine has one GPU, so two set-ups:

* **NCCL at world size 1** (``get_pool(1, "nccl")``): the real NCCL engine.
  Every sharding strategy becomes NO_SHARD there (torch's FSDP1 and fsdp_wrap
  both switch), so this checks casts, offload, input moves and the scaler
  against torch's FSDP1 on the device.
* **Two ranks on the one GPU over gloo with CUDA tensors** (``pool2``): the
  sharded strategies, with real all-gathers and reduce-scatters of CUDA
  tensors, against torch's FSDP1 on the same group.

The step-by-step sweeps are the CPU suite's own (``tests/test_parity.py``,
``tests/test_mixed_precision.py``) with ``device_id`` set to the GPU; then the
schedule's CUDA-only behaviours: stream ordering while the GPU lags far
behind the CPU, reductions on a stream of their own, bounded unsharded
memory.  ``tests/test_cuda_features.py`` holds the features on the device
(pinned offload, the scaler's inf check, ``sync_module_states`` and
meta-device init, QLoRA with bitsandbytes' CUDA NF4 kernels, the arguments
a machine cannot honour, the quantized-collective codec).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests import _parity_configs, _parity_run
from tests import test_mixed_precision as mixed_precision
from tests._cuda_common import (
    CUDA,
    LagNet,
    _lag_wrap,
    _on_cuda,
    _pool_at,
)
from tests._dist import DistPool
from tests._options_common import (
    Replicated,
    cmp,
    fsdp_params_full,
    loss_of,
    rank_tag,
    replicated_tol,
)

pytestmark = pytest.mark.gpu

# ---------------------------------------------------------------------------
# 1. the CPU suite's parity sweeps, on the GPU
# ---------------------------------------------------------------------------


def _parity_failures(pool: DistPool, configs: list[dict[str, Any]]) -> tuple[list[str], int]:
    results = pool.run(_parity_run._sweep, configs)
    fails = [f for fails, _ in results for _, f in fails]
    ran = min(
        sum(v for k, v in stats.items() if k.startswith("configs:")) for _, stats in results
    )
    return fails, int(ran)


def test_parity_with_torch_two_ranks_gloo_cuda(pool2: DistPool) -> None:
    """FULL_SHARD / SHARD_GRAD_OP / NO_SHARD x use_orig_params x prefetch x no_sync x
    clip x accumulation, with state-dict round trips, on CUDA tensors."""
    configs = _on_cuda(_parity_configs._configs(2))
    fails, ran = _parity_failures(pool2, configs)
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)
    assert ran == len(configs)


def test_parity_with_torch_nccl_world_size_1(nccl1: DistPool) -> None:
    configs = _on_cuda([c for c in _parity_configs._configs(2) if c["model"] in ("transformer", "deep")])
    fails, ran = _parity_failures(nccl1, configs)
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)
    assert ran == len(configs)


@pytest.mark.parametrize("where", ["gloo2", "nccl1"])
def test_mixed_precision_with_torch_on_cuda(request: pytest.FixtureRequest, where: str) -> None:
    """bf16 and fp16 params, reduce and buffer dtypes, keep_low_precision_grads, cast
    inputs, ignored classes: losses, grads, params, buffers and collective dtypes."""
    pool = _pool_at(request, where)
    configs = _on_cuda(mixed_precision._configs())
    results = pool.run(mixed_precision._sweep, configs)
    fails = [f for fails, _ in results for f in fails]
    # Collective dtypes are recorded per call; NCCL at world size 1 still
    # issues torch's all-reduce, which fsdp_wrap skips (nothing to reduce).
    if where == "nccl1":
        fails = [f for f in fails if "collective dtypes" not in f]
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)
    assert all(stats["configs"] == len(configs) for _, stats in results)


# ---------------------------------------------------------------------------
# 2. stream ordering and memory while the GPU lags far behind the CPU
# ---------------------------------------------------------------------------

def _lagged_training_matches_replicated() -> list[str]:
    warnings.simplefilter("ignore")
    fails: list[str] = []
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for uop, bp, fp in ((False, "BACKWARD_PRE", True), (True, "BACKWARD_POST", False)):
            tag = f"{rank_tag()} {strategy} uop={uop} {bp} forward_prefetch={fp}"
            torch.manual_seed(0)
            base = LagNet(64, 6).to(CUDA)
            ours = _lag_wrap("ours", copy.deepcopy(base), sharding_strategy=strategy,
                             use_orig_params=uop, backward_prefetch=bp, forward_prefetch=fp)
            fails += _train_like_replicated(base, ours, tag)
    return fails


def _train_like_replicated(base: nn.Module, ours: nn.Module, tag: str) -> list[str]:
    """Three Adam steps of ``ours`` (wrapping a copy of ``base``) and of a
    replicated ``base``, each rank on its own batches; the first step where a
    loss or a parameter departs beyond the derived bound, if any."""
    ref = Replicated(base)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref.module, ours)]
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    names = [n for n, _ in base.named_parameters()]
    for step in range(3):
        x = torch.randn(8, 64, generator=gen).to(CUDA)
        res = []
        for m, o in zip((ref.module, ours), opts):
            loss = loss_of(m(x))
            loss.backward()
            if m is ref.module:
                ref.sync()
            o.step()
            o.zero_grad()
            full = (list(fsdp_params_full(m).values()) if m is ours
                    else [p.detach().clone() for p in m.parameters()])
            res.append((loss.detach(), full))
        # loss: a mean over the 8 x 64 outputs; matmuls sum 64 terms
        tol = replicated_tol(step, dist.get_world_size(), 8 * 64)
        errs = [cmp("loss", res[0][0], res[1][0], tol)]
        errs += [cmp(f"param {n}", a, b, tol) for n, a, b in zip(names, res[0][1], res[1][1])]
        errs = [e for e in errs if e]
        if errs:
            return [f"{tag} step {step}: " + "; ".join(errs[:4])]
    return []


def test_stream_ordering_with_the_gpu_lagging(pool2: DistPool) -> None:
    """Gathered units are freed, and their memory reused, while the GPU is still
    milliseconds behind; every result must still equal a replicated model's."""
    fails = [f for r in pool2.run(_lagged_training_matches_replicated) for f in r]
    assert not fails, "\n".join(fails)


def _stream_recording_hook(streams: list[int]) -> Any:
    """torch's default hooks (all-reduce for NO_SHARD, reduce-scatter for the
    sharded strategies), recording the stream each call is issued on."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    def hook(state: Any, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
        streams.append(torch.cuda.current_stream().stream_id)
        if output is None:
            default_hooks.allreduce_hook(state, grad)
        else:
            default_hooks.reduce_scatter_hook(state, grad, output)

    return hook


def _reductions_on_their_own_stream() -> list[str]:
    """Every reduction (a communication hook here, so that NCCL at world size 1
    reduces too) runs off the compute stream, and the results, with the GPU
    lagging, still equal a replicated model's (the compute stream waits for
    the reductions before the optimizer reads them; the gradients they read
    are not reused early)."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    warnings.simplefilter("ignore")
    fails: list[str] = []
    compute = torch.cuda.current_stream().stream_id
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        for uop in (False, True):
            tag = f"{rank_tag()} {strategy} uop={uop}"
            torch.manual_seed(0)
            base = LagNet(64, 6).to(CUDA)
            ours = _lag_wrap("ours", copy.deepcopy(base), sharding_strategy=strategy,
                             use_orig_params=uop)
            streams: list[int] = []
            ours.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD),
                                    _stream_recording_hook(streams))
            fails += _train_like_replicated(base, ours, tag)
            if not streams or compute in streams:
                fails.append(f"{tag}: the hook ran on streams {sorted(set(streams))}, the "
                             f"compute stream is {compute}: expected a reduction stream")
    return fails


@pytest.mark.parametrize("where", ["gloo2", "nccl1"])
def test_reductions_on_their_own_stream(request: pytest.FixtureRequest, where: str) -> None:
    pool = _pool_at(request, where)
    fails = [f for r in pool.run(_reductions_on_their_own_stream) for f in r]
    assert not fails, "\n".join(fails)


UNIT_D = 1024  # one unit: 1M params, 4 MiB unsharded in fp32
N_UNITS = 12


def _unsharded_peaks(impl: str, limit_all_gathers: bool, forward_prefetch: bool) -> dict[str, float]:
    """Peak CUDA memory above the sharded state, in units of one unsharded unit."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = _lag_wrap(impl, LagNet(UNIT_D, N_UNITS), sharding_strategy="FULL_SHARD",
                      limit_all_gathers=limit_all_gathers, forward_prefetch=forward_prefetch,
                      backward_prefetch="BACKWARD_PRE")
    unit = UNIT_D * (UNIT_D + 1) * 4
    x = torch.randn(4, UNIT_D, device=CUDA)
    out: dict[str, float] = {}
    for _ in range(2):  # the second step is the steady state (prefetch order known)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = loss_of(model(x))
        torch.cuda.synchronize()
        out["forward"] = (torch.cuda.max_memory_allocated() - base) / unit
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        # The sharded gradients stay after backward (half a unit each here);
        # what is bounded is the transient memory above them.
        grads = torch.cuda.memory_allocated() - base
        out["backward"] = (torch.cuda.max_memory_allocated() - base - grads) / unit
        out["grads"] = grads / unit
    return out


def _memory_bound() -> dict[str, dict[str, float]]:
    res = {}
    for impl in ("ours", "torch"):
        for limit in (True, False):
            for fp in (False, True):
                res[f"{impl} limit_all_gathers={limit} forward_prefetch={fp}"] = _unsharded_peaks(
                    impl, limit, fp
                )
    return res


def test_unsharded_memory_stays_bounded_with_the_gpu_lagging(pool2: DistPool) -> None:
    """12 units, the CPU far ahead of the GPU: at most a few units are ever gathered
    at once (what torch's rate limiter guarantees), never the whole model."""
    for rank, res in enumerate(pool2.run(_memory_bound)):
        print(f"[rank {rank}] peak above the sharded state, in unsharded units "
              f"({N_UNITS} units; backward: above the sharded gradients it leaves):")
        for k, v in res.items():
            print(f"  {k}: forward {v['forward']:.2f}, backward {v['backward']:.2f}, "
                  f"sharded grads {v['grads']:.2f}")
        for k, v in res.items():
            if k.startswith("ours"):
                # Root (kept gathered) + the unit computing + one prefetched.
                assert v["forward"] <= 4.5, (rank, k, v)
                # + a unit's unsharded gradient and its reduce-scatter input.
                assert v["backward"] <= 5.5, (rank, k, v)
                assert v["grads"] <= N_UNITS / 2 + 1, (rank, k, v)
