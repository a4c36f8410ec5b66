"""Model state dicts: the hooks that give ``state_dict()`` / ``load_state_dict()``
torch's FSDP1 formats.

``state_dict()`` and ``load_state_dict()`` stay ``nn.Module``'s; hooks on each
FSDP unit adapt them to the unit's state-dict type.  Keys are always clean
FQNs (no ``_fsdp_wrapped_module.``), exactly the unwrapped model's keys.

* FULL, save: the pre-hook gathers the unit and registers its original
  parameters (full shapes) in place of the flat parameter, so ``nn.Module``
  emits them in the unwrapped model's key order; the post-hook clones the
  unit's values (to CPU if asked, dropped off rank 0 under ``rank0_only``),
  and frees the unit again.  Units are gathered one nested level at a time.
* FULL, load: the pre-hook gathers the unit; after ``nn.Module`` copies into
  the full views, the post-hook writes this rank's part back into the shard.
* SHARDED: each original parameter is cut on dim 0 with ``torch.chunk``
  semantics into a ShardedTensor (DTensor ``Shard(0)`` with a device mesh;
  ``state_dict/chunks.py``).  The layout depends only on the parameter's shape and the
  world size, never on the flat layout, so DCP can reshard it.  Saving and
  loading move only the pieces each rank needs, without gathering a unit
  (``state_dict/sharded_io.py``).
* LOCAL: one ``<unit>._flat_param`` 1-D ShardedTensor per unit holding this
  rank's flat shard without its right padding.  No collective; needs the same
  world size and wrapping to load.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)

import fsdp_wrap._compat as _compat
import fsdp_wrap.comm.collectives as _collectives
import fsdp_wrap.handle.full_copies as full_copies
import fsdp_wrap.state_dict.chunks as CH
import fsdp_wrap.state_dict.two_d as two_d
from fsdp_wrap.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    coerce_dataclass,
    coerce_enum,
)
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.names import WRAPPED, clean_fqn
from fsdp_wrap.runtime.state import TrainingState, UnitState, expect_state, state_of
from fsdp_wrap.runtime.tree import lazy_init, units_under
from fsdp_wrap.state_dict.buffers import buffers_in_original_dtype
from fsdp_wrap.state_dict.keys import param_rels, shared_rels, unit_keys
from fsdp_wrap.state_dict.summoned import in_summon, summoned_post_state_dict

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle

_CONFIG_CLASSES: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


# ------------------------------------------------------------- settings


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: Any,
    state_dict_config: StateDictConfig | None,
    optim_state_dict_config: OptimStateDictConfig | None,
) -> StateDictSettings:
    """Set the type and configs on every FSDP unit in ``module``; return the previous ones."""
    sd_type = coerce_enum(state_dict_type, StateDictType, "state_dict_type")
    if sd_type is None:
        raise TypeError("state_dict_type must be a StateDictType member, not None")
    cfg_cls, optim_cls = _CONFIG_CLASSES[sd_type]
    cfg = coerce_dataclass(state_dict_config, cfg_cls, "state_dict_config") if (
        state_dict_config is not None and type(state_dict_config).__name__ == cfg_cls.__name__
    ) else state_dict_config
    optim_cfg = coerce_dataclass(
        optim_state_dict_config, optim_cls, "optim_state_dict_config"
    ) if (
        optim_state_dict_config is not None
        and type(optim_state_dict_config).__name__ == optim_cls.__name__
    ) else optim_state_dict_config
    cfg = cfg if cfg is not None else cfg_cls()
    optim_cfg = optim_cfg if optim_cfg is not None else optim_cls()
    if type(cfg) is not cfg_cls:
        raise RuntimeError(
            f"Expected state_dict_config of type {cfg_cls} but got {type(cfg)}"
        )
    if type(optim_cfg) is not optim_cls:
        raise RuntimeError(
            f"Expected optim_state_dict_config of type {optim_cls} but got {type(optim_cfg)}"
        )
    states = units_under(module)
    if not states:
        raise ValueError(f"set_state_dict_type found no FSDP unit in {type(module).__name__}")
    previous = get_state_dict_type(module)
    for st in states:
        st._state_dict_type = sd_type
        st._state_dict_config = cfg
        st._optim_state_dict_config = optim_cfg
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    settings: StateDictSettings | None = None
    for st in units_under(module):
        _refuse_local_with_mesh(st)  # as torch, which checks here for the optimizer APIs
        mine = StateDictSettings(
            st._state_dict_type, st._state_dict_config, st._optim_state_dict_config
        )
        if settings is None:
            settings = mine
        elif mine != settings:
            raise AssertionError(
                "All FSDP modules must have the same state dict settings. Got "
                f"{mine} and {settings}."
            )
    if settings is None:
        raise ValueError(f"get_state_dict_type found no FSDP unit in {type(module).__name__}")
    return settings


# ------------------------------------------------ collective-call check

_CALLS = (
    "state_dict(FULL_STATE_DICT)",
    "state_dict(SHARDED_STATE_DICT)",
    "load_state_dict(FULL_STATE_DICT)",
    "load_state_dict(SHARDED_STATE_DICT)",
    "optim_state_dict",
    "optim_state_dict_to_load",
)


def check_same_call(group: ProcessGroup, rank: int, call: str) -> None:
    """Fail on every rank, naming the call, if the ranks are not all making it.

    One tiny all-gather of a call code.  When some ranks run a different
    FSDP collective entry point (another state-dict call, another type) the
    codes differ and every rank raises the same error instead of the group
    deadlocking or exchanging mismatched buffers.  A rank that makes no
    collective at all cannot be detected without a timeout; that case is left
    to the process group's own timeout.
    """
    if dist.get_world_size(group) == 1:
        return
    code = _CALLS.index(call) + 1
    mine = torch.tensor([code], dtype=torch.int64)
    device = _group_device(group)
    mine = mine.to(device)
    everyone = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    _collectives.all_gather_into(everyone, mine, group)
    codes = everyone.tolist()
    if any(c != code for c in codes):
        seen = {r: (_CALLS[c - 1] if 0 < c <= len(_CALLS) else f"<unknown {c}>") for r, c in enumerate(codes)}
        raise RuntimeError(
            f"[rank {rank}] {call} is a collective: every rank of the process group must call "
            f"it at the same point, but the ranks called {seen}"
        )


def _group_device(group: ProcessGroup) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------- hooks


def register_hooks(state: UnitState) -> None:
    """The state-dict hooks on the unit's module (the façade): each finds the
    unit's state from the module it is called with."""
    module = state.module
    module.register_state_dict_pre_hook(_on_state(_pre_state_dict_hook))
    _compat.register_state_dict_post_hook(module, _on_state(_post_state_dict_hook))
    _compat.register_load_state_dict_pre_hook(module, _on_state(_pre_load_state_dict_hook))
    module.register_load_state_dict_post_hook(_on_state(_post_load_state_dict_hook))


