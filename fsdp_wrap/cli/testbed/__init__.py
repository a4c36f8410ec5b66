"""A multi-node test bed on one machine: nodes as network namespaces, a slow link between them.

:class:`Cluster` makes ``N`` nodes (a Linux network namespace each, a veth pair
per node into a bridge, ``tc`` rate limits and an optional delay on each
node's link), runs a command under torchrun's multi-node (c10d) rendezvous in
every node, reports the bytes each node's link carried, and always removes
what it made.  ``fsdp-wrap cluster`` is the same from the command line
(:mod:`fsdp_wrap.cli.cluster`).  Needs Linux, root and iproute2; elsewhere
:func:`unavailable_reason` says why in one line.

Used by the multi-node tests and ``benchmarks/bench_nodes.py``; nothing in the
library imports it.  Standard library only (torchrun runs as a subprocess).
"""

from fsdp_wrap.cli.testbed.cluster import Cluster, Interrupted, Run, RunResult
from fsdp_wrap.cli.testbed.link import (
    link_during,
    node_frame_bytes,
    node_index,
    node_link_bytes,
    node_resent_segments,
    sent_during,
)
from fsdp_wrap.cli.testbed.network import (
    LinkBytes,
    NodeLink,
    TestbedUnavailable,
    leftovers,
    parse_rate,
    remove_stale,
    unavailable_reason,
)

__all__ = [
    "Cluster",
    "Interrupted",
    "LinkBytes",
    "NodeLink",
    "Run",
    "RunResult",
    "TestbedUnavailable",
    "leftovers",
    "link_during",
    "node_frame_bytes",
    "node_index",
    "node_link_bytes",
    "node_resent_segments",
    "parse_rate",
    "remove_stale",
    "sent_during",
    "unavailable_reason",
]
