"""Which ranks share a node, and the sub-groups a collective across nodes is routed through.

``torchrun`` numbers ranks node after node: with ``LOCAL_WORLD_SIZE`` ranks
per node, global rank ``g`` runs on node ``g // LOCAL_WORLD_SIZE``.  That is
all fsdp_wrap assumes, and it checks what it can see of it (this rank's
``LOCAL_RANK``) before relying on it.  Nothing here communicates except
:func:`hierarchy`, which creates sub-groups (once per set of ranks).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["Hierarchy", "Topology", "hierarchy", "topology_from_env"]


@dataclass(frozen=True)
class Topology:
    """``ranks_per_node`` consecutive global ranks per node."""

    ranks_per_node: int

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.ranks_per_node

    def nodes_of(self, group: ProcessGroup) -> list[int]:
        """The node of each rank of ``group``, in group-rank order."""
        return [self.node_of(r) for r in dist.get_process_group_ranks(group)]


@dataclass(frozen=True)
class Hierarchy:
    """A group of ``nodes * per_node`` ranks, node after node: ``intra`` is this
    rank's node's part of it (group rank = local index), ``cross`` the ranks of
    this rank's local index on every node (group rank = node index).  Equal
    for every unit over the same group (the sub-groups are created once)."""

    nodes: int
    per_node: int
    intra: ProcessGroup
    cross: ProcessGroup


def topology_from_env(rank_tag: str) -> Topology | None:
    """The layout ``torchrun`` describes, or ``None`` without ``LOCAL_WORLD_SIZE``.

    ``ValueError`` if it cannot be that layout (the same on every rank); a
    warning if this rank's ``LOCAL_RANK`` contradicts it.
    """
    env = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not env:
        return None
    try:
        per_node = int(env)
    except ValueError:
        raise ValueError(f"{rank_tag}LOCAL_WORLD_SIZE must be a whole number of ranks per node "
                         f"but got {env!r}") from None
    world = dist.get_world_size() if dist.is_initialized() else per_node
    if per_node < 1 or world % per_node:
        raise ValueError(
            f"{rank_tag}quantized collectives tell nodes apart by LOCAL_WORLD_SIZE, expecting "
            f"a whole number of ranks per node that divides the world size {world} but got "
            f"{per_node}; launch with torchrun, or quantize every collective (where='all')")
    rank = dist.get_rank() if dist.is_initialized() else 0
    local = os.environ.get("LOCAL_RANK", "").strip()
    if local.isdigit() and int(local) != rank % per_node:
        # (a warning, not an error: the others ranks may not see it, and the
        # collectives stay correct; only which link the codes cross differs)
        warnings.warn(
            f"{rank_tag}quantized collectives take global rank g to run on node "
            f"g // LOCAL_WORLD_SIZE ({per_node}), as torchrun numbers ranks, but this rank "
            f"{rank} has LOCAL_RANK {local}: the steps coded as 'between nodes' may not be",
            stacklevel=4)
    return Topology(per_node)


# Sub-groups by their global ranks.  Created once per process and set of
# ranks (``new_group`` with the same ranks twice would reuse one rendezvous
# name); the default group is part of the key, so a re-initialised world gets
# new ones.
_SUBGROUPS: dict[tuple[int, tuple[int, ...]], tuple[object, ProcessGroup]] = {}


def _subgroup(ranks: list[int]) -> ProcessGroup:
    world = dist.distributed_c10d._get_default_group()
    key = (id(world), tuple(ranks))
    cached = _SUBGROUPS.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    group = dist.new_group(ranks, use_local_synchronization=True)
    _SUBGROUPS[key] = (world, group)
    return group


def hierarchy(group: ProcessGroup, topo: Topology, rank_tag: str, what: str) -> Hierarchy | None:
    """How ``group`` spans nodes: ``None`` if all its ranks share one node, else
    its :class:`Hierarchy` (sub-groups created on first use, by the group's
    ranks only).  ``ValueError`` (before any collective) unless the group holds
    the same number of ranks on each node, node after node, in rank order."""
    ranks = dist.get_process_group_ranks(group)
    nodes = [topo.node_of(r) for r in ranks]
    distinct = sorted(set(nodes))
    if len(distinct) == 1:
        return None
    per_node = len(ranks) // len(distinct)
    expected = [distinct[min(i // per_node, len(distinct) - 1)] for i in range(len(ranks))]
    if nodes != expected or ranks != sorted(ranks) or per_node * len(distinct) != len(ranks):
        raise ValueError(
            f"{rank_tag}{what}: a quantized collective across nodes routes through one "
            "sub-group per node and one per local index, expecting the group's ranks in "
            f"ascending order with the same number on every node but got ranks {ranks} on "
            f"nodes {nodes} ({topo.ranks_per_node} ranks per node); use groups made of whole "
            "nodes, or quantize every collective (where='all')")
    me = ranks.index(dist.get_rank())
    node, local = divmod(me, per_node)
    # (every rank creates its node's group first, then its local index's: the
    # members of each group reach it in the same order)
    intra = _subgroup(ranks[node * per_node : (node + 1) * per_node])
    cross = _subgroup(ranks[local::per_node])
    return Hierarchy(len(distinct), per_node, intra, cross)
