"""``fsdp_wrap.plan``: the units and per-rank bytes, against what FSDP really builds.

Every configuration is wrapped for real on the pool's ranks and planned for the
same world size without a process group.  The plan must name the same units
with the same flat, padded and shard sizes and strategies, and after a few
training steps every rank must hold exactly the planned bytes of sharded
parameters, gradients and optimizer state (measured as distinct storages).
Single-process tests cover the meta-device path, warnings, errors and the
table.
"""

from __future__ import annotations

import copy
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap as fw
from fsdp_wrap.planning import _memory
from fsdp_wrap.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from tests.models import Block, FrozenModel, Mlp, TinyTransformer
from tests.test_mixed_precision import BNBlock, BNNet

# ---------------------------------------------------------------------------
# configurations: (model, policy, FSDP kwargs, optimizer)
# ---------------------------------------------------------------------------


class Stack(nn.Module):
    """Blocks of odd sizes plus an untied head: padding on every world size."""

    def __init__(self, n: int = 4, d: int = 13) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.Sequential(*(Block(d, 2 * d + 1) for _ in range(n)))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x).unsqueeze(1))).squeeze(1)


class MixedBlock(Block):
    """A Block whose norm and mixing are a frozen bf16 base, its MLP's up
    weight frozen fp32, the rest trainable fp32 (LoRA-like): three flat
    parameters of different dtypes and ``requires_grad``."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__(d, h)
        self.norm.to(torch.bfloat16).requires_grad_(False)
        self.mix.to(torch.bfloat16).requires_grad_(False)
        self.mlp.up.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = self.mix(self.norm(x.to(torch.bfloat16))).to(x.dtype)
        return x + mix + self.mlp(x.to(self.mlp.up.weight.dtype)).to(x.dtype)


class MixedDtype(nn.Module):
    """MixedBlocks; in the root a frozen fp32 input layer beside a trainable head."""

    def __init__(self, n: int = 2, d: int = 13) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.inp.requires_grad_(False)
        self.blocks = nn.Sequential(*(MixedBlock(d, 2 * d + 1) for _ in range(n)))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x).unsqueeze(1))).squeeze(1)


MODELS: dict[str, Any] = {
    "stack": (Stack, lambda g: torch.randn(3, 5, generator=g)),
    "transformer": (TinyTransformer, lambda g: torch.randint(0, 11, (2, 5), generator=g)),
    "frozen_mixed": (lambda: FrozenModel(mixed=True), lambda g: torch.randn(2, 4, 5, generator=g)),
    "bn": (BNNet, lambda g: torch.randn(4, 5, generator=g)),
    "mixed_dtype": (MixedDtype, lambda g: torch.randn(3, 5, generator=g)),
}


def _policy(name: str) -> Any:
    if name == "blocks":
        return ModuleWrapPolicy({Block})
    if name == "nested":
        return ModuleWrapPolicy({Block, Mlp})
    if name == "transformer_fn":
        import functools

        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    if name == "size":
        import functools

        return functools.partial(size_based_auto_wrap_policy, min_num_params=200)
    if name == "custom":
        # Blocks are units; the first one keeps its parameters after forward.
        def decide(m: nn.Module) -> Any:
            if not isinstance(m, Block):
                return False
            return {"sharding_strategy": fw.ShardingStrategy.SHARD_GRAD_OP} if m.first else True

        return CustomPolicy(decide)
    if name == "bn":
        return ModuleWrapPolicy({BNBlock})
    if name == "none":
        return None
    raise ValueError(name)


def _configs() -> list[dict[str, Any]]:
    out = []

    def add(model: str, policy: str, opt: str = "adam", **kw: Any) -> None:
        out.append(dict(model=model, policy=policy, opt=opt, kw=kw, idx=len(out)))

    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for uop in (False, True):
            add("stack", "blocks", "adam", sharding_strategy=strategy, use_orig_params=uop)
    add("stack", "nested", "sgd-momentum", use_orig_params=True)
    add("stack", "transformer_fn", "sgd")
    add("stack", "size", "adam", sharding_strategy="SHARD_GRAD_OP")
    add("stack", "custom", "adam", use_orig_params=True)
    add("stack", "none", "adam")
    add("transformer", "blocks", "adam", use_orig_params=True)  # tied weights, a buffer
    add("transformer", "blocks", "adam", ignored_modules="blocks.1")
    add("frozen_mixed", "nested", "adam", use_orig_params=True)  # frozen params: no state
    # Units split into frozen and trainable flat parameters (and dtypes): frozen
    # ones hold no gradient or optimizer state (issue 20 item 6).
    add("frozen_mixed", "blocks", "adam")
    add("frozen_mixed", "none", "sgd-momentum", sharding_strategy="SHARD_GRAD_OP")
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        for uop in (False, True):
            add("mixed_dtype", "blocks", "adam", sharding_strategy=strategy, use_orig_params=uop)
    add("mixed_dtype", "blocks", "adam", mixed_precision=dict(param_dtype=torch.bfloat16))
    add("stack", "blocks", "adam", mixed_precision=dict(param_dtype=torch.bfloat16))
    # fp16 gradients next to fp32 parameters: Adam refuses them, SGD takes them.
    add("stack", "blocks", "sgd-momentum", use_orig_params=True,
        mixed_precision=dict(param_dtype=torch.float16, keep_low_precision_grads=True))
    add("bn", "bn", "adam", mixed_precision=dict(param_dtype=torch.bfloat16))  # BN units added
    add("stack", "blocks", "adam", cpu_offload=True, use_orig_params=True)
    return out


def _kwargs(cfg: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    kw = dict(cfg["kw"])
    if "sharding_strategy" in kw:
        kw["sharding_strategy"] = fw.ShardingStrategy[kw["sharding_strategy"]]
    if "mixed_precision" in kw:
        kw["mixed_precision"] = fw.MixedPrecision(**kw["mixed_precision"])
    if kw.pop("cpu_offload", False):
        kw["cpu_offload"] = fw.CPUOffload(offload_params=True)
    if "ignored_modules" in kw:
        kw["ignored_modules"] = [model.get_submodule(kw["ignored_modules"])]
    kw["auto_wrap_policy"] = _policy(cfg["policy"])
    return kw


def _new_model(cfg: dict[str, Any]) -> nn.Module:
    torch.manual_seed(cfg["idx"])
    model = MODELS[cfg["model"]][0]()
    for i, m in enumerate(x for x in model.modules() if isinstance(x, Block)):
        m.first = i == 0  # type: ignore[assignment]
    return model


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind in ("adam", "adamw"):
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9 if kind == "sgd-momentum" else 0.0)


# ---------------------------------------------------------------------------
# measuring what a rank holds
# ---------------------------------------------------------------------------


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: dict[tuple[int, str], int] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device)) if st.nbytes() else (id(st), str(t.device))
        seen[key] = st.nbytes()
    return sum(seen.values())


def held(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Sharded parameters, gradients and optimizer state this rank holds for FSDP's units."""
    handles = [h for u in fw.FullyShardedDataParallel.fsdp_modules(model) for h in u._handles]
    params = [h.flat_param for h in handles] + [i.param for h in handles for i in h.infos]
    managed = set(params)
    state = [v for p, st in opt.state.items() if p in managed for v in st.values()
             if torch.is_tensor(v)]
    return {
        "params": _bytes(p.data for p in params),
        "grads": _bytes(p.grad for p in params),
        "optimizer": _bytes(state),
    }


