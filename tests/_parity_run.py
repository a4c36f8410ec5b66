"""One parity configuration run and compared (``tests/test_parity.py`` says
what is compared and how closely): torch's FSDP1 and fsdp_wrap trained in
lockstep from one model, compared bit for bit where the order of operations is
torch's, else each against a float64 replicated model (:class:`Exact64`)
under :func:`fp32_bound`; the state-dict checks; the sweep over a world size's
configurations (``_sweep``, what a pool runs).
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests._options_common import fp32_bound as _fp32_bound
from tests._parity_configs import (
    MAX_NORM,
    _describe,
)
from tests._sweep import Injection, any_rank, injected, run_sweep
from tests.models import VOCAB, build, fsdp_api, make_input, new_model

# ---------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _order_is_torchs(cfg: dict[str, Any]) -> bool:
    """Does fsdp_wrap add each gradient element across ranks in torch's order?

    At 2 ranks always (``a + b == b + a`` exactly); at more only without
    buckets, where it issues torch's per-unit collective.
    """
    return dist.get_world_size() <= 2 or cfg["cap"] == 0.0


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.numel():
        return 0.0
    # in float64, so that comparing with the float64 reference adds no rounding;
    # offloaded state dicts are on the CPU, torch's may be on the GPU
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def _cmp_tensors(what: str, a: torch.Tensor | None, b: torch.Tensor | None) -> str | None:
    """None if ``a`` (torch) and ``b`` (ours) are identical, else why not."""
    bad = injected(what)
    if bad:
        return bad
    if a is None or b is None:
        return None if a is None and b is None else f"{what}: torch {_sh(a)} vs ours {_sh(b)}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{what}: torch {_sh(a)} vs ours {_sh(b)}"
    d = _maxdiff(a, b)
    return None if d == 0.0 else f"{what}: max |diff| {d:.3g} (must be bit-exact)"


def _sh(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{tuple(t.shape)}/{t.dtype}"


def _param_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


# ---------------------------------------------------------------------------
# the float64 reference and the bound for bucketed reductions at 3+ ranks
# ---------------------------------------------------------------------------


# The longest sum any of the models computes: the loss's mean over the
# transformer's 3 x 5 x VOCAB logits (matmuls sum over at most 11 terms, the
# backward's weight gradients over 15 rows).
LONGEST_SUM = 3 * 5 * VOCAB


def fp32_bound(step: int, ws: int, scale: float) -> float:
    """:func:`tests._options_common.fp32_bound` for these models (their longest
    sum is :data:`LONGEST_SUM`).

    The bound holds for any summation order, so it holds for torch's FSDP1 as
    for fsdp_wrap; the sweep checks both.  Measured on a 2-core Xeon, the worst
    value reaches 0.3 of it (parameters after 3 Adam steps at 3 and 4 ranks).
    It still catches real errors: a reference whose gradients are off by one
    part in 10**4 fails it in 22 of 24 bucketed configurations at 3 ranks (the
    other two clip, which cancels a uniform scaling); a rank's contribution
    lost or counted twice is an error of 1 part in 3.
    """
    return _fp32_bound(step, ws, scale, LONGEST_SUM)


class Exact64:
    """The same training as the FSDP models, in float64 on a plain model replicated
    on every rank: gradients all-reduced and divided by the world size, then
    clipping and the optimizer as in FSDP.  Its own rounding (2**-53) is 2**29
    times below fp32's, so it stands for the exact trajectory."""

    def __init__(self, base: nn.Module, cfg: dict[str, Any]) -> None:
        self.model = copy.deepcopy(base).double()
        self.opt = _optimizer(self.model, cfg["opt"])
        self.cfg = cfg

    def _loss(self, x: torch.Tensor) -> torch.Tensor:
        x = x.double() if x.is_floating_point() else x
        return self.model(x).pow(2).mean()

    def step(self, x: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg, ws = self.cfg, dist.get_world_size()
        if cfg["nosync"]:
            self._loss(x2).backward()
        loss = self._loss(x)
        loss.backward()
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(ws)
        norm = None
        if cfg["clip"] is not None:
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM[cfg["clip"]], cfg["clip"])
        self.opt.step()
        if not cfg["accum"]:
            self.opt.zero_grad()
        return loss.detach(), norm

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}


