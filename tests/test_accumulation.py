"""Accumulation controls with FSDP2's names: sharded accumulation across replicas and the rest.

* ``set_requires_all_reduce(False)`` on 4 ranks (2 replicas x 2 shards),
  micro-batches per optimizer step; against
  :meth:`tests._quant_emulation.Emulation.step_accumulated` (the same sums in
  the same order: tolerance 0) for HYBRID_SHARD / _HYBRID_SHARD_ZERO2,
  ``use_orig_params`` both ways, buckets on and off, a bf16 ``reduce_dtype``
  (partial sums in float32), CPU offload, split (LoRA) units, coded replicas,
  a first micro-batch under ``no_sync()``, ``set_is_last_backward(False)``,
  a unit unused in the last micro-batch;
  and against a plain replicated model's accumulation (sums in another order:
  a bound derived from the terms).  Between micro-batches each rank holds
  the sharded float32 partial sum and no unsharded gradient; the replicas
  communicate once per optimizer step (one all-reduce per flat parameter, the
  bytes of one micro-batch's).
* ``set_reshard_after_backward``: ``False`` keeps the gathered parameters so
  the next forward gathers nothing (re-gathered after an optimizer step
  changed the shard), ``True`` frees them where FSDP1 keeps them; results
  bit-identical to the default.
* ``set_requires_gradient_sync(False)`` is ``no_sync()`` (bit-identical).
* Errors and the warning of ``clip_grad_norm_`` on partial sums.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist

import fsdp_wrap
import fsdp_wrap.comm.collectives as C
from tests._dist import progress
from tests._options_common import cmp, loss_of, rank_tag, run_configs
from tests._quant_emulation import build_pair, full_params, model_input, nodes_of
from tests._sweep import Injection

MICRO = 3
STEPS = 2


def _configs() -> list[dict[str, Any]]:
    hy, z2 = "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"
    return [
        dict(model="transformer", strategy=hy, uop=False, plain=True),
        dict(model="transformer", strategy=z2, uop=True, cap=0, groups="tuple"),
        dict(model="transformer", strategy=hy, uop=True, mp="reduce", not_last=True),
        dict(model="transformer", strategy=hy, uop=False, offload=True, no_sync=1),
        dict(model="lora", strategy=hy, uop=True, quant="grads,block=6"),
        dict(model="transformer", strategy=z2, uop=False, quant="grads=int4,block=8",
             not_last=True),
        # a unit unused in the all-reducing micro-batch: its partial sum is
        # all-reduced at the end of that backward all the same
        dict(model="skipping", strategy=hy, uop=True, skip_last=True),
    ]


class _ReplicaTraffic:
    """Collectives on the replicate group: calls and bytes (patched into comm.collectives)."""

    NAMES = ("all_reduce", "all_gather_into", "all_to_all_into", "reduce_scatter_sum")

    def __init__(self, replicate: Any) -> None:
        self.replicate, self.calls, self.nbytes = replicate, 0, 0
        self.real = {n: getattr(C, n) for n in self.NAMES}

    def __enter__(self) -> _ReplicaTraffic:
        for name, real in self.real.items():
            def counting(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
                group = kw.get("group", args[-1] if _name == "all_to_all_into" else
                               args[1] if _name == "all_reduce" else args[2])
                # (int64: the first forward's check that replicas hold the same
                # parameters, one fingerprint per flat parameter: runtime.guards)
                if group is self.replicate and args[0].dtype is not torch.int64:
                    self.calls += 1
                    self.nbytes += args[0].numel() * args[0].element_size()
                return _real(*args, **kw)
            setattr(C, name, counting)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, real in self.real.items():
            setattr(C, name, real)


def _memory_problems(model: Any) -> list[str]:
    """Between micro-batches: the float32 partial sum of each trainable shard and
    no gradient (sharded or unsharded) anywhere else."""
    out = []
    for h in model._all_handles:
        if not h.flat_param.requires_grad:
            continue
        part = h.grads._partial
        if part is None or part.numel() != h.shard_numel or part.dtype != torch.float32:
            out.append(f"{h.unit_fqn or '<root>'}: partial {None if part is None else part.shape}")
        if h.flat_param.grad is not None or h.grads.has_unreduced_grad:
            out.append(f"{h.unit_fqn or '<root>'}: a gradient is held between micro-batches")
        if h.use_orig_params and any(i.param.grad is not None for i in h.infos):
            out.append(f"{h.unit_fqn or '<root>'}: an original parameter has a gradient")
    return out


def _plain_accumulation_bound(cfg: dict[str, Any], model: Any, emu: Any,
                              xs: list[torch.Tensor]) -> list[str | None]:
    """fsdp_wrap's accumulated gradient (before the step) against a plain
    replicated model summing micro-batches, then ranks: the same terms (each
    rank's local gradients, bit-identical) in another order.  Each side is
    within ``(n - 1) u sum|t|`` of the exact sum of its ``n = ranks x
    micro-batches`` terms ``t`` (Higham; divisions by the powers of two
    ``pre``/``post``/``ranks`` are exact), so they differ by at most twice that,
    over the number of ranks."""
    import copy

    plain = copy.deepcopy(emu.master)
    world = dist.get_world_size()
    sums = {n: torch.zeros_like(p) for n, p in plain.named_parameters()}
    abss = {n: torch.zeros_like(p) for n, p in plain.named_parameters()}
    for x in xs:
        plain.zero_grad(set_to_none=True)
        loss_of(plain(x)).backward()
        for n, p in plain.named_parameters():
            if p.grad is not None:
                sums[n] += p.grad
                abss[n] += p.grad.abs()
    fails: list[str | None] = []
    n_terms = world * len(xs)
    for n in sums:
        dist.all_reduce(sums[n])
        dist.all_reduce(abss[n])
        sums[n] /= world
    for u in emu.units:
        if not u.trainable:
            continue
        h = next(h for h in model._all_handles if [h.unit_fqn + "." + i.fqn if h.unit_fqn
                                                   else i.fqn for i in h.infos] == u.names)
        flat_ref = emu._flat(u, sums, torch.float32)
        flat_abs = emu._flat(u, abss, torch.float32)
        pos = dist.get_rank() % 2
        sl = slice(pos * u.shard, (pos + 1) * u.shard)
        bound = 2 * (n_terms - 1) * 2.0**-24 * flat_abs[sl].double() / world
        got = h.flat_param.grad.double()
        diff = (got - flat_ref[sl].double()).abs()
        if not bool((diff <= bound).all()):
            fails.append(f"{u.names[0]}: accumulated gradient off the plain model's by "
                         f"{float((diff - bound).max()):.3g} beyond the bound")
    return fails


def _train(cfg: dict[str, Any]) -> list[str]:
    tag = f"{rank_tag()} {cfg}"
    with nodes_of(2):
        ours, emu, opt = build_pair(cfg)
    replicate = ours._inter_node_pg
    gen = torch.Generator().manual_seed(300 + dist.get_rank())
    fails: list[str | None] = []
    trainable = [h for h in ours._all_handles if h.flat_param.requires_grad]
    in_flight_seen: set[int] = set()  # the steps in which a reduction was left in flight
    # set_is_last_backward is for the whole tree: called on the root in the first
    # step, on a nested unit in the second
    nested = [m for m in ours.modules() if m is not ours and isinstance(m, type(ours))][0]
    for step in range(STEPS):
        xs = [model_input(cfg["model"], gen) for _ in range(MICRO)]
        losses = []
        def before(i: int, module: Any) -> None:
            if cfg.get("skip_last"):
                module.skip = 1 if i == MICRO - 1 else None

        with _ReplicaTraffic(replicate) as traffic:
            for i, x in enumerate(xs):
                last = i == MICRO - 1
                before(i, ours.module)
                ours.set_requires_all_reduce(last)
                if cfg.get("not_last"):
                    (ours if step == 0 else nested).set_is_last_backward(last)
                if i > cfg.get("no_sync", 0):  # (the last micro-batch reduced)
                    # the setters finish what set_is_last_backward(False) left in
                    # flight: issued under the flags they change
                    if not ours._grad_buckets.idle:
                        fails.append(f"micro-batch {i}: reductions in flight after the setters")
                        ours._grad_buckets.finish()
                    fails += _memory_problems(ours)
                if i < cfg.get("no_sync", 0):
                    with ours.no_sync():
                        loss = loss_of(ours(x))
                        loss.backward()
                else:
                    loss = loss_of(ours(x))
                    loss.backward()
                losses.append(loss.detach())
                if not last and i >= cfg.get("no_sync", 0):
                    if not ours._grad_buckets.idle:
                        in_flight_seen.add(step)
        if cfg.get("plain") and step == 0:
            fails += _plain_accumulation_bound(cfg, ours, emu, xs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref = emu.step_accumulated(xs, loss_of, no_sync=cfg.get("no_sync", 0),
                                   before=functools.partial(before, module=emu.compute))
        for i, (a, b) in enumerate(zip(ref, losses)):
            fails.append(cmp(f"step {step} micro-batch {i} loss", a, b, 0.0))
        got = full_params(ours)
        for name, p in emu.master.named_parameters():
            fails.append(cmp(f"step {step} param {name}", p, got[name], 0.0))
        # the replicas communicate once per flat parameter and optimizer step
        # (coded: a reduce-scatter as an all-to-all, then an all-gather)
        if traffic.calls != (1 if cfg.get("quant") is None else 2) * len(trainable):
            fails.append(f"step {step}: {traffic.calls} collectives on the replicate group")
        if cfg.get("quant") is None:
            itemsize = torch.finfo(trainable[0].reduce_dtype).bits // 8
            expected = sum(h.shard_numel for h in trainable) * itemsize
            if traffic.nbytes != expected:
                fails.append(f"step {step}: {traffic.nbytes} bytes to the replicas, not {expected}")
        progress()
    if cfg.get("not_last") and cfg.get("cap") != 0 and in_flight_seen != set(range(STEPS)):
        fails.append(f"set_is_last_backward(False) left reductions in flight in steps "
                     f"{sorted(in_flight_seen)} only")
    found = [f for f in fails if f]
    return [f"{tag}: " + "; ".join(found[:4])] if found else []


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_configs(configs, _train, inject=inject)


def test_sharded_accumulation_equals_emulation(pool4: Any) -> None:
    assert pool4.run(_sweep, _configs()) == [[]] * 4


# ------------------------------------------------- the other controls, 2 ranks


def _gathers(fn: Any) -> int:
    real, count = C.all_gather_into, [0]

    def counting(*args: Any, **kw: Any) -> Any:
        count[0] += 1
        return real(*args, **kw)

    C.all_gather_into = counting  # type: ignore[assignment]
    try:
        fn()
    finally:
        C.all_gather_into = real  # type: ignore[assignment]
    return count[0]


def _forward_loss(model: Any, x: torch.Tensor, box: list[torch.Tensor]) -> None:
    box.append(loss_of(model(x)))


def _reshard_after_backward() -> list[Any]:
    """Per strategy: the forward gathers of the micro-batches after the first
    (kept: none), of the first after an optimizer step (re-gathered), whether
    the results equal the default's bit for bit, and, under ``no_sync``,
    whether SHARD_GRAD_OP keeps its gathered parameters by default and frees
    them with ``set_reshard_after_backward(True)``."""
    from tests._quant_emulation import model_input as mk

    out: list[Any] = []
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        cfg = dict(model="transformer", strategy=strategy, uop=strategy == "SHARD_GRAD_OP",
                   batch=0)
        runs = []
        for keep in (False, True):
            model, _, opt = build_pair(cfg)
            if keep:
                model.set_reshard_after_backward(False)
            gen = torch.Generator().manual_seed(5 + dist.get_rank())
            gathers = []
            for _step in range(2):
                for _ in range(3):
                    x = mk("transformer", gen)
                    box: list[torch.Tensor] = []
                    gathers.append(_gathers(functools.partial(_forward_loss, model, x, box)))
                    box[0].backward()
                opt.step()
                opt.zero_grad()
            runs.append((gathers, full_params(model)))
        (g0, p0), (g1, p1) = runs
        same = all(torch.equal(p0[n], p1[n]) for n in p0)
        out.append((strategy, g0, g1, same))
        progress()
    # FSDP1's rule under no_sync (SHARD_GRAD_OP keeps), and the override
    held = []
    for explicit in (None, True):
        model, _, _ = build_pair(dict(model="transformer", strategy="SHARD_GRAD_OP", uop=False))
        if explicit is not None:
            model.set_reshard_after_backward(explicit)
        with model.no_sync():
            loss_of(model(mk("transformer", torch.Generator().manual_seed(1)))).backward()
        held.append(any(h.holds_unsharded_storage for h in model._all_handles))
    out.append(held)
    return out


def test_reshard_after_backward(pool2: Any) -> None:
    for res in pool2.run(_reshard_after_backward):
        *per_strategy, held = res
        for strategy, default, kept, same in per_strategy:
            assert same, strategy
            # the default gathers in every forward; kept: nothing in the forwards
            # that follow a backward within a step, everything after a step
            assert all(n > 0 for n in default), (strategy, default)
            assert kept[0] > 0 and kept[1] == kept[2] == 0, (strategy, kept)
            assert kept[3] > 0 and kept[4] == kept[5] == 0, (strategy, kept)
        assert held == [True, False], held


def _gradient_sync_is_no_sync() -> list[Any]:
    results = []
    for how in ("no_sync", "setter"):
        model, _, opt = build_pair(dict(model="transformer", strategy="FULL_SHARD", uop=True))
        gen = torch.Generator().manual_seed(9 + dist.get_rank())
        for _ in range(2):
            xs = [model_input("transformer", gen) for _ in range(3)]
            for i, x in enumerate(xs):
                if how == "no_sync" and i < 2:
                    with model.no_sync():
                        loss_of(model(x)).backward()
                else:
                    model.set_requires_gradient_sync(i == 2)
                    loss_of(model(x)).backward()
            opt.step()
            opt.zero_grad()
        results.append(full_params(model))
    a, b = results
    return [all(torch.equal(a[n], b[n]) for n in a)]


def test_requires_gradient_sync_is_no_sync(pool2: Any) -> None:
    assert pool2.run(_gradient_sync_is_no_sync) == [[True], [True]]


def _errors_and_warning() -> list[str]:
    with nodes_of(2):
        model, _, _ = build_pair(dict(model="transformer", strategy="HYBRID_SHARD", uop=False))
    out = []
    try:
        model.set_requires_all_reduce(1)  # type: ignore[arg-type]
    except ValueError as e:
        out.append(str(e))
    model.zero_grad(set_to_none=True)
    model.set_requires_all_reduce(False)
    loss_of(model(model_input("transformer", torch.Generator()))).backward()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        norm = model.clip_grad_norm_(1.0)
    out.append(" | ".join(str(w.message) for w in seen))
    out.append(str(math.isfinite(float(norm))))
    model.set_requires_all_reduce(True)
    loss_of(model(model_input("transformer", torch.Generator()))).backward()
    out.append(str(any(h.grads.holds_partial for h in model._all_handles)))
    # last (the forward it breaks leaves the model mid-forward)
    inner = model._all_fsdp_states[1]
    inner.register_forward_pre_hook(lambda *a: model.set_reshard_after_backward(False))
    try:
        model(model_input("transformer", torch.Generator()))
    except ValueError as e:
        out.append(str(e))
    return out


def test_errors_and_the_clip_warning(pool4: Any) -> None:
    for rank, (not_bool, warned, finite, left, in_forward) in enumerate(pool4.run(_errors_and_warning)):
        assert not_bool.startswith("requires_all_reduce should be a bool, got <class 'int'>"), not_bool
        assert in_forward.startswith("expected to be in states") and f"[rank {rank}, " in in_forward \
            and "set_reshard_after_backward() expects IDLE or SUMMON_FULL_PARAMS, the unit is in " \
            "FORWARD_BACKWARD" in in_forward and "call it between iterations" in in_forward, in_forward
        assert "clip_grad_norm_() sees gradients without the micro-batches held in sharded " \
            "partial sums" in warned and "set_requires_all_reduce(False)" in warned, warned
        assert finite == "True" and left == "False"


def _recorded(fn: Any) -> str:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return " | ".join(str(w.message) for w in seen)


def _misuse_warnings() -> list[str]:
    """``set_requires_all_reduce(False)`` left set at the optimizer step, and
    set where it has no effect (no replicas); the neighbours: the documented
    use, and ``True`` anywhere, are silent."""
    with nodes_of(2):
        hybrid, _, opt = build_pair(dict(model="transformer", strategy="HYBRID_SHARD", uop=False))
        full, _, _ = build_pair(dict(model="transformer", strategy="FULL_SHARD", uop=False))
    out = [_recorded(lambda: hybrid.set_requires_all_reduce(False))]  # (replicas: silent)
    loss_of(hybrid(model_input("transformer", torch.Generator()))).backward()
    before = full_params(hybrid)
    out.append(_recorded(opt.step))
    opt.zero_grad()
    after = full_params(hybrid)
    # the case is real: the step changed nothing, the sums outlived it and zero_grad
    out.append(str(all(torch.equal(before[k], after[k]) for k in before)))
    out.append(str(any(h.grads.holds_partial for h in hybrid._all_handles)))
    hybrid.set_requires_all_reduce(True)  # the documented use: silent at the step
    loss_of(hybrid(model_input("transformer", torch.Generator()))).backward()
    out.append(_recorded(opt.step))
    out.append(_recorded(lambda: full.set_requires_all_reduce(False)))
    out.append(_recorded(lambda: full.set_requires_all_reduce(True)))
    with nodes_of(4):  # one node: HYBRID_SHARD's replicate groups are of one rank
        from tests.models import TinyTransformer, transformer_policy

        one_node = fsdp_wrap.FullyShardedDataParallel(
            TinyTransformer(), sharding_strategy=fsdp_wrap.ShardingStrategy.HYBRID_SHARD,
            auto_wrap_policy=transformer_policy("ours"))
    out.append(_recorded(lambda: one_node.set_requires_all_reduce(False)))
    return out


def test_requires_all_reduce_misuse_warns_on_every_rank(pool4: Any) -> None:
    for rank, res in enumerate(pool4.run(_misuse_warnings)):
        set_hybrid, at_step, unchanged, survived, documented, no_replicas, back, one_node = res
        assert set_hybrid == "" and documented == "" and back == "", res
        assert unchanged == "True" and survived == "True", res
        assert at_step.startswith(f"SGD.step() [rank {rank}] with set_requires_all_reduce(False) "
                                  "still in effect"), at_step
        assert "Call set_requires_all_reduce(True) before the last micro-batch's backward" \
            in at_step, at_step
        # the units by name (the root as '<root>'): the root and the two blocks
        assert "(units ['<root>', 'blocks.0', 'blocks.1'])" in at_step, at_step
        assert no_replicas.startswith(f"[rank {rank}] set_requires_all_reduce(False) has no "
                                      "effect here: no FSDP unit it applies to has replicas"), \
            no_replicas
        assert "use no_sync() or set_requires_gradient_sync(False)" in no_replicas, no_replicas
        assert f"[rank {rank}] set_requires_all_reduce(False) has no effect here" in one_node, \
            one_node