def _real_units(model: nn.Module) -> dict[str, tuple[Any, ...]]:
    """Per unit, per flat parameter in order: sizes, strategy, dtype, requires_grad."""
    out = {}
    for st in fw.FullyShardedDataParallel.fsdp_modules(model):
        if st._handles:
            out[st._handles[0].unit_fqn] = tuple(
                (h.unpadded_numel, h.padded_numel, h.shard_numel, st.sharding_strategy.name,
                 str(h.orig_dtype), h.flat_param.requires_grad) for h in st._handles)
    return out


def _planned_units(p: fw.Plan) -> dict[str, tuple[Any, ...]]:
    return {u.fqn: tuple((f.layout.unpadded_numel, f.layout.padded_numel, f.layout.shard_numel,
                          f.strategy.name, str(f.dtype), f.requires_grad) for f in u.flats)
            for u in p.units}


# ---------------------------------------------------------------------------
# worker: plan vs real, every config
# ---------------------------------------------------------------------------


def _plan_vs_real(configs: list[dict[str, Any]]) -> list[str]:
    warnings.simplefilter("ignore")
    rank, ws = dist.get_rank(), dist.get_world_size()
    fails: list[str] = []
    for cfg in configs:
        tag = f"[rank {rank}] {cfg['model']}/{cfg['policy']}/{cfg['opt']} {cfg['kw']}"
        model = _new_model(cfg)
        planned = fw.plan(model, ws, optimizer=cfg["opt"], **_kwargs(cfg, model))
        # The plan leaves the model untouched: it can still be wrapped for real.
        real = fw.FullyShardedDataParallel(model, **_kwargs(cfg, model))
        opt = _optimizer(cfg["opt"], real.parameters())
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):
            opt.zero_grad()
            real(MODELS[cfg["model"]][1](gen)).float().pow(2).mean().backward()
            opt.step()
        want, got = _planned_units(planned), _real_units(real)
        if want != got:
            fails.append(f"{tag}: units planned {want} vs built {got}")
            continue
        m = planned.per_rank[rank] if len(planned.per_rank) > 1 else planned.per_rank[0]
        planned_bytes = {
            "params": m.params_device + m.params_cpu,
            "grads": m.grads_device + m.grads_cpu,
            "optimizer": m.optimizer_device + m.optimizer_cpu,
        }
        measured = held(real, opt)
        if planned_bytes != measured:
            fails.append(f"{tag}: bytes planned {planned_bytes} vs held {measured}")
    return fails


