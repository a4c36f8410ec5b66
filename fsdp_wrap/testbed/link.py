"""Inside a node of a cluster: which node this is, and what its link has carried.

A rank started by :class:`fsdp_wrap.testbed.Cluster` finds in its environment
the node's number, the number of nodes and the name of the node's interface;
:func:`node_link_bytes` reads that interface's counters (``ip netns exec``
mounts the namespace's own ``/sys``).  The counters are the node's, shared by
its ranks: read them on one rank per node (``LOCAL_RANK`` 0), between barriers,
to learn what a step sent across the link.  Standard library only.
"""

from __future__ import annotations

import os

__all__ = ["ENV_IFNAME", "ENV_NODE", "ENV_NODES", "node_index", "node_link_bytes"]

ENV_IFNAME = "FSDP_WRAP_NODE_IFNAME"
ENV_NODE = "FSDP_WRAP_NODE"
ENV_NODES = "FSDP_WRAP_NODES"


def node_index() -> int | None:
    """This node's number in its cluster (node 0 hosts the rendezvous); ``None``
    outside a cluster."""
    value = os.environ.get(ENV_NODE)
    return int(value) if value is not None else None


def node_link_bytes() -> tuple[int, int] | None:
    """``(sent, received)``: the bytes this node's link has carried so far
    (Ethernet frames: payload, TCP/IP/Ethernet headers, acks); ``None`` outside
    a cluster."""
    ifname = os.environ.get(ENV_IFNAME)
    if not ifname:
        return None
    stats = f"/sys/class/net/{ifname}/statistics"
    with open(f"{stats}/tx_bytes") as f:
        sent = int(f.read())
    with open(f"{stats}/rx_bytes") as f:
        received = int(f.read())
    return sent, received
