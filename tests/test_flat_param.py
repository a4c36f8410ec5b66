"""Flat-parameter arithmetic of ``fsdp_wrap.handle.flat_param``: layout, padding, shards.

Single process: a handle's layout and shard need the group's rank and size,
not the group itself, so both our ``FlatParamHandle`` and torch's are built
with a stand-in group object and compared rank by rank for world sizes 1-4.
The section-6 table of the reference doc is checked as exact numbers, and two
pool runs compare handles built by real FSDP constructors.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp._flat_param import FlatParamHandle as TorchHandle
from torch.distributed.fsdp._flat_param import HandleShardingStrategy

from fsdp_wrap import FlatParameter, ShardingStrategy
from fsdp_wrap.comm.collectives import divide_factors
from fsdp_wrap.handle.config import UnitSettings
from fsdp_wrap.handle.flat_param import PADDING_VALUE, FlatParamHandle
from fsdp_wrap.handle.layout import collect_unit_params
from tests.models import Block, TinyTransformer

CPU = torch.device("cpu")
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


class FakeGroup:
    """What a handle asks of its group at construction: rank() and size()."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def section6_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.LayerNorm(3))


def units() -> dict[str, nn.Module]:
    """Modules flattened as one unit each (no nesting: every param is in the unit)."""
    torch.manual_seed(0)
    m = section6_model()
    return {
        "linear_4_6": m[0],
        "linear_6_3": m[2],
        "layernorm_3": m[3],
        "section6_whole": m,
        "block": Block(),
        "tied_transformer": TinyTransformer(),  # shared emb/head weight: flattened once
        "odd_1d": nn.ParameterList(
            [
                nn.Parameter(torch.randn(5)),
                nn.Parameter(torch.randn(1)),
                nn.Parameter(torch.randn(2, 3)),
                nn.Parameter(torch.randn(7)),
            ]
        ),
        "bigger_than_ws": nn.Linear(1, 1),  # 2 elements, fewer than some world sizes
    }


def ours_handle(module: nn.Module, rank: int, ws: int, strategy: str, uop: bool) -> FlatParamHandle:
    params, shared = collect_unit_params(module, lambda m: False, set())
    config = UnitSettings(
        device=CPU,
        strategy=ShardingStrategy[strategy],
        process_group=FakeGroup(rank, ws),  # type: ignore[arg-type]
        rank=rank,
        world_size=ws,
        use_orig_params=uop,
        divide=divide_factors(ws),
    )
    return FlatParamHandle(module, params, shared, config)


def torch_handle(module: nn.Module, rank: int, ws: int, strategy: str, uop: bool) -> TorchHandle:
    h = TorchHandle(
        list(module.parameters()),
        module,
        CPU,
        HandleShardingStrategy[strategy],
        False,
        None,
        None,
        False,
        FakeGroup(rank, ws),
        uop,  # type: ignore[arg-type]
    )
    h.shard()
    return h


def torch_offsets(fp: Any) -> list[int]:
    """Start of each original parameter in torch's unsharded flat parameter."""
    out, total = [], 0
    for n, pad in zip(fp._numels_with_padding, fp._is_padding_mask):
        if not pad:
            out.append(total)
        total += n
    return out


CASES = [
    (name, ws, rank, s, uop)
    for name in units()
    for ws in (1, 2, 3, 4)
    for rank in range(ws)
    for s, uop in itertools.product(STRATEGIES, (False, True))
]