@pytest.mark.parametrize("ws", [2, 3])
def test_plan_matches_what_fsdp_builds_and_holds(request: pytest.FixtureRequest, ws: int) -> None:
    configs = _configs()
    fails = [f for r in request.getfixturevalue(f"pool{ws}").run(_plan_vs_real, configs) for f in r]
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)


def _hybrid_plan_vs_real() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fails = []
    for strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        for uop in (False, True):
            cfg = dict(model="stack", policy="blocks", opt="adam", idx=0,
                       kw=dict(sharding_strategy=strategy, use_orig_params=uop))
            model = _new_model(cfg)
            kw = _kwargs(cfg, model)
            planned = fw.plan(model, 4, shard_group_size=2, **kw)
            real = fw.FullyShardedDataParallel(copy.deepcopy(model), device_mesh=mesh, **kw)
            opt = _optimizer("adam", real.parameters())
            real(torch.randn(3, 5)).pow(2).mean().backward()
            opt.step()
            if _planned_units(planned) != _real_units(real):
                fails.append(f"{strategy} uop={uop}: {_planned_units(planned)} vs "
                             f"{_real_units(real)}")
                continue
            m = planned.per_rank[mesh.get_local_rank("shard")] if uop else planned.per_rank[0]
            got = held(real, opt)
            want = {"params": m.params_device, "grads": m.grads_device,
                    "optimizer": m.optimizer_device + m.optimizer_cpu}
            if got != want:
                fails.append(f"[rank {dist.get_rank()}] {strategy} uop={uop}: {want} vs {got}")
    return fails


def test_plan_hybrid_shard_group(pool4: Any) -> None:
    fails = [f for r in pool4.run(_hybrid_plan_vs_real) for f in r]
    assert not fails, "\n".join(fails)


# ---------------------------------------------------------------------------
# single process: meta models, warnings, errors, output
# ---------------------------------------------------------------------------


