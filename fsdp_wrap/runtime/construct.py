"""Construction-time helpers: argument resolution and checks, before any collective.

Every check that can fail on bad user input runs here, on each rank, before
the first collective of the constructor, so a mistake is an error and never a
hang.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

import fsdp_wrap.comm.collectives as C
from fsdp_wrap.handle.dtensor import local_of
from fsdp_wrap.handle.layout import walk_unit_modules
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import UnitState, is_unit, state_of


def _rank_tag() -> str:
    """`` [rank N]`` to follow torch's sentence (empty before init_process_group)."""
    return f" [rank {dist.get_rank()}]" if dist.is_initialized() else ""


def _sorted_types(items: Iterable[Any]) -> list[type]:
    """The distinct types of ``items``, sorted by repr (as torch's messages list them)."""
    return sorted({type(x) for x in items}, key=repr)


def check_not_wrapped(
    root: nn.Module, wrapper_cls: Any, ignored: Iterable[nn.Module], key_phrase: str
) -> None:
    """ValueError naming every ``wrapper_cls`` instance already in ``root``'s tree.

    ``key_phrase`` (torch's wording, which starts the message) is formatted
    with ``first`` (the first such module's name, as torch names it),
    ``root`` (the class of ``root``) and ``cls``; the rank and every such
    module's name follow it.

    Names are clean FQNs (``''`` is ``root`` itself); module reprs are not
    printed, since those of wrapped units spell out FSDP's internals.
    """
    skip = set(ignored)
    found = [
        clean_fqn(name)
        for name, m in root.named_modules()
        if m not in skip and isinstance(m, wrapper_cls)
    ]
    if found:
        names = ", ".join(f"'{n}'" if n else "the root module itself" for n in found)
        cls_name = getattr(wrapper_cls, "__name__", str(wrapper_cls))
        phrase = key_phrase.format(first=found[0], root=type(root).__name__, cls=cls_name)
        raise ValueError(
            f"{phrase}{_rank_tag()} (every {cls_name} in it: {names}). Either give "
            "auto_wrap_policy a module with no FSDP inside (let the policy make those units), "
            "or wrap every unit by hand and the root without auto_wrap_policy."
        )


def check_wrapped_module(module: nn.Module) -> None:
    """The module given to the constructor: not a unit already; a container
    without ``forward`` (``ModuleList``, ``ModuleDict``) is warned about."""
    if is_unit(module):
        raise ValueError(
            "FSDP was given a module that is already wrapped by FullyShardedDataParallel; "
            "wrap the inner module once (nest FSDP around submodules instead)."
        )
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        # First, before anything that can block: when ranks are threads of
        # one process (torch's threaded process group), a thread waiting in
        # a collective lets the other enter its own warnings.catch_warnings
        # (process-wide state), and the warning would land in the wrong
        # thread's record.  Names, not the repr: a child unit's repr spells
        # out FSDP's internals.
        children = [clean_fqn(n) for n, _ in module.named_children()]
        warnings.warn(
            "FSDP will not all-gather parameters for containers that do "
            f"not implement forward: {type(module).__name__} (children {children}) "
            f"[rank {C.global_rank()}]; wrap its "
            "children, or a module whose forward uses them, instead",
            stacklevel=3,  # (the constructor's caller)
        )


