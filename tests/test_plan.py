"""``fsdp_wrap.plan``: the units and per-rank bytes, against what FSDP really builds.

Every configuration is wrapped for real on the pool's ranks and planned for the
same world size without a process group.  The plan must name the same units
with the same flat, padded and shard sizes and strategies, and after a few
training steps every rank must hold exactly the planned bytes of sharded
parameters, gradients and optimizer state (measured as distinct storages).
Single-process tests cover the meta-device path, warnings, errors and the
table; the command line is in ``tests/test_plan_cli.py``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap as fw
from fsdp_wrap.planning import _memory
from fsdp_wrap.wrap import (
    ModuleWrapPolicy,
)
from tests._plan_common import (
    MODELS,
    Stack,
    _configs,
    _kwargs,
    _new_model,
    _optimizer,
    _planned_units,
    _real_units,
    held,
)
from tests.models import Block

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