def test_meta_model_is_planned_without_allocating_or_changing_it() -> None:
    with torch.device("meta"):
        model = Stack(n=6, d=64)
    before = [(n, type(m)) for n, m in model.named_modules()]
    p = fw.plan(model, 8, auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert [(n, type(m)) for n, m in model.named_modules()] == before
    assert all(t.is_meta for t in model.parameters())
    assert [u.fqn for u in p.units] == [""] + [f"blocks.{i}" for i in range(6)]
    total = sum(t.numel() for t in model.parameters())
    assert p.total_params == total
    # FULL_SHARD over 8 ranks: each rank holds an eighth (rounded up) of every unit.
    block = p.units[1]
    assert block.layout.shard_numel == -(-block.numel // 8)
    assert p.memory.params_device == sum(u.layout.shard_numel * 4 for u in p.units)
    assert p.memory.optimizer_device == 2 * p.memory.params_device  # Adam, fp32
    assert p.memory.optimizer_cpu == 4 * len(p.units)  # one step counter per flat param


def test_unsharded_peaks_follow_the_strategy() -> None:
    with torch.device("meta"):
        model = Stack(n=6, d=64)
    # Each unit reduced alone (cap 0): at the default cap these small units'
    # gradients all wait in one bucket, whose peak at the end of backward
    # would hide the prefetch's (test_bucket_cap_is_resolved_as_the_constructor_does).
    policy = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), bucket_cap_mb=0)
    full = fw.plan(model, 4, **policy).memory
    zero2 = fw.plan(model, 4, **policy,
                    sharding_strategy=fw.ShardingStrategy.SHARD_GRAD_OP).memory
    prefetch_none = fw.plan(model, 4, **policy, backward_prefetch=None).memory
    bf16 = fw.plan(model, 4, **policy,
                   mixed_precision=fw.MixedPrecision(param_dtype=torch.bfloat16)).memory
    offload = fw.plan(model, 4, **policy, cpu_offload=fw.CPUOffload(True)).memory
    # SHARD_GRAD_OP keeps every unit gathered from its forward to its backward.
    assert zero2.unsharded_forward > 5 * full.unsharded_forward / 2
    assert prefetch_none.unsharded_backward < full.unsharded_backward
    assert bf16.unsharded_peak < full.unsharded_peak
    assert offload.params_device == offload.grads_device == offload.optimizer_device == 0
    assert offload.params_cpu == full.params_device and offload.unsharded_peak > 0


