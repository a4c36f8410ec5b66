"""Bucketed gradient reduction (``bucket_cap_mb``) on real gloo groups.

Every configuration trains two copies of one model in lockstep on different
data per rank: one with ``bucket_cap_mb=0`` (one collective per unit) and one
with a cap that puts several units in a bucket.  Gradients and parameters
must be *bit-identical* every step (the same elements go through the same
casts, divisions and sums).  The reduction collectives are counted and their
sizes recorded by wrapping :mod:`fsdp_wrap.comm.collectives`, so the bucket
boundaries are checked exactly.  One configuration per strategy is also
compared with torch's FSDP1, bit for bit (at 2 ranks the order of a two-term
sum does not matter).  Cases: several units per bucket, a unit
bigger than the cap, cap 0, the flush at the end of backward, ``no_sync``,
several forwards before one backward, units unused in a step, mixed
precision, CPU offload, ``use_orig_params`` both ways, 3 ranks (uneven
padding, a post-divide factor), and the per-unit fallback of comm hooks.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fsdp_wrap.comm.collectives as C
from fsdp_wrap import CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from fsdp_wrap.comm.bucket import BUCKET_CAP_ENV, DEFAULT_BUCKET_CAP_MB, resolve_bucket_cap_mb
from tests._options_common import fp32_bound, rank_tag, run_configs
from tests._sweep import Injection, injected

# Block sizes (hidden width h: 33h + 16 parameters).  h=8: 280 elements (1120
# bytes fp32); h=64: 2128 elements, bigger than every cap used below.
HIDDEN = (8, 8, 8, 64, 8, 8)
UNIT_BYTES = 280 * 4
TWO_UNITS_MB = 2.2 * UNIT_BYTES / 2**20  # room for two small units, not two and the root's


class Net(nn.Module):
    def __init__(self, hidden: tuple[int, ...] = HIDDEN) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, h), nn.Tanh(), nn.Linear(h, 16)) for h in hidden
        )
        self.head = nn.Linear(16, 4)
        self.skip: set[int] = set()
        self.checkpoint = False  # non-reentrant activation checkpointing of each block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i in self.skip:
                continue
            if self.checkpoint:
                x = x + checkpoint(block, x, use_reentrant=False)
            else:
                x = x + block(x)
        return self.head(x)


def _wrap(net: nn.Module, cap: float, fsdp_cls: Any = FullyShardedDataParallel,
          **kw: Any) -> nn.Module:
    for i, block in enumerate(net.blocks):
        net.blocks[i] = fsdp_cls(block, **kw)
    if fsdp_cls is FullyShardedDataParallel:
        kw["bucket_cap_mb"] = cap
    return fsdp_cls(net, **kw)


def _kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        sharding_strategy=ShardingStrategy[cfg["strategy"]], use_orig_params=cfg["uop"]
    )
    if cfg.get("mp"):
        kw["mixed_precision"] = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=cfg["mp"], buffer_dtype=torch.bfloat16
        )
    if cfg.get("offload"):
        kw["cpu_offload"] = CPUOffload(offload_params=True)
    return kw


@contextlib.contextmanager
def counting() -> Iterator[list[tuple[str, int]]]:
    """Record ``(name, input numel)`` of every reduce-scatter and all-reduce."""
    calls: list[tuple[str, int]] = []
    rs, ar = C.reduce_scatter_sum, C.all_reduce

    def reduce_scatter_sum(output: torch.Tensor, inp: torch.Tensor, *a: Any, **k: Any) -> Any:
        calls.append(("reduce_scatter", inp.numel()))
        return rs(output, inp, *a, **k)

    def all_reduce(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        calls.append(("all_reduce", t.numel()))
        return ar(t, *a, **k)

    C.reduce_scatter_sum, C.all_reduce = reduce_scatter_sum, all_reduce  # type: ignore[assignment]
    try:
        yield calls
    finally:
        C.reduce_scatter_sum, C.all_reduce = rs, ar  # type: ignore[assignment]


def _batch(step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(4, 16, generator=g)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _differences(tag: str, a: list[torch.Tensor | None], b: list[torch.Tensor | None],
                 tol: float | Callable[[torch.Tensor], float] = 0.0) -> list[str]:
    """What differs between two lists of tensors (the comparison of this file and
    tests/test_gather_batch.py; an injected failure comes first, see tests/_sweep.py).

    ``tol`` 0 means bit-identical; a callable gives each tensor's own tolerance.
    """
    bad = injected(tag)
    if bad:
        return [bad]
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            if (x is None) != (y is None):
                out.append(f"{tag} #{i}: {x is None=} vs {y is None=}")
        elif x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"{tag} #{i}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}")
        elif tol == 0.0 and not torch.equal(x, y):
            out.append(f"{tag} #{i}: max |diff| {(x.float() - y.float()).abs().max():.3g}")
        elif tol and x.numel():
            t = tol(x) if callable(tol) else tol
            if (x.float() - y.float()).abs().max() > t:
                d = (x.float() - y.float()).abs().max()
                out.append(f"{tag} #{i}: max |diff| {d:.3g} > {t:.3g}")
    if len(a) != len(b):
        out.append(f"{tag}: {len(a)} vs {len(b)} tensors")
    return out


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, cfg: dict[str, Any],
          net: Net) -> None:
    """One step as ``cfg`` says: no_sync micro-batches, several forwards, skipped units."""
    net.skip = set(cfg.get("skip", {}).get(step, ()))
    if cfg.get("nosync"):
        with model.no_sync():  # type: ignore[operator]
            model(_batch(step, 1)).float().pow(2).mean().backward()
    if cfg.get("forwards", 1) > 1:
        loss = sum(model(_batch(step, 2 + k)).float().pow(2).mean()
                   for k in range(cfg["forwards"]))
    else:
        loss = model(_batch(step)).float().pow(2).mean()
    loss.backward()  # type: ignore[union-attr]


# The longest sum Net computes: the h=64 block's second Linear (64 terms).
LONGEST_SUM = 64


def _reorder_tol(step: int) -> Callable[[torch.Tensor], float]:
    """Two runs that differ only in the order of the cross-rank sums: each is
    within ``fp32_bound`` of the exact values, so within twice it of the other."""
    ws = dist.get_world_size()
    return lambda x: 2 * fp32_bound(step, ws, float(x.abs().max()), LONGEST_SUM)


def _bucket_vs_per_unit(cfg: dict[str, Any]) -> list[str]:
    """Train cap=0 and cap=cfg['cap'] in lockstep; grads and params bit-identical
    on 2 ranks (within the reordering bound on more, see the 3-rank test)."""
    torch.manual_seed(0)
    base = Net()
    nets = [copy.deepcopy(base), copy.deepcopy(base)]
    kw = _kwargs(cfg)
    models = [_wrap(nets[0], 0.0, **kw), _wrap(nets[1], cfg["cap"], **kw)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    fails: list[str] = []
    tag = f"{rank_tag()} {cfg}"
    for step in range(3):
        for i, (m, o) in enumerate(zip(models, opts)):
            if i == 1 and step == 1:
                with counting() as calls:
                    _step(m, o, step, cfg, nets[i])
                want = cfg.get("calls")
                if want is not None and [n for _, n in calls] != want:
                    fails.append(f"{tag}: reductions of step 1 {calls}, expected sizes {want}")
            else:
                _step(m, o, step, cfg, nets[i])
            if not models[i]._root._grad_buckets.idle:  # type: ignore[union-attr]
                fails.append(f"{tag}: a bucket is still open or in flight after backward")
        tol = _reorder_tol(step) if cfg.get("reordered") else 0.0
        fails += _differences(f"{tag} step {step} grad", _grads(models[0]), _grads(models[1]),
                              tol)
        for o in opts:
            o.step()
            if not cfg.get("keep_grads"):
                o.zero_grad()
        fails += _differences(f"{tag} step {step} param", list(models[0].parameters()),
                              list(models[1].parameters()), tol)
    return fails[:6]


def _sizes(strategy: str, ws: int, units: list[list[int]]) -> list[int]:
    """Expected reduction input sizes: each bucket's units' (padded) numels, summed."""
    def one(numel: int) -> int:
        return numel if strategy == "NO_SHARD" else -(-numel // ws) * ws
    return [sum(one(n) for n in bucket) for bucket in units]


# Units in backward order: block 5, 4, 3 (the big one, 2128 elements), 2, 1,
# 0 (280 each), then the root (its own flat parameter holds only the head: 68
# elements; autograd reaches the node splitting it, made first, last).
ROOT, SMALL, BIG = 68, 280, 2128


def _configs(ws: int) -> list[dict[str, Any]]:
    out = []
    for strategy, uop in itertools.product(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"],
                                           [False, True]):
        base = dict(strategy=strategy, uop=uop)
        # Two small units per bucket (a third would pass the cap: flush first);
        # the big unit alone (flushes what was open first); the last bucket by
        # the end-of-backward flush.
        two = [[SMALL, SMALL], [BIG], [SMALL, SMALL], [SMALL, ROOT]]
        out.append(dict(base, cap=TWO_UNITS_MB, calls=_sizes(strategy, ws, two)))
        # Everything in one bucket, reduced by the end-of-backward flush.
        everything = [[SMALL, SMALL, BIG, SMALL, SMALL, SMALL, ROOT]]
        out.append(dict(base, cap=1.0, calls=_sizes(strategy, ws, everything)))
        # no_sync reduces nothing: the step's reductions are the synced backward's.
        out.append(dict(base, cap=TWO_UNITS_MB, nosync=True, calls=_sizes(strategy, ws, two)))
        out.append(dict(base, cap=1.0, forwards=2))
        # Blocks 1 and 3 unused in step 1, gradients kept across steps (a parked
        # gradient goes back), then used again.
        out.append(dict(base, cap=TWO_UNITS_MB, skip={1: (1, 3)}, keep_grads=True,
                        calls=_sizes(strategy, ws, [[SMALL, SMALL], [SMALL, SMALL], [ROOT]])))
    for strategy, uop in itertools.product(["FULL_SHARD", "NO_SHARD"], [False, True]):
        out.append(dict(strategy=strategy, uop=uop, cap=TWO_UNITS_MB, mp=torch.float32))
        out.append(dict(strategy=strategy, uop=uop, cap=1.0, mp=torch.bfloat16))
        out.append(dict(strategy=strategy, uop=uop, cap=TWO_UNITS_MB, offload=True,
                        nosync=True))
    return out


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """No decision here gates a collective: every step and comparison runs on
    every rank whatever an earlier comparison found."""
    return run_configs(configs, _bucket_vs_per_unit, inject=inject)


def test_buckets_bit_identical_to_per_unit(pool2: Any) -> None:
    fails = [f for r in pool2.run(_sweep, _configs(2)) for f in r]
    assert not fails, "\n".join(fails)


def test_buckets_three_ranks_uneven_shards(pool3: Any) -> None:
    """282-element padded units and pre=2, post=1.5 division.

    Not bit-identical here: on 3 ranks gloo's ring sums each element in an
    order that depends on where the element falls in the message, i.e. on the
    message's size, so a bucket rounds differently from a lone unit (the same
    happens between any two message sizes).  Compared within the bound of
    ``tests._options_common.fp32_bound`` (doubled: two reorderings)."""
    configs = [dict(c, reordered=True) for c in _configs(3)
               if not c.get("mp") and not c.get("offload")][:10]
    fails = [f for r in pool3.run(_sweep, configs) for f in r]
    assert not fails, "\n".join(fails)


def _vs_torch(strategy: str) -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    torch.manual_seed(0)
    base = Net()
    ref = _wrap(copy.deepcopy(base), 0.0, TorchFSDP, device_id=torch.device("cpu"),
                sharding_strategy=TorchStrategy[strategy])
    ours = _wrap(copy.deepcopy(base), TWO_UNITS_MB, sharding_strategy=ShardingStrategy[strategy])
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, ours)]
    fails: list[str] = []
    for step in range(3):
        for m in (ref, ours):
            m(_batch(step)).pow(2).mean().backward()
        fails += _differences(f"{rank_tag()} {strategy} step {step} grad", _grads(ref),
                              _grads(ours))
        for o in opts:
            o.step()
            o.zero_grad()
    return fails[:4]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_buckets_match_torch_fsdp1(pool2: Any, strategy: str) -> None:
    fails = [f for r in pool2.run(_vs_torch, strategy) for f in r]
    assert not fails, "\n".join(fails)


def _hook_calls(strategy: str) -> list[Any]:
    """A comm hook is called once per unit (the per-unit fallback)."""
    calls = []

    def hook(state: Any, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
        calls.append(grad.numel())
        dist.all_reduce(grad)
        grad.div_(dist.get_world_size())
        if output is not None:
            output.copy_(grad.chunk(dist.get_world_size())[dist.get_rank()])

    torch.manual_seed(0)
    model = _wrap(Net(), 1.0, sharding_strategy=ShardingStrategy[strategy])
    model.register_comm_hook(None, hook)  # type: ignore[operator]
    with counting() as counted:
        model(_batch(0)).pow(2).mean().backward()
    return [len(calls), len(counted)]


def test_comm_hook_reduces_per_unit(pool2: Any) -> None:
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        assert pool2.run(_hook_calls, strategy) == [[7, 0], [7, 0]]


def test_cap_resolution_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BUCKET_CAP_ENV, raising=False)
    assert resolve_bucket_cap_mb(None) == DEFAULT_BUCKET_CAP_MB
    assert resolve_bucket_cap_mb(0) == 0.0
    monkeypatch.setenv(BUCKET_CAP_ENV, "4")
    assert resolve_bucket_cap_mb(None) == 4.0
    assert resolve_bucket_cap_mb(2.5) == 2.5  # the keyword wins
    monkeypatch.setenv(BUCKET_CAP_ENV, "lots")
    with pytest.raises(ValueError, match=BUCKET_CAP_ENV):
        resolve_bucket_cap_mb(None)
    with pytest.raises(ValueError, match="bucket_cap_mb must be >= 0"):
        resolve_bucket_cap_mb(-1)
    with pytest.raises(ValueError, match="bucket_cap_mb must be >= 0"):
        resolve_bucket_cap_mb(float("nan"))


def test_bad_cap_raises_before_any_collective() -> None:
    """No process group is needed to see the error: it comes before anything else."""
    with pytest.raises(ValueError, match="bucket_cap_mb must be >= 0"):
        FullyShardedDataParallel(nn.Linear(2, 2), bucket_cap_mb=-1.0)


def _grads_seen_at_final_callback(cap: float) -> list[int]:
    """Flat gradients present when the end-of-backward callback starts, and after backward."""
    torch.manual_seed(0)
    model = _wrap(Net(), cap, sharding_strategy=ShardingStrategy.FULL_SHARD)
    buckets = model._grad_buckets  # type: ignore[union-attr]
    seen: list[int] = []
    real_finish = buckets.finish

    def grads() -> int:  # the root knows its handles after lazy init
        return sum(h.flat_param.grad is not None for h in model._all_handles)  # type: ignore

    def finish() -> None:
        seen.append(grads())
        real_finish()

    buckets.finish = finish  # type: ignore[method-assign]
    model(_batch(0)).pow(2).mean().backward()
    return [seen[0], grads()]


def test_bucketed_grads_appear_at_the_end_of_backward(pool2: Any) -> None:
    # Per unit: all 7 gradients are installed by the post-backward hooks.  One
    # bucket: none until the end-of-backward callback, all 7 when backward returns.
    assert pool2.run(_grads_seen_at_final_callback, 0.0) == [[7, 7], [7, 7]]
    assert pool2.run(_grads_seen_at_final_callback, 1.0) == [[0, 7], [0, 7]]