def _full_params(model: nn.Module, impl: str) -> dict[str, torch.Tensor]:
    """Every original parameter, unsharded, by its clean name (collective)."""
    cls = fsdp_api(impl).FullyShardedDataParallel
    with cls.summon_full_params(model, writeback=False):
        return {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
        }


def _cmp_exact64(
    what: str, step: int, exact: torch.Tensor | None, got: dict[str, Any], stats: dict[str, float]
) -> list[str]:
    """Each implementation's value against the float64 one, within :func:`fp32_bound`."""
    bad = injected(what)
    if bad:
        return [bad]
    if exact is None:
        return [
            f"{what}: {impl} has {_sh(t)}, float64 has None"
            for impl, t in got.items()
            if t is not None
        ]
    scale = float(exact.abs().max()) if exact.numel() else 0.0
    bound = fp32_bound(step, dist.get_world_size(), scale)
    errs = []
    for impl, t in got.items():
        if t is None or t.shape != exact.shape:
            errs.append(f"{what}: {impl} has {_sh(t)}, float64 has {_sh(exact)}")
            continue
        d = _maxdiff(exact, t)
        key = f"worst/bound:{what.split()[0]}:{impl}"
        if scale:
            stats[key] = max(stats.get(key, 0.0), d / bound)
        if d > bound:
            errs.append(
                f"{what}: {impl} is {d:.3g} from float64 (bound {bound:.3g} at step {step})"
            )
    return errs


def _step_both(
    models: tuple[nn.Module, nn.Module],
    opts: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    cfg: dict[str, Any],
    x: torch.Tensor,
    x2: torch.Tensor,
    unsharded: bool = False,
) -> list[tuple[Any, ...]]:
    """One step of each model; gradients and parameters as each rank holds
    them, or (``unsharded``) gathered whole, frozen parameters' gradients
    (zeros in torch's one flat parameter) as ``None``."""
    clip, res = cfg["clip"], []
    for model, opt, impl in zip(models, opts, ("torch", "ours")):
        if cfg["nosync"]:
            with model.no_sync():
                _loss(model(x2)).backward()
        loss = _loss(model(x))
        loss.backward()
        norm = model.clip_grad_norm_(MAX_NORM[clip], clip) if clip is not None else None
        if unsharded:
            with fsdp_api(impl).FullyShardedDataParallel.summon_full_params(
                model, writeback=False, with_grads=True
            ):
                grads = [None if p.grad is None or not p.requires_grad
                         else p.grad.detach().clone() for p in model.parameters()]
        else:
            grads = [None if p.grad is None else p.grad.detach().clone()
                     for p in model.parameters()]
        opt.step()
        if not cfg["accum"]:
            opt.zero_grad()
        if unsharded:
            params = list(_full_params(model, impl).values())
        else:
            params = [p.detach().clone() for p in model.parameters()]
        res.append((loss.detach(), norm, grads, params))
    return res


