"""The parts of torch's FSDP1 that frameworks touch, checked directly on 2 ranks.

``tests/test_frameworks.py`` runs the frameworks; these pin the behaviours
they rely on, against torch's FSDP1 where torch has them: the flat
parameter's metadata, a flat parameter upcast after wrapping (Accelerate's
fp32 master weights for a bf16-loaded model), FULL loads of lazily loaded
tensor-likes (Lightning), re-keying by id with flat parameters.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests._sweep import Injection, injected, run_sweep

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(8, 2)).to(dtype)


def _pair(strategy: str, uop: bool, dtype: torch.dtype, **kw: Any) -> tuple[nn.Module, nn.Module]:
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    import fsdp_wrap
    from fsdp_wrap.wrap import ModuleWrapPolicy

    base = _model(dtype)
    theirs = tfsdp.FullyShardedDataParallel(
        copy.deepcopy(base), auto_wrap_policy=TorchPolicy({Block}), device_id=CPU,
        use_orig_params=uop, sharding_strategy=tfsdp.ShardingStrategy[strategy],
        **{k: (tfsdp.MixedPrecision(**v) if k == "mixed_precision" else v) for k, v in kw.items()})
    ours = fsdp_wrap.FullyShardedDataParallel(
        copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=uop,
        sharding_strategy=fsdp_wrap.ShardingStrategy[strategy],
        **{k: (fsdp_wrap.MixedPrecision(**v) if k == "mixed_precision" else v)
           for k, v in kw.items()})
    return theirs, ours


def _units(model: nn.Module) -> list[Any]:
    return [m for m in type(model).fsdp_modules(model) if m._has_params]


def _metadata() -> list[str]:
    warnings.simplefilter("ignore")
    fails = []
    for strategy, uop in itertools.product(("FULL_SHARD", "NO_SHARD"), (False, True)):
        theirs, ours = _pair(strategy, uop, torch.float32)
        for t, o in zip(_units(theirs), _units(ours)):
            tf, of = t._flat_param, o._flat_param
            for attr in ("_fqns", "_shapes", "_numels", "_fsdp_flattened"):
                want, got = getattr(tf, attr), getattr(of, attr)
                if tuple(want) != tuple(got) if isinstance(want, (list, tuple)) else want != got:
                    fails.append(f"{strategy} uop={uop} {attr}: torch {want} ours {got}")
    return fails


def test_flat_parameter_metadata_matches_torch(pool2: Any) -> None:
    for fails in pool2.run(_metadata):
        assert not fails, fails


def _upcast_configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, uop=u)
            for s, u in itertools.product(("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"), (False, True))]


def _upcast_after_wrap(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """bf16 model, bf16 mixed precision, flat parameters upcast to fp32 before
    the first forward (what Accelerate does): trains as torch does."""
    warnings.simplefilter("ignore")
    return run_sweep(configs, _upcast_one, inject=inject)


def _bad(what: str, failed: bool) -> list[str]:
    """``[what]`` if the comparison failed (an injected failure first)."""
    hit = injected(what)
    return [hit] if hit else [what] if failed else []


def _upcast_one(cfg: dict[str, Any]) -> list[str]:
    strategy, uop = cfg["strategy"], cfg["uop"]
    fails = []
    theirs, ours = _pair(strategy, uop, torch.bfloat16,
                         mixed_precision={"param_dtype": torch.bfloat16})
    for model in (theirs, ours):
        for unit in _units(model):
            unit._flat_param.data = unit._flat_param.data.to(torch.float32)
            unit._handle._orig_param_dtype = torch.float32  # torch's FSDP1 needs this too
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    gen = torch.Generator().manual_seed(dist.get_rank())
    for step in range(3):
        x = torch.randn(4, 8, generator=gen, dtype=torch.bfloat16)
        losses = []
        for m, opt in zip((theirs, ours), opts):
            loss = m(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        fails += _bad(f"{strategy} uop={uop} step {step}: torch {losses[0]} ours {losses[1]}",
                      abs(losses[0] - losses[1]) > 1e-5 * max(abs(losses[0]), 1e-6))
    dtypes = {u._flat_param.dtype for u in _units(ours)}
    fails += _bad(f"{strategy} uop={uop}: flat params now {dtypes}", dtypes != {torch.float32})
    fails += _bad(f"{strategy} uop=True: original parameters are not fp32 views",
                  uop and {p.dtype for p in ours.parameters()} != {torch.float32})
    sd = ours.state_dict()  # FULL: the fp32 masters, full shapes
    fails += _bad(f"{strategy} uop={uop}: state dict dtypes {({v.dtype for v in sd.values()})}",
                  {v.dtype for v in sd.values()} != {torch.float32})
    return fails


def test_flat_parameter_upcast_after_wrap_trains_like_torch(pool2: Any) -> None:
    for fails in pool2.run(_upcast_after_wrap, _upcast_configs()):
        assert not fails, fails


class _Lazy:
    """A tensor-like materialised on first use, like Lightning's lazy checkpoint tensors."""

    loads = 0

    def __init__(self, value: torch.Tensor) -> None:
        self._value = value

    @property
    def shape(self) -> torch.Size:
        return self._value.shape

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.loads += 1
        args = [a._value if isinstance(a, _Lazy) else a for a in args]
        return func(*args, **(kwargs or {}))