def resolve_ignored(
    module: nn.Module,
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Iterable[Any] | None,
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The ignored modules (whole subtrees) and ignored parameters."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time. "
            "Please just pass ignored_states."
        )
    roots: list[nn.Module] = []
    params: set[nn.Parameter] = set()
    if ignored_states is not None:
        states = list(ignored_states)
        if states and all(isinstance(s, nn.Parameter) for s in states):
            params.update(states)
        elif states and all(isinstance(s, nn.Module) for s in states):
            roots = states
        elif states:
            raise ValueError(
                "ignored_states expects all nn.Parameter or all nn.Module list elements but got "
                f"types {_sorted_types(states)}{_rank_tag()}: pass either the parameters or the "
                "modules to ignore (a module's parameters are ignored with it)"
            )
    elif ignored_modules is not None:
        try:
            roots = list(ignored_modules)
        except TypeError:
            raise TypeError(
                "`ignored_modules` should be an iterable of `torch.nn.Module`s but got "
                f"{type(ignored_modules)}"
            ) from None
        if not all(isinstance(m, nn.Module) for m in roots):
            raise ValueError(
                f"ignored_modules expects nn.Module list elements but got types "
                f"{_sorted_types(roots)}{_rank_tag()}: pass parameters as ignored_states "
                "instead, or their modules as ignored_modules"
            )
    if any(is_unit(m) for m in roots):
        raise ValueError("`ignored_modules` should not include FSDP modules")
    if module in roots:
        warnings.warn(
            "Trying to ignore the top-level module passed into the FSDP constructor itself will "
            "result in all parameters being ignored and is not well-supported",
            stacklevel=3,
        )
    mods: set[nn.Module] = set()
    for root in roots:
        for m in root.modules():
            if not is_unit(m):
                mods.add(m)
    for m in mods:
        params.update(m.parameters(recurse=False))
    return mods, params


def unit_tensors(
    module: nn.Module, stop: Callable[[nn.Module], bool], ignored: set[nn.Parameter]
) -> list[tuple[str, torch.Tensor]]:
    """This unit's managed parameters and buffers, by FQN."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for mod_fqn, mod in walk_unit_modules(module, stop):
        for kind in (mod._parameters, mod._buffers):
            for name, t in kind.items():
                if t is None or id(t) in seen or t in ignored:
                    continue
                seen.add(id(t))
                out.append((f"{mod_fqn}.{name}" if mod_fqn else name, t))
    return out


def materialize_meta(
    module: nn.Module,
    stop: Callable[[nn.Module], bool],
    ignored: set[nn.Parameter],
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
    rank: int,
) -> bool:
    """Materialise a meta-device unit, one module at a time, on ``device``;
    whether there was anything on the meta device.

    Modules are visited breadth-first, not entering nested FSDP units (they
    materialised themselves) or ignored modules.  ``param_init_fn(module)`` is
    called on each; without one, each module holding tensors directly gets
    ``to_empty(device, recurse=False)`` and ``reset_parameters()``.
    """
    if param_init_fn is not None and not callable(param_init_fn):
        # Checked on every construction, meta-device or not (torch only checks
        # when it would call it): a typo should not wait for the meta model.
        raise ValueError(
            f"Expected {param_init_fn} to be callable but got "
            f"{type(param_init_fn)} [rank {rank}]: pass param_init_fn as a function of one module "
            "(e.g. lambda m: m.to_empty(device=..., recurse=False)), or None"
        )
    if not any(t.is_meta for _, t in unit_tensors(module, stop, ignored)):
        return False
    queue, order = [module], []
    while queue:
        m = queue.pop(0)
        order.append(m)
        queue.extend(c for c in m.children() if not stop(c))
    with torch.no_grad():
        for m in order:
            if param_init_fn is not None:
                param_init_fn(m)
                continue
            if not any(True for _ in m.parameters(recurse=False)) and not any(
                True for _ in m.buffers(recurse=False)
            ):
                continue
            m.to_empty(device=device, recurse=False)
            reset = getattr(m, "reset_parameters", None)
            if not callable(reset):
                raise ValueError(
                    f"[rank {rank}] {type(m).__name__} has meta-device tensors but no "
                    "reset_parameters(); pass param_init_fn to initialise it"
                )
            reset()
    left = [fqn for fqn, t in unit_tensors(module, stop, ignored) if t.is_meta]
    if left:
        raise RuntimeError(
            f"[rank {rank}] meta-device tensors remain after initialisation: {left}. "
            "param_init_fn must materialise every parameter and buffer of the module it is given "
            "(e.g. module.to_empty(device=..., recurse=False) then initialise)."
        )
    return True


def move_to_device(
    module: nn.Module,
    device: torch.device,
    stop: Callable[[nn.Module], bool],
    ignored: set[nn.Parameter],
) -> None:
    """Move this unit's managed parameters and buffers; keep Parameter identity.

    A bitsandbytes 4-bit weight's quantization state (``absmax``, the code
    book) lives on the Parameter object, beside its data: it moves too, or the
    CUDA kernels would be handed host pointers (bitsandbytes' own
    ``Params4bit.to`` does the same)."""
    for _, mod in walk_unit_modules(module, stop):
        for p in mod._parameters.values():
            if p is not None and p not in ignored and p.device != device:
                p.data = p.data.to(device)
                quant_state = getattr(p, "quant_state", None)
                if quant_state is not None and callable(getattr(quant_state, "to", None)):
                    quant_state.to(device)
        for name, b in mod._buffers.items():
            if b is not None and b.device != device:
                mod._buffers[name] = b.to(device)


def sync_module_states(
    module: nn.Module,
    stop: Callable[[nn.Module], bool],
    ignored: set[nn.Parameter],
    groups: list[ProcessGroup],
) -> None:
    """Give every rank group-rank 0's parameters and buffers.

    One broadcast per dtype per group: tensors are packed into one flat buffer.
    For hybrid sharding the replicate group goes first, then the shard group,
    so global rank 0's values reach everyone.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    with torch.no_grad():
        # (a DTensor parameter: its local tensor, the same within a data-parallel group)
        tensors = [local_of(t) for _, t in unit_tensors(module, stop, ignored)]
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t.data if isinstance(t, nn.Parameter) else t)
        for group in groups:
            src = dist.get_global_rank(group, 0)
            for same in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in same])
                C.broadcast(flat, src, group)
                offset = 0
                for t in same:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()