@pytest.mark.parametrize("name,ws,rank,strategy,uop", CASES)
def test_layout_and_shard_match_torch(
    name: str, ws: int, rank: int, strategy: str, uop: bool
) -> None:
    mod = units()[name]
    ours = ours_handle(copy.deepcopy(mod), rank, ws, strategy, uop)
    ref_mod = copy.deepcopy(mod)
    ref = torch_handle(ref_mod, rank, ws, strategy, uop)
    fp = ref.flat_param
    sharded = strategy != "NO_SHARD"

    assert ours.unpadded_numel == fp._unpadded_unsharded_size.numel()
    assert [i.fqn for i in ours.infos] == list(fp._fqns)
    assert [tuple(i.shape) for i in ours.infos] == [tuple(s) for s in fp._shapes]
    assert [i.numel for i in ours.infos] == list(fp._numels)
    assert [i.offset for i in ours.infos] == torch_offsets(fp)
    assert [s.fqn for s in ours.shared] == [
        info.param_name if not info.module_name else f"{info.module_name}.{info.param_name}"
        for info in fp._shared_param_infos
    ]
    # The local shard: size, right padding, contents (alignment pads hold 42).
    assert ours.flat_param.numel() == ours.shard_numel == fp.numel()
    assert ours.shard_numel - ours.shard_valid_numel == fp._shard_numel_padded
    assert ours.padded_numel == (fp.numel() * ws if sharded else fp.numel())
    torch.testing.assert_close(ours.flat_param.detach(), fp.detach(), rtol=0, atol=0)
    # Each original parameter's piece of this shard.
    for i, info in enumerate(fp._shard_param_infos):
        sl = ours.param_shard_slice(i)
        if not info.in_shard:
            assert sl is None, (i, sl)
        else:
            assert sl == (info.offset_in_shard, info.offset_in_shard + info.numel_in_shard), (
                i,
                sl,
                info,
            )
    # use_orig_params=True: the originals are views with torch's sharded shapes.
    if uop:
        assert [tuple(p.shape) for p in ours.params] == [
            tuple(p.shape) for p in ref_mod.parameters()
        ]
    assert isinstance(ours.flat_param, FlatParameter)
    assert ours.flat_param.requires_grad


SECTION6 = {
    # unit: (numel uop=False, shard per rank uop=False, numel uop=True, shard per rank uop=True)
    "layernorm_3": (6, [3, 3], 8, [4, 4]),
    "linear_4_6": (30, [15, 15], 30, [15, 15]),
    "linear_6_3": (21, [11, 11], 24, [12, 12]),
}


@pytest.mark.parametrize("unit", sorted(SECTION6))
def test_section6_table(unit: str) -> None:
    numel, shards, numel_uop, shards_uop = SECTION6[unit]
    for uop, n, per_rank in ((False, numel, shards), (True, numel_uop, shards_uop)):
        for rank in range(2):
            h = ours_handle(copy.deepcopy(units()[unit]), rank, 2, "FULL_SHARD", uop)
            assert h.unpadded_numel == n
            assert h.flat_param.numel() == per_rank[rank]
            assert h.padded_numel == 2 * per_rank[rank]
    # Linear(6,3), uop=False: rank 1 holds 10 values and 1 zero of padding.
    h = ours_handle(copy.deepcopy(units()["linear_6_3"]), 1, 2, "FULL_SHARD", False)
    assert h.shard_valid_numel == 10 and float(h.flat_param.detach()[10]) == 0.0


def test_section8_sharded_view_shapes() -> None:
    """uop=True views per rank for the section-6 model as one unit (reference section 8)."""
    expected = {  # rank 0, rank 1 shapes of each original param in its own unit
        "linear_4_6": [[(15,), (0,)], [(9,), (6,)]],
        "linear_6_3": [[(12,), (0,)], [(6,), (3,)]],
        "layernorm_3": [[(3,), (0,)], [(0,), (3,)]],
    }
    for unit, per_rank in expected.items():
        for rank, shapes in enumerate(per_rank):
            h = ours_handle(copy.deepcopy(units()[unit]), rank, 2, "FULL_SHARD", True)
            assert [tuple(p.shape) for p in h.params] == shapes, (unit, rank)


def test_alignment_padding_values() -> None:
    """uop=True: each param starts at a multiple of 4 fp32 elements; pads hold 42."""
    ln = units()["layernorm_3"]
    w, b = ln.weight.detach().clone(), ln.bias.detach().clone()
    h = ours_handle(copy.deepcopy(ln), 0, 2, "NO_SHARD", True)  # 7 -> 8: a multiple of 2
    assert [i.offset for i in h.infos] == [0, 4]
    expected = torch.cat([w, torch.tensor([PADDING_VALUE]), b, torch.tensor([PADDING_VALUE])])
    torch.testing.assert_close(h.flat_param.detach(), expected, rtol=0, atol=0)
    # NO_SHARD uop=True keeps the padding (reference: 24 instead of 21 for Linear(6,3)).
    assert (
        ours_handle(copy.deepcopy(units()["linear_6_3"]), 0, 2, "NO_SHARD", True).unpadded_numel
        == 24
    )
    # uop=False: no padding at all.
    h = ours_handle(copy.deepcopy(ln), 0, 1, "NO_SHARD", False)
    torch.testing.assert_close(h.flat_param.detach(), torch.cat([w, b]), rtol=0, atol=0)


