"""What a sharding strategy must send across the link, per node and per training step.

The count is the payload (tensor bytes) one node's link sends in one step of
forward, backward and optimizer step, for ``nodes`` nodes of ``ranks_per_node``
ranks each, numbered as torchrun numbers them (a node's ranks consecutive),
with gloo's algorithms:

* all-gather over ``n`` ranks: a ring in rank order; every rank sends
  ``(n - 1) / n`` of the output to the next rank, and one edge of the ring
  leaves each node, so a node sends ``(n - 1) / n`` of the output;
* all-reduce over ``n`` ranks: a ring reduce-scatter and a ring all-gather,
  ``2 (n - 1) / n`` of the tensor per node; gloo has no reduce-scatter of its
  own: torch's ``reduce_scatter_tensor`` on gloo and fsdp_wrap's are an
  all-reduce of the whole input, so they send as much;
* hybrid strategies shard within a node (nothing crosses) and all-reduce each
  shard over the ``nodes`` ranks that hold it: ``ranks_per_node`` groups of one
  rank per node, each ``2 (nodes - 1) / nodes`` of its ``1 / ranks_per_node``
  shard per rank.

Per step and unit (``unit_bytes``: each unit's unsharded, padded flat parameter
in bytes; ``root_bytes``: the root unit's, which FSDP1 keeps gathered from
forward to backward):

=======================  ======================================================
strategy                 collectives over the link
=======================  ======================================================
FULL_SHARD               all-gather in forward and in backward (not the
                         root's), reduce-scatter
SHARD_GRAD_OP            all-gather in forward, reduce-scatter
HYBRID_SHARD,            all-reduce of the shards across nodes
_HYBRID_SHARD_ZERO2
NO_SHARD, DDP            all-reduce over every rank
=======================  ======================================================

What the wire carries on top (TCP/IP and Ethernet headers, the acks of what
the node receives) is the protocol overhead: measure it on the same link
(``tests/test_nodes.py`` and ``benchmarks/bench_nodes.py`` exchange a known
number of bytes) and multiply.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["STRATEGIES", "all_gather_bytes", "all_reduce_bytes", "step_bytes"]

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD",
              "DDP")


def all_gather_bytes(output_bytes: float, ranks: int, nodes: int) -> float:
    """Bytes one node sends in a ring all-gather of ``output_bytes`` over ``ranks``
    ranks spread over ``nodes`` nodes (0 within one node)."""
    return 0.0 if nodes <= 1 else output_bytes * (ranks - 1) / ranks


def all_reduce_bytes(tensor_bytes: float, ranks: int, nodes: int) -> float:
    """Bytes one node sends in a ring all-reduce of ``tensor_bytes`` over ``ranks``
    ranks spread over ``nodes`` nodes (0 within one node)."""
    return 0.0 if nodes <= 1 else 2 * tensor_bytes * (ranks - 1) / ranks


def step_bytes(strategy: str, unit_bytes: Sequence[float], root_bytes: float, nodes: int,
               ranks_per_node: int) -> float:
    """The payload one node sends across its link per training step (see the
    module's table); ``unit_bytes`` includes the root's ``root_bytes``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"nodes={nodes}, ranks_per_node={ranks_per_node}: at least 1 each")
    total = float(sum(unit_bytes))
    world = nodes * ranks_per_node
    if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        # each rank all-reduces its 1/ranks_per_node shard with its peers on the other nodes
        return ranks_per_node * all_reduce_bytes(total / ranks_per_node, nodes, nodes)
    if strategy in ("NO_SHARD", "DDP"):
        return all_reduce_bytes(total, world, nodes)
    gathered = 2 * total - root_bytes if strategy == "FULL_SHARD" else total
    return all_gather_bytes(gathered, world, nodes) + all_reduce_bytes(total, world, nodes)