def _train_compare(
    ref: nn.Module,
    ours: nn.Module,
    base: nn.Module,
    cfg: dict[str, Any],
    gen: torch.Generator,
    steps: int,
    tag: str,
    stats: dict[str, float],
) -> list[str]:
    """Train both in lockstep; return what differed (stop after the first bad step,
    on every rank: the decision is agreed).

    ``base`` (the unwrapped model both started from) seeds the float64
    reference where the reduction order is not torch's.
    """
    names = _param_names(ref)
    # A unit mixing frozen and trainable parameters is split into several flat
    # parameters (docs/fine_tuning.rst): each rank's 1-D pieces then differ
    # from torch's, so gradients and parameters are compared unsharded.
    split = any(len(u._handles) > 1 for u in fsdp_api("ours").FullyShardedDataParallel.fsdp_modules(ours))
    if names != _param_names(ours) or (not split and [p.shape for p in ref.parameters()] != [
        p.shape for p in ours.parameters()
    ]):
        # the same on every rank (construction is deterministic): no collective skipped unevenly
        return [
            f"{tag}: optimizer-visible params differ: torch "
            f"{[(n, tuple(p.shape)) for n, p in ref.named_parameters()]} vs ours "
            f"{[(n, tuple(p.shape)) for n, p in ours.named_parameters()]}"
        ]
    # (split: the same sums, but kernels see differently aligned views, so the
    # last bit may differ from torch's; both are held to the float64 reference)
    exact = None if _order_is_torchs(cfg) and not split else Exact64(base, cfg)
    opts = (_optimizer(ref, cfg["opt"]), _optimizer(ours, cfg["opt"]))
    clip = cfg["clip"]
    for step in range(steps):
        x = make_input(cfg["model"], gen)
        x2 = make_input(cfg["model"], gen)
        (l1, n1, g1, p1), (l2, n2, g2, p2) = _step_both((ref, ours), opts, cfg, x, x2, split)
        if clip is not None and n1 is not None and float(n1) > MAX_NORM[clip]:
            stats["clipped"] += 1
        stats["grads_seen"] += sum(g is not None for g in g1)
        where = f"{tag} step {step}"
        if exact is None:
            errs = [_cmp_tensors("loss", l1, l2)]
            if clip is not None:
                errs.append(
                    _cmp_tensors(f"clip_grad_norm_({MAX_NORM[clip]}, {clip}) result", n1, n2)
                )
            errs += [
                _cmp_tensors(f"grad of {names[i]}", a, b) for i, (a, b) in enumerate(zip(g1, g2))
            ]
            errs += [
                _cmp_tensors(f"param {names[i]}", a, b) for i, (a, b) in enumerate(zip(p1, p2))
            ]
            found = [e for e in errs if e]
        else:
            found = _cmp_with_exact64(exact, (ref, ours), step, x, x2, (l1, l2), (n1, n2), stats)
            # the structure still matches torch's exactly: which grads exist, their shapes
            found += [
                f"grad of {names[i]}: torch {_sh(a)} vs ours {_sh(b)}"
                for i, (a, b) in enumerate(zip(g1, g2))
                if (a is None) != (b is None)
                or (a is not None and b is not None and a.shape != b.shape)
            ]
        if found:
            more = f" (+{len(found) - 6} more)" if len(found) > 6 else ""
            fails = [f"{where}: " + "; ".join(found[:6]) + more]
        else:
            fails = []
        if any_rank(bool(fails)):
            return fails
    return []


def _cmp_with_exact64(
    exact: Exact64,
    models: tuple[nn.Module, nn.Module],
    step: int,
    x: torch.Tensor,
    x2: torch.Tensor,
    losses: tuple[torch.Tensor, torch.Tensor],
    norms: tuple[Any, Any],
    stats: dict[str, float],
) -> list[str]:
    loss64, norm64 = exact.step(x, x2)
    found = _cmp_exact64("loss", step, loss64, dict(torch=losses[0], ours=losses[1]), stats)
    if norm64 is not None:
        found += _cmp_exact64(
            "clip_grad_norm_", step, norm64, dict(torch=norms[0], ours=norms[1]), stats
        )
    full = [_full_params(m, impl) for m, impl in zip(models, ("torch", "ours"))]
    for name, p64 in exact.params().items():
        got = dict(torch=full[0].get(name), ours=full[1].get(name))
        found += _cmp_exact64(f"param {name}", step, p64, got, stats)
    return found