def test_world_size_padding_and_empty_ranks() -> None:
    """A 2-element flat param over 4 ranks: chunks of 1, ranks 2-3 hold only padding."""
    lin = units()["bigger_than_ws"]
    vals = torch.cat([lin.weight.detach().reshape(-1), lin.bias.detach()])
    for rank in range(4):
        h = ours_handle(copy.deepcopy(lin), rank, 4, "FULL_SHARD", False)
        assert h.shard_numel == 1
        assert h.shard_valid_numel == (1 if rank < 2 else 0)
        want = vals[rank : rank + 1] if rank < 2 else torch.zeros(1)
        torch.testing.assert_close(h.flat_param.detach(), want, rtol=0, atol=0)
        assert [h.param_shard_slice(i) for i in range(2)] == (
            [(0, 1), None] if rank == 0 else [None, (0, 1)] if rank == 1 else [None, None]
        )


def test_load_shard_takes_the_padded_shard_or_its_valid_part() -> None:
    """``load_shard``: the whole padded shard (a LOCAL_STATE_DICT value) is
    copied as it is; only the valid elements (what a SHARDED load assembles)
    fill the shard's front and leave its end padding as it was.  19 elements over 2
    ranks: rank 1 holds 9 and one padding element."""
    for rank, valid in ((0, 10), (1, 9)):
        h = ours_handle(copy.deepcopy(units()["odd_1d"]), rank, 2, "FULL_SHARD", False)
        assert (h.shard_numel, h.shard_valid_numel) == (10, valid)
        whole = torch.arange(10, dtype=h.local_shard.dtype) + 100
        h.load_shard(whole)
        torch.testing.assert_close(h.local_shard, whole, rtol=0, atol=0)
        part = torch.arange(valid, dtype=h.local_shard.dtype) - 50
        h.load_shard(part)
        torch.testing.assert_close(h.local_shard[:valid], part, rtol=0, atol=0)
        assert torch.equal(h.local_shard[valid:], whole[valid:]), rank


def test_tied_parameter_flattened_once() -> None:
    m = TinyTransformer()
    h = ours_handle(m, 0, 2, "FULL_SHARD", False)
    fqns = [i.fqn for i in h.infos]
    assert "emb.weight" in fqns and "head.weight" not in fqns
    assert [s.fqn for s in h.shared] == ["head.weight"]
    assert h.unpadded_numel == sum(p.numel() for p in TinyTransformer().parameters())


def test_originals_released_and_flat_param_registered() -> None:
    lin = nn.Linear(3, 5)
    h = ours_handle(lin, 0, 2, "FULL_SHARD", False)
    assert [n for n, _ in lin.named_parameters()] == ["_flat_param"]
    assert all(p.numel() == 0 for p in h.params)  # original storage dropped
    lin2 = nn.Linear(3, 5)
    h2 = ours_handle(lin2, 1, 2, "FULL_SHARD", True)
    assert [n for n, _ in lin2.named_parameters()] == ["weight", "bias"]
    # weight 0..14, 1 alignment pad, bias 16..20, 1 world-size pad: 22 -> 11 per rank;
    # rank 1 holds weight[11:15] and the whole bias.
    assert [tuple(p.shape) for p in lin2.parameters()] == [(4,), (5,)]
    assert h2.flat_param.numel() == 11 and h2.padded_numel == 22


def test_divide_factors_match_reference_and_torch() -> None:
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

    _get_gradient_predivide_factor = DefaultState._get_gradient_predivide_factor

    table = {
        1: (1, 1),
        2: (2, 1),
        3: (2, 1.5),
        4: (2, 2),
        6: (4, 1.5),
        8: (4, 2),
        16: (4, 4),
        32: (8, 4),
        64: (8, 8),
        128: (16, 8),
        256: (16, 16),
    }
    for ws, (pre, post) in table.items():
        assert tuple(divide_factors(ws)) == (pre, post), ws
    for ws in range(1, 300):
        pre = _get_gradient_predivide_factor(ws)
        assert tuple(divide_factors(ws)) == (pre, ws / pre), ws