def test_bucket_cap_is_resolved_as_the_constructor_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The argument, else ``$FSDP_WRAP_BUCKET_CAP_MB``, else 1 MiB; a cap that
    holds every unit's gradient adds about one unsharded gradient of the model
    (the open bucket, then its buffer) to the backward peak; cap 0 adds none."""
    with torch.device("meta"):
        model = Stack(n=6, d=64)  # 6 units of ~66 KB: all fit one 1 MiB bucket
    kw = dict(auto_wrap_policy=ModuleWrapPolicy({Block}))
    monkeypatch.delenv("FSDP_WRAP_BUCKET_CAP_MB", raising=False)
    default, one = fw.plan(model, 4, **kw), fw.plan(model, 4, **kw, bucket_cap_mb=1)
    assert default.settings["bucket_cap_mb"] == 1.0 and default.memory == one.memory
    monkeypatch.setenv("FSDP_WRAP_BUCKET_CAP_MB", "0")
    env_off = fw.plan(model, 4, **kw)
    assert env_off.settings["bucket_cap_mb"] == 0.0
    assert fw.plan(model, 4, **kw, bucket_cap_mb=1).memory == one.memory  # the argument wins
    # One bucket takes every unit's gradient; the backward peak is its copy at
    # the end of backward: every unsharded fp32 gradient and the padded buffer.
    grads = sum(u.layout.unpadded_numel for u in default.units) * 4
    buffer = sum(u.layout.padded_numel for u in default.units) * 4
    assert default.memory.unsharded_backward == grads + buffer
    assert env_off.memory.unsharded_backward < grads
    with pytest.raises(ValueError, match="FSDP_WRAP_BUCKET_CAP_MB must be a number"):
        monkeypatch.setenv("FSDP_WRAP_BUCKET_CAP_MB", "lots")
        fw.plan(model, 4, **kw)


def test_warnings_a_person_can_act_on() -> None:
    with torch.device("meta"):
        model = Stack(n=8, d=16)
    nothing = fw.plan(model, 8)
    assert any("one unit holds every parameter" in w for w in nothing.warnings)
    single = fw.plan(model, 1, auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert any("nothing is sharded" in w for w in single.warnings)
    small = fw.plan(model, 8, auto_wrap_policy=ModuleWrapPolicy({Block, nn.Linear}))
    assert any("smaller than 1 MiB" in w for w in small.warnings)
    with torch.device("meta"):
        lopsided = nn.Sequential(nn.Linear(512, 512), nn.Linear(8, 8), nn.Linear(8, 8))
    big = fw.plan(lopsided, 8, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    assert any("more than all other units together" in w for w in big.warnings)
    with torch.device("meta"):
        root_heavy = Stack(n=2, d=8)
        root_heavy.head = nn.Linear(8, 4096)
    assert any("root unit holds" in w for w in
               fw.plan(root_heavy, 8, auto_wrap_policy=ModuleWrapPolicy({Block})).warnings)
    good = fw.plan(Stack(n=4, d=512), 8, auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert good.warnings == ()


def test_errors_name_the_problem() -> None:
    with torch.device("meta"):
        model = Stack()
    with pytest.raises(ValueError, match="not a multiple of the shard group size 3"):
        fw.plan(model, 8, sharding_strategy=fw.ShardingStrategy.HYBRID_SHARD, shard_group_size=3,
                auto_wrap_policy=ModuleWrapPolicy({Block}))
    with pytest.raises(ValueError, match="optimizer must be one of"):
        fw.plan(model, 8, optimizer="lion")
    with torch.device("meta"):
        quant = Stack().to(torch.bfloat16)
    quant.blocks[0].mix.weight.bnb_quantized = True  # packed 4-bit values in bf16 storage
    quant.blocks[0].mix.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"would cast the quantized weight 'mix.weight'.*"
                       r"planned FSDP unit 'blocks.0'.*bnb_4bit_quant_storage"):
        fw.plan(quant, 8, auto_wrap_policy=ModuleWrapPolicy({Block}),
                mixed_precision=fw.MixedPrecision(param_dtype=torch.float32))


class Adapted(nn.Module):
    """One unit by hand: a frozen bf16 base (24 elements) beside fp32 adapters (8 + 12)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 6, bias=False).to(torch.bfloat16).requires_grad_(False)
        self.a = nn.Linear(4, 2, bias=False)
        self.b = nn.Linear(2, 6, bias=False)