def _cmp_state_dicts(
    what: str, ref_sd: dict[str, Any], our_sd: dict[str, Any], steps: int | None = None
) -> list[str]:
    """Bit-exact, or (``steps``: values trained that many steps by the two
    implementations in different summation orders) within twice the fp32
    bound each has from the exact trajectory."""
    if list(ref_sd) != list(our_sd):
        return [f"{what}: keys differ: torch {list(ref_sd)} vs ours {list(our_sd)}"]
    if steps is None:
        errs = [_cmp_tensors(f"{what}[{k}]", ref_sd[k], our_sd[k]) for k in ref_sd]
        return [e for e in errs if e]
    errs = []
    for k, a in ref_sd.items():
        bad = injected(f"{what}[{k}]")
        if bad:
            return [bad]
        b = our_sd[k]
        scale = float(a.abs().max()) if a.numel() and a.is_floating_point() else 0.0
        bound = 2 * fp32_bound(steps, dist.get_world_size(), scale)
        if a.shape != b.shape or _maxdiff(a, b) > bound:
            errs.append(f"{what}[{k}]: max |diff| {_maxdiff(a, b) if a.shape == b.shape else 'shape'}"
                        f" > {bound:.3g}")
    return errs


def _full_sd(
    model: nn.Module, impl: str, rank0_only: bool = False, offload: bool = False
) -> dict[str, Any]:
    api = fsdp_api(impl)
    cfg = api.FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)
    with api.FullyShardedDataParallel.state_dict_type(
        model, api.StateDictType.FULL_STATE_DICT, cfg
    ):
        return model.state_dict()


def _state_dict_checks(
    ref: nn.Module,
    ours: nn.Module,
    cfg: dict[str, Any],
    kw: dict[str, Any],
    gen: torch.Generator,
    tag: str,
    stats: dict[str, float],
) -> list[str]:
    rank = dist.get_rank()
    fails: list[str] = []
    # split units: trained in other summation orders (see _train_compare)
    tol = 3 if any(len(u._handles) > 1 for u in fsdp_api("ours").FullyShardedDataParallel.fsdp_modules(ours)) else None
    ref_sd = _full_sd(ref, "torch")
    our_sd = _full_sd(ours, "ours")
    plain_keys = list(new_model(cfg["model"]).state_dict())
    if list(our_sd) != plain_keys:
        fails.append(f"{tag}: state_dict keys {list(our_sd)} != unwrapped model's {plain_keys}")
    ref_sd_r0 = _full_sd(ref, "torch", rank0_only=True)  # every rank: it may all-gather
    no_shard = cfg["strategy"] == "NO_SHARD"
    for rank0_only, offload in ((True, False), (False, True), (True, True)):
        sd = _full_sd(ours, "ours", rank0_only=rank0_only, offload=offload)
        what = f"{tag}: FULL_STATE_DICT(rank0_only={rank0_only}, offload_to_cpu={offload})"
        if rank0_only and rank > 0:
            # torch's NO_SHARD ignores rank0_only (full dict everywhere); that
            # divergence has its own test below.
            if not no_shard:
                if len(sd) != 0:
                    fails.append(f"{what}: expected {{}} on rank {rank}, got keys {list(sd)}")
                if len(ref_sd_r0) != 0:
                    fails.append(f"{what}: torch's rank0_only dict is not empty on rank {rank}")
            continue
        if rank0_only and not offload:
            fails += _cmp_state_dicts(f"{what} vs torch's same config", ref_sd_r0, sd, tol)
        fails += _cmp_state_dicts(f"{what} vs torch's default", ref_sd, sd, tol)
        if offload and any(t.device.type != "cpu" for t in sd.values()):
            fails.append(f"{what}: a value is not on CPU")
    fails += _cmp_state_dicts(f"{tag}: FULL_STATE_DICT", ref_sd, our_sd, tol)
    # Parameter values are copies: changing them must not touch the model
    # (buffers are the modules' own tensors, as in torch: tests/test_state_dict_buffers.py).
    if our_sd:
        before = [p.detach().clone() for p in ours.parameters()]
        buffer_keys = {n for n, _ in new_model(cfg["model"]).named_buffers()}
        for k, t in our_sd.items():
            if t.is_floating_point() and k not in buffer_keys:
                t.add_(1000.0)
        if any(_maxdiff(a, p) > 0 for a, p in zip(before, ours.parameters())):
            fails.append(f"{tag}: mutating the returned state dict changed the model")
        our_sd = _full_sd(ours, "ours")

    # Round trips: torch's dict into a fresh ours, ours into a fresh torch.
    torch.manual_seed(4242 + cfg["idx"])
    base2 = new_model(cfg["model"])
    ref2 = build(cfg["model"], "torch", base2, **_torch_kw(kw))
    ours2 = build(cfg["model"], "ours", base2, **kw)
    base2.load_state_dict(ref_sd)  # (the float64 reference starts where both models do)
    ours2.load_state_dict(ref_sd)
    ref2.load_state_dict(our_sd)
    fails += _cmp_state_dicts(
        f"{tag}: ours after loading torch's FULL dict", ref_sd, _full_sd(ours2, "ours")
    )
    fails += _cmp_state_dicts(
        f"{tag}: torch after loading our FULL dict", our_sd, _full_sd(ref2, "torch")
    )
    fails += _train_compare(
        ref2, ours2, base2, cfg, gen, 2, f"{tag} after cross-loading state dicts", stats
    )
    stats["sd_checked"] += 1
    return fails


