"""Helpers shared by the option test files (mixed precision, offload, hybrid, ...).

Each test file ships a list of configurations to one ``pool.run``; on every
rank a worker trains a reference (torch's FSDP1 where it supports the option
on CPU, else a plain replicated model with all-reduced mean gradients) and
fsdp_wrap in lockstep on different data per rank, and returns a list of
human-readable failures.  Everything here runs inside the workers.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from tests._sweep import Injection, injected, run_sweep
from tests.models import VOCAB

U32 = 2.0**-24  # unit roundoff of float32

# A tolerance for :func:`cmp`: a number, or a function of the reference value
# (for bounds that scale with its magnitude, see :func:`replicated_tol`).
# There is no default: 0.0 (bit-exact) where both sides compute the same
# values by the same operations in the same order, else a bound derived from
# what differs, written beside the call.
Tol = Union[float, Callable[[torch.Tensor], float]]


def fp32_bound(step: int, ws: int, scale: float, longest_sum: int) -> float:
    """How far an fp32 FSDP value may be from the exact one after ``step + 1`` steps.

    Higham's bound for a sum of ``n`` terms in floating point is
    ``gamma_n ~= n * u`` times the sum of their magnitudes, whatever the
    order.  One step computes sums of at most ``longest_sum`` terms on each
    rank (the model's widest matmul or mean), then a sum over ``ws`` ranks:
    at most ``(longest_sum + ws - 1) * u`` relative to the value's ``scale``
    (its largest magnitude).  To first order the errors of successive steps
    add, hence ``step + 1``.

    Two fp32 runs that differ only in summation order (buckets at 3+ ranks)
    are each within this of the exact result, so within twice it of each
    other.
    """
    return (step + 1) * (longest_sum + ws - 1) * U32 * scale


# The longest sum one training step of each model of tests.models computes
# (for fp32_bound), forward and backward:
LONGEST_SUM = {
    # the loss's mean over the 3 x 5 x VOCAB logits (matmuls sum over at most
    # HIDDEN = 10 terms, weight gradients over the 15 rows of a batch, the
    # tied embedding's gradient over 15 head rows + 15 token lookups)
    "transformer": 3 * 5 * VOCAB,
    # the loss's mean over the 3 x 4 x 3 outputs (matmuls sum over at most 9
    # terms, weight gradients over the 12 rows of a batch)
    "deep": 3 * 4 * 3,
}


def longest_sum(model_name: str, model: nn.Module, clip: float | None = None) -> int:
    """:data:`LONGEST_SUM` of ``model_name``, or with a finite-``clip`` norm (a
    sum over every gradient element) the number of parameters if larger.  An
    inf norm is a max, exact in any order, and adds no sum."""
    n = LONGEST_SUM[model_name]
    if clip is not None and math.isfinite(clip):
        n = max(n, sum(p.numel() for p in model.parameters()))
    return n


def replicated_tol(step: int, ws: int, longest: int) -> Callable[[torch.Tensor], float]:
    """fsdp_wrap against a plain replicated model, where the two compute the same
    sums in different orders: each is within :func:`fp32_bound` of the exact
    value (at the reference's largest magnitude), so within twice it of the
    other (as in tests/test_buckets.py).

    What may reorder the sums (each call site says which it sees): the
    matmuls read the parameters as views into a flat parameter (offset,
    alignment) where the reference has standalone tensors, and a BLAS may
    block the same dot products differently for them (bit-exact on the
    machines measured so far, not guaranteed); over 3+ ranks the reference's
    all-reduce and FSDP's reductions add the ranks in different orders (over
    2 it is one commutative add); a finite-norm clip sums the squares per
    parameter there, per flat shard and then over ranks here.
    """

    def tol(ref: torch.Tensor) -> float:
        scale = float(ref.detach().float().abs().max()) if ref.numel() else 0.0
        return 2 * fp32_bound(step, ws, scale, longest)

    return tol


def rank_tag() -> str:
    return f"[rank {dist.get_rank()}]"


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max())


def shape_of(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{tuple(t.shape)}/{t.dtype}/{t.device.type}"


def cmp(what: str, a: torch.Tensor | None, b: torch.Tensor | None, tol: Tol,
        check_dtype: bool = True) -> str | None:
    """None if ``a`` (reference) and ``b`` (ours) agree within ``tol``, else why not.

    ``tol`` is required (see :data:`Tol`); a callable gets the reference ``a``.
    """
    bad = injected(what)
    if bad:
        return bad
    if a is None or b is None:
        return None if a is None and b is None else f"{what}: ref {shape_of(a)} vs ours {shape_of(b)}"
    if a.shape != b.shape or (check_dtype and a.dtype != b.dtype):
        return f"{what}: ref {shape_of(a)} vs ours {shape_of(b)}"
    d = maxdiff(a, b)
    bound = tol(a) if callable(tol) else tol
    return None if d <= bound else f"{what}: max |diff| {d:.3g} > {bound:.3g}"


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def snapshot(model: nn.Module) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    return grads, params


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss: torch.Tensor,
    before_step: Callable[[nn.Module], Any] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None], list[torch.Tensor]]:
    """Backward, (optional hook, e.g. clipping), snapshot the gradients, step.

    Returns ``(loss, grads, params)``, the tuple :func:`compare_step` compares.
    """
    loss.backward()
    if before_step is not None:
        before_step(model)
    grads, _ = snapshot(model)
    opt.step()
    opt.zero_grad()
    return loss.detach(), grads, [p.detach().clone() for p in model.parameters()]


def compare_step(tag: str, names: list[str], ref: tuple[Any, ...], ours: tuple[Any, ...],
                 tol: Tol, loss_tol: Tol | None = None) -> list[str]:
    """Compare ``(loss, grads, params)`` triples within ``tol`` (required, see
    :data:`Tol`); return at most one summary line."""
    (l1, g1, p1), (l2, g2, p2) = ref, ours
    errs = [cmp("loss", l1, l2, loss_tol if loss_tol is not None else tol)]
    errs += [cmp(f"grad of {names[i]}", a, b, tol) for i, (a, b) in enumerate(zip(g1, g2))]
    errs += [cmp(f"param {names[i]}", a, b, tol) for i, (a, b) in enumerate(zip(p1, p2))]
    if len(g1) != len(g2):
        errs.append(f"parameter count: ref {len(g1)} vs ours {len(g2)}")
    found = [e for e in errs if e]
    if not found:
        return []
    more = f" (+{len(found) - 5} more)" if len(found) > 5 else ""
    return [f"{tag}: " + "; ".join(found[:5]) + more]


def run_configs(configs: list[dict[str, Any]], fn: Callable[[dict[str, Any]], list[str]],
                describe: Callable[[dict[str, Any]], str] | None = None,
                inject: Injection | None = None) -> list[str]:
    """Run ``fn(cfg)`` for each config (:func:`tests._sweep.run_sweep`): differences
    are returned, an exception ends the task naming its configuration.

    (It used to report an exception and go on, which is only safe when every
    rank raises at the same point; one rank raising alone left the others in a
    collective until the pool's timeout.)
    """
    return run_sweep(configs, fn, describe or (lambda c: f"{rank_tag()} {c}"), inject)


# ---------------------------------------------------------------------------
# a plain replicated reference (what FSDP must equal when torch cannot run it)
# ---------------------------------------------------------------------------


class Replicated:
    """A plain copy of the model whose gradients are all-reduced to the mean.

    ``group=None`` means the default group.  ``sync()`` after backward turns
    the local gradients into the mean over the group's ranks, which is what
    every FSDP strategy must produce.
    """

    def __init__(self, model: nn.Module, group: Any = None) -> None:
        self.module = copy.deepcopy(model)
        self.group = group

    def sync(self) -> None:
        ws = dist.get_world_size(self.group)
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad.div_(ws)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type)


def fsdp_grads_full(model: nn.Module) -> list[torch.Tensor | None]:
    """Full (unsharded) gradients of an fsdp_wrap model in original-parameter order.

    Uses ``summon_full_params(with_grads=True)``, which needs use_orig_params.
    """
    import fsdp_wrap as fw

    with fw.FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def fsdp_params_full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full original parameters of an fsdp_wrap or torch FSDP model, by clean FQN."""
    from tests.models import fsdp_api

    impl = "ours" if type(model).__module__.startswith("fsdp_wrap") else "torch"
    cls = fsdp_api(impl).FullyShardedDataParallel
    with cls.summon_full_params(model, writeback=False):
        return {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
        }
