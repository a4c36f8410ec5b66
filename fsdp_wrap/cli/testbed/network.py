"""Nodes as network namespaces: one namespace per node, a veth pair per node into a bridge.

Node ``i`` is the namespace ``fwt<pid><tag>-n<i>`` with loopback up and one
interface, ``fwt<pid><tag>n<i>``, at :func:`node_address` ``(i)``; its other end,
``fwt<pid><tag>h<i>``, is a port of the bridge ``fwt<pid><tag>b``.  Ranks of one
node talk over its loopback (the kernel delivers a node's own address locally),
ranks of different nodes through the two veth pairs and the bridge: the link.

Each node's link is shaped in both directions with ``tc``: a token bucket
(``tbf``) at the node's rate on the node's end (what it sends) and on the
bridge's end (what it receives), and, with a delay, ``netem`` in front of the
node's sending side.  The bucket's queue is deep (half a second at the rate):
a slow link queues rather than drops, so the bytes on the wire are the bytes
sent, not retransmissions.

Nothing of a cluster is visible to the host's own network: the bridge has no
address and IPv6 is off on every interface a cluster makes (no router or
neighbour chatter on the counters), so clusters of different processes, each
on its own bridge, may use the same addresses at the same time.  Every name
carries the creating process's id; :func:`remove_stale` deletes what processes
that no longer exist left behind (a ``kill -9`` skips every ``finally``).

Only the standard library and the ``ip`` and ``tc`` programs (iproute2).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = [
    "LinkBytes",
    "Network",
    "NodeLink",
    "TestbedUnavailable",
    "leftovers",
    "node_address",
    "parse_delay",
    "parse_rate",
    "remove_stale",
    "unavailable_reason",
]

PREFIX = "fwt"
#: ``fwt<pid><tag>``: a run's names begin so (``tag``: one lower-case letter per
#: cluster of that process, so one process may hold several at once).
_RUN_RE = re.compile(rf"^{PREFIX}(\d+)([a-z])")
SUBNET = "10.213.0"
#: the address's last byte, node 0 first: always three digits, so the address
#: strings sort as the node numbers do (torchrun's c10d rendezvous numbers the
#: nodes by sorting their ``--local-addr``).
_FIRST_HOST = 101
MAX_NODES = 150
_IFNAMSIZ = 15  # Linux interface names: at most 15 characters


class TestbedUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why in one line."""

    __test__ = False  # not a pytest test class, whatever its name says


# ---------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------

_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_RATE_UNIT = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_DELAY_RE = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$", re.IGNORECASE)
_DELAY_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_rate(rate: str | None) -> int | None:
    """A link rate in ``tc``'s words (``200mbit``, ``1gbit``, ``1.5gbit``) as bits
    per second; ``None``, ``""``, ``unlimited`` or ``0``: no limit (``None``)."""
    if rate is None or rate.strip().lower() in ("", "unlimited", "none", "0"):
        return None
    m = _RATE_RE.match(rate.strip())
    if not m:
        raise ValueError(f"link rate {rate!r}: expected a number and a unit, e.g. 200mbit, "
                         "1gbit, 500kbit (bits per second), or 'unlimited'")
    bits = int(float(m.group(1)) * _RATE_UNIT[m.group(2).lower()])
    if bits < 8000:
        raise ValueError(f"link rate {rate!r}: at least 8kbit")
    return bits


def parse_delay(delay: str | None) -> float | None:
    """A one-way delay (``500us``, ``2ms``, ``0.1s``) in seconds; ``None`` or ``""``: none."""
    if delay is None or delay.strip() in ("", "0"):
        return None
    m = _DELAY_RE.match(delay.strip())
    if not m:
        raise ValueError(f"link delay {delay!r}: expected a number and a unit, e.g. 1ms, 500us")
    return float(m.group(1)) * _DELAY_UNIT[m.group(2).lower()]


