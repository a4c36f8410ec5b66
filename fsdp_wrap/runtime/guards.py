"""Set-ups that run without an error and train wrongly: refused, or warned about.

Each check here catches a set-up under which torch's FSDP1 (and fsdp_wrap
before it) trains on without a word while nothing learns, nothing is
synchronised or the ranks drift apart (``docs/silent.rst`` lists them, with
what torch does and the test of each):

* an optimizer holding the parameters FSDP replaced by its flat parameters
  (built before wrapping with ``use_orig_params=False``): refused at its
  ``step()`` (:func:`install_optimizer_check`);
* ``optimizer.step()`` inside ``no_sync()``: refused for the sharded
  strategies, warned about for ``NO_SHARD``; with ``set_requires_all_reduce(False)``
  left set (partial sums waiting): warned about;
* every trainable parameter ignored, so FSDP reduces no gradient: warned about
  at lazy init (:func:`check_tree`);
* some ranks built a unit on the meta device and others with real weights,
  without ``sync_module_states``: warned about at lazy init
  (:func:`meta_mismatch`);
* replicas (``NO_SHARD``, or the replicas of a hybrid strategy) holding
  different parameters at the first forward: refused on every rank
  (:func:`check_replicas`, one small all-gather, only for those strategies);
* ``load_state_dict(strict=False)`` that matched no key: warned about
  (:func:`check_nothing_loaded`).

The optimizer check is one global optimizer step pre-hook, registered at the
first unit's construction; per step it costs a sum over the optimizer's
parameter groups and a flag read per unit (the parameters are looked at again
only when their number changes).
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

import fsdp_wrap.comm.collectives as C
from fsdp_wrap.api import ShardingStrategy
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.accumulation import warn_step_with_partial
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import UnitState

__all__ = [
    "install_optimizer_check",
    "mark_unit_params",
    "check_tree",
    "meta_mismatch",
    "check_replicas",
    "check_nothing_loaded",
]

# Marks on parameters are plain ints (a parameter stays picklable): keys into
# this registry of live units.
_UNITS: weakref.WeakValueDictionary[int, UnitState] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)
_GENERATION = [0]  # bumped whenever parameters are marked: cached optimizer checks expire
_UNIT_ATTR = "_fsdp_wrap_unit"  # on a flat parameter, or an original one with use_orig_params=True
_REPLACED_ATTR = "_fsdp_wrap_replaced"  # on an original replaced by a flat parameter: (unit, h, i)


def mark_unit_params(state: UnitState) -> None:
    """Tag the parameters an optimizer should hold (the flat parameters, or the
    originals with ``use_orig_params=True``) with their unit, and the originals a
    flat parameter replaced as replaced."""
    key = next(_KEYS)
    _UNITS[key] = state
    _GENERATION[0] += 1
    for h_index, h in enumerate(state._handles):
        if h.use_orig_params:
            for info in h.infos:
                setattr(info.param, _UNIT_ATTR, key)
        else:
            setattr(h.flat_param, _UNIT_ATTR, key)
            for i, info in enumerate(h.infos):
                setattr(info.param, _REPLACED_ATTR, (key, h_index, i))


# --------------------------------------------------------------- optimizer

_OPTIMIZERS: weakref.WeakKeyDictionary[Any, tuple[int, list[int], list[tuple[int, int, int]]]] = (
    weakref.WeakKeyDictionary()
)
_HOOK: Any = None


def install_optimizer_check() -> None:
    """Register the optimizer step pre-hook (once per process)."""
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return
    count = sum(len(g["params"]) for g in groups) + (_GENERATION[0] << 32)
    seen = _OPTIMIZERS.get(optimizer)
    if seen is None or seen[0] != count:
        units: dict[int, None] = {}
        replaced: list[tuple[int, int, int]] = []
        for g in groups:
            for p in g["params"]:
                key = getattr(p, _UNIT_ATTR, None)
                if key is not None:
                    units[key] = None
                mark = getattr(p, _REPLACED_ATTR, None)
                if mark is not None:
                    replaced.append(mark)
        seen = (count, list(units), replaced)
        _OPTIMIZERS[optimizer] = seen
    if seen[2]:
        _refuse_replaced(optimizer, seen[2])
    live = [u for u in (_UNITS.get(key) for key in seen[1]) if u is not None]
    for unit in live:
        if not unit._sync_gradients:
            _step_in_no_sync(unit)
    warn_step_with_partial(optimizer, live)


def _param_name(mark: tuple[int, int, int]) -> str | None:
    unit = _UNITS.get(mark[0])
    if unit is None or mark[1] >= len(unit._handles):
        return None
    h = unit._handles[mark[1]]
    fqn = clean_fqn(h.infos[mark[2]].fqn)
    return f"{h.unit_fqn}.{fqn}" if h.unit_fqn else fqn


def _refuse_replaced(optimizer: Any, marks: list[tuple[int, int, int]]) -> None:
    names = [n for n in (_param_name(m) for m in marks) if n is not None]
    shown = ", ".join(f"'{n}'" for n in names[:5]) + (", ..." if len(names) > 5 else "")
    raise RuntimeError(
        f"{type(optimizer).__name__}.step() [rank {global_rank()}]: the optimizer holds "
        f"{len(marks)} parameter(s) that FSDP replaced by its flat parameters ({shown}): it was "
        "built from the model's parameters before the model was wrapped with "
        "use_orig_params=False. Those parameters are no longer part of the model and get no "
        "gradient, so this step would change nothing (training would run and learn nothing). "
        "Build the optimizer after wrapping, from the wrapped model's parameters "
        "(torch.optim.AdamW(fsdp_model.parameters(), ...)), or wrap with use_orig_params=True "
        "(with Accelerate: fsdp_use_orig_params: true, or prepare the model before creating "
        "the optimizer)."
    )


def _step_in_no_sync(unit: UnitState) -> None:
    where = f"FSDP unit '{unit._handles[0].unit_fqn or '<root>'}'" if unit._handles else "an FSDP unit"
    what = (
        f"optimizer.step() inside FullyShardedDataParallel.no_sync() [rank {global_rank()}]: the "
        f"gradients of {where} were accumulated on this rank only and never reduced across "
        "ranks. Leave the no_sync() block before the step: run the last micro-batch's "
        "forward and backward outside it, then step."
    )
    if unit.settings.strategy is ShardingStrategy.NO_SHARD:
        warnings.warn(what + " (With NO_SHARD this step uses this rank's gradients alone, so "
                      "the replicas drift apart.)", stacklevel=4)
        return
    raise RuntimeError(
        what + " (With a sharded strategy each rank holds whole unsharded gradients for its "
        "parameter shard, which the optimizer cannot apply.)"
    )


# --------------------------------------------------------------- lazy init


def check_tree(root: UnitState) -> None:
    """At lazy init: warn when FSDP manages none of the trainable parameters
    (every one ignored), so no gradient is ever reduced."""
    if root.world_size <= 1:
        return
    if any(h.flat_param.requires_grad for h in root._all_handles):
        return
    ignored = [p for p in root._ignored_params if p.requires_grad]
    if not ignored:
        return
    names = {id(p): clean_fqn(n) for n, p in root.module.named_parameters()}
    shown = sorted(names.get(id(p), "?") for p in ignored)[:5]
    warnings.warn(
        f"FSDP manages none of the model's trainable parameters [rank {global_rank()}]: all "
        f"{len(ignored)} of them ({', '.join(repr(n) for n in shown)}"
        f"{', ...' if len(ignored) > 5 else ''}) are ignored (ignored_modules / ignored_states), "
        "so FSDP shards nothing and reduces none of their gradients: every rank trains its own "
        "copy and the ranks drift apart. Ignore only the modules whose gradients you "
        "synchronise yourself.",
        stacklevel=5,
    )


def meta_mismatch(state: UnitState, unit: str, built_from_meta: list[bool]) -> None:
    """At lazy init, with every rank's answer: warn if some ranks materialised
    the unit from the meta device and others had real weights."""
    if len(set(built_from_meta)) <= 1 or state.settings.sync_module_states:
        return
    meta = [r for r, m in enumerate(built_from_meta) if m]
    real = [r for r, m in enumerate(built_from_meta) if not m]
    warnings.warn(
        f"FSDP unit '{unit}' was built from the meta device on rank(s) {meta} (initialised by "
        f"reset_parameters / param_init_fn) but with real weights on rank(s) {real} "
        f"[rank {global_rank()}], and sync_module_states is False: each rank keeps its own "
        "shard, so the model is a mix of the real weights and fresh initialisations. Pass "
        "sync_module_states=True to give every rank rank 0's weights, or load the weights "
        "on every rank (load_pretrained, a checkpoint) before training.",
        stacklevel=6,
    )


# ---------------------------------------------------------- first forward


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A fingerprint of ``t``'s bits: their sum as integers (an int64 scalar,
    wrapping).  Order-insensitive, so not exact: any one element that differs
    changes it, but a permutation of the elements, or differences that cancel
    in the sum, do not (replicas built differently differ in many elements
    at once, which a sum tells apart but for a 2**-64 chance)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(ints).sum(dtype=torch.int64)


def check_root_flag(state: UnitState) -> None:
    """Refuse a forward through a unit marked as a root (``_is_root = True``)
    that lazy initialisation set up inside another unit's tree.

    Code outside FSDP sets the flag to summon one nested unit on its own and
    must set it back (verl 0.9.1's ``layered_summon_lora_params`` does not
    when a unit yields no adapter PEFT recognises).  torch's FSDP1 then runs
    the root's pre-forward on the nested unit and fails reading the tree's
    handles, which only the real root has; fsdp_wrap names the cause.  A unit
    whose root is gone keeps ``_is_root = False`` and is not concerned.
    """
    if state._is_root and state._root is not state:
        wrapped = type(getattr(state.module, "module", state.module)).__name__
        fqn = state.fqn or "(its tree's root module)"
        raise AttributeError(
            f"'{wrapped}' object has no attribute '_all_handles' [rank {global_rank()}, FSDP unit "
            f"'{fqn}']: the unit is marked as a root (_is_root=True) but was set up inside the "
            f"tree of another root unit, which runs its forward; code outside FSDP set the flag "
            f"(e.g. to summon the unit alone) and did not set it back. Set unit._is_root = False "
            f"after such a summon"
        )


def check_replicas(root: UnitState) -> None:
    """At the first forward: every replica holds the same parameters.

    Only units whose ranks hold copies of the same data (``NO_SHARD`` over more
    than one rank, or the replicate group of a hybrid strategy); one all-gather
    of an int64 fingerprint per flat parameter per such group.  Refused on every
    rank (each sees every fingerprint) before the first gather.
    """
    root._replicas_checked = True
    by_group: dict[Any, list[Any]] = {}
    kind: dict[Any, str] = {}
    for h in root._all_handles:
        if h.strategy is ShardingStrategy.NO_SHARD and h.world_size > 1:
            by_group.setdefault(h.process_group, []).append(h)
            kind[h.process_group] = "With NO_SHARD these ranks"
        elif h.replicate_group is not None and dist.get_world_size(h.replicate_group) > 1:
            by_group.setdefault(h.replicate_group, []).append(h)
            kind[h.replicate_group] = "Across the replicas of a hybrid strategy (HYBRID_SHARD) the ranks"
    for group, handles in by_group.items():
        device = handles[0].device
        mine = torch.stack([_fingerprint(h.local_shard).to(device) for h in handles])
        world = dist.get_world_size(group)
        out = torch.empty(world * len(handles), dtype=torch.int64, device=device)
        C.all_gather_into(out, mine, group)
        rows = out.view(world, len(handles)).cpu()
        for i, h in enumerate(handles):
            column = rows[:, i].tolist()
            if len(set(column)) == 1:
                continue
            ranks = dist.get_process_group_ranks(group)
            differ = [ranks[r] for r, v in enumerate(column) if v != column[0]]
            names = ", ".join(f"'{clean_fqn(x.fqn)}'" for x in h.infos[:3])
            raise RuntimeError(
                f"[rank {global_rank()}] the replicas of FSDP unit '{h.unit_fqn or '<root>'}' "
                f"({names}{', ...' if len(h.infos) > 3 else ''}) hold different parameters at "
                f"the first forward: rank(s) {differ} differ from rank {ranks[0]}. {kind[group]} "
                "keep copies of the same parameters and only average gradients, so "
                "copies that start different never agree. Build the model identically on "
                "every rank (torch.manual_seed(...) before building it, the same weights "
                "loaded everywhere) or pass sync_module_states=True."
            )


# --------------------------------------------------------------- loading


def check_nothing_loaded(state_dict: Any, result: Any) -> None:
    """After ``load_state_dict(..., strict=False)``: warn if no key was loaded."""
    missing = list(getattr(result, "missing_keys", []) or [])
    unexpected = set(getattr(result, "unexpected_keys", []) or [])
    keys = list(state_dict.keys()) if hasattr(state_dict, "keys") else []
    if not missing or any(k not in unexpected for k in keys):
        return
    given = f"its keys look like {keys[0]!r}" if keys else "it is empty"
    warnings.warn(
        f"load_state_dict(strict=False) loaded none of the model's {len(missing)} keys "
        f"[rank {global_rank()}]: the model's keys look like {clean_fqn(missing[0])!r} and the "
        f"state dict's do not match them ({given}); the model keeps the values it had. Strip "
        "or add the prefix the keys differ by (e.g. 'module.'), or, if rank 0 alone holds the "
        "state dict, load it on every rank.",
        stacklevel=3,
    )