def test_split_unit_bytes_by_hand() -> None:
    """Trainable fp32 [a, b] first (20 elements), frozen bf16 [base] (24) second;
    3 ranks, Adam.  Every number below is worked out from those sizes."""
    with torch.device("meta"):
        model = Adapted()
    p = fw.plan(model, 3)
    (unit,) = p.units
    train, frozen = unit.flats
    assert (train.dtype, train.requires_grad, [e.fqn for e in train.params]) == (
        torch.float32, True, ["a.weight", "b.weight"])
    assert (frozen.dtype, frozen.requires_grad, [e.fqn for e in frozen.params]) == (
        torch.bfloat16, False, ["base.weight"])
    assert (train.layout.shard_numel, train.layout.padded_numel) == (7, 21)  # ceil(20 / 3)
    assert (frozen.layout.shard_numel, frozen.layout.padded_numel) == (8, 24)
    m = p.memory
    assert m.params_device == 7 * 4 + 8 * 2  # each shard in its own dtype
    assert m.grads_device == 7 * 4  # the frozen flat parameter has no gradient
    assert (m.optimizer_device, m.optimizer_cpu) == (2 * 7 * 4, 4)  # one flat param's state
    assert _memory.gathered_bytes(unit) == 21 * 4 + 24 * 2
    assert _memory.gradient_stages(unit)[:2] == (20 * 4, 2 * 20 * 4)  # trainable only
    assert unit.shard_bytes == 44 and unit.unsharded_bytes == 21 * 4 + 24 * 2
    assert p.to_dict()["units"][0]["dtype"] == "float32+bfloat16"

    # use_orig_params: fp32 parameters start on 4-element boundaries (a at 0,
    # b at 8), the total padded to 21; the optimizer sees each rank's pieces.
    p = fw.plan(model, 3, use_orig_params=True)
    assert [r.optimizer_device for r in p.per_rank] == [2 * 7 * 4, 2 * 7 * 4, 2 * 6 * 4]
    assert [r.optimizer_cpu for r in p.per_rank] == [4, 8, 4]  # rank 1 holds a piece of each
    assert {r.grads_device for r in p.per_rank} == {7 * 4}

    # bf16 compute: the adapters' gather is cast (source 7 * 2 bytes), the
    # bf16 base is gathered as it is; gradients reduce in bf16.
    bf16 = fw.MixedPrecision(param_dtype=torch.bfloat16)
    (unit,) = fw.plan(model, 3, mixed_precision=bf16).units
    assert _memory.gathered_bytes(unit) == 21 * 2 + 24 * 2
    assert _memory.gather_source_bytes(unit) == 7 * 2
    # NO_SHARD: only the cast adapters need a copy; the base computes on itself.
    (unit,) = fw.plan(model, 3, mixed_precision=bf16,
                      sharding_strategy=fw.ShardingStrategy.NO_SHARD).units
    assert _memory.gathered_bytes(unit) == 20 * 2


def test_frozen_weights_count_no_gradient_or_optimizer_state() -> None:
    """Freezing a block removes exactly its shard from gradients and optimizer state."""
    with torch.device("meta"):
        model = Stack(n=3, d=16)
    kw: dict[str, Any] = dict(auto_wrap_policy=ModuleWrapPolicy({Block}))
    full = fw.plan(model, 4, **kw)
    model.blocks[1].requires_grad_(False)
    part = fw.plan(model, 4, **kw)
    shard = part.units[2].layout.shard_numel * 4
    assert not part.units[2].trainable and part.units[2].fqn == "blocks.1"
    assert part.memory.params_device == full.memory.params_device
    assert full.memory.grads_device - part.memory.grads_device == shard
    assert full.memory.optimizer_device - part.memory.optimizer_device == 2 * shard
    # The MLP of a block frozen: one unit, two flat parameters; only the
    # trainable one's shard has a gradient and optimizer state.
    model.blocks[1].requires_grad_(True)
    model.blocks[1].mlp.requires_grad_(False)
    half = fw.plan(model, 4, **kw)
    unit = half.units[2]
    assert [f.requires_grad for f in unit.flats] == [True, False]
    assert unit.flats[1].numel == sum(t.numel() for t in model.blocks[1].mlp.parameters())
    trainable_shard = unit.flats[0].layout.shard_numel * 4
    assert full.memory.grads_device - half.memory.grads_device == shard - trainable_shard
    assert full.memory.optimizer_device - half.memory.optimizer_device == 2 * (
        shard - trainable_shard)


def test_quantized_storage_is_sharded_packed_and_its_state_counted() -> None:
    """A 4-bit weight (bitsandbytes' Params4bit shape: packed values in bf16
    storage, the state on the Parameter) without importing bitsandbytes: the
    flat parameter shards the packed storage; the state's tensors are held
    whole; the forward dequantizes the weight to its logical size."""
    import types

    model = Adapted()
    packed = nn.Parameter(torch.zeros(6, 1, dtype=torch.bfloat16), requires_grad=False)
    packed.quant_state = types.SimpleNamespace(  # type: ignore[attr-defined]
        shape=torch.Size([6, 4]), absmax=torch.zeros(1), code=torch.zeros(16),
        dtype=torch.bfloat16, state2=None)
    packed.bnb_quantized = True  # type: ignore[attr-defined]
    model.base.weight = packed
    p = fw.plan(model, 3)
    (unit,) = p.units
    frozen = unit.flats[1]
    assert frozen.layout.unpadded_numel == 6 and frozen.quantized_numels == (24,)
    assert p.memory.quant_state_device == frozen.quant_state_bytes == 4 + 16 * 4
    assert p.memory.params_device == 7 * 4 + 2 * 2
    assert _memory.dequantized_bytes(unit) == 24 * 2
    assert p.memory.peak_device == (p.memory.params_device + p.memory.optimizer_device
                                    + p.memory.quant_state_device + p.memory.step_device)
    assert "4-bit quantization states" in str(p)