def _lazy_configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, uop=u) for s, u in itertools.product(("FULL_SHARD", "NO_SHARD"), (False, True))]


def _full_load_tensor_likes(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    return run_sweep(configs, _lazy_one, inject=inject)


def _lazy_one(cfg: dict[str, Any]) -> list[str]:
    import fsdp_wrap

    strategy, uop = cfg["strategy"], cfg["uop"]
    _, ours = _pair(strategy, uop, torch.float32)
    target = _model()
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(-2.0)
    want = target.state_dict()
    _Lazy.loads = 0
    result = ours.load_state_dict({k: _Lazy(v) for k, v in want.items()})
    fails = _bad(f"{strategy} uop={uop}: {result}",
                 bool(list(result.missing_keys) or list(result.unexpected_keys)))
    fails += _bad(f"{strategy} uop={uop}: only {_Lazy.loads} of {len(want)} values loaded",
                  _Lazy.loads < len(want))
    with fsdp_wrap.FullyShardedDataParallel.summon_full_params(ours):
        got = dict(ours.named_parameters())
        bad = [k for k, v in want.items() if not torch.equal(got[k], v)]
    fails += _bad(f"{strategy} uop={uop}: wrong values for {bad}", bool(bad))
    return fails


def test_full_load_accepts_lazily_loaded_tensor_likes(pool2: Any) -> None:
    for fails in pool2.run(_full_load_tensor_likes, _lazy_configs()):
        assert not fails, fails


def _rekey_by_id() -> list[str]:
    import fsdp_wrap
    from fsdp_wrap import OptimStateKeyType, StateDictType

    warnings.simplefilter("ignore")
    out = []
    for uop in (False, True):
        _, ours = _pair("FULL_SHARD", uop, torch.float32)
        opt = torch.optim.Adam(ours.parameters(), lr=1e-2)
        ours(torch.ones(2, 8)).sum().backward()
        opt.step()
        FSDP = fsdp_wrap.FullyShardedDataParallel
        with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT):
            osd = FSDP.optim_state_dict(ours, opt)
        try:
            keyed = FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, ours)
            out.append(f"uop={uop}: ok {sorted(keyed['state'])}")
        except RuntimeError as e:
            out.append(f"uop={uop}: RuntimeError {e}")
    return out


def test_rekey_by_id_with_flat_parameters(pool2: Any) -> None:
    """torch raises for a flat parameter of several originals; so does fsdp_wrap,
    naming them and the fix; with use_orig_params=True every id maps one name."""
    for rank, (flat, orig) in enumerate(pool2.run(_rekey_by_id)):
        assert flat.startswith(f"uop=False: RuntimeError rank {rank}: "), flat
        assert "holding 2 original parameters (2.weight, 2.bias)" in flat, flat
        assert "use_orig_params=True" in flat
        assert "_fsdp_wrapped_module" not in flat
        assert orig == "uop=True: ok [0, 1, 2, 3, 4, 5, 6, 7]", orig


def _upcast_on_one_rank() -> str:
    warnings.simplefilter("ignore")
    _, ours = _pair("FULL_SHARD", False, torch.bfloat16)
    if dist.get_rank() == 1:
        for unit in _units(ours):
            unit._flat_param.data = unit._flat_param.data.float()
    try:
        ours(torch.ones(2, 8, dtype=torch.bfloat16))
    except Exception as e:  # every rank must get here, none may hang
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_flat_parameter_replaced_on_one_rank_only_fails_everywhere(pool2: Any) -> None:
    for rank, msg in enumerate(pool2.run(_upcast_on_one_rank)):
        assert "torch.bfloat16" in msg and "torch.float32" in msg, (rank, msg)
        assert "_fsdp_wrapped_module" not in msg, msg
