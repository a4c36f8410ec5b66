"""Environment variables torch's FSDP1 reads, against torch as the oracle (2 ranks).

* ``FSDP_USE_FULL_PREC_IN_EVAL=1``: in ``eval()`` mixed precision is skipped:
  parameters are gathered in full precision, inputs are not cast, buffers are
  back in their original dtype (and cast to ``buffer_dtype`` again once the
  model trains).  Without it, eval computes in low precision as in training.
* ``FSDP_USE_UNSAFE_SETATTR``: by default, swapping parameter views goes
  through a module's own ``__setattr__``/``__delattr__`` override; with ``=1``
  the override is bypassed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

from tests.models import fsdp_api, fsdp_cls, fsdp_kwargs, wrap_api


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# ---------------------------------------------------------------------------
# FSDP_USE_FULL_PREC_IN_EVAL
# ---------------------------------------------------------------------------


class Scaled(nn.Module):
    """Two Linear units and a float buffer used by the (root) forward."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x))) * self.scale


def _eval_run(impl: str, flag: str | None, strategy: str, uop: bool) -> dict[str, Any]:
    api = fsdp_api(impl)
    mp = api.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
    )
    torch.manual_seed(0)
    base = Scaled()
    with _env("FSDP_USE_FULL_PREC_IN_EVAL", flag):
        model = fsdp_cls(impl)(
            base, mixed_precision=mp, auto_wrap_policy=wrap_api(impl).ModuleWrapPolicy({nn.Linear}),
            **fsdp_kwargs(impl, sharding_strategy=strategy, use_orig_params=uop),
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    x = torch.randn(3, 8, generator=gen)
    out: dict[str, Any] = {}
    model(x).sum().backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        y = model(x)
    out["eval_out"] = y
    out["eval_buffer_dtype"] = model.scale.dtype
    model.train()
    y_train = model(x)
    out["train_out_dtype"] = y_train.dtype
    out["train_buffer_dtype"] = model.scale.dtype
    y_train.sum().backward()
    return out


CONFIGS = [("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", False)]


def _full_prec_in_eval(strategy: str, uop: bool) -> dict[str, dict[str, Any]]:
    return {
        f"{impl}-{flag}": _eval_run(impl, flag, strategy, uop)
        for impl in ("torch", "ours") for flag in (None, "1")
    }


@pytest.mark.parametrize("strategy,uop", CONFIGS)
def test_full_precision_in_eval_matches_torch(pool2: Any, strategy: str, uop: bool) -> None:
    for res in pool2.run(_full_prec_in_eval, strategy, uop):
        for flag, dtype in ((None, torch.bfloat16), ("1", torch.float32)):
            ref, ours = res[f"torch-{flag}"], res[f"ours-{flag}"]
            assert ref["eval_out"].dtype == dtype, (flag, ref["eval_out"].dtype)
            assert ours["eval_out"].dtype == dtype, (flag, ours["eval_out"].dtype)
            assert ours["eval_buffer_dtype"] == ref["eval_buffer_dtype"] == dtype, (flag, ours)
            # Same computation as torch: exact match in either precision.
            torch.testing.assert_close(ours["eval_out"], ref["eval_out"], rtol=0, atol=0)
            # Training again: back to low precision, buffers cast again.
            assert ours["train_out_dtype"] == ref["train_out_dtype"] == torch.bfloat16
            assert ours["train_buffer_dtype"] == ref["train_buffer_dtype"] == torch.bfloat16


# ---------------------------------------------------------------------------
# FSDP_USE_UNSAFE_SETATTR
# ---------------------------------------------------------------------------


class LoggingLinear(nn.Linear):
    """Records every name its own __setattr__/__delattr__ override is called for."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.__dict__.setdefault("_log", []).append(("set", name))
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        self.__dict__.setdefault("_log", []).append(("del", name))
        super().__delattr__(name)


def _setattr_run(impl: str, flag: str | None, uop: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    base = nn.Sequential(LoggingLinear(4, 4), nn.ReLU(), LoggingLinear(4, 2))
    with _env("FSDP_USE_UNSAFE_SETATTR", flag):
        model = fsdp_cls(impl)(
            base, auto_wrap_policy=wrap_api(impl).ModuleWrapPolicy({LoggingLinear}),
            **fsdp_kwargs(impl, use_orig_params=uop),
        )
    layers = [m for m in model.modules() if isinstance(m, LoggingLinear)]
    for m in layers:
        m.__dict__["_log"] = []  # construction is not what is compared
    model(torch.randn(3, 4)).sum().backward()
    seen = sorted({entry for m in layers for entry in m.__dict__["_log"]})
    with fsdp_cls(impl).summon_full_params(model):
        pass
    weight = layers[0].weight
    return {"seen": seen, "weight_shape": tuple(weight.shape)}


def _setattr_all() -> dict[str, Any]:
    return {
        f"{impl}-{flag}-{uop}": _setattr_run(impl, flag, uop)
        for impl in ("torch", "ours") for flag in (None, "1") for uop in (False, True)
    }


def test_setattr_override_called_unless_unsafe(pool2: Any) -> None:
    for res in pool2.run(_setattr_all):
        for uop in (False, True):
            safe_ref, safe = res[f"torch-None-{uop}"], res[f"ours-None-{uop}"]
            unsafe_ref, unsafe = res[f"torch-1-{uop}"], res[f"ours-1-{uop}"]
            # Default: the override sees the swaps of weight and bias (both calls).
            assert ("set", "weight") in safe_ref["seen"] and ("del", "bias") in safe_ref["seen"]
            assert safe["seen"] == safe_ref["seen"], (uop, safe, safe_ref)
            # FSDP_USE_UNSAFE_SETATTR=1: the override is bypassed.
            assert unsafe_ref["seen"] == unsafe["seen"] == [], (uop, unsafe, unsafe_ref)
            assert safe["weight_shape"] == safe_ref["weight_shape"], (uop, safe, safe_ref)
            assert unsafe["weight_shape"] == unsafe_ref["weight_shape"], (uop, unsafe, unsafe_ref)