def check_no_cross_unit_sharing(
    module: nn.Module, params: list[tuple[str, nn.Module, str, nn.Parameter]], rank: int
) -> None:
    """A parameter owned by a nested unit cannot also belong to this unit."""
    owned: dict[nn.Parameter, str] = {}
    for name, sub in module.named_modules():
        unit = state_of(sub)
        if unit is not None:
            for h in unit._handles:  # (the user's objects: a DTensor's local one differs)
                for orig, info in zip(h.originals, h.infos):
                    owned[orig] = f"{name}.{info.fqn}"
    for fqn, *_, p in params:
        if p in owned:
            raise ValueError(
                f"[rank {rank}] parameter '{fqn}' is shared with '{owned[p]}', which a nested FSDP "
                "unit already owns. Tied parameters must live in one FSDP unit: wrap their common "
                "parent instead (e.g. exclude one of the two modules from the wrap policy)."
            )


def cast_buffers(state: UnitState) -> dict[str, torch.dtype]:
    """Cast the unit's floating buffers to ``buffer_dtype``; return their original dtypes."""
    dtype = state.settings.mixed_precision.buffer_dtype
    if dtype is None:
        return {}
    orig: dict[str, torch.dtype] = dict(state._buffer_orig_dtypes)
    for mod_fqn, mod in walk_unit_modules(state.wrapped_module, is_unit):
        if mod in state._ignored_modules:
            continue  # ignored modules' buffers keep their dtype, as in torch
        for name, b in mod._buffers.items():
            if b is None or not b.is_floating_point() or b.dtype == dtype:
                continue
            fqn = f"{mod_fqn}.{name}" if mod_fqn else name
            orig.setdefault(fqn, b.dtype)
            b.data = b.to(dtype)  # in place, as torch: references to it see the cast
    return orig


def restore_buffer_dtypes(state: UnitState) -> None:
    """Undo :func:`cast_buffers`: the unit's cast buffers back in their original dtypes."""
    if not state._buffer_orig_dtypes:
        return
    for mod_fqn, mod in walk_unit_modules(state.wrapped_module, is_unit):
        for name, b in mod._buffers.items():
            dtype = state._buffer_orig_dtypes.get(f"{mod_fqn}.{name}" if mod_fqn else name)
            if b is not None and dtype is not None and b.dtype != dtype:
                b.data = b.to(dtype)