def node_address(index: int) -> str:
    """Node ``index``'s address on its link (the same in every cluster: each has its own bridge)."""
    if not 0 <= index < MAX_NODES:
        raise ValueError(f"node index {index}: at most {MAX_NODES} nodes")
    return f"{SUBNET}.{_FIRST_HOST + index}"


@dataclasses.dataclass(frozen=True)
class NodeLink:
    """One node's namespace and the two ends of its link."""

    index: int
    namespace: str
    ifname: str  # the node's end, inside its namespace
    bridge_port: str  # the other end, a port of the bridge
    address: str


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """What a node's link carried: ``sent`` by the node, ``received`` by it (bytes
    of Ethernet frames: the payload plus TCP/IP/Ethernet headers and the acks)."""

    sent: int
    received: int

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.sent - other.sent, self.received - other.received)


# ---------------------------------------------------------------------------
# running ip and tc
# ---------------------------------------------------------------------------


def _cmd(args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _netem(args: list[str]) -> None:
    """A ``netem`` qdisc (the delay); a kernel without it gets a sentence, not tc's."""
    proc = _cmd(args, check=False)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip()
        if "unknown" in said.lower():
            raise TestbedUnavailable(
                "a link delay needs the kernel's netem queueing discipline (sch_netem), which "
                f"this kernel does not have (tc said: {said}); leave the delay out")
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {said}")


def _netns_list() -> list[str]:
    out = _cmd(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


#: ``ip netns exec NS`` mounts the files of ``/etc/netns/NS/`` over ``/etc``'s
_ETC_NETNS = "/etc/netns"


def _etc_list() -> list[str]:
    try:
        return os.listdir(_ETC_NETNS)
    except OSError:
        return []


def _remove_etc(namespace: str) -> None:
    shutil.rmtree(os.path.join(_ETC_NETNS, namespace), ignore_errors=True)


def _link_list() -> list[str]:
    out = _cmd(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def _netns_pids(namespace: str) -> list[int]:
    out = _cmd(["ip", "netns", "pids", namespace], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _write(path: str, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError:
        pass  # e.g. no IPv6 in this kernel: nothing to turn off


# ---------------------------------------------------------------------------
# availability, stale runs, leftovers
# ---------------------------------------------------------------------------

_reason_cache: list[str | None] = []
_tags_lock = threading.Lock()
_tags_used: set[str] = set()


def unavailable_reason() -> str | None:
    """``None`` where this process can make a cluster, else why not (one line).

    Checks Linux, root, ``ip`` and ``tc``, then makes and removes a namespace
    and a veth pair for real (containers may refuse either).  Cached.
    """
    if not _reason_cache:
        _reason_cache.append(_probe())
    return _reason_cache[0]


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in CI as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' program (iproute2) is not installed"
    tag = _new_tag()
    ns, veth = f"{PREFIX}{os.getpid()}{tag}-probe", f"{PREFIX}{os.getpid()}{tag}p"
    try:
        for args in (["ip", "netns", "add", ns],
                     ["ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "x",
                      "netns", ns]):
            proc = _cmd(args, check=False)
            if proc.returncode != 0:
                return (f"cannot make network namespaces here ('{' '.join(args[:4])}' said: "
                        f"{(proc.stderr or proc.stdout).strip()})")
        return None
    finally:
        _cmd(["ip", "link", "del", veth], check=False)
        _cmd(["ip", "netns", "del", ns], check=False)
        _release_tag(tag)


def _new_tag() -> str:
    with _tags_lock:
        for c in "abcdefghijklmnopqrstuvwxyz":
            if c not in _tags_used:
                _tags_used.add(c)
                return c
    raise RuntimeError("more than 26 clusters at once in one process")


def _release_tag(tag: str) -> None:
    with _tags_lock:
        _tags_used.discard(tag)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(run: str | None = None) -> list[str]:
    """Namespaces and interfaces of clusters still on this machine (those of the
    run named ``run``, e.g. ``fwt1234a``, or of every run)."""
    names = set(_netns_list() + _link_list() + _etc_list())
    return sorted(n for n in names if _RUN_RE.match(n) and (run is None or n.startswith(run)))


def remove_stale() -> list[str]:
    """Remove every namespace and interface that a cluster of a process that no
    longer exists left behind (after killing what still runs in them); return
    their names."""
    stale = [n for n in leftovers() if not _alive(int(_RUN_RE.match(n).group(1)))]  # type: ignore[union-attr]
    namespaces = set(_netns_list())
    for name in stale:
        if name in namespaces:
            _kill_all(_netns_pids(name))
            _cmd(["ip", "netns", "del", name], check=False)
        elif name in _link_list():
            _cmd(["ip", "link", "del", name], check=False)
        _remove_etc(name)
    return stale


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------
# the network of one cluster
# ---------------------------------------------------------------------------


class Network:
    """The namespaces, links and bridge of one cluster: :meth:`create`, then
    :meth:`destroy` (idempotent; also after a failed :meth:`create`)."""

    def __init__(self, nodes: int, rates: list[int | None], delay_s: float | None) -> None:
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes={nodes}: between 1 and {MAX_NODES}")
        if len(rates) != nodes:
            raise ValueError(f"{len(rates)} link rates for {nodes} nodes")
        self.tag = _new_tag()
        self.run = f"{PREFIX}{os.getpid()}{self.tag}"
        self.bridge = self.run + "b"
        self.rates, self.delay_s = rates, delay_s
        self.nodes = [
            NodeLink(i, f"{self.run}-n{i}", f"{self.run}n{i}", f"{self.run}h{i}", node_address(i))
            for i in range(nodes)
        ]
        if len(self.nodes[-1].bridge_port) > _IFNAMSIZ:
            raise ValueError(f"interface name {self.nodes[-1].bridge_port!r} is too long")
        self._made = False

    # -- building ----------------------------------------------------------

    def create(self) -> None:
        self._made = True
        _cmd(["ip", "link", "add", self.bridge, "type", "bridge", "forward_delay", "0",
              "nf_call_iptables", "0", "nf_call_ip6tables", "0", "nf_call_arptables", "0"])
        _write(f"/proc/sys/net/ipv6/conf/{self.bridge}/disable_ipv6", "1")
        _cmd(["ip", "link", "set", self.bridge, "up"])
        for node in self.nodes:
            self._add_node(node)

    def _add_node(self, node: NodeLink) -> None:
        ns = node.namespace
        _cmd(["ip", "netns", "add", ns])
        self._write_etc(node)
        # before any interface appears: no IPv6 link-local chatter on the counters
        _cmd(["ip", "netns", "exec", ns, "sh", "-c",
              "for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 "
              "/proc/sys/net/ipv6/conf/default/disable_ipv6; do "
              "[ -w $f ] && echo 1 > $f; done; true"])
        _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        _cmd(["ip", "link", "add", node.bridge_port, "type", "veth", "peer", "name", node.ifname,
              "netns", ns])
        _write(f"/proc/sys/net/ipv6/conf/{node.bridge_port}/disable_ipv6", "1")
        _cmd(["ip", "link", "set", node.bridge_port, "master", self.bridge])
        _cmd(["ip", "link", "set", node.bridge_port, "up"])
        _cmd(["ip", "-n", ns, "addr", "add", f"{node.address}/24", "dev", node.ifname])
        _cmd(["ip", "-n", ns, "link", "set", node.ifname, "up"])
        rate = self.rates[node.index]
        if rate is not None:
            self._shape(["-n", ns], node.ifname, rate, self.delay_s)
            self._shape([], node.bridge_port, rate, None)
        elif self.delay_s is not None:
            _netem(["tc", "-n", ns, "qdisc", "add", "dev", node.ifname, "root", "netem",
                    "delay", f"{self.delay_s * 1e6:.0f}us", "limit", "100000"])

    def _write_etc(self, node: NodeLink) -> None:
        """The node's ``/etc/hosts`` and ``/etc/resolv.conf``: every node by name
        (``node0``, ...) and this machine's host name as the node's own address;
        no name server, so a lookup of an unknown name fails at once instead of
        waiting for a server the node cannot reach (torch's c10d looks up every
        peer's name)."""
        lines = ["127.0.0.1 localhost", f"{node.address} {socket.gethostname()}"]
        lines += [f"{n.address} node{n.index}" for n in self.nodes]
        directory = os.path.join(_ETC_NETNS, node.namespace)
        try:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")
            with open(os.path.join(directory, "resolv.conf"), "w") as f:
                f.write("# no name server inside a test-bed node\noptions timeout:1 attempts:1\n")
        except OSError:
            pass  # then lookups go to the machine's resolver: slower, still correct

    @staticmethod
    def _shape(where: list[str], dev: str, rate: int, delay_s: float | None) -> None:
        """A token bucket at ``rate`` on ``dev``'s sending side (after ``netem``'s
        delay, if any).  The bucket holds at least two 64 KiB segments, so the
        kernel's segmentation offload passes whole, and its queue half a second
        of traffic, so TCP is slowed by queueing, not by drops."""
        burst = max(128 * 1024, rate // 8 // 250)  # bytes: >= 4 ms at the rate
        limit = max(4 * 2**20, rate // 8 // 2)  # bytes: 0.5 s at the rate
        tbf = ["tbf", "rate", f"{rate}bit", "burst", str(burst), "limit", str(limit)]
        if delay_s is None:
            _cmd(["tc", *where, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])
            return
        _netem(["tc", *where, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                "delay", f"{delay_s * 1e6:.0f}us", "limit", "100000"])
        _cmd(["tc", *where, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])

    # -- reading -----------------------------------------------------------

    def link_bytes(self) -> list[LinkBytes]:
        """Every node's :class:`LinkBytes` so far, read on the bridge's end of its
        link (what the node sent arrives there, and what it received left from there)."""
        out = []
        for node in self.nodes:
            stats = f"/sys/class/net/{node.bridge_port}/statistics"
            with open(f"{stats}/rx_bytes") as f:
                sent = int(f.read())
            with open(f"{stats}/tx_bytes") as f:
                received = int(f.read())
            out.append(LinkBytes(sent, received))
        return out

    def pids(self, index: int) -> list[int]:
        """The processes running in node ``index``'s namespace."""
        return _netns_pids(self.nodes[index].namespace)

    def kill_node(self, index: int, spare: int | None = None) -> None:
        """SIGKILL every process in node ``index`` (a node that dies), but ``spare``."""
        _kill_all([pid for pid in self.pids(index) if pid != spare])

    # -- tearing down ------------------------------------------------------

    def destroy(self) -> None:
        """Kill what still runs in the namespaces, delete the links, the
        namespaces and the bridge.  Leaves nothing of this run behind."""
        if not self._made:
            _release_tag(self.tag)
            return
        for node in self.nodes:
            if node.namespace in _netns_list():
                _kill_all(_netns_pids(node.namespace))
        for node in self.nodes:
            _cmd(["ip", "link", "del", node.bridge_port], check=False)
            _cmd(["ip", "netns", "del", node.namespace], check=False)
            _remove_etc(node.namespace)
        _cmd(["ip", "link", "del", self.bridge], check=False)
        # a namespace's interfaces go when its last process has: wait briefly
        deadline = time.monotonic() + 10
        while leftovers(self.run) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = leftovers(self.run)
        self._made = False
        _release_tag(self.tag)
        if left:
            raise RuntimeError(f"cluster {self.run}: could not remove {', '.join(left)}")
