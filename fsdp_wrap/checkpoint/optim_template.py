"""A fresh optimizer made ready to receive a DCP checkpoint's optimizer state.

The FSDP1 recipe for loading a sharded optimizer state (Accelerate's
``load_fsdp_optimizer``, and scripts written after it) builds the DCP load
template from the optimizer itself::

    template = {"optimizer": FSDP.optim_state_dict(model, optim)}
    dcp.load(template, checkpoint_id=path)          # reads the template's keys only
    optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, template["optimizer"]))

A freshly built optimizer has no state (Adam creates its moments at the first
step), so the template lists none and nothing of it is read: the learning rate
and the other group settings are restored, the moments silently are not, and
the run after resuming drifts from the uninterrupted one.  This happens with
torch's FSDP1 as with fsdp_wrap.

:func:`init_optim_state_from_checkpoint` closes that gap from the checkpoint
itself: it reads the checkpoint's metadata (local, no collective) and gives
each parameter the checkpoint holds state for a zero state of the stored dtype,
laid out as the optimizer keeps it (this rank's shard of a flat parameter, or
of an original parameter with ``use_orig_params=True``).  The template then
names exactly what the checkpoint stores, DCP fills it, and
``optim.load_state_dict`` replaces the placeholders.  Unlike torch's
``_init_optim_state`` (one zero-learning-rate step) it runs no optimizer step,
so it works for every optimizer and leaves a checkpoint without optimizer
state (saved before the first step) loadable.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.state_dict.optim_index import _index

__all__ = ["init_optim_state_from_checkpoint"]


def _stored_states(metadata: Any, prefix: str) -> dict[str, dict[str, Any]]:
    """Parameter FQN -> state name -> storage metadata, for the keys under ``prefix``.

    DCP flattens ``{"state": {fqn: {name: value}}}`` to ``state.<fqn>.<name>``;
    a state name has no dot, so the last dot splits the two (a parameter's FQN
    is never the start of another parameter's FQN followed by a dot).
    """
    out: dict[str, dict[str, Any]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        fqn, _, name = key[len(prefix):].rpartition(".")
        if fqn and name:
            out.setdefault(fqn, {})[name] = md
    return out


def _placeholder(md: Any, like: torch.Tensor, full_shape: tuple[int, ...]) -> Any:
    """A zero state value standing where the checkpoint stores ``md``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if isinstance(md, BytesStorageMetadata):
        return 0  # (a pickled object: DCP replaces the value wholesale)
    assert isinstance(md, TensorStorageMetadata)
    dtype = md.properties.dtype
    if len(md.size) > 0 and tuple(md.size) == full_shape:
        # one value per element of the parameter: held as the optimizer holds
        # the parameter here (a flat shard, or this rank's piece of it)
        return torch.zeros_like(like, dtype=dtype, memory_format=torch.contiguous_format)
    return torch.zeros(tuple(md.size), dtype=dtype)  # ("step", or any other whole value)


def init_optim_state_from_checkpoint(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    checkpoint_id: str | os.PathLike[str] | Any,
    *,
    key: str = "optimizer",
) -> int:
    """Give ``optim`` zero state shaped as the DCP checkpoint holds it, so that
    ``FullyShardedDataParallel.optim_state_dict(model, optim)`` is a complete
    template for ``torch.distributed.checkpoint.load``.

    ``checkpoint_id``: the checkpoint directory (or a DCP ``StorageReader``);
    ``key``: where the optimizer state dict sits in the saved state dict
    (``"optimizer"`` for ``{"optimizer": FSDP.optim_state_dict(model, optim)}``,
    Accelerate's layout; ``""`` when it was saved at the top level).

    Only an optimizer without any state is changed (one that has state is a
    complete template already); returns how many of its parameters were given
    state (0 when the checkpoint holds no optimizer state).  Local to this rank:
    no collective.  The zeros are placeholders for the load, which replaces
    them: use the optimizer after ``optim.load_state_dict``, not before.
    A directory is checked first, before anything changes: its ``.metadata``
    readable, every data file it names present and long enough (a
    ``ValueError`` naming the file otherwise).
    """
    if any(optim.state.values()):
        return 0
    if isinstance(checkpoint_id, (str, os.PathLike)):
        import fsdp_wrap.checkpoint._dcp as _dcp  # (DCP's import: only when it is used)

        try:  # (the offline tool's reader: it tells a missing, incomplete or damaged one apart)
            metadata = _dcp.read_metadata(os.fspath(checkpoint_id))
            _dcp.check_files(os.fspath(checkpoint_id), metadata)  # missing or truncated data
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(f"[rank {global_rank()}] init_optim_state_from_checkpoint: {e}; "
                          "pass the directory dcp.save wrote") from e
    else:
        metadata = checkpoint_id.read_metadata()
    prefix = f"{key}.state." if key else "state."
    stored = _stored_states(metadata, prefix)
    if not stored:
        return 0
    index = _index(model)
    seeded = 0
    for group in optim.param_groups:
        for p in group["params"]:
            u, k, fqns = index.where.get(id(p), (-1, -1, []))
            state: dict[str, Any] = {}
            for j, fqn in enumerate(fqns):
                if u >= 0:
                    h = index.units[u].handle
                    shape = tuple(h.infos[k if k >= 0 else j].shape)
                else:
                    shape = tuple(p.shape)
                for name, md in stored.get(fqn, {}).items():
                    if name not in state:
                        state[name] = _placeholder(md, p, shape)
            if state:
                optim.state[p] = state
                seeded += 1
    return seeded
