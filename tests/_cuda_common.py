"""Shared pieces of the CUDA tests (``tests/test_cuda.py``,
``tests/test_cuda_features.py``): the device, the derived tolerances, the
NCCL world-size-1 pool and the choice between it and two gloo ranks on the GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from tests._dist import DistPool, get_pool
from tests._options_common import (
    U32,
    Tol,
    replicated_tol,
)
from tests.models import fsdp_api, fsdp_kwargs, wrap_api

CUDA = "cuda:0"
# Tolerances, derived as the CPU suite's are (tests/_options_common.py), and
# checked on an H100 with torch 2.11 (docs/performance/gpu.rst):
#
# * against torch's FSDP1 where both run the same kernels on the same values
#   in the same order (the fp16 scaler, CPU offload once torch agrees with the
#   replicated model): 0.0;
# * against a replicated model on the GPU (the lagging units): the matmuls
#   read views into a flat parameter where the reference has standalone
#   tensors, so cuBLAS may pick another blocking: replicated_tol with the
#   longest sum of a step (measured bit-exact on the H100);
# * against a replicated model on the GPU while fsdp_wrap offloads (Adam runs
#   on the host): replicated_tol, plus what two devices' Adam kernels may
#   round differently (see _adam_across_devices).  Measured: 1 ulp of the
#   parameter per step (1.5e-8 at |p| ~ 0.2).


def _adam_across_devices(step: int, ws: int, longest: int, lr: float) -> Tol:
    """How far Adam run on the host may land from Adam run on the GPU, on top of
    :func:`replicated_tol`: each step's few elementwise operations (moments,
    square root, division, the update) round independently on each device, the
    GPU fusing multiply-adds where the host may not; at most ~4 roundings of
    values no larger than ``|p|`` plus the update, whose size Adam bounds by
    about ``4 * lr``.  To first order the steps' errors add."""
    base = replicated_tol(step, ws, longest)

    def tol(ref: torch.Tensor) -> float:
        scale = float(ref.detach().float().abs().max()) if ref.numel() else 0.0
        return base(ref) + (step + 1) * 4 * U32 * (scale + 4 * lr)

    return tol


@pytest.fixture(scope="module")
def nccl1() -> DistPool:
    return get_pool(1, "nccl")


def _pool_at(request: pytest.FixtureRequest, where: str) -> DistPool:
    """The pool a ``where``-parametrised test runs in: ``gloo2`` (two ranks on
    the GPU over gloo) or ``nccl1`` (NCCL at world size 1)."""
    return request.getfixturevalue("pool2" if where == "gloo2" else "nccl1")


def _on_cuda(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(c, device=CUDA) for c in configs]


# A model whose backward makes the GPU lag far behind the CPU (stream ordering).

LAG_CYCLES = 2_000_000  # about a millisecond per unit and direction on an H100


class _LagBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(LAG_CYCLES)
        return grad


class LagUnit(nn.Module):
    """A unit whose kernels queue behind a sleep, forward and backward, so the CPU
    issues gathers, frees and reductions long before the GPU reaches them."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(LAG_CYCLES)
        return torch.tanh(self.lin(_LagBackward.apply(x))) + x


class LagNet(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.units = nn.Sequential(*(LagUnit(d) for _ in range(n)))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.units(x))


def _lag_wrap(impl: str, model: nn.Module, **kw: Any) -> nn.Module:
    policy = wrap_api(impl).ModuleWrapPolicy({LagUnit})
    kw.setdefault("device_id", torch.device(CUDA))
    return fsdp_api(impl).FullyShardedDataParallel(model, auto_wrap_policy=policy,
                                                   **fsdp_kwargs(impl, **kw))