def _on_state(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook(state, ...)`` called as a module hook ``(module, ...)``."""

    def on_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = state_of(module)
        if state is None:  # (only units register these hooks)
            raise TypeError(f"{type(module).__name__} is not an FSDP unit")
        return hook(state, *args, **kwargs)

    return on_module


def effective_type(state: UnitState, warn: bool = True) -> StateDictType:
    """The type ``state`` really uses: NO_SHARD always falls back to FULL (with a warning)."""
    sd_type = state._state_dict_type
    if sd_type is StateDictType.FULL_STATE_DICT:
        return sd_type
    if state.settings.strategy is ShardingStrategy.NO_SHARD:
        if warn:
            warnings.warn(
                "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned.",
                stacklevel=4,
            )
        return StateDictType.FULL_STATE_DICT
    _refuse_local_with_mesh(state)
    return sd_type


def _refuse_local_with_mesh(state: UnitState) -> None:
    """torch's refusal of LOCAL_STATE_DICT for a unit built with a device mesh
    (model and optimizer state dicts alike)."""
    if state._state_dict_type is StateDictType.LOCAL_STATE_DICT and state.settings.device_mesh is not None:
        raise RuntimeError(
            "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not "
            "compatible with LOCAL_STATE_DICT. Please set state_dict_type to SHARDED_STATE_DICT "
            f"to get DTensor state_dict. [rank {global_rank()}] The model was wrapped with a "
            "device_mesh."
        )


def _pre_state_dict_hook(state: UnitState, prefix: str, keep_vars: bool) -> None:
    lazy_init(state)
    sd_type = effective_type(state)
    if in_summon(state, sd_type, prefix):
        return  # (the parameters are full already: torch gathers nothing more)
    expect_state(state, TrainingState.IDLE, action="state_dict()", error=RuntimeError,
                 fix="call it outside forward/backward and outside summon_full_params")
    if sd_type is StateDictType.LOCAL_STATE_DICT:
        return
    if sd_type is StateDictType.SHARDED_STATE_DICT:
        two_d.check_sharded_supported(state, prefix.rstrip("."))
    if state._is_root:
        check_same_call(state.process_group, state.rank, f"state_dict({sd_type.name})")
    for handle in state._handles:
        handle.pre_unshard()  # replaced original parameters are taken up first (as torch)
    for handle in state._handles:
        if sd_type is StateDictType.FULL_STATE_DICT:
            # Stream: copy this flat parameter's parameters and free it again
            # before the next is gathered, so at most one is unsharded at a time
            # (with rank0_only the other ranks never hold a whole one).
            cfg = state._state_dict_config
            rank0_only = isinstance(cfg, FullStateDictConfig) and cfg.rank0_only
            copies = full_copies.full_param_copies(handle, to_rank0_only=rank0_only,
                                                   to_cpu=cfg.offload_to_cpu)
            if copies is not None:
                handle.register_params(copies)
            continue
        if two_d.is_two_d(state):  # (torch's 2-D values are made from gathered ones)
            handle.register_params(full_copies.full_param_copies(handle, False, False) or [])
            continue
        # SHARDED: register this rank's dim-0 chunks, moved point to point from the
        # flat shards (one all-to-all, nothing gathered); the post-hook wraps them.
        import fsdp_wrap.state_dict.sharded_io as _sharded_io

        handle.register_params(_sharded_io.local_chunks(handle))


def _post_state_dict_hook(
    state: UnitState, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    sd_type = effective_type(state, warn=False)
    if state.training_state is TrainingState.SUMMON_FULL_PARAMS:
        summoned_post_state_dict(state, state_dict, prefix, sd_type)
        return
    try:
        if sd_type is StateDictType.FULL_STATE_DICT:
            _full_post_state_dict(state, state_dict, prefix)
        elif sd_type is StateDictType.SHARDED_STATE_DICT:
            _sharded_post_state_dict(state, state_dict, prefix)
        else:
            _local_post_state_dict(state, state_dict, prefix)
        buffers_in_original_dtype(state, state_dict, prefix,
                                  local=sd_type is StateDictType.LOCAL_STATE_DICT)
        old = prefix + WRAPPED
        for key in [k for k in state_dict if k.startswith(old)]:
            state_dict[prefix + key[len(old) :]] = state_dict.pop(key)
    finally:
        if sd_type is not StateDictType.LOCAL_STATE_DICT:
            for h in state._handles:
                h.use_sharded_views()  # copies/chunks were registered by the pre-hook


def _full_post_state_dict(state: UnitState, state_dict: dict[str, Any], prefix: str) -> None:
    cfg = state._state_dict_config
    rank0_only = isinstance(cfg, FullStateDictConfig) and cfg.rank0_only
    drop = rank0_only and state.rank != 0
    fresh = set(param_rels(state))  # copied by the pre-hook already
    for rel in unit_keys(state):
        key = prefix + WRAPPED + rel
        if key not in state_dict:
            continue
        value = state_dict[key]
        if drop:
            del state_dict[key]
        elif isinstance(value, torch.Tensor) and rel not in fresh and cfg.offload_to_cpu:
            # Buffers stay the modules' own tensors (torch's ``buf.detach()``),
            # moved to CPU if asked.
            state_dict[key] = value.detach().to("cpu")


def _sharded_post_state_dict(state: UnitState, state_dict: dict[str, Any], prefix: str) -> None:
    """Original parameters (tied aliases included, as torch) become dim-0 chunks.

    The values in the dict are already this rank's chunks (see the pre-hook).
    """
    cfg = state._state_dict_config
    if two_d.is_two_d(state):
        two_d.outgoing_sharded_values(state, state_dict, prefix + WRAPPED, cfg.offload_to_cpu)
        return
    layout = CH.chunk_layout(state, CH.uses_dtensor(state))
    shapes = {clean_fqn(i.fqn): i.shape for h in state._handles for i in h.infos}
    shapes.update({clean_fqn(s.fqn): h.infos[s.index].shape
                   for h in state._handles for s in h.shared})
    for rel, shape in shapes.items():
        key = prefix + WRAPPED + rel
        if key in state_dict:
            local = state_dict[key]
            state_dict[key] = CH.wrap_chunk(local, shape, local.dtype, layout, cfg.offload_to_cpu)


def local_flat_value(h: FlatParamHandle, offload_to_cpu: bool) -> ShardedTensor:
    """This rank's flat shard without right padding as a 1-D ShardedTensor (a view)."""
    local = h.local_shard[: h.shard_valid_numel]
    if offload_to_cpu:
        local = local.cpu()
    shards_md: list[ShardMetadata] = []
    for r in range(h.world_size):
        valid = max(0, min(h.shard_numel, h.unpadded_numel - r * h.shard_numel))
        if valid:
            shards_md.append(
                ShardMetadata(
                    [r * h.shard_numel], [valid],
                    CH.placement(dist.get_global_rank(h.process_group, r), local.device),
                )
            )
    local_shards = []
    if h.shard_valid_numel:
        gr = dist.get_global_rank(h.process_group, h.rank)
        local_shards.append(Shard.from_tensor_and_offsets(local, [h.shard_offset], gr))
    metadata = ShardedTensorMetadata(
        shards_metadata=shards_md,
        size=torch.Size([h.unpadded_numel]),
        tensor_properties=TensorProperties(dtype=local.dtype, requires_grad=False),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=metadata, process_group=h.process_group
    )


def _local_post_state_dict(state: UnitState, state_dict: dict[str, Any], prefix: str) -> None:
    """One ``_flat_param`` key per flat parameter (``_flat_param_1``, ... for a
    split unit's others); the 1-D original views (use_orig_params) are dropped."""
    base = prefix + WRAPPED
    for rel in [*param_rels(state), *shared_rels(state), *(h.flat_name for h in state._handles)]:
        state_dict.pop(base + rel, None)
    for h in state._handles:
        state_dict[base + h.flat_name] = local_flat_value(
            h, state._state_dict_config.offload_to_cpu
        )


def _pre_load_state_dict_hook(
    state: UnitState,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any = None,
    strict: bool = True,
    missing_keys: Any = None,
    unexpected_keys: Any = None,
    error_msgs: list[str] | None = None,
) -> None:
    _pre_load_for_type(state, state_dict, prefix, missing_keys, error_msgs)
    for h in state._handles:
        if h.use_orig_params or "_checkpoint_wrapped_module" not in h.module._modules:
            continue
        # FSDP(checkpoint_wrapper(m)): the wrapper's load hook would move the key
        # away from the flat parameter; load it here, hidden until the post-hook.
        value = state_dict.pop(prefix + WRAPPED + h.flat_name, None)
        if (isinstance(value, torch.Tensor) and value.shape == h.local_shard.shape
                and value.data_ptr() != h.local_shard.data_ptr()):
            h.load_shard(value)
        h.register_flat_param(False)
        state._sd_flat_param_hidden = True


def _pre_load_for_type(
    state: UnitState,
    state_dict: dict[str, Any],
    prefix: str,
    missing_keys: Any = None,
    error_msgs: list[str] | None = None,
) -> None:
    lazy_init(state)
    sd_type = effective_type(state)
    wrapped = prefix + WRAPPED
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(wrapped)]:
        state_dict[wrapped + key[len(prefix) :]] = state_dict.pop(key)
    if sd_type is StateDictType.LOCAL_STATE_DICT:
        _local_pre_load(state, state_dict, wrapped, error_msgs if error_msgs is not None else [])
        return
    if state._is_root:
        check_same_call(state.process_group, state.rank, f"load_state_dict({sd_type.name})")
    if two_d.applies(state):  # DTensor values -> gathered local tensors, loaded as FULL
        if sd_type is StateDictType.SHARDED_STATE_DICT:
            two_d.check_sharded_supported(state, prefix.rstrip("."))
        two_d.incoming_model_values(state, state_dict, wrapped)
        sd_type = StateDictType.FULL_STATE_DICT
    if sd_type is StateDictType.FULL_STATE_DICT:
        for h in state._handles:
            _full_pre_load(
                h,
                state_dict,
                wrapped,
                missing_keys if missing_keys is not None else [],
                error_msgs if error_msgs is not None else [],
            )
        return
    if sd_type is StateDictType.SHARDED_STATE_DICT and state._handles:
        import fsdp_wrap.state_dict.sharded_io as _sharded_io

        _sharded_io.load_sharded_unit(
            state, state_dict, wrapped,
            missing_keys if missing_keys is not None else [],
            error_msgs if error_msgs is not None else [],
        )


