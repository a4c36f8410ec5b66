"""``FullyShardedDataParallel``: the public façade tying the layers together.

Construction runs the steps of :mod:`fsdp_wrap.runtime.setup` (arguments
resolved and checked first, then process groups, auto-wrapping of children
through :mod:`fsdp_wrap.wrap`, the unit's settings and state, its handles,
the hooks).  The instance holds its unit's state
(:class:`~fsdp_wrap.runtime.state.UnitState`, ``_fsdp_state``), which is what
the layers below receive; forward and backward delegate to
:mod:`fsdp_wrap.runtime.hooks`, lazy init to :mod:`fsdp_wrap.runtime.tree`,
state dicts to :mod:`fsdp_wrap.state_dict`.  torch's attribute names read the
state (:mod:`.torch_attributes`); the optimizer-state and accumulation
methods are in their own modules of this package.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Generator, Iterable, Iterator
from typing import Any, Callable

import torch
import torch.nn as nn

import fsdp_wrap.runtime.construct as _init
import fsdp_wrap.runtime.dynamo as dynamo
import fsdp_wrap.runtime.guards as guards
import fsdp_wrap.runtime.hooks as _runtime
import fsdp_wrap.runtime.settings as settings_of
import fsdp_wrap.runtime.setup as setup
import fsdp_wrap.runtime.summon as _summon
import fsdp_wrap.runtime.tree as tree
import fsdp_wrap.state_dict.model as _state_dict
from fsdp_wrap.api import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp_wrap.comm.bucket import resolve_bucket_cap_mb
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.comm.gather_batch import resolve_all_gather_batch_mb
from fsdp_wrap.comm.quant.config import CollectiveQuantization, resolve_quantization
from fsdp_wrap.fully_sharded_data_parallel.accumulation_methods import AccumulationMethods
from fsdp_wrap.fully_sharded_data_parallel.optim_methods import OptimStateDictMethods
from fsdp_wrap.fully_sharded_data_parallel.torch_attributes import TorchAttributes
from fsdp_wrap.runtime.grad_norm import clip_grad_norm
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import (
    STATE_ATTR,
    TrainingState,
    expect_state,
    register_unit,
)
from fsdp_wrap.runtime.tensors import cast_floating

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]

class FullyShardedDataParallel(TorchAttributes, OptimStateDictMethods, AccumulationMethods,
                               nn.Module):
    """Shard a module's parameters across data-parallel ranks (FSDP1 semantics).

    The wrapped module's parameters (except those of nested FSDP units and
    ignored modules) are flattened into one flat parameter, and each rank keeps
    one ``1/world_size`` shard of it.  Before the unit's forward and backward the
    shards are all-gathered; afterwards the full copy is freed as the
    ``sharding_strategy`` says, and gradients are reduce-scattered so every rank
    ends with the mean gradient of its shard.

    The arguments, their order and defaults are torch's (:doc:`/options` says
    what each one gathers or frees, and when).  ``auto_wrap_policy`` makes
    nested units of the submodules it picks (:mod:`fsdp_wrap.wrap`), each
    built with this call's arguments; the parameters no nested unit owns form
    this unit's flat parameter.  Create the optimizer *after* wrapping: it
    must step the flat (sharded) parameters, or with ``use_orig_params=True``
    the original parameters, which are then views into them.

    Construction checks the arguments before any collective.  It
    communicates only for ``sync_module_states=True`` (broadcasts from rank
    0) and, for hybrid strategies without explicit groups, to create the
    shard and replicate groups.  The first forward (or state-dict call) runs
    lazy initialisation: the outermost unit becomes the root and one
    ``all_gather_object`` checks that every rank built the same units.

    Keyword-only additions (:doc:`/options`); the first two count at the
    root for its whole tree: ``bucket_cap_mb`` (default
    ``$FSDP_WRAP_BUCKET_CAP_MB``, else 1) reduces the gradients of
    consecutive units in one collective once their (unsharded,
    ``reduce_dtype``) bytes reach the cap; 0 reduces each unit on its own.
    ``all_gather_batch_mb`` (default ``$FSDP_WRAP_ALL_GATHER_BATCH_MB``, else
    1; 0: off) lets a unit whose gather is smaller gather the next units in
    the same collective, within that many MiB.  ``quantize_collectives``
    (default ``$FSDP_WRAP_QUANTIZE_COLLECTIVES``, else off; a
    :class:`~fsdp_wrap.CollectiveQuantization` or a string such as
    ``"weights,grads"``) sends weights' all-gathers and/or gradients'
    reductions as blockwise int8 (int4) codes, by default only where they
    cross nodes; master weights, optimizer state and checkpoints stay exact.

    Example (under ``torchrun``, after ``dist.init_process_group``)::

        model = FullyShardedDataParallel(
            MyModel(),
            auto_wrap_policy=ModuleWrapPolicy({MyBlock}),   # one unit per block
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
            device_id=torch.cuda.current_device(),
        )
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    """

    # The public path, as torch's class names its module (type(m).__module__ is
    # what frameworks and pickle see).
    __module__ = "fsdp_wrap.fully_sharded_data_parallel"

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable[..., Any] | Any | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: Any = None,
        *,
        bucket_cap_mb: float | None = None,
        all_gather_batch_mb: float | None = None,
        quantize_collectives: CollectiveQuantization | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(module, FullyShardedDataParallel):
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
                f"[rank {global_rank()}]; wrap its "
                "children, or a module whose forward uses them, instead",
                stacklevel=2,
            )
        # 1. Arguments, checked before any collective.
        strategy, backward_prefetch, cpu_offload, mixed_precision = settings_of.coerce_arguments(
            sharding_strategy, backward_prefetch, cpu_offload, mixed_precision)
        cap_mb = resolve_bucket_cap_mb(bucket_cap_mb)
        batch_mb = resolve_all_gather_batch_mb(all_gather_batch_mb)
        quant = resolve_quantization(quantize_collectives, f"[rank {global_rank()}] ")
        ignored = _init.resolve_ignored(module, ignored_modules, ignored_states)
        # ... and what this machine cannot honour (a device it lacks, a dtype).
        device = setup.check_machine(module, device_id, mixed_precision, ignored[1])
        # 2. Process groups (their backends must carry the device's tensors).
        pg_state, child_group = settings_of.init_process_groups(
            process_group, device_mesh, strategy, auto_wrap_policy is not None, device
        )
        wire = settings_of.init_wire(quant, pg_state, strategy, module)
        # 3. Children the policy picks become units of their own, with the
        # root's arguments (the ignored set resolved to parameters, as torch
        # passes it, so one-shot iterables are safe).
        if auto_wrap_policy is not None:
            from fsdp_wrap.wrap import _auto_wrap

            root_kwargs = dict(
                process_group=child_group, sharding_strategy=sharding_strategy,
                cpu_offload=cpu_offload, auto_wrap_policy=auto_wrap_policy,
                backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
                ignored_modules=None, param_init_fn=param_init_fn, device_id=device_id,
                sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params,
                ignored_states=list(ignored[1]) if ignored[1] else None,
                device_mesh=device_mesh, quantize_collectives=quant or "off",
            )
            _auto_wrap(module, auto_wrap_policy, ignored[0], ignored[1], root_kwargs,
                       FullyShardedDataParallel)
        # 4. This unit: every option resolved once into its settings, its
        # state, its module placed, its handles.
        settings = settings_of.resolve_settings(
            module, pg_state, device_mesh, device_id, ignored, strategy=strategy,
            cpu_offload=cpu_offload, mixed_precision=mixed_precision,
            backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params,
            sync_module_states=sync_module_states, quant=quant, wire=wire,
        )
        state = setup.new_unit_state(self, module, settings, ignored, cap_mb, batch_mb)
        object.__setattr__(self, STATE_ATTR, state)
        setup.place_module(state, param_init_fn)
        setup.build_handle(state)
        _runtime.register_handle_hooks(state)
        self._fsdp_wrapped_module = module
        register_unit(state)
        # 5. State-dict hooks; torch.compile breaks the graph at unit boundaries.
        _state_dict.register_hooks(state)
        dynamo.run_eagerly_under_dynamo()
        dynamo.annotate_for_dynamo(module, ignored[0], settings.use_orig_params)

    # ------------------------------------------------------------ module API

    @property
    def module(self) -> nn.Module:
        """The wrapped module (the inner one, if it is an activation-checkpoint wrapper)."""
        inner = self._fsdp_wrapped_module
        return getattr(inner, "_checkpoint_wrapped_module", inner)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather this unit's parameters, run the wrapped module, free them as the strategy says.

        The root's first forward runs lazy initialisation (one
        ``all_gather_object`` comparing every rank's units).  Then: floating
        inputs are cast to ``mixed_precision.param_dtype`` where torch casts
        them; this unit's flat parameters are all-gathered (unless a prefetch
        or ``SHARD_GRAD_OP`` already holds it); the wrapped module runs on the
        unsharded parameters; ``FULL_SHARD`` and ``HYBRID_SHARD`` free them
        again, the other strategies keep them until the unit's backward.
        Hooks on the outputs make backward gather the parameters again (where
        they were freed) and reduce the gradients.
        """
        state = self._fsdp_state
        args, kwargs = _runtime.root_pre_forward(state, args, kwargs)
        mp = state.settings.mixed_precision
        # The root casts for cast_root_forward_inputs; every unit, the root
        # included, casts for cast_forward_inputs (torch's rule).
        full_precision = (state.settings.use_full_prec_in_eval
                          and not self._fsdp_wrapped_module.training)
        if mp.param_dtype is not None and not full_precision and (
            mp.cast_forward_inputs or (state._is_root and mp.cast_root_forward_inputs)
        ):
            args, kwargs = cast_floating((args, kwargs), mp.param_dtype)
        _runtime.pre_forward(state, (args, kwargs))
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return _runtime.post_forward(state, output)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module``'s; inside ``summon_full_params`` the names are clean FQNs."""
        clean = self._fsdp_state.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, param in super().named_parameters(*args, **kwargs):
            yield (clean_fqn(name) if clean else name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """As ``nn.Module``'s; inside ``summon_full_params`` the names are clean FQNs."""
        clean = self._fsdp_state.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, buf in super().named_buffers(*args, **kwargs):
            yield (clean_fqn(name) if clean else name), buf

    def check_is_root(self) -> bool:
        """Whether this unit is the root of its tree (the outermost unit).

        Runs lazy initialisation if the tree has not run it yet; the first
        time, that is one ``all_gather_object`` over the process group, so call
        it on every rank.  Called on a nested unit before the root's first
        forward, it makes that unit a root, as in torch.
        """
        tree.lazy_init(self._fsdp_state)
        return bool(self._fsdp_state._is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every FSDP instance in ``module``'s tree (pre-order), ``module`` included.

        With ``root_only=True``, only the outermost ones.  No communication.
        """
        return [st.module for st in tree.units_under(module, root_only)]  # type: ignore[misc]

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:  # type: ignore[override]
        """``nn.Module.apply`` with this unit's parameters gathered and written back.

        ``fn`` sees the full, unflattened parameters (as inside
        :meth:`summon_full_params` with ``writeback=True``), typically to
        initialise weights.  A collective: call it on every rank.
        """
        state = self._fsdp_state
        uninitialised = state._is_root is None
        expect_state(state, TrainingState.IDLE, action="apply()",
                     fix="call apply() outside summon_full_params and outside forward/backward")
        with _summon.summon([state], writeback=True):
            super().apply(fn)
        if uninitialised and state._is_root:
            state._is_root = None
        return self

    # ------------------------------------------------------------- lazy init

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``.half()``/``.to(dtype)``: with ``use_orig_params=True`` the flat
        parameter is what gets converted, as in torch."""
        from fsdp_wrap.handle.writeback import flat_param_exposed

        with contextlib.ExitStack() as stack:
            state = self.__dict__.get(STATE_ATTR)  # (none yet while the constructor runs)
            for h in state._handles if state is not None else []:
                stack.enter_context(flat_param_exposed(h))
            return super()._apply(*args, **kwargs)

    def _lazy_init(self) -> None:
        """Link every unit of this tree to its root (once; see :func:`~fsdp_wrap.runtime.tree.lazy_init`)."""
        tree.lazy_init(self._fsdp_state)

    def _reset_lazy_init(self) -> None:
        self._fsdp_state._is_root = None

    # ------------------------------------------------------------- no_sync

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Inside the block, backward reduces nothing: gradients accumulate locally.

        Root only, outside forward and backward.  No collective is issued for
        gradients inside the block; each rank keeps its *unsharded* local
        gradient per unit (memory the sharded strategies otherwise free), and
        the first backward after the block reduces the accumulated gradients
        together with its own.  Example, gradient accumulation::

            with model.no_sync():
                for batch in micro_batches[:-1]:
                    loss_fn(model(batch)).backward()    # no communication
            loss_fn(model(micro_batches[-1])).backward()  # reduces everything
            optim.step()
        """
        state = self._fsdp_state
        tree.lazy_init(state)
        if not state._is_root:
            raise RuntimeError(
                "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` "
                "on root FSDP module."
            )
        expect_state(state, TrainingState.IDLE, action="no_sync()",
                     fix="enter no_sync() between iterations, outside forward and backward")
        states = tree.units_under(self)
        previous = [st._sync_gradients for st in states]
        for st in states:
            st._sync_gradients = False
        try:
            yield
        finally:
            for st, prev in zip(states, previous):
                st._sync_gradients = prev

    def _assert_state(self, state: TrainingState | list[TrainingState]) -> None:
        """torch's private check: ``ValueError`` unless this unit is in one of ``state``."""
        expect_state(self._fsdp_state, state)

    # ------------------------------------------------------- clip_grad_norm_

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
        """Clip gradients by their true global norm over all shards; return that norm.

        The local norms are computed in fp32, ``norm ** p`` is summed over ranks
        (max for ``inf``), and every gradient is scaled in place by
        ``min(1, max_norm / (total + 1e-6))``.  Root only, between backward
        and the optimizer step; one all-reduce of one scalar (none when no
        unit is sharded).  Returns the total norm in the gradients' dtype.
        """
        return clip_grad_norm(self._fsdp_state, max_norm, norm_type)

    # ---------------------------------------------------- summon_full_params

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Generator[None, None, None]:
        """Expose full, unflattened parameters inside the context.

        Every FSDP unit in ``module`` (only ``module`` itself if not
        ``recurse``) is all-gathered in full precision; original parameters
        become full ``nn.Parameter`` s with clean names.  On exit each rank
        copies its slice back into its shard (``writeback=True``) and the full
        copies are freed.  ``rank0_only=True``: only rank 0 keeps the full
        parameters (not with ``writeback``).  ``offload_to_cpu=True``: the full
        copies move to CPU, one unit on the device at a time.
        ``with_grads=True`` (``use_orig_params=True`` only): the mean gradients
        are gathered onto ``.grad`` too.  A collective: one all-gather per
        unit, on every rank; not during forward or backward.  Example::

            with FullyShardedDataParallel.summon_full_params(model, writeback=False):
                print(model.head.weight.shape)   # full shape on every rank
        """
        if recurse:
            states = tree.units_under(module)
        else:
            states = [module._fsdp_state] if isinstance(module, FullyShardedDataParallel) else []
        with _summon.summon(states, writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    # ------------------------------------------------------------ state dicts

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set the state-dict type and configs of every FSDP unit in ``module``; return the old ones.

        They apply to ``module.state_dict()``, ``module.load_state_dict()``,
        :meth:`optim_state_dict` and :meth:`optim_state_dict_to_load` until set
        again.  A config left ``None`` is the type's default
        (:class:`~fsdp_wrap.FullStateDictConfig` and
        :class:`~fsdp_wrap.FullOptimStateDictConfig` for ``FULL_STATE_DICT``,
        and so on); a config of another type's class raises ``RuntimeError``.
        Nothing is gathered or communicated.  :meth:`state_dict_type` does
        the same for a ``with`` block and restores the old settings.
        """
        return _state_dict.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The :class:`~fsdp_wrap.StateDictSettings` every FSDP unit in ``module`` shares.

        ``AssertionError`` if units differ (set them together with
        :meth:`set_state_dict_type`); ``ValueError`` if ``module`` holds no
        unit.  No communication.
        """
        return _state_dict.get_state_dict_type(module)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Generator[None, None, None]:
        """Use ``state_dict_type`` for every FSDP unit in ``module`` inside the context.

        See :meth:`set_state_dict_type`; unlike torch's, the previous settings
        come back even if the body raises.  What each type gathers and holds:
        :doc:`/checkpointing`.  Example, a sharded checkpoint with DCP::

            with FullyShardedDataParallel.state_dict_type(
                model, StateDictType.SHARDED_STATE_DICT
            ):
                state = {
                    "model": model.state_dict(),
                    "optim": FullyShardedDataParallel.optim_state_dict(model, optim),
                }
            torch.distributed.checkpoint.save(state, checkpoint_id=path)
        """
        prev = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(
                module,
                prev.state_dict_type,
                prev.state_dict_config,
                prev.optim_state_dict_config,
            )

    # ------------------------------------------------------------ comm hooks

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Replace gradient reduction by ``hook`` on every unit of this (root) tree.

        ``hook(state, grad)`` for NO_SHARD units (reduce ``grad`` in place);
        ``hook(state, padded_unsharded_grad, output)`` for sharded units (write
        this rank's reduced shard into ``output``).  The hook owns the
        averaging: the default pre/post division is skipped, and gradient
        buckets are not used.  Root only, once, not with hybrid strategies
        (``AssertionError`` as in torch).  No communication itself; the hook
        issues the reduction in every backward.
        """
        if not self.check_is_root():
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        if not callable(hook):
            raise ValueError(f"The communication hook must be callable but got {hook}")
        states = tree.units_under(self)
        for st in states:
            settings = st.settings
            if settings.strategy in HYBRID_STRATEGIES:
                raise AssertionError(
                    "Communication hook is not supported for hybrid strategies: "
                    f"{settings.strategy}"
                )
            if st._comm_hook is not None:
                raise AssertionError("A communication hook is already registered")
            if settings.wire.grads is not None or settings.wire.replicas is not None:
                raise AssertionError(
                    "Communication hook is not supported with quantized gradient reductions "
                    f"(quantize_collectives={settings.quantize}) [rank {global_rank()}]: a hook "
                    "replaces the reduction; quantize the weights only, or drop the hook")
        for st in states:
            st._comm_hook, st._comm_hook_state = hook, state
            for h in st._handles:
                h.grads.comm_hook = (state, hook)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict`` in the state-dict type set by :meth:`state_dict_type`.

        FULL: every rank passes the full dict and copies its own slices into
        its shards; nothing gathered, no collective beyond the call check.
        SHARDED: each unit's chunk pieces move to the ranks owning them (one
        all-to-all), nothing gathered.  LOCAL: the flat shards are copied in,
        no collective.  Missing or unexpected keys and shape mismatches are
        named by clean FQN.
        """
        try:
            result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        except RuntimeError as err:
            raise RuntimeError(clean_fqn(str(err))) from None
        if not strict:
            guards.check_nothing_loaded(state_dict, result)  # a warning if no key matched
        return result

