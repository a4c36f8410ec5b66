"""Inside a node of a cluster: which node this is, and what its link has carried.

A rank started by :class:`fsdp_wrap.cli.testbed.Cluster` finds in its environment
the node's number, the number of nodes and the name of the node's interface;
:func:`node_link_bytes` reads that interface's counters (``ip netns exec``
mounts the namespace's own ``/sys``), :func:`node_resent_segments` the
namespace's TCP retransmissions.  The counters are the node's, shared by
its ranks: read them on one rank per node (``LOCAL_RANK`` 0), with a barrier
on each side of every read, to learn what a step sent across the link
(:func:`sent_during` does it).  Standard library only.
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

__all__ = ["ENV_IFNAME", "ENV_NODE", "ENV_NODES", "link_during", "node_frame_bytes", "node_index",
           "node_link_bytes", "node_resent_segments", "sent_during"]

T = TypeVar("T")

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


def node_resent_segments() -> int | None:
    """TCP segments this node has sent again so far (``RetransSegs`` of its
    network namespace's ``/proc/net/snmp``: a loaded machine can make the
    link's queue drop, and TCP sends those bytes twice); ``None`` outside a
    cluster.  Counts every connection in the namespace, the node's loopback
    ones too (which rarely resend): an upper bound for the link's."""
    if not os.environ.get(ENV_IFNAME):
        return None
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    names, values = rows[0], rows[1]
    return int(values[names.index("RetransSegs")])


def node_frame_bytes() -> int | None:
    """The most bytes one resent segment puts on this node's link: the
    interface's MTU and the Ethernet header (14 bytes); ``None`` outside a
    cluster."""
    ifname = os.environ.get(ENV_IFNAME)
    if not ifname:
        return None
    with open(f"/sys/class/net/{ifname}/mtu") as f:
        return int(f.read()) + 14


def sent_during(fn: Callable[[], T], barrier: Callable[[], object]) -> tuple[T, int | None]:
    """Run ``fn()`` on every rank; return its result and the bytes this node's
    link sent meanwhile (on ``LOCAL_RANK`` 0; ``None`` on the other ranks and
    outside a cluster).  Call it on every rank, with ``barrier`` a barrier over
    all of them (``torch.distributed.barrier``).

    A barrier on *each* side of both reads: one barrier before a read is not
    enough, since the node's other ranks leave it and start sending while local
    rank 0 is still reading (on a 1 Gbit/s link an 8 MiB exchange measured 5%
    short that way), and their next work would be counted after ``fn``.  The
    barriers' own few hundred bytes are counted.
    """
    result, link = link_during(fn, barrier)
    return result, None if link is None else link[0]


def link_during(fn: Callable[[], T],
                barrier: Callable[[], object]) -> tuple[T, tuple[int, int] | None]:
    """As :func:`sent_during`, with the TCP segments the node sent again
    meanwhile (:func:`node_resent_segments`): ``(result, (bytes sent,
    segments resent))``, the pair ``None`` off ``LOCAL_RANK`` 0 and outside a
    cluster.  Two runs of the same ``fn`` differ in bytes sent by at most
    the resent segments' frames (:func:`node_frame_bytes` each) and the acks'
    timing."""
    def read() -> tuple[int, int] | None:
        barrier()
        got = None
        if os.environ.get("LOCAL_RANK") == "0":
            link, resent = node_link_bytes(), node_resent_segments()
            if link is not None and resent is not None:
                got = (link[0], resent)
        barrier()
        return got

    before = read()
    result = fn()
    after = read()
    if before is None or after is None:
        return result, None
    return result, (after[0] - before[0], after[1] - before[1])
