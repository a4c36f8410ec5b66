"""summon_full_params options against torch's FSDP1 (2 ranks).

For each strategy and ``use_orig_params`` mode, one model is deep-copied into
torch's FSDP1 and fsdp_wrap, trained one step, and then both go through the
same sequence of ``summon_full_params`` calls: ``recurse`` both ways,
``writeback`` both ways, ``rank0_only``, ``offload_to_cpu``, ``with_grads``,
``apply()`` (which summons internally) and the invalid combinations.  Inside
each context the names, shapes, devices and values must be torch's; after it,
the sharded state must be torch's; and two more training steps must still
match, so no option leaves the model in a wrong state.  ``with_grads`` is
also checked against the mean of the per-rank gradients.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests._options_common import (
    LONGEST_SUM,
    Replicated,
    cmp,
    compare_step,
    loss_of,
    rank_tag,
    replicated_tol,
    train_step,
)
from tests._sweep import Injection, injected, run_sweep
from tests.models import build, fsdp_api, make_input, new_model

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _view(model: nn.Module) -> list[tuple[str, tuple[int, ...], str, torch.Tensor]]:
    return [(n, tuple(p.shape), p.device.type, p.detach().clone()) for n, p in model.named_parameters()]


def _cmp_views(what: str, a: list[Any], b: list[Any]) -> list[str]:
    if [x[:3] for x in a] != [x[:3] for x in b]:
        return [f"{what}: torch {[x[:3] for x in a]} vs ours {[x[:3] for x in b]}"]
    return [e for e in (cmp(f"{what} {x[0]}", x[3], y[3], 0.0) for x, y in zip(a, b)) if e]


def _outcome(fn: Any) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _torch_error_first(torch_msg: str, ours: str) -> bool:
    """fsdp_wrap's error: torch's type and sentence first, then what torch's
    lacks, the rank among it (the project's rule for errors)."""
    return torch_msg != "ok" and ours.startswith(torch_msg) and f"[rank {dist.get_rank()}" in ours


def _both(ref: nn.Module, ours: nn.Module, **kw: Any) -> tuple[Any, Any]:
    return (fsdp_api("torch").FullyShardedDataParallel.summon_full_params(ref, **kw),
            fsdp_api("ours").FullyShardedDataParallel.summon_full_params(ours, **kw))


def _run(cfg: dict[str, Any]) -> list[str]:
    warnings.simplefilter("ignore")
    s, uop, model = cfg["strategy"], cfg["uop"], cfg["model"]
    rank = dist.get_rank()
    tag = f"{rank_tag()} {cfg}"
    torch.manual_seed(cfg["idx"])
    base = new_model(model)
    kw = dict(sharding_strategy=s, use_orig_params=uop)
    ref, ours = build(model, "torch", base, **kw), build(model, "ours", base, **kw)
    plain = Replicated(base)
    gen = torch.Generator().manual_seed(100 + rank + cfg["idx"])
    x = make_input(model, gen)
    for m in (ref, ours, plain.module):
        loss_of(m(x)).backward()
    plain.sync()
    fails: list[str] = []

    def check(what: str, ours_only: dict[str, Any] | None = None, **opts: Any) -> None:
        views = []
        c1, _ = _both(ref, ours, **opts)
        _, c2 = _both(ref, ours, **opts, **(ours_only or {}))
        with c1:
            views.append(_view(ref))
        with c2:
            views.append(_view(ours))
        fails.extend(f"{tag} {what}: {e}" for e in _cmp_views("inside", *views))

    check("recurse=True", writeback=False)
    check("recurse=False", writeback=False, recurse=False)
    check("rank0_only", writeback=False, rank0_only=True)
    if s != "NO_SHARD":
        # torch's offload_to_cpu crashes on a CPU compute device (reference
        # section 12): compare with its non-offloaded values; the device is
        # "cpu" either way on this host.
        check("offload_to_cpu", dict(offload_to_cpu=True), writeback=False, rank0_only=True)
        check("offload_to_cpu, all ranks", dict(offload_to_cpu=True), writeback=False)

    # with_grads: torch's values, and the mean of the per-rank gradients.
    if uop:
        grads = []
        for m, impl in ((ref, "torch"), (ours, "ours")):
            with fsdp_api(impl).FullyShardedDataParallel.summon_full_params(m, with_grads=True):
                grads.append([(n, None if p.grad is None else p.grad.clone()) for n, p in m.named_parameters()])
        if [n for n, _ in grads[0]] != [n for n, _ in grads[1]]:
            fails.append(f"{tag} with_grads: names {grads[0]} vs {grads[1]}")
        # torch's: bit-exact (same reduction, same order).  The replicated mean:
        # after one backward (step 0) on 2 ranks, the same sums possibly
        # blocked differently by the BLAS for flat-parameter views (see
        # replicated_tol); bit-exact on the machines measured so far.
        fails += [f"{tag} with_grads: {e}" for e in
                  (cmp(f"grad {n}", a, b, 0.0) for (n, a), (_, b) in zip(*grads)) if e]
        mean = dict(plain.module.named_parameters())
        tol = replicated_tol(0, dist.get_world_size(), LONGEST_SUM[model])
        fails += [f"{tag} with_grads vs mean of per-rank grads: {e}" for e in
                  (cmp(f"grad {n}", mean[n].grad, g, tol) for n, g in grads[1] if n in mean) if e]

    # Invalid combinations: the same exception and message as torch.
    invalid = [dict(writeback=True, rank0_only=True)]
    if not uop:
        invalid.append(dict(with_grads=True))
    if uop:
        invalid.append(dict(with_grads=True, offload_to_cpu=True))
    if s == "NO_SHARD":
        invalid.append(dict(offload_to_cpu=True))
    for opts in invalid:
        c1, c2 = _both(ref, ours, **opts)
        r1 = _outcome(lambda c=c1: c.__enter__())
        r2 = _outcome(lambda c=c2: c.__enter__())
        if r1 == "ok" or r1.split(":")[0] != r2.split(":")[0]:
            fails.append(f"{tag} invalid {opts}: torch {r1!r} vs ours {r2!r}")
        elif r1 != r2:
            fails.append(f"MSG {tag} invalid {opts}: torch {r1!r} vs ours {r2!r}")

    # Nested summon on the same module.
    def nested(impl: str, m: nn.Module) -> str:
        cls = fsdp_api(impl).FullyShardedDataParallel
        with cls.summon_full_params(m):
            return _outcome(lambda: cls.summon_full_params(m).__enter__())
    r1, r2 = nested("torch", ref), nested("ours", ours)
    if not _torch_error_first(r1, r2):
        fails.append(f"{tag} nested summon: torch {r1!r} vs ours {r2!r}")

    # writeback: changes persist to the shards (True) or vanish (False).
    for wb, val in ((False, 3.0), (True, 0.25 + rank)):
        for m, impl in ((ref, "torch"), (ours, "ours")):
            with fsdp_api(impl).FullyShardedDataParallel.summon_full_params(m, writeback=wb):
                first = next(p for p in m.parameters() if p.numel() > 0)
                first.data.fill_(val)
        fails += [f"{tag} after writeback={wb}: {e}" for e in _cmp_views("outside", _view(ref), _view(ours))]

    # apply() runs inside a summon of the instance it is called on.
    def scale(mod: nn.Module) -> None:
        if isinstance(mod, (nn.Linear, nn.LayerNorm, nn.Embedding)):
            with torch.no_grad():
                mod.weight.mul_(0.5)
    ref.apply(scale)
    ours.apply(scale)
    fails += [f"{tag} after apply(): {e}" for e in _cmp_views("outside", _view(ref), _view(ours))]

    # Everything above must leave both models able to train identically.
    names = [n for n, _ in ref.named_parameters()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for m in (ref, ours):
        m.zero_grad()
    for step in range(2):
        x = make_input(model, gen)
        res = []
        for m, o in zip((ref, ours), opts):
            res.append(train_step(m, o, loss_of(m(x))))
        # Bit-exact: the same ops as torch's FSDP1 on the same flat layout, same order.
        fails += compare_step(f"{tag} training afterwards, step {step}", names, res[0], res[1], 0.0)
    return fails


def _configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, uop=uop, model=("transformer", "deep")[k % 2], idx=k)
            for k, (s, uop) in enumerate(itertools.product(STRATEGIES, [False, True]))]


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    from tests._options_common import run_configs

    return run_configs(configs, _run, inject=inject)


