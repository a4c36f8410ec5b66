"""The FSDP1 optimizer-state API: the façade's static methods.

torch's FSDP1 offers them as static methods of the class
(``FullyShardedDataParallel.optim_state_dict(model, optim)`` ...); they take
the model and work on every unit under it, so they need no instance.  The
optimizer-state layer (:mod:`fsdp_wrap.state_dict.optim`) does the work; this
part of the façade holds no state and only gives the calls torch's names,
signatures and deprecation warnings.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

import fsdp_wrap.state_dict.optim as _osd
from fsdp_wrap.api import OptimStateKeyType

__all__ = ["OptimStateDictMethods"]


class OptimStateDictMethods:
    """``optim_state_dict``, ``optim_state_dict_to_load``, ``rekey_optim_state_dict`` and
    the legacy functions torch deprecates; see each method."""

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """``optim``'s state keyed by clean FQNs, in the model's state-dict type.

        The type and config come from :meth:`state_dict_type`.  FULL: each
        unit's state tensors are all-gathered one state name at a time and
        copied out (to CPU by default, ``offload_to_cpu=True``); with
        ``rank0_only=True`` only rank 0 keeps them and the other ranks get
        ``{}``.  SHARDED and LOCAL: every rank gets the dim-0 chunks of each
        state (``ShardedTensor``, or ``DTensor`` with a device mesh), moved
        between ranks piece by piece (one all-to-all per unit and state
        name), nothing gathered.  Every rank must call it; it first checks
        with one small all-gather that all ranks make the same call.
        ``optim_state_dict`` (default ``optim.state_dict()``) and ``group``
        are torch's arguments.
        """
        return _osd.optim_state_dict(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict[str, Any]:
        """The inverse of :meth:`optim_state_dict`: a dict ``optim.load_state_dict`` takes.

        ``optim_state_dict`` is in the model's current state-dict type; the
        result holds this rank's flat shards of every state.  FULL: no
        collective (every rank holds the full dict and slices its own part),
        except that with ``rank0_only=True`` rank 0's dict is broadcast.
        SHARDED: each unit's pieces move to the ranks that own them (one
        all-to-all), nothing gathered.  Every mismatch with the model and
        optimizer is reported in one ``ValueError`` before any collective.
        ``load_directly=True`` also calls ``optim.load_state_dict``.
        ``is_named_optimizer=True`` keys the result by the model's parameter
        names (``model.named_parameters()``), for ``_NamedOptimizer``.  Example::

            with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                osd = FullyShardedDataParallel.optim_state_dict_to_load(model, optim, saved)
            optim.load_state_dict(osd)
        """
        return _osd.optim_state_dict_to_load(
            model, optim, optim_state_dict, is_named_optimizer, load_directly, group
        )

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: Any = None,
    ) -> dict[str, Any]:
        """Legacy: the FULL optimizer state dict, full tensors on CPU (``FutureWarning``).

        Same as :meth:`optim_state_dict` under ``FULL_STATE_DICT`` with
        ``offload_to_cpu=True``: each unit's states are all-gathered one name
        at a time; with ``rank0_only=True`` (the default here) only rank 0
        keeps the result and the others get ``{}``.  A collective.
        ``optim_input`` is deprecated (pass ``optim``).
        """
        _warn_legacy_optim("full_optim_state_dict", "optim_state_dict")
        _warn_optim_input(optim_input)
        return _osd.full_optim_state_dict(model, optim, optim_input, rank0_only, group)

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: Any = None
    ) -> dict[str, Any]:
        """Legacy: the SHARDED optimizer state dict (``FutureWarning``).

        Same as :meth:`optim_state_dict` under ``SHARDED_STATE_DICT`` with
        ``offload_to_cpu=True``: ``ShardedTensor`` chunks, moved piece by
        piece, nothing gathered.  A collective.
        """
        _warn_legacy_optim("sharded_optim_state_dict", "optim_state_dict")
        return _osd.sharded_optim_state_dict(model, optim, group)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Legacy: this rank's part of a FULL optimizer state dict, ready to load (``FutureWarning``).

        Every rank passes the whole full dict (e.g. each ``torch.load`` s the
        file) and keeps only the slices of its own shards; no communication.
        Pass ``optim`` (``optim_input`` is deprecated) so the parameter groups
        are the optimizer's.  Use :meth:`scatter_full_optim_state_dict` when
        only rank 0 holds the dict.
        """
        _warn_legacy_optim("shard_full_optim_state_dict", "optim_state_dict_to_load")
        _warn_optim_input(optim_input)
        return _osd.shard_full_optim_state_dict(full_optim_state_dict, model, optim_input, optim)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """Legacy: like :meth:`shard_full_optim_state_dict`, with the full dict on rank 0 only (``FutureWarning``).

        Rank 0 passes the full dict, the other ranks ``None``; it is broadcast
        (every rank holds all of it for a moment) and each rank keeps the
        slices of its own shards.  A collective.
        """
        _warn_legacy_optim("scatter_full_optim_state_dict", "optim_state_dict_to_load")
        _warn_optim_input(optim_input)
        return _osd.scatter_full_optim_state_dict(
            full_optim_state_dict, model, optim_input, optim, group
        )

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Legacy: a SHARDED optimizer state dict turned into one ``optim`` loads (``FutureWarning``).

        The inverse of :meth:`sharded_optim_state_dict`, as
        :meth:`optim_state_dict_to_load` under ``SHARDED_STATE_DICT``: each
        unit's chunk pieces move to the ranks whose flat shards hold them (one
        all-to-all), nothing gathered.  A collective.
        """
        _warn_legacy_optim("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
        return _osd.flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim)

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Re-key an optimizer state dict by parameter name or by parameter id.

        ``OptimStateKeyType.PARAM_NAME`` turns the ids of ``optim.state_dict()``
        into clean FQNs (and ``param_groups``' ``params`` lists with them);
        ``PARAM_ID`` turns names into the ids of ``optim`` (or of
        ``model.parameters()`` when no optimizer is given), so a state dict
        saved by FSDP loads into a plain model's optimizer and back.  A dict
        already keyed that way is returned as is.  No communication.  An
        optimizer stepping flat parameters of several originals
        (``use_orig_params=False``) has no one name per id: that raises
        ``RuntimeError``.  Example::

            by_id = FullyShardedDataParallel.rekey_optim_state_dict(
                saved, OptimStateKeyType.PARAM_ID, plain_model, optim=plain_optim
            )
            plain_optim.load_state_dict(by_id)
        """
        _warn_optim_input(optim_input)
        return _osd.rekey_optim_state_dict(
            optim_state_dict, optim_state_key_type, model, optim_input, optim
        )


def _warn_optim_input(optim_input: Any) -> None:
    if optim_input is not None:
        warnings.warn(
            "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. "
            "You may remove it from your code without changing its functionality (pass "
            "optim=... instead).",
            FutureWarning,
            stacklevel=3,
        )


def _warn_legacy_optim(curr: str, new: str) -> None:
    warnings.warn(
        f"FullyShardedDataParallel.{curr} is being deprecated and is replaced by "
        f"FullyShardedDataParallel.{new} (set the state-dict type with "
        "FullyShardedDataParallel.state_dict_type); call that instead: PyTorch may remove "
        f"{curr}.",
        FutureWarning,
        stacklevel=3,
    )
