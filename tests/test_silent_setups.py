"""Set-ups that train wrongly without a word on torch's FSDP1 get an error or a warning here.

Each case is built the same way with torch's FSDP1 and with fsdp_wrap (2 gloo
ranks); every rank records whether the call raised, the warnings it gave and
the effect (did the parameters change, do the ranks agree).  For torch the
test checks the set-up is silent and wrong (so the case stays real); for
fsdp_wrap that every rank got the error or the warning, naming the rank and
the fix, and, for the warnings, that training still runs.  A legitimate
neighbour of each case (optimizer built after wrapping, ``sync_module_states``,
a seeded model, a partial ``strict=False`` load) must stay silent.
``docs/silent.rst`` lists them.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import fsdp_cls, fsdp_kwargs, wrap_api

Record = dict[str, Any]


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _full(model: nn.Module, impl: str) -> dict[str, torch.Tensor]:
    with fsdp_cls(impl).summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int = 3) -> None:
    for i in range(n):
        g = torch.Generator().manual_seed(10 * i + dist.get_rank())
        model(torch.randn(5, 4, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()


def _ranks_agree(t: torch.Tensor) -> bool:
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return all(torch.equal(out[0], o) for o in out)


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before)


# Each case: fn(impl) -> effect (a str), run under warnings.catch_warnings.
def _optimizer_before_wrap(impl: str, use_orig_params: bool = False) -> str:
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # before wrapping: holds the originals
    model = fsdp_cls(impl)(m, **fsdp_kwargs(impl, use_orig_params=use_orig_params))
    before = _full(model, impl)
    _steps(model, opt)
    return "learned" if _changed(before, _full(model, impl)) else "unchanged"


def _optimizer_on_unwrapped_model(impl: str) -> str:
    base = _net()
    model = fsdp_cls(impl)(copy.deepcopy(base), **fsdp_kwargs(impl))
    opt = torch.optim.SGD(base.parameters(), lr=0.1)  # the unwrapped copy's parameters
    before = _full(model, impl)
    _steps(model, opt)
    return "learned" if _changed(before, _full(model, impl)) else "unchanged"


def _step_in_no_sync(impl: str, strategy: str) -> str:
    model = fsdp_cls(impl)(_net(), **fsdp_kwargs(impl, sharding_strategy=strategy))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.no_sync():  # never left before the steps
        _steps(model, opt)
    params = _full(model, impl)
    return "ranks agree" if _ranks_agree(params[next(iter(params))]) else "ranks differ"


def _everything_ignored(impl: str) -> str:
    m = _net()
    model = fsdp_cls(impl)(m, **fsdp_kwargs(impl, ignored_modules=[m[0], m[2]]))
    _steps(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return "ranks agree" if _ranks_agree(m[0].weight.detach()) else "ranks differ"


def _policy_matching_nothing(impl: str) -> str:
    policy = wrap_api(impl).ModuleWrapPolicy({nn.Conv2d})  # not in the model
    model = fsdp_cls(impl)(_net(), **fsdp_kwargs(impl, auto_wrap_policy=policy))
    return f"{len(fsdp_cls(impl).fsdp_modules(model))} unit(s)"


def _load_matching_nothing(impl: str) -> str:
    model = fsdp_cls(impl)(_net(), **fsdp_kwargs(impl))
    before = _full(model, impl)
    prefixed = {"module." + k: v for k, v in _net(seed=1).state_dict().items()}
    model.load_state_dict(prefixed, strict=False)
    return "changed" if _changed(before, _full(model, impl)) else "unchanged"


def _replicas_differ(impl: str, strategy: str) -> str:
    kw: dict[str, Any] = {"sharding_strategy": strategy}
    if strategy == "HYBRID_SHARD":
        from torch.distributed.device_mesh import init_device_mesh

        kw["device_mesh"] = init_device_mesh("cpu", (dist.get_world_size(), 1))
    model = fsdp_cls(impl)(_net(seed=dist.get_rank()), **fsdp_kwargs(impl, **kw))  # unseeded alike
    _steps(model, torch.optim.SGD(model.parameters(), lr=0.1))
    params = _full(model, impl)
    return "ranks agree" if _ranks_agree(params[next(iter(params))]) else "ranks differ"


def _meta_on_some_ranks(impl: str, sync: bool = False) -> str:
    if dist.get_rank() == 0:
        m = _net(seed=5)  # "the pretrained weights"
    else:
        with torch.device("meta"):
            m = _net()
    model = fsdp_cls(impl)(m, **fsdp_kwargs(impl, sync_module_states=sync,
                                           device_id=torch.device("cpu")))
    got = _full(model, impl)
    want = _net(seed=5).state_dict()
    return "rank 0's weights" if all(torch.equal(got[k], want[k]) for k in want) else "a mix"


def _partial_strict_false_load(impl: str) -> str:
    model = fsdp_cls(impl)(_net(), **fsdp_kwargs(impl))
    sd = {k: v for k, v in _net(seed=1).state_dict().items() if k.startswith("0.")}
    model.load_state_dict(sd, strict=False)
    return "loaded"


# name -> (fn, torch's silent effect, what ours does: ("raises"|"warns", fragments) or None)
CASES: dict[str, tuple[Callable[[str], str], str, tuple[str, tuple[str, ...]] | None]] = {
    "optimizer_before_wrap": (
        _optimizer_before_wrap, "unchanged",
        ("raises", ("SGD.step()", "replaced by its flat parameters", "'0.weight'",
                    "Build the optimizer after wrapping"))),
    "optimizer_on_unwrapped_model": (
        _optimizer_on_unwrapped_model, "unchanged", None),  # see the test below
    "step_in_no_sync_no_shard": (
        lambda i: _step_in_no_sync(i, "NO_SHARD"), "ranks differ",
        ("warns", ("optimizer.step() inside FullyShardedDataParallel.no_sync()",
                   "Leave the no_sync() block before the step"))),
    "everything_ignored": (
        _everything_ignored, "ranks differ",
        ("warns", ("FSDP manages none of the model's trainable parameters",
                   "all 4 of them ('0.bias', '0.weight', '2.bias'",
                   "reduces none of their gradients"))),
    "policy_matching_nothing": (
        _policy_matching_nothing, "1 unit(s)",
        ("warns", ("auto_wrap_policy wraps module classes ['Conv2d']",
                   "contains none of them", "Its module classes: Linear, ReLU, Sequential"))),
    "load_matching_nothing": (
        _load_matching_nothing, "unchanged",
        ("warns", ("load_state_dict(strict=False) loaded none of the model's 4 keys",
                   "'module.0.weight'", "'0.weight'"))),
    "replicas_differ_no_shard": (
        lambda i: _replicas_differ(i, "NO_SHARD"), "ranks differ",
        ("raises", ("the replicas of FSDP unit '<root>'", "hold different parameters at the "
                    "first forward", "rank(s) [1] differ from rank 0", "With NO_SHARD",
                    "sync_module_states=True"))),
    "replicas_differ_hybrid": (
        lambda i: _replicas_differ(i, "HYBRID_SHARD"), "ranks differ",
        ("raises", ("the replicas of FSDP unit '<root>'", "Across the replicas of a hybrid strategy"))),
    "meta_on_some_ranks": (
        _meta_on_some_ranks, "a mix",
        ("warns", ("FSDP unit '<root>' was built from the meta device on rank(s) [1]",
                   "real weights on rank(s) [0]", "sync_module_states=True"))),
}

# Legitimate neighbours: silent on both, with the right effect.
LEGIT: dict[str, tuple[Callable[[str], str], str]] = {
    "optimizer_before_wrap_orig_params": (lambda i: _optimizer_before_wrap(i, True), "learned"),
    "meta_on_some_ranks_synced": (lambda i: _meta_on_some_ranks(i, True), "rank 0's weights"),
    "partial_strict_false_load": (_partial_strict_false_load, "loaded"),
    "step_after_no_sync": (lambda i: _step_after_no_sync(i), "ranks agree"),
}


def _step_after_no_sync(impl: str) -> str:
    model = fsdp_cls(impl)(_net(), **fsdp_kwargs(impl, sharding_strategy="NO_SHARD"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    with model.no_sync():
        model(x).sum().backward()
    model(x).sum().backward()  # the last micro-batch outside: gradients reduced
    opt.step()
    params = _full(model, impl)
    return "ranks agree" if _ranks_agree(params[next(iter(params))]) else "ranks differ"


# Warnings both give for the set-ups' own sake (HYBRID_SHARD over a 2x1 mesh
# has shard groups of one rank; NO_SHARD is deprecated).
_NOISE = ("deprecated", "FSDP is switching to use `NO_SHARD`")


def _record(fn: Callable[[str], str], impl: str) -> Record:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        try:
            effect, error = fn(impl), None
        except Exception as e:  # noqa: BLE001  (recorded for the test)
            effect, error = None, (type(e).__name__, str(e))
    warned = [str(w.message) for w in rec
              if issubclass(w.category, UserWarning) and not issubclass(w.category, FutureWarning)
              and not any(n in str(w.message) for n in _NOISE)]
    dist.barrier()  # both ranks finished the case (no rank left inside a collective)
    return {"effect": effect, "error": error, "warnings": warned}


def _run_all() -> dict[str, dict[str, Record]]:
    out: dict[str, dict[str, Record]] = {}
    for name, (fn, *_) in {**CASES, **LEGIT}.items():
        for impl in ("torch", "ours"):
            out.setdefault(name, {})[impl] = _record(fn, impl)
    return out


_RESULTS: list[dict[str, dict[str, Record]]] = []


def _results(pool: Any) -> list[dict[str, dict[str, Record]]]:
    if not _RESULTS:
        _RESULTS.extend(pool.run(_run_all))
    return _RESULTS


@pytest.mark.parametrize("case", sorted(CASES))
def test_silent_on_torch_named_here(pool2: Any, case: str) -> None:
    _, torch_effect, ours_expect = CASES[case]
    for rank, res in enumerate(_results(pool2)):
        theirs, ours = res[case]["torch"], res[case]["ours"]
        # the oracle: silent and wrong
        assert theirs["error"] is None and not theirs["warnings"], theirs
        assert theirs["effect"] == torch_effect, theirs
        if ours_expect is None:
            continue
        kind, fragments = ours_expect
        if kind == "raises":
            assert ours["error"] is not None, (case, ours)
            text = ours["error"][1]
        else:
            assert ours["error"] is None, (case, ours)
            hits = [w for w in ours["warnings"] if fragments[0] in w]
            assert hits and len(set(hits)) == 1, (case, ours["warnings"])
            text = hits[0]
        for fragment in (*fragments, f"rank {rank}"):
            assert fragment in text, (case, fragment, text)
        assert "_fsdp_wrapped_module" not in text


def test_optimizer_on_an_unwrapped_copy_runs_and_leaves_the_model_as_torch_does(
        pool2: Any) -> None:
    """Left as it is, deliberately (docs/silent.rst): its parameters are not the
    model's at all (a copy), nothing to trace back, and an optimizer of a second
    model looks the same; the step must touch no FSDP parameter, silently, as
    with torch's FSDP1."""
    for res in _results(pool2):
        case = res["optimizer_on_unwrapped_model"]
        for impl in ("torch", "ours"):
            rec = case[impl]
            assert rec["error"] is None and not rec["warnings"], (impl, rec)
            assert rec["effect"] == "unchanged", (impl, rec)