def _during_forward() -> list[str]:
    """summon_full_params inside forward raises torch's AssertionError."""
    warnings.simplefilter("ignore")
    out = []
    for impl in ("torch", "ours"):
        cls = fsdp_api(impl).FullyShardedDataParallel

        torch.manual_seed(0)
        wrapped = build("deep", impl, new_model("deep"))
        seen: list[str] = []

        def hook(m: nn.Module, a: Any, cls: Any = cls, wrapped: Any = wrapped, seen: list[str] = seen) -> None:
            seen.append(_outcome(lambda: cls.summon_full_params(wrapped).__enter__()))

        wrapped.module.inp.register_forward_pre_hook(hook)
        wrapped(torch.randn(2, 4, 5))
        out.append(seen[0] if seen else "hook did not run")
    if not _torch_error_first(out[0], out[1]):
        return [f"{rank_tag()} summon during forward: torch {out[0]!r} vs ours {out[1]!r}"]
    return []


_RESULTS: list[str] = []


def _results(pool2: Any) -> list[str]:
    if not _RESULTS:
        _RESULTS.extend(f for r in pool2.run(_sweep, _configs()) for f in r)
        _RESULTS.append("ran")
    return _RESULTS


def test_summon_options_match_torch(pool2: Any) -> None:
    fails = [f for f in _results(pool2) if f != "ran" and not f.startswith("MSG ")]
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)