def _torch_kw(kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` without fsdp_wrap's additions (torch's FSDP1 has no bucket_cap_mb)."""
    return {k: v for k, v in kw.items() if k != "bucket_cap_mb"}


def _run_config(cfg: dict[str, Any], stats: dict[str, float]) -> list[str]:
    rank = dist.get_rank()
    tag = f"[rank {rank}] {_describe(cfg)}"
    torch.manual_seed(cfg["idx"])  # same initial model on every rank
    base = new_model(cfg["model"])
    kw = dict(
        sharding_strategy=cfg["strategy"],
        use_orig_params=cfg["uop"],
        backward_prefetch=cfg["bp"],
        forward_prefetch=cfg["fp"],
    )
    if cfg.get("device"):  # the CUDA sweeps (tests/test_cuda.py) set it
        kw["device_id"] = torch.device(cfg["device"])
    if cfg["cap"] is not None:
        kw["bucket_cap_mb"] = cfg["cap"]
    ref = build(cfg["model"], "torch", base, **_torch_kw(kw))
    ours = build(cfg["model"], "ours", base, **kw)
    gen = torch.Generator().manual_seed(1000 + 7919 * rank + cfg["idx"])  # different data per rank
    fails = _train_compare(ref, ours, base, cfg, gen, 3, tag, stats)
    # agreed: a difference on one rank must not make it skip the others' collectives
    if cfg["sd"] and not any_rank(bool(fails)):
        fails += _state_dict_checks(ref, ours, cfg, kw, gen, tag, stats)
    return fails


def _group(cfg: dict[str, Any]) -> str:
    return "accumulation" if cfg["accum"] else cfg["model"]


def _sweep(
    configs: list[dict[str, Any]], inject: Injection | None = None
) -> tuple[list[tuple[str, str]], dict[str, float]]:
    """Run every config; return ``(group, failure)`` pairs and counters."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    stats: dict[str, float] = {"clipped": 0, "grads_seen": 0, "sd_checked": 0}

    def one(cfg: dict[str, Any]) -> list[tuple[str, str]]:
        group = _group(cfg)
        t0, c0 = time.perf_counter(), time.process_time()
        fails = [(group, f) for f in _run_config(cfg, stats)]
        stats[f"configs:{group}"] = stats.get(f"configs:{group}", 0) + 1
        stats[f"seconds:{group}"] = stats.get(f"seconds:{group}", 0.0) + time.perf_counter() - t0
        stats[f"cpu_seconds:{group}"] = (
            stats.get(f"cpu_seconds:{group}", 0.0) + time.process_time() - c0
        )
        return fails

    return run_sweep(configs, one, _describe, inject), stats  # type: ignore[arg-type]