def test_table_and_json() -> None:
    import json

    with torch.device("meta"):
        model = Stack(n=5, d=64)
    p = fw.plan(model, 16, auto_wrap_policy=ModuleWrapPolicy({Block}), optimizer="sgd")
    text = str(p)
    assert "blocks.0 .. blocks.4 (5 units)" in text and "<root>" in text
    assert "optimizer state" in text and "peak, without activations" in text
    data = json.loads(json.dumps(p.to_dict()))
    assert [u["fqn"] for u in data["units"]] == [u.fqn for u in p.units]
    assert data["memory"]["optimizer_device"] == 0
    assert data["memory"]["peak_device"] == p.memory.peak_device
    assert set(_memory.OPTIMIZERS) >= {"adam", "adamw", "sgd", "sgd-momentum", "none"}


def test_torch_enums_and_configs_are_accepted() -> None:
    import torch.distributed.fsdp as tfsdp

    with torch.device("meta"):
        model = Stack()
    ours = fw.plan(model, 4, auto_wrap_policy=ModuleWrapPolicy({Block}),
                   sharding_strategy=fw.ShardingStrategy.SHARD_GRAD_OP,
                   mixed_precision=fw.MixedPrecision(param_dtype=torch.bfloat16))
    theirs = fw.plan(model, 4, auto_wrap_policy=ModuleWrapPolicy({Block}),
                     sharding_strategy=tfsdp.ShardingStrategy.SHARD_GRAD_OP,
                     mixed_precision=tfsdp.MixedPrecision(param_dtype=torch.bfloat16))
    assert ours.memory == theirs.memory and ours.units == theirs.units


# ---------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------


def make_stack(n: int = 4, d: int = 64) -> nn.Module:
    """A factory for ``fsdp-wrap plan tests.test_plan:make_stack``."""
    return Stack(n=n, d=d)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    from fsdp_wrap.cli import main

    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_cli_table_json_and_compare(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    out = _cli(capsys, "tests.test_plan:make_stack", "--factory-kwargs", '{"n": 3}',
               "--world-size", "8", "--policy", "transformer:Block")
    assert "blocks.0 .. blocks.2 (3 units)" in out and "peak, without activations" in out
    data = json.loads(_cli(capsys, "tests.test_plan:make_stack", "--world-size", "4",
                           "--policy", "transformer:Block", "--mixed-precision", "bf16",
                           "--offload", "--json"))
    want = fw.plan(make_stack(), 4, auto_wrap_policy=ModuleWrapPolicy({Block}),
                   mixed_precision=fw.MixedPrecision(param_dtype=torch.bfloat16),
                   cpu_offload=fw.CPUOffload(True))
    assert data == json.loads(json.dumps(want.to_dict()))
    out = _cli(capsys, "tests.test_plan:make_stack", "--world-size", "8", "--policy",
               "size:1000", "--compare", "--gpu-memory", "0.0001")
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        assert out.count(strategy) == 4  # offload x precision
    assert "fits" in out and " no" in out


def test_cli_hf_config_and_auto_policy(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    import json

    cfg = json.dumps({"model_type": "gpt2", "n_layer": 3, "n_embd": 64, "n_head": 4,
                      "vocab_size": 1000, "n_positions": 32})
    data = json.loads(_cli(capsys, "--hf-config", cfg, "--world-size", "4", "--json"))
    # auto: transformers' _no_split_modules (GPT2Block) become the units.
    assert [u["fqn"] for u in data["units"]] == ["", "transformer.h.0", "transformer.h.1",
                                                 "transformer.h.2"]
    assert data["units"][1]["module"] == "GPT2Block"


def test_cli_llama_7b_config_plans_on_the_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    """A 7B-class model is planned without allocating it (the docs' worked example)."""
    pytest.importorskip("transformers")
    import json

    cfg = json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                      "num_hidden_layers": 32, "num_attention_heads": 32,
                      "num_key_value_heads": 32, "vocab_size": 32000})
    data = json.loads(_cli(capsys, "--hf-config", cfg, "--world-size", "64", "--json",
                           "--mixed-precision", "bf16"))
    assert data["total_params"] == 6_738_415_616
    assert len(data["units"]) == 33
    # Parameters fp32, sharded over 64 ranks; Adam: two states of the same size.
    assert data["memory"]["params_device"] == sum(u["shard_bytes"] for u in data["units"])
    assert data["memory"]["optimizer_device"] == 2 * data["memory"]["params_device"]


