"""The state of one FSDP unit: a plain object the façade holds.

:class:`UnitState` is what the layers below the façade (the hooks, summon,
state dicts, optimizer state) receive: never the ``nn.Module`` wrapper.  The
façade (:class:`~fsdp_wrap.FullyShardedDataParallel`) builds one at
construction and keeps it as its ``_fsdp_state``; :func:`state_of` finds it
from a module, :func:`is_unit` asks whether a module is a unit.  The
attributes torch's frameworks read on an FSDP module (``sharding_strategy``,
``_handle``, ``training_state``, ...) are properties of the façade that read
this object.

What a unit holds, in three groups:

* **settings** (:class:`~fsdp_wrap.handle.config.UnitSettings`, frozen): its
  options and groups, resolved once at construction; its handles hold the
  same object.
* **run-time state** (below, per unit): the phase (:class:`TrainingState`,
  changed only through :func:`enter` and checked only through
  :func:`expect_state`), the controls set between iterations
  (``no_sync``, FSDP2's accumulation controls, the state-dict type) and the
  backward's progress.
* **the tree** (the root's only): every unit and handle, the execution
  order, the gradient buckets; every unit points at its root.

Phases, as torch's FSDP1 names them (the unit's ``training_state``):
``IDLE`` between the unit's forward and its backward and between steps;
``FORWARD_BACKWARD`` from a pre-forward to its post-forward and from the
unit's pre-backward to the end of backward; ``SUMMON_FULL_PARAMS`` inside
``summon_full_params``.  Each handle has its own finer phase
(:class:`~fsdp_wrap.handle.flat_tensor.HandleTrainingState`) and sharded
state (:class:`~fsdp_wrap.handle.flat_tensor.HandleState`), asserted by the
handle where it relies on them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from fsdp_wrap.comm.collectives import global_rank

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from fsdp_wrap.api import OptimStateDictConfig, StateDictConfig, StateDictType
    from fsdp_wrap.comm.bucket import GradBuckets
    from fsdp_wrap.handle.config import UnitSettings
    from fsdp_wrap.handle.flat_param import FlatParamHandle
    from fsdp_wrap.runtime.exec_order import ExecOrder

__all__ = [
    "STATE_ATTR",
    "TrainingState",
    "UnitState",
    "enter",
    "expect_state",
    "is_unit",
    "live_units",
    "register_unit",
    "state_of",
]

#: The attribute of the façade holding its :class:`UnitState`.
STATE_ATTR = "_fsdp_state"


class TrainingState(Enum):
    """What an FSDP unit is doing (same members and values as torch's)."""

    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


class UnitState:
    """The state of one FSDP unit (see the module docstring for its groups).

    ``module`` is the façade (an ``nn.Module``: hooks are registered on it and
    walks start from it); ``wrapped_module`` the module it wraps.
    """

    def __init__(self, module: nn.Module, wrapped_module: nn.Module, settings: UnitSettings,
                 ignored_modules: set[nn.Module], ignored_params: set[nn.Parameter],
                 buckets: GradBuckets, exec_order: ExecOrder, batch_bytes: int) -> None:
        self.module = module
        self.wrapped_module = wrapped_module
        self.settings = settings
        self._ignored_modules = ignored_modules
        self._ignored_params = ignored_params
        self._handles: list[FlatParamHandle] = []  # trainable first (see runtime.setup)
        # Original dtypes of buffers cast to ``buffer_dtype`` (clean FQN under
        # the wrapped module -> dtype); state dicts save them in these dtypes.
        self._buffer_orig_dtypes: dict[str, torch.dtype] = {}
        self._built_from_meta = False  # this rank materialised the unit from the meta device

        # -------------------------------------------------- run-time state
        self.training_state = TrainingState.IDLE  # (changed by enter() only)
        # Controls set between iterations: no_sync / set_requires_gradient_sync,
        # set_reshard_after_backward (None: FSDP1's rule), set_is_last_backward
        # (the root's counts), register_comm_hook.
        self._sync_gradients = True
        self._reshard_after_backward: bool | None = None
        self._is_last_backward = True
        self._comm_hook: Callable[..., Any] | None = None
        self._comm_hook_state: object = None
        # The state-dict type and configs (set_state_dict_type), set by the façade.
        self._state_dict_type: StateDictType
        self._state_dict_config: StateDictConfig
        self._optim_state_dict_config: OptimStateDictConfig
        # Scratch of one state_dict()/load_state_dict() call (state_dict.model)
        self._sd_flat_param_hidden = False
        self._sd_local_load: list[Any] | None = None
        self._sd_device_mesh: Any = None
        # The backward's progress (runtime.hooks).
        self._ran_pre_backward = False  # this unit's pre-backward ran in this backward
        self._frozen_open_graphs = 0  # forwards whose frozen flat parameters await their backward
        self._grad_inputs: list[weakref.ref[torch.Tensor]] = []  # last forward's inputs with grad
        self._hooked_handles: set[FlatParamHandle] = set()  # gradient hooks registered
        self._optims_in_backward = False  # _apply_optimizer_in_backward on its parameters
        # The root's: a forward awaits its backward, the end-of-backward
        # callback is queued, buffers shown in full precision (eval), the
        # replicas were compared (runtime.guards, at the first forward).
        self._forward_pending_backward = False
        self._final_callback_queued = False
        self._buffers_in_full_precision = False
        self._replicas_checked = False
        # FSDP2's explicit controls, once one is set (runtime.explicit.controls;
        # None: the default schedule, one attribute read in the hooks).
        self._explicit: Any = None

        # ----------------------------------------------------------- the tree
        self._is_root: bool | None = None  # None until lazy init
        self._root: UnitState = self
        # Kept on the root only (set at lazy init): every unit and handle.
        self._all_fsdp_states: list[UnitState] = []
        self._all_handles: list[FlatParamHandle] = []
        self._state_of: dict[FlatParamHandle, UnitState] = {}
        # Built by every unit, used at the root only (the root's caps count
        # for its whole tree).
        self._exec_order = exec_order
        self._grad_buckets = buckets
        self._all_gather_batch_bytes = batch_bytes

    # ----------------------------------------------------- groups (settings)

    @property
    def process_group(self) -> ProcessGroup:
        return self.settings.process_group

    @property
    def rank(self) -> int:
        return self.settings.rank

    @property
    def world_size(self) -> int:
        return self.settings.world_size

    @property
    def compute_device(self) -> torch.device:
        return self.settings.device

    @property
    def training(self) -> bool:
        """Whether the unit's module is in training mode."""
        return self.module.training

    @property
    def fqn(self) -> str:
        """The unit's clean FQN under its root ('' for the root, or before lazy init)."""
        return self._handles[0].unit_fqn if self._handles else ""

    def describe(self) -> str:
        """``rank R, FSDP unit 'fqn'`` (or ``root FSDP unit``) for messages."""
        fqn = self.fqn
        unit = ("root FSDP unit" if self._is_root
                else f"FSDP unit '{fqn}'" if fqn else "FSDP unit")
        return f"rank {global_rank()}, {unit}"


# ------------------------------------------------------------------ phases


def expect_state(state: UnitState, allowed: TrainingState | Iterable[TrainingState], *,
                 action: str = "", fix: str = "", error: type[Exception] = ValueError,
                 sentence: str | None = None) -> None:
    """Raise unless ``state`` is in one of ``allowed``: every phase check of
    the library goes through here, with one message format.

    The message starts with torch's sentence for the call where torch has one
    (``sentence``; else torch's generic "expected to be in states ..."), then
    names the rank, the unit, the call (``action``), the state expected and
    found, and the fix.  ``error`` is torch's exception type for that call.
    """
    states = [allowed] if isinstance(allowed, TrainingState) else list(allowed)
    current = state.training_state
    if current in states:
        return
    first = sentence or f"expected to be in states {states} but current state is {current}"
    what = f"; {action} expects {' or '.join(s.name for s in states)}, the unit is in {current.name}"
    raise error(f"{first} [{state.describe()}]{what if action else ''}"
                + (f"; {fix}" if fix else ""))


def enter(state: UnitState, to: TrainingState) -> None:
    """Move ``state`` to the phase ``to`` (the only writer of ``training_state``).

    Entering ``SUMMON_FULL_PARAMS`` is checked by its caller first (torch's
    own sentences); forward and backward move between ``IDLE`` and
    ``FORWARD_BACKWARD`` whenever autograd calls their hooks (a unit may run
    several forwards, and a reentrant checkpoint's recomputation runs one
    inside backward), so those moves are not refused.
    """
    state.training_state = to


# ------------------------------------------------------------------ lookup


def state_of(module: object) -> UnitState | None:
    """The unit state ``module`` holds if it is an FSDP unit (a façade), else ``None``."""
    found = getattr(module, "__dict__", {}).get(STATE_ATTR)
    return found if isinstance(found, UnitState) else None


def is_unit(module: object) -> bool:
    """Is ``module`` an FSDP unit (an instance of the façade)?"""
    return isinstance(getattr(module, "__dict__", {}).get(STATE_ATTR), UnitState)


# Every unit built in this process, held weakly (a dropped model is freed): the
# framework glue finds the unit tree a module given to it lives in, which a
# module cannot tell (it has no parent pointer).
_LIVE: weakref.WeakSet[UnitState] = weakref.WeakSet()


def register_unit(state: UnitState) -> None:
    _LIVE.add(state)


def live_units() -> list[UnitState]:
    """The units built in this process that are still alive."""
    return list(_LIVE)
