"""The gloo forms of fsdp_wrap's collectives (``fsdp_wrap/comm/collectives.py``).

On gloo with CPU tensors an all-gather over two ranks runs as one exchange of
rows (``isend``/``irecv``), over more a large one as one broadcast per
rank (where the group lies within one node), and
a reduce-scatter over two ranks as one exchange of halves, over more (of a
scratch input) as an in-place all-reduce.  Checked here:
both give exactly what torch's collectives give (2 and 3 ranks, a subgroup,
synchronous and asynchronous, below and above the size where broadcasts take
over, one node or one rank per node as ``LOCAL_WORLD_SIZE`` says), they issue
the c10d ops they claim to, and
training with units larger than that size matches torch's FSDP1 step by step.
"""

from __future__ import annotations

import copy
import itertools
import os
import warnings
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_wrap.comm.collectives as C
from tests._options_common import compare_step, loss_of, rank_tag, run_configs, train_step
from tests._sweep import Injection, injected
from tests.models import fsdp_api, fsdp_kwargs, wrap_api


class _C10dOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            self.ops[func._schema.name.split("::")[-1]] += 1
        return func(*args, **(kwargs or {}))


def _storage_uses(t: torch.Tensor) -> int:
    """How many references hold ``t``'s storage (ours and any collective's)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def _gloo_configs(ws: int) -> list[dict[str, Any]]:
    """Below and above the size where broadcasts take over, sync and async; on 3
    ranks also the subgroup of ranks 0 and 2 (group ranks differ from global ones);
    ``per_node``: the ``LOCAL_WORLD_SIZE`` the ranks see (``None``: unset, one
    node; 1: every rank a node of its own, so every group spans nodes)."""
    big = C.GLOO_BROADCAST_MIN_BYTES // 4  # fp32 elements in the threshold
    groups = ["world"] + (["ranks 0, 2"] if ws == 3 else [])
    return [dict(group=g, numel=numel, async_op=async_op, per_node=per_node)
            for g, numel, async_op, per_node in itertools.product(
                groups, [1000, big, 3 * big + 6], [False, True], [None, 1])]


def _expect(what: str, ok: bool, why: str) -> str | None:
    """None if ``ok``, else ``what: why`` (an injected failure first, see tests/_sweep.py)."""
    bad = injected(what)
    if bad:
        return bad
    return None if ok else f"{what}: {why}"


def _gather_and_reduce(cfg: dict[str, Any], group: Any) -> list[str]:
    rank = dist.get_rank()
    numel, async_op = cfg["numel"], cfg["async_op"]
    members = dist.get_process_group_ranks(group)
    if rank not in members:
        # the same on every rank's view of the config: only members enter the
        # subgroup's collectives, as they must
        return []
    n = len(members)
    shard_numel = -(-numel // n)
    shard = torch.arange(shard_numel, dtype=torch.float32) + 1000.0 * rank
    expected = torch.empty(n * shard_numel)
    dist.all_gather_into_tensor(expected, shard, group=group)
    out = torch.full((n * shard_numel,), float("nan"))
    uses_before = _storage_uses(out)
    old = os.environ.pop("LOCAL_WORLD_SIZE", None)
    if cfg["per_node"] is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(cfg["per_node"])
    try:
        with _C10dOps() as seen:
            work = C.all_gather_into(out, shard, group, async_op=async_op)
            if work is not None:
                work.wait()
            del work
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if old is not None:
            os.environ["LOCAL_WORLD_SIZE"] = old
    tag = f"{rank_tag()} all-gather n={n} numel={numel} async={async_op} per_node={cfg['per_node']}"
    # two ranks: one exchange at any size, wherever they are; more: across nodes
    # (per_node=1) gloo's own ring, within one node broadcasts from the threshold up
    by_broadcast = n * shard_numel * 4 >= C.GLOO_BROADCAST_MIN_BYTES and cfg["per_node"] is None
    want = ({"send": 1, "recv_": 1} if n == 2 else
            {"broadcast_": n} if by_broadcast else {"_allgather_base_": 1})
    errs = [_expect(f"{tag} values", torch.equal(out, expected), "wrong values"),
            _expect(f"{tag} c10d ops", dict(seen.ops) == want, f"{dict(seen.ops)}, expected {want}")]
    if n == 2:
        # Nothing of the exchange holds the output once it is waited for: a
        # form that gloo's worker thread keeps a moment longer (all_to_all_single
        # does) lets a buffer freed right after a gather outlive its use.
        uses = _storage_uses(out)
        errs.append(_expect(f"{tag} released", uses == uses_before,
                            f"output storage used {uses} times after the gather, {uses_before} before"))

    gen = torch.Generator().manual_seed(7 + rank)
    for dtype in (torch.float32, torch.bfloat16):
        grad = torch.randn(n * shard_numel, generator=gen).to(dtype)
        errs += _reduce_scatter_forms(grad, n, group, async_op,
                                      f"{rank_tag()} reduce-scatter n={n} numel={numel} {dtype}")
    return [e for e in errs if e]


def _reduce_scatter_forms(grad: torch.Tensor, n: int, group: Any, async_op: bool,
                          tag: str) -> list[str | None]:
    """``reduce_scatter_sum`` against torch's reduce-scatter, bit for bit: into a
    fresh output and, of a scratch input, into this rank's own chunk of it
    (the output aliases what is being sent and summed)."""
    expected = torch.empty(grad.numel() // n, dtype=grad.dtype)
    dist.reduce_scatter_tensor(expected, grad.clone(), group=group)
    errs: list[str | None] = []
    for scratch, aliased in ((False, False), (True, False), (True, True)):
        inp = grad.clone()
        out = (inp.chunk(n)[dist.get_rank(group)] if aliased
               else torch.full(expected.shape, float("nan"), dtype=grad.dtype))
        with _C10dOps() as seen:
            work = C.reduce_scatter_sum(out, inp, group, async_op=async_op, input_is_scratch=scratch)
            if work is not None:
                work.wait()
        # two ranks: one exchange of halves; more: gloo's own, or an all-reduce of scratch
        want = ({"send": 1, "recv_": 1} if n == 2 else
                {"allreduce_": 1} if scratch else {"_reduce_scatter_base_": 1})
        what = f"{tag} scratch={scratch} aliased={aliased} async={async_op}"
        errs += [
            _expect(f"{what} values", torch.equal(out, expected),
                    f"max |diff| {(out.float() - expected.float()).abs().max():.3g}"),
            _expect(f"{what} c10d ops", dict(seen.ops) == want, f"{dict(seen.ops)}, expected {want}"),
        ]
    return errs


def _gathers_and_reductions(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """No comparison gates a collective; the one rank-dependent branch is
    membership of the subgroup, which is what decides who enters its collectives."""
    groups = {"world": dist.group.WORLD}
    if any(c["group"] == "ranks 0, 2" for c in configs):  # the same configs on every rank
        groups["ranks 0, 2"] = dist.new_group([0, 2])  # every rank takes part in new_group
    return run_configs(configs, lambda c: _gather_and_reduce(c, groups[c["group"]]), inject=inject)


def test_gather_by_broadcasts_only_within_a_node() -> None:
    big = C.GLOO_BROADCAST_MIN_BYTES
    assert C.gather_by_broadcasts(big, [0, 1, 2, 3], None)  # no LOCAL_WORLD_SIZE: one node
    assert C.gather_by_broadcasts(big, [0, 1, 2, 3], 4)
    assert C.gather_by_broadcasts(big, [2, 3], 2)  # node 1's shard group
    assert not C.gather_by_broadcasts(big - 1, [0, 1], 2)  # below the threshold
    assert not C.gather_by_broadcasts(big, [0, 1, 2, 3], 2)  # 2 nodes x 2 ranks
    assert not C.gather_by_broadcasts(big, [1, 3], 2)  # a replicate group
    assert not C.spans_nodes([0, 1], None) and C.spans_nodes([3, 4], 4)
    old = os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        assert C.ranks_per_node() is None
        os.environ["LOCAL_WORLD_SIZE"] = "8"
        assert C.ranks_per_node() == 8
        os.environ["LOCAL_WORLD_SIZE"] = "0"
        assert C.ranks_per_node() is None
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if old is not None:
            os.environ["LOCAL_WORLD_SIZE"] = old


def test_gloo_forms_equal_torch_collectives(pool2: Any, pool3: Any) -> None:
    fails = [f for pool, ws in ((pool2, 2), (pool3, 3))
             for r in pool.run(_gathers_and_reductions, _gloo_configs(ws)) for f in r]
    assert not fails, "\n".join(fails)


class _Big(nn.Module):
    """Units of about 1.1 MiB of fp32 parameters: gathered in place, row by row
    (one exchange over two ranks, broadcasts over three)."""

    def __init__(self, d: int = 384) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d + 9)
        self.fc2 = nn.Linear(d + 9, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def _train_big(cfg: dict[str, Any]) -> list[str]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 384), _Big(), _Big(), nn.Linear(384, 4))
    models = []
    for impl in ("torch", "ours"):
        policy = wrap_api(impl).ModuleWrapPolicy({_Big})
        models.append(fsdp_api(impl).FullyShardedDataParallel(
            copy.deepcopy(base), auto_wrap_policy=policy,
            **fsdp_kwargs(impl, sharding_strategy=cfg["strategy"], use_orig_params=cfg["uop"],
                          limit_all_gathers=cfg["limit"])))
    names = [n for n, _ in models[0].named_parameters()]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    gen = torch.Generator().manual_seed(11 + dist.get_rank())
    fails: list[str] = []
    for step in range(3):
        x = torch.randn(8, 16, generator=gen)
        res = [train_step(m, o, loss_of(m(x))) for m, o in zip(models, opts)]
        # Bit-exact: the same ops as torch's FSDP1 on the same flat layout; the
        # gathers move bits, and the 2-rank reduction is one commutative add.
        fails += compare_step(f"{rank_tag()} {cfg} step {step}", names, res[0], res[1], 0.0)
    return fails


def _big_configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, uop=u, limit=lim) for s, u, lim in itertools.product(
        ["FULL_SHARD", "SHARD_GRAD_OP"], [False, True], [True, False])]


def _sweep_big(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """No comparison gates a collective: all steps run whatever they found."""
    warnings.simplefilter("ignore")
    return run_configs(configs, _train_big, inject=inject)


def test_training_with_row_gathers_matches_torch(pool2: Any, pool3: Any) -> None:
    fails = [f for pool in (pool2, pool3) for r in pool.run(_sweep_big, _big_configs()) for f in r]
    assert not fails, "\n".join(fails)
