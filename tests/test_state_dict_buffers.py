"""Buffers in state dicts against torch's FSDP1 (2 ranks).

torch's FSDP1 puts the modules' own buffer tensors into FULL and SHARDED
state dicts (``buf.detach()``: the same storage, no copy); with
``MixedPrecision(buffer_dtype=...)`` it saves every managed buffer as a copy
in its original dtype, while ignored modules' buffers (never cast) stay the
modules' own tensors.  For each state-dict type, strategy, ``use_orig_params``
mode and mixed-precision setting, before and after a forward, the keys,
dtypes, values and whether each buffer shares the module's storage must be
torch's.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests._options_common import cmp, rank_tag, run_configs
from tests._sweep import Injection, injected
from tests.models import fsdp_api, fsdp_kwargs, wrap_api


class Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))
        self.register_buffer("count", torch.arange(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale.to(x.dtype)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.child = Child()
        self.ignored = Child()
        self.register_buffer("shift", torch.linspace(0, 1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(self.inp(x) + self.shift.to(x.dtype)) + self.ignored.scale.sum()


def _build(impl: str, base: nn.Module, cfg: dict[str, Any]) -> nn.Module:
    api = fsdp_api(impl)
    model = copy.deepcopy(base)
    kw: dict[str, Any] = dict(sharding_strategy=cfg["strategy"], use_orig_params=cfg["uop"],
                              ignored_modules=[model.ignored],
                              auto_wrap_policy=wrap_api(impl).ModuleWrapPolicy({Child}))
    if cfg["mp"]:
        kw["mixed_precision"] = api.MixedPrecision(buffer_dtype=torch.float16)
    return api.FullyShardedDataParallel(model, **fsdp_kwargs(impl, **kw))


def _own_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("_fsdp_wrapped_module.", ""): b for n, b in model.named_buffers()}


def _describe(impl: str, model: nn.Module, sd_type: str) -> dict[str, tuple[Any, ...]]:
    api = fsdp_api(impl)
    own = _own_buffers(model)
    with api.FullyShardedDataParallel.state_dict_type(model, api.StateDictType[sd_type]):
        sd = model.state_dict()
    out = {}
    for key, b in own.items():
        v = sd.get(key)
        if v is None:
            out[key] = (None,)
            continue
        shares = v.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        out[key] = (v.dtype, shares, b.dtype, v.detach().clone())
    return out


def _run(cfg: dict[str, Any]) -> list[str]:
    warnings.simplefilter("ignore")
    tag = f"{rank_tag()} {cfg}"
    torch.manual_seed(0)
    base = Model()
    models = {impl: _build(impl, base, cfg) for impl in ("torch", "ours")}
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    fails = []
    for when in ("before forward", "after forward"):
        if when == "after forward":
            for m in models.values():
                m(x).sum().backward()
        got = {i: _describe(i, m, cfg["sd_type"]) for i, m in models.items()}
        # (no collective below: a rank that found a difference skips nothing the others run)
        if e := injected(f"buffers {when}"):
            fails.append(f"{tag} {when}: {e}")
        if got["torch"].keys() != got["ours"].keys():
            fails.append(f"{tag} {when}: buffers {sorted(got['torch'])} vs {sorted(got['ours'])}")
            continue
        for key, ref in got["torch"].items():
            ours = got["ours"][key]
            if ref[:3] != ours[:3]:
                fails.append(f"{tag} {when} {key}: torch (dtype, same storage, module dtype) "
                             f"{ref[:3]} vs ours {ours[:3]}")
            elif len(ref) > 3 and (e := cmp(key, ref[3], ours[3], 0.0)):
                fails.append(f"{tag} {when}: {e}")
    return fails


def _configs() -> list[dict[str, Any]]:
    return [dict(sd_type=t, strategy=s, uop=u, mp=mp)
            for t, s, u, mp in itertools.product(("FULL_STATE_DICT", "SHARDED_STATE_DICT"),
                                                 ("FULL_SHARD", "NO_SHARD"), (False, True),
                                                 (False, True))]


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_configs(configs, _run, inject=inject)


def test_state_dict_buffers_are_the_modules_own_as_in_torch(pool2: Any) -> None:
    fails = [f for r in pool2.run(_sweep, _configs()) for f in r]
    assert not fails, "\n".join(fails[:20])