# torch's FSDP1 refuses sync_module_states for CPU parameters, whatever device_id says.
_TORCH_REFUSES_ON_CPU = {"meta_on_some_ranks_synced"}


@pytest.mark.parametrize("case", sorted(LEGIT))
def test_legitimate_neighbours_stay_silent(pool2: Any, case: str) -> None:
    for res in _results(pool2):
        for impl in ("torch", "ours"):
            if impl == "torch" and case in _TORCH_REFUSES_ON_CPU:
                continue
            rec = res[case][impl]
            assert rec["error"] is None and not rec["warnings"], (impl, rec)
            assert rec["effect"] == LEGIT[case][1], (impl, rec)


def test_step_in_no_sync_with_a_sharded_strategy_names_the_cause(pool2: Any) -> None:
    """torch fails with a bare shape mismatch inside the optimizer; ours says why."""
    for rank, (theirs, ours) in enumerate(pool2.run(_no_sync_full_shard)):
        assert theirs is not None and "must match the size" in theirs, theirs
        assert ours is not None and "inside FullyShardedDataParallel.no_sync()" in ours, ours
        assert f"[rank {rank}]" in ours and "cannot apply" in ours, ours


def _no_sync_full_shard() -> tuple[str | None, str | None]:
    out = []
    for impl in ("torch", "ours"):
        rec = _record(lambda i: _step_in_no_sync(i, "FULL_SHARD"), impl)
        out.append(rec["error"][1] if rec["error"] else None)
    return out[0], out[1]


