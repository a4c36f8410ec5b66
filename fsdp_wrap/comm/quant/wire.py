"""The seam: how one unit's collectives move their bytes, exactly or coded.

A :class:`Wire` is what the gather and reduce paths call instead of the
exact collectives of :mod:`fsdp_wrap.comm.collectives`.  :data:`EXACT` (every
unit's default) calls those, with torch's bytes and numerics; a wire built
by :func:`build_wire` from a ``quantize_collectives`` setting routes the
chosen collectives through :mod:`fsdp_wrap.comm.quant.collectives`.  It is
decided once per unit, at construction, from settings that are the same on
every rank, so every rank takes the same path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.comm.quant.collectives as Q
from fsdp_wrap.comm.quant.codec import Codec
from fsdp_wrap.comm.quant.config import QuantSpec
from fsdp_wrap.comm.quant.topology import Hierarchy, hierarchy, topology_from_env

__all__ = ["EXACT", "Wire", "build_wire", "ineffective"]


@dataclass(frozen=True)
class Wire:
    """Which of a unit's collectives are coded, and how.

    ``weights``: the all-gathers of the compute copy over the shard group;
    ``grads``: the gradient reductions over the shard group; ``replicas``: the
    replicate group's all-reduce (hybrid strategies).  ``hierarchy``: the
    shard group spans nodes and only its step between nodes is coded.
    ``None`` everywhere: exact.  Units whose wires are equal may share a
    collective (gradient buckets, batched gathers).
    """

    weights: Codec | None = None
    grads: Codec | None = None
    replicas: Codec | None = None
    hierarchy: Hierarchy | None = None

    @property
    def is_exact(self) -> bool:
        return self.weights is None and self.grads is None and self.replicas is None

    def signature(self) -> tuple[str, ...]:
        """What every rank of the unit's groups must agree on (no process
        groups: it is compared across ranks at lazy initialisation)."""
        hier = "" if self.hierarchy is None else \
            f"routed {self.hierarchy.nodes}x{self.hierarchy.per_node}"
        return (f"weights={self.weights or 'exact'}", f"grads={self.grads or 'exact'}",
                f"replicas={self.replicas or 'exact'}", hier)

    def sum_dtype(self, reduce_dtype: torch.dtype) -> torch.dtype:
        """The dtype a reduction over the shard group returns: ``reduce_dtype``,
        or float32 where decoded values are summed."""
        return torch.float32 if self.grads is not None else reduce_dtype

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup,
                   segments: Sequence[int] | None = None,
                   async_op: bool = False) -> C.Work | C.PendingWork | None:
        """Every rank's ``shard`` into ``output`` (in ``output``'s dtype)."""
        if self.weights is None:
            if shard.dtype != output.dtype:
                shard = shard.to(output.dtype)
            return C.all_gather_into(output, shard, group, async_op=async_op)
        if self.hierarchy is not None:
            Q.hier_all_gather(output, shard, self.hierarchy, self.weights, segments)
            return None
        return Q.all_gather(output, shard, group, self.weights, segments, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, padded_input: torch.Tensor,
                       group: ProcessGroup, segments: Sequence[int] | None = None,
                       async_op: bool = False,
                       input_is_scratch: bool = False) -> C.Work | C.PendingWork | None:
        """The sum over the group of ``padded_input``'s chunk of this rank, into ``output``."""
        if self.grads is None:
            return C.reduce_scatter_sum(output, padded_input, group, async_op=async_op,
                                        input_is_scratch=input_is_scratch)
        if self.hierarchy is not None:
            Q.hier_reduce_scatter(output, padded_input, self.hierarchy, self.grads, segments)
            return None
        return Q.reduce_scatter(output, padded_input, group, self.grads, segments,
                                async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        """NO_SHARD's sum over the group: ``tensor`` in place, or a float32 result."""
        if self.grads is None:
            C.all_reduce(tensor, group)
            return tensor
        if self.hierarchy is not None:
            return Q.hier_all_reduce(tensor, self.hierarchy, self.grads)
        return Q.all_reduce(tensor, group, self.grads)

    def all_reduce_replicas(self, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        """The hybrid strategies' sum over the replicate group: ``tensor`` in
        place, or a float32 result."""
        if self.replicas is None:
            C.all_reduce(tensor, group)
            return tensor
        return Q.all_reduce(tensor, group, self.replicas)


EXACT = Wire()


def build_wire(spec: QuantSpec | None, group: ProcessGroup,
               replicate_group: ProcessGroup | None, *, hybrid: bool, label: str,
               gathers: bool = True) -> Wire:
    """The wire of a unit over ``group`` (its shard group) and, for hybrid
    strategies, ``replicate_group``.  ``label`` (rank and unit) starts every
    error message.  ``gathers=False`` (NO_SHARD): the unit all-gathers
    nothing, so its weights are never coded.

    ``where='cross_node'`` (the default of :class:`CollectiveQuantization`):
    with a hybrid strategy the replicas' all-reduce is coded where the
    replicate group spans nodes (always, if ``LOCAL_WORLD_SIZE`` does not say)
    and the shard group must lie within one node; otherwise the shard group's
    collectives are routed through the nodes (:class:`Hierarchy`) and coded
    between them.  ``ValueError`` before any collective where that cannot be
    done.  A group of one rank moves nothing and is never coded.
    """
    if spec is None:
        return EXACT
    shard_ws = dist.get_world_size(group)
    rep_ws = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    weights = spec.weights if shard_ws > 1 and gathers else None
    grads = spec.grads if shard_ws > 1 else None
    replicas = spec.grads if rep_ws > 1 else None
    if spec.where == "all":
        return Wire(weights, grads, replicas)
    topo = topology_from_env(label)
    if hybrid:
        if topo is not None and shard_ws > 1 and len(set(topo.nodes_of(group))) > 1:
            raise ValueError(
                f"{label}quantize_collectives where='cross_node' with a hybrid strategy "
                "expects each shard group within one node (its replicate group between nodes) "
                f"but got a shard group on nodes {sorted(set(topo.nodes_of(group)))}; shard "
                "within nodes, or quantize every collective (where='all')")
        if replicas is not None and topo is not None and replicate_group is not None:
            if len(set(topo.nodes_of(replicate_group))) == 1:
                replicas = None  # (the replicas share a node: nothing crosses)
        return Wire(None, None, replicas)
    if shard_ws == 1:
        return EXACT
    if topo is None:
        raise ValueError(
            f"{label}quantize_collectives where='cross_node' needs to know which ranks share "
            "a node, expecting LOCAL_WORLD_SIZE in the environment (torchrun sets it) but it "
            "is not set; launch with torchrun, set LOCAL_WORLD_SIZE, or quantize every "
            "collective (where='all')")
    hier = hierarchy(group, topo, label, "quantize_collectives where='cross_node'")
    if hier is None:
        return EXACT  # (the group lies within one node: nothing crosses)
    return Wire(weights, grads, None, hier)


def ineffective(spec: QuantSpec | None, wire: Wire, group: ProcessGroup,
                replicate_group: ProcessGroup | None, *, hybrid: bool,
                gathers: bool = True) -> list[str]:
    """What of ``spec`` codes nothing on the groups :func:`build_wire` made
    ``wire`` for, each with why and what would code it (for a warning: a
    setting that worked on a cluster may meet one node, and nothing is wrong
    with the run, only with the expectation)."""
    if spec is None:
        return []
    shard_ws = dist.get_world_size(group)
    rep_ws = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    topo = "" if spec.where == "all" else os.environ.get("LOCAL_WORLD_SIZE", "")
    one_node = (f"every rank of the unit's group is on one node (LOCAL_WORLD_SIZE={topo}) and "
                "where='cross_node' codes only what crosses nodes; quantize every collective "
                "with where='all' to code within a node")
    out = []
    if spec.weights is not None and wire.weights is None:
        if not gathers:
            why = "NO_SHARD all-gathers no parameters; leave 'weights' out"
        elif shard_ws == 1:
            why = "the unit's shard group has one rank, so nothing is gathered"
        elif hybrid:
            why = ("with a hybrid strategy where='cross_node' codes only the replicas' "
                   "all-reduce of the gradients (the shard group's gathers stay within a "
                   "node); where='all' codes the gathers too")
        else:
            why = one_node
        out.append(f"'weights' codes nothing: {why}")
    if spec.grads is not None and wire.grads is None and wire.replicas is None:
        if hybrid and shard_ws > 1 and rep_ws == 1:
            why = ("the hybrid strategy has one replica (one node), so no all-reduce crosses "
                   "nodes; where='all' codes the shard group's reductions")
        elif hybrid and rep_ws > 1:
            why = ("the replicas share a node (LOCAL_WORLD_SIZE="
                   f"{os.environ.get('LOCAL_WORLD_SIZE', '')}); where='all' codes them")
        elif shard_ws == 1 and rep_ws == 1:
            why = "the unit's groups have one rank, so nothing is reduced across ranks"
        else:
            why = one_node
        out.append(f"'grads' codes nothing: {why}")
    return out
