"""Whole copies of a unit's flat parameter, outside its unshard/reshard cycle.

State dicts, ``summon_full_params`` to rank 0 and streamed exports read the
original parameters of one unit at a time in the original dtype: gathered
into a buffer of the caller's (or the unit's own unsharded state, freed
again before returning), then split into per-parameter views or copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import fsdp_wrap.comm.collectives as C

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle

__all__ = ["full_param_copies", "gather_full_flat", "param_views"]


def full_param_copies(handle: FlatParamHandle, to_rank0_only: bool,
                      to_cpu: bool) -> list[torch.Tensor] | None:
    """Full-precision copies of the original parameters, one tensor each (a collective).

    The unit is gathered, copied parameter by parameter and freed again
    before returning, so a caller walking the units never holds more than
    one unit unsharded.  With ``to_rank0_only`` the shards are gathered to
    rank 0 alone (other ranks get ``None`` and never hold the whole).
    """
    full: torch.Tensor | None
    if to_rank0_only:
        full = gather_full_flat(handle, to_rank0_only=True)
        if full is None:
            return None
    else:
        handle.finish_unshard(full_precision=True)
        full = handle.flat_param.detach()
    # independent tensors, as torch returns (never views of one buffer)
    copies = [view.to("cpu") if to_cpu and view.device.type != "cpu" else view.clone()
              for view in param_views(handle, full)]
    if not to_rank0_only:
        handle.reshard(free=True)
    return copies


def gather_full_flat(handle: FlatParamHandle, to_rank0_only: bool) -> torch.Tensor | None:
    """The whole flat parameter in the original dtype, in a buffer of the
    caller's (a collective over the unit's group; the handle's own state and
    buffers are left as they are).

    Padded (``padded_numel`` elements) when sharded; ``to_rank0_only``: only
    group rank 0 receives it (the others send their shard and get ``None``).
    NO_SHARD returns the shard itself, not a copy.  Use
    :func:`param_views` to read the original parameters out of it.
    """
    handle.pre_unshard()
    src = handle.gather_source(handle.orig_dtype)
    if not handle.uses_sharded_strategy:
        return src if not to_rank0_only or handle.rank == 0 else None
    if to_rank0_only:
        out = src.new_empty(handle.padded_numel) if handle.rank == 0 else None
        C.gather_into(out, src, 0, handle.process_group)
        return out
    full = src.new_empty(handle.padded_numel)
    C.all_gather_into(full, src, handle.process_group)
    return full


def param_views(handle: FlatParamHandle, full: torch.Tensor) -> list[torch.Tensor]:
    """The original parameters as views of a whole flat parameter ``full``."""
    views = full[: handle.unpadded_numel].split(handle._segments)
    return [views[seg].view(info.shape) for info, seg in zip(handle.infos, handle._info_segment)]