def _named_in_refusals() -> dict[str, str]:
    """The details two refusals name: the optimizer built before wrapping (six
    replaced parameters: five named, then "..."; again once the model is gone,
    which leaves nothing to name), and a forward through a nested unit left
    marked as a root (the unit's FQN)."""
    import gc
    import weakref

    import fsdp_wrap
    from fsdp_wrap.wrap import ModuleWrapPolicy

    out: dict[str, str] = {}
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    model: Any = fsdp_wrap.FullyShardedDataParallel(m)
    gone = weakref.ref(model)

    def step() -> str:
        try:
            opt.step()
            return "no error"
        except RuntimeError as e:
            return str(e)

    out["wrapped"] = step()
    del model, m
    gc.collect()
    out["collected"] = str(gone() is None)
    out["model gone"] = step()
    # an optimizer that stepped once before the model was wrapped: its check
    # looks again once the model is wrapped
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt.step()  # (no gradient yet: nothing changes, nothing to refuse)
    model = fsdp_wrap.FullyShardedDataParallel(m)
    out["stepped before wrapping"] = step()
    torch.manual_seed(0)
    model = fsdp_wrap.FullyShardedDataParallel(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3)),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    with torch.no_grad():
        model(torch.ones(2, 4))  # (the tree set up: unit '0' is not a root)
    model.module[0]._is_root = True
    try:
        model(torch.ones(2, 4))
        out["stale root"] = "no error"
    except AttributeError as e:
        out["stale root"] = str(e)
    return out


def test_refusals_name_what_they_found(pool2: Any) -> None:
    for rank, got in enumerate(pool2.run(_named_in_refusals)):
        wrapped = got["wrapped"]
        assert "holds 6 parameter(s) that FSDP replaced" in wrapped, wrapped
        # (five named, in the model's order, then "...")
        assert "('0.weight', '0.bias', '1.weight', '1.bias', '2.weight', ...)" in wrapped, wrapped
        assert got["collected"] == "True", got  # (else the next case says nothing)
        assert "holds 6 parameter(s) that FSDP replaced by its flat parameters ()" in \
            got["model gone"], got
        assert "holds 4 parameter(s) that FSDP replaced" in got["stepped before wrapping"], got
        stale = got["stale root"]
        assert f"[rank {rank}, FSDP unit '0']" in stale and "_is_root=True" in stale, stale
