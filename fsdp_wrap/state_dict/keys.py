"""The state-dict keys one unit emits, relative to its wrapped module."""

from __future__ import annotations

from fsdp_wrap.handle.layout import walk_unit_modules
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import UnitState, is_unit

__all__ = ["param_rels", "shared_rels", "unit_keys"]


def param_rels(state: UnitState) -> list[str]:
    """Keys (relative to the wrapped module) of the unit's flattened parameters."""
    return [clean_fqn(i.fqn) for h in state._handles for i in h.infos]


def shared_rels(state: UnitState) -> list[str]:
    """Keys of the unit's tied (shared) parameters' other names."""
    return [clean_fqn(s.fqn) for h in state._handles for s in h.shared]


def unit_keys(state: UnitState) -> list[str]:
    """Keys (relative, under the wrapped module) that this unit itself emits."""
    keys: list[str] = []
    for mod_fqn, mod in walk_unit_modules(state.wrapped_module, is_unit):
        pre = f"{clean_fqn(mod_fqn)}." if mod_fqn else ""
        pre = clean_fqn(pre)
        keys.extend(pre + n for n, p in mod._parameters.items() if p is not None)
        keys.extend(
            pre + n
            for n, b in mod._buffers.items()
            if b is not None and n not in mod._non_persistent_buffers_set
        )
        keys.append(pre + "_extra_state")
    return keys