def _full_pre_load(
    h: FlatParamHandle,
    state_dict: dict[str, Any],
    wrapped: str,
    missing_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load a full state dict without gathering anything.

    Every rank holds every full tensor, so each copies just its own slice of
    each parameter into its local shard: no collective, and no unit is ever
    unsharded.  The parameter keys are then claimed so that ``nn.Module``'s
    own loading neither reports them as unexpected nor copies them again:
    with ``use_orig_params=True`` they point at the (registered) parameters
    themselves, otherwise they are removed and ``_flat_param`` points at
    itself.  Missing and mis-shaped parameters are reported here, by name.
    """
    h.invalidate_unsharded()  # any gathered copy is stale from here on
    with torch.no_grad():
        for i, info in enumerate(h.infos):
            key = wrapped + clean_fqn(info.fqn)
            value = _as_tensor(state_dict.get(key))
            if value is None:
                if not h.use_orig_params:  # not registered: nn.Module cannot see it
                    missing_keys.append(key)
                continue
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(info.shape):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                want = info.spec.shape if info.spec is not None else info.shape  # (global)
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {shape} from "
                    f"checkpoint, the shape in current model is {tuple(want)}."
                )
            else:
                h.load_param(i, value)
            CH.claim(state_dict, key, info.param, h.use_orig_params)
        CH.claim_shared_and_flat(h, state_dict, wrapped)


def _as_tensor(value: Any) -> Any:
    """A real tensor for a tensor-like (``__torch_function__``) value, else ``value``.

    Lightning loads checkpoints lazily: its values materialise only when a
    torch function touches them.  Materialised here, one parameter at a time
    as each unit loads, so the whole checkpoint is never in memory at once.
    """
    if value is None or isinstance(value, torch.Tensor):
        return value
    if callable(getattr(type(value), "__torch_function__", None)):
        loaded = torch.detach(value)
        if isinstance(loaded, torch.Tensor):
            return loaded
    return value


def _local_pre_load(
    state: UnitState, state_dict: dict[str, Any], wrapped: str, error_msgs: list[str]
) -> None:
    pending: list[tuple[list[str], str | None]] = []
    state._sd_local_load = pending
    for h in state._handles:
        _local_pre_load_flat(h, state_dict, wrapped, error_msgs, pending)


def _local_pre_load_flat(
    h: FlatParamHandle, state_dict: dict[str, Any], wrapped: str, error_msgs: list[str],
    pending: list[tuple[list[str], str | None]],
) -> None:
    """:func:`_local_pre_load` for one flat parameter (key ``h.flat_name``)."""
    key = wrapped + h.flat_name
    originals = [wrapped + clean_fqn(x.fqn) for x in h.infos]
    originals += [wrapped + clean_fqn(x.fqn) for x in h.shared]
    if h.use_orig_params:
        # The original names are registered (1-D views); the flat key carries the data.
        for k in originals:
            state_dict.pop(k, None)
        pending.append((originals, key if key not in state_dict else None))
    if key not in state_dict:
        return
    value = state_dict[key]
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        local = shards[0].tensor if shards else torch.empty(0, dtype=value.dtype)
    elif isinstance(value, torch.Tensor):  # a padded shard (this unit's own flat_param)
        local = value.reshape(-1)
        if local.numel() == h.shard_numel:
            local = local[: h.shard_valid_numel]
    else:
        local = None
    if local is None or local.numel() != h.shard_valid_numel:
        got = "no tensor" if local is None else f"{local.numel()} elements"
        error_msgs.append(
            f"[rank {global_rank()}] LOCAL_STATE_DICT key '{clean_fqn(key)}' of FSDP unit "
            f"'{h.unit_fqn or '<root>'}' expects this rank's flat shard of "
            f"{h.shard_valid_numel} elements but got {got}; LOCAL_STATE_DICT needs the same "
            "world size, wrapping and use_orig_params as when it was saved"
        )
        if h.use_orig_params:
            state_dict.pop(key)
        else:
            state_dict[key] = h.flat_param.detach()
        return
    if h.use_orig_params:
        h.load_shard(local.reshape(-1))
        state_dict.pop(key)
    else:
        padded = h.flat_param.detach().new_zeros(h.shard_numel)
        padded[: h.shard_valid_numel].copy_(local.reshape(-1))
        state_dict[key] = padded


def _post_load_state_dict_hook(state: UnitState, incompatible_keys: Any) -> None:
    hidden, state._sd_flat_param_hidden = state._sd_flat_param_hidden, False
    if hidden:
        for h in state._handles:
            if not h.use_orig_params:
                h.register_flat_param(True)
    sd_type = effective_type(state, warn=False)
    if sd_type is StateDictType.LOCAL_STATE_DICT:
        pending, state._sd_local_load = state._sd_local_load, None
        for originals, missing_flat in pending or []:
            # (an inner unit's hook may already have cleaned the shared list)
            handled = {clean_fqn(k) for k in originals}
            incompatible_keys.missing_keys[:] = [
                k for k in incompatible_keys.missing_keys if clean_fqn(k) not in handled
            ]
            if missing_flat is not None:
                incompatible_keys.missing_keys.append(missing_flat)
        for h in state._handles:
            h.invalidate_unsharded()
    # FULL and SHARDED loads wrote straight into the local shard in the pre-hook.
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [clean_fqn(k) for k in keys]