def test_summon_invalid_combination_messages_match_torch(pool2: Any) -> None:
    fails = [f for f in _results(pool2) if f.startswith("MSG ")]
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)


def test_summon_during_forward_is_an_error(pool2: Any) -> None:
    fails = [f for r in pool2.run(_during_forward) for f in r]
    assert not fails, "\n".join(fails)


def _between_configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, both=b, nested=n)
            for s, b, n in itertools.product(("FULL_SHARD", "SHARD_GRAD_OP"), (False, True), (False, True))]


def _between_two_forwards(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """forward, summon_full_params, forward, backward with use_orig_params=True (the
    summon must not leave the first forward's views modified in place): gradients
    as torch's, flat and nested units, backward through the second forward only
    or through both."""
    warnings.simplefilter("ignore")
    return run_sweep(configs, _between_one, inject=inject)


def _between_one(cfg: dict[str, Any]) -> list[str]:
    from torch.distributed import fsdp as torch_fsdp

    import fsdp_wrap

    strategy, both, nested = cfg["strategy"], cfg["both"], cfg["nested"]
    grads = {}
    for impl, api in (("torch", torch_fsdp), ("ours", fsdp_wrap)):
        fsdp = api.FullyShardedDataParallel
        kw = dict(sharding_strategy=getattr(api.ShardingStrategy, strategy),
                  use_orig_params=True, device_id=torch.device("cpu"))
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        if nested:
            m[0] = fsdp(m[0], **kw)
        model = fsdp(m, **kw)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        # No try/except: an error (a failure either way) raised on one rank
        # only would leave the other in a collective; it ends the task instead.
        first = model(x).sum()
        with fsdp.summon_full_params(model):
            pass
        second = model(x).sum()
        (first + second if both else second).backward()
        with fsdp.summon_full_params(model, with_grads=True):
            grads[impl] = [p.grad.clone() for p in model.parameters()]
    tag = f"{rank_tag()} {strategy} both={both} nested={nested}"
    if bad := injected(tag):
        return [bad]
    a, b = grads["torch"], grads["ours"]
    if any(not torch.allclose(x, y) for x, y in zip(a, b)):
        return [f"{tag}: gradients differ from torch's"]
    return []


def test_summon_between_two_forwards_with_orig_params(pool2: Any) -> None:
    fails = [f for r in pool2.run(_between_two_forwards, _between_configs()) for f in r]
    assert not fails, "\n".join(fails[:20])


def _seen_between_forward_and_backward() -> list[str]:
    """``named_parameters()`` after a forward, before its backward (a previous
    backward left gradients), use_orig_params=True: names, shapes and
    gradients as torch's (torch's ``test_with_grads_core``).  FULL_SHARD's root
    and every NO_SHARD unit show their sharded parameters with their sharded
    gradients; SHARD_GRAD_OP's units show the unsharded ones, without."""
    from torch.distributed import fsdp as torch_fsdp

    import fsdp_wrap

    warnings.simplefilter("ignore")
    fails = []
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        seen = {}
        for impl, api in (("torch", torch_fsdp), ("ours", fsdp_wrap)):
            fsdp = api.FullyShardedDataParallel
            kw = dict(sharding_strategy=getattr(api.ShardingStrategy, strategy),
                      use_orig_params=True, device_id=torch.device("cpu"))
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 6), nn.ReLU()),
                              nn.Linear(6, 3))
            m[1] = fsdp(m[1], **kw)
            model = fsdp(m, **kw)
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
            model(x).sum().backward()
            out = model(x)
            seen[impl] = [(n, tuple(p.shape), None if p.grad is None else p.grad.clone())
                          for n, p in model.named_parameters()]
            out.sum().backward()  # the backward still works from there
            with fsdp.summon_full_params(model, with_grads=True):
                seen[impl + " after"] = [p.grad.clone() for p in model.parameters()]
        for (n1, s1, g1), (n2, s2, g2) in zip(seen["torch"], seen["ours"], strict=True):
            same = n1 == n2 and s1 == s2 and (
                (g1 is None and g2 is None)
                or (g1 is not None and g2 is not None and torch.equal(g1, g2)))
            if not same:
                fails.append(f"{rank_tag()} {strategy} {n1}: torch {s1} grad "
                             f"{None if g1 is None else tuple(g1.shape)}, ours {n2} {s2} grad "
                             f"{None if g2 is None else tuple(g2.shape)}")
        if any(not torch.equal(a, b)
               for a, b in zip(seen["torch after"], seen["ours after"], strict=True)):
            fails.append(f"{rank_tag()} {strategy}: gradients after the backward differ")
    return fails


def test_parameters_seen_between_forward_and_backward_match_torch(pool2: Any) -> None:
    fails = [f for r in pool2.run(_seen_between_forward_and_backward) for f in r]
    assert not fails, "\n".join(fails[:20])