def test_validation_errors_single_process() -> None:
    with pytest.raises(ValueError, match="FSDP doesn't support scalar parameters"):
        ours_handle(nn.ParameterList([nn.Parameter(torch.tensor(1.0))]), 0, 2, "FULL_SHARD", False)
    with pytest.raises(ValueError, match="Cannot flatten integer dtype tensors"):
        ours_handle(
            nn.ParameterList([nn.Parameter(torch.ones(3, dtype=torch.int64), requires_grad=False)]),
            0,
            2,
            "FULL_SHARD",
            False,
        )
    with pytest.raises(
        ValueError,
        match="Must flatten tensors with uniform dtype but got torch.float32 and torch.float64",
    ):
        ours_handle(
            nn.ParameterList(
                [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, dtype=torch.float64))]
            ),
            0,
            2,
            "FULL_SHARD",
            False,
        )
    mixed = nn.Linear(2, 2)
    mixed.bias.requires_grad_(False)
    with pytest.raises(
        ValueError,
        match="Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`",
    ):
        ours_handle(mixed, 0, 2, "FULL_SHARD", False)
    ours_handle(copy.deepcopy(mixed), 0, 2, "FULL_SHARD", True)  # fine with use_orig_params=True


# ---------------------------------------------------------------------------
# real constructors on real groups
# ---------------------------------------------------------------------------


def _real_handles() -> list[tuple[str, bool, str, list[Any], list[Any]]]:
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchMWP

    import fsdp_wrap
    from fsdp_wrap.wrap import ModuleWrapPolicy

    warnings.simplefilter("ignore")
    out = []
    for strategy, uop in itertools.product(STRATEGIES, (False, True)):
        base = section6_model()
        base.register_buffer("buf", torch.arange(3, dtype=torch.float32))
        ref = tfsdp.FullyShardedDataParallel(
            copy.deepcopy(base),
            auto_wrap_policy=TorchMWP({nn.Linear}),
            device_id=CPU,
            use_orig_params=uop,
            sharding_strategy=tfsdp.ShardingStrategy[strategy],
        )
        ours = fsdp_wrap.FullyShardedDataParallel(
            copy.deepcopy(base),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=uop,
            sharding_strategy=fsdp_wrap.ShardingStrategy[strategy],
        )
        t_info, o_info = [], []
        for st in tfsdp.FullyShardedDataParallel.fsdp_modules(ref):
            fp = st._handle.flat_param
            t_info.append(
                (
                    fp.numel(),
                    fp._unpadded_unsharded_size.numel(),
                    fp._shard_numel_padded,
                    [
                        (i.in_shard, i.offset_in_shard, i.numel_in_shard)
                        for i in fp._shard_param_infos
                    ],
                )
            )
        for st in fsdp_wrap.FullyShardedDataParallel.fsdp_modules(ours):
            h = st._handle
            slices = [h.param_shard_slice(i) for i in range(len(h.infos))]
            o_info.append(
                (
                    h.flat_param.numel(),
                    h.unpadded_numel,
                    h.shard_numel - h.shard_valid_numel,
                    [
                        (False, None, None) if s is None else (True, s[0], s[1] - s[0])
                        for s in slices
                    ],
                )
            )
        out.append((strategy, uop, f"rank {dist.get_rank()}", t_info, o_info))
    return out


def _check_real(pool: Any) -> None:
    for rank_result in pool.run(_real_handles):
        for strategy, uop, who, t_info, o_info in rank_result:
            assert o_info == t_info, (strategy, uop, who)


def test_real_handles_match_torch_ws2(pool2: Any) -> None:
    _check_real(pool2)
    # the section-6 table itself, from real constructors (FULL_SHARD)
    res = pool2.run(_real_handles)
    for rank, rank_result in enumerate(res):
        by_cfg = {(s, u): o for s, u, _, _, o in rank_result}
        assert [x[0] for x in by_cfg[("FULL_SHARD", False)]] == [3, 15, 11]
        assert [x[0] for x in by_cfg[("FULL_SHARD", True)]] == [4, 15, 12]
        assert [x[1] for x in by_cfg[("FULL_SHARD", True)]] == [8, 30, 24]
        assert [x[2] for x in by_cfg[("FULL_SHARD", False)]] == (
            [0, 0, 0] if rank == 0 else [0, 0, 1]
        )


def test_real_handles_match_torch_ws3(pool3: Any) -> None:
    _check_real(pool3)