def test_cli_peft_lora(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--peft lora:...``: the adapters are the only trainable parameters; the
    plan equals ``fw.plan`` of the same PEFT model built by hand; a bad spec is a
    usage error before anything is built; without peft the error names the extra."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import json

    from fsdp_wrap.cli import main

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    data = json.loads(_cli(capsys, "--hf-config", json.dumps(cfg), "--world-size", "2",
                           "--json", "--peft", "lora:r=4,targets=q_proj,v_proj,alpha=8"))
    # Per layer: q_proj and v_proj (64 -> 64) each get A (4 x 64) and B (64 x 4).
    assert [u["trainable_params"] for u in data["units"]] == [0, 2 * 2 * 4 * 64, 2 * 2 * 4 * 64]
    assert [[f["requires_grad"] for f in u["flat_params"]] for u in data["units"]] == [
        [False], [True, False], [True, False]]
    layer = data["units"][1]["flat_params"][0]
    assert data["memory"]["grads_device"] == 2 * layer["shard_numel"] * 4
    assert data["memory"]["optimizer_device"] == 2 * data["memory"]["grads_device"]
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                                 target_modules=["q_proj", "v_proj"]))
    want = fw.plan(model, 2, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    assert data == json.loads(json.dumps(want.to_dict()))

    for spec, text in (("lora:r=0", "r must be at least 1"), ("ia3:r=4", "supports lora"),
                       ("lora:r=4,bogus=1", "unknown key 'bogus'"),
                       ("lora:q_proj", "is not KEY=VALUE"), ("lora:r=four", "is not int")):
        assert main(["plan", "tests.test_plan:no_such_factory", "--world-size", "2",
                     "--peft", spec]) == 2, spec  # before the factory is looked up
        assert text in capsys.readouterr().err, spec
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    assert main(["plan", "tests.test_plan:make_stack", "--world-size", "2",
                 "--peft", "lora:r=4,targets=mix"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'fsdp_wrap[finetune]'" in err and err.count("\n") == 1, err


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Usage errors exit 2, failures 1, each one line on stderr (tests/test_cli.py: the rest)."""
    from fsdp_wrap.cli import main

    cases = [
        (1, "no module class named", ["tests.test_plan:make_stack", "--policy", "transformer:Nope"]),
        (2, "either MODULE:FACTORY or --hf-config", []),
        (2, "unknown --policy", ["tests.test_plan:make_stack", "--policy", "bogus"]),
        (1, "cannot import 'no_such_module_here'", ["no_such_module_here:build"]),
        (2, "expected MODULE:FACTORY", ["tests.test_plan"]),
    ]
    for code, text, argv in cases:
        assert main(["plan", "--world-size", "2", *argv]) == code, argv
        err = capsys.readouterr().err
        assert text in err and "Traceback" not in err and err.count("\n") == 1, err


def test_plan_refuses_what_the_constructor_refuses_without_a_policy() -> None:
    """The handle's own checks run for every planned unit, not only the wrap pass's."""
    with torch.device("meta"):
        scalar = Stack()
        scalar.register_parameter("gain", nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(ValueError, match="doesn't support scalar parameters. Change gain"):
        fw.plan(scalar, 2)
