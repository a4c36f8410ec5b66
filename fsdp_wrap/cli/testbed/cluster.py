"""A cluster on one machine: N nodes x M ranks under torchrun's multi-node rendezvous.

::

    from fsdp_wrap.cli.testbed import Cluster

    with Cluster(nodes=2, rate="200mbit") as cluster:       # namespaces, links, tc
        result = cluster.run([sys.executable, "train.py"], nproc_per_node=2, timeout=600)
    print(result.returncodes, [b.sent for b in result.link_bytes])   # everything removed here

Every node runs ``python -m torch.distributed.run`` (torchrun) in its own
namespace, with the c10d rendezvous hosted by node 0 (``is_host=1`` there and
``0`` elsewhere) and ``--local-addr`` set to the node's own address (inside a
namespace the host name resolves to the machine's address, which the other
nodes cannot reach).  The command runs once per rank (``--no-python``: give the
interpreter yourself) with torchrun's variables, plus ``GLOO_SOCKET_IFNAME``
and ``NCCL_SOCKET_IFNAME`` set to the node's interface and the variables of
:mod:`fsdp_wrap.cli.testbed.link` (which node, which interface).

Teardown is unconditional: leaving the ``with`` block by success, exception,
``KeyboardInterrupt`` (Ctrl-C), SIGTERM or SIGHUP (turned into
:class:`Interrupted` while a cluster is open in the main thread) kills every
process of the cluster and deletes its namespaces, links and bridge.  A
``kill -9`` of the owner skips that; the next cluster made on the machine
removes what dead owners left (:func:`fsdp_wrap.cli.testbed.network.remove_stale`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any, Callable, TextIO

from fsdp_wrap.cli.testbed.link import ENV_IFNAME, ENV_NODE, ENV_NODES
from fsdp_wrap.cli.testbed.network import (
    LinkBytes,
    Network,
    NodeLink,
    TestbedUnavailable,
    parse_delay,
    parse_rate,
    remove_stale,
    unavailable_reason,
)

__all__ = ["Cluster", "Interrupted", "Run", "RunResult", "RDZV_PORT"]

#: the rendezvous port on node 0 (free there: node 0 is a namespace of its own)
RDZV_PORT = 29400
_GRACE_S = 5.0  # after SIGTERM, before SIGKILL


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while a cluster was open (SIGINT stays
    ``KeyboardInterrupt``); ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


@dataclasses.dataclass
class RunResult:
    """How a command ended on every node."""

    returncodes: list[int]  # per node: torchrun's exit code (negative: killed by that signal)
    outputs: list[str]  # per node: torchrun's and the ranks' stdout and stderr, interleaved
    link_bytes: list[LinkBytes]  # per node: what its link carried during the run
    seconds: float
    timed_out: bool  # stopped at the run's timeout
    stopped: list[bool]  # per node: stopped by the test bed (timeout, or a failed peer node)

    @property
    def ok(self) -> bool:
        return not any(self.stopped) and all(rc == 0 for rc in self.returncodes)

    def summary(self) -> str:
        """One line per node: exit code and megabytes across its link."""
        lines = []
        for i, (rc, b) in enumerate(zip(self.returncodes, self.link_bytes)):
            how = " (stopped by the test bed)" if self.stopped[i] else ""
            lines.append(f"node {i}: exit code {rc}{how}, sent {b.sent / 1e6:.1f} MB, "
                         f"received {b.received / 1e6:.1f} MB")
        state = "timed out" if self.timed_out else "done"
        lines.append(f"{state} in {self.seconds:.1f} s")
        return "\n".join(lines)


class Run:
    """A command running on every node of a :class:`Cluster` (from :meth:`Cluster.start`)."""

    def __init__(self, network: Network, procs: list[subprocess.Popen[str]],
                 echo: TextIO | None) -> None:
        self._net, self.procs = network, procs
        self._outputs: list[list[str]] = [[] for _ in procs]
        self._start_bytes = network.link_bytes()
        self._t0 = time.monotonic()
        self._readers = [threading.Thread(target=self._read, args=(i, echo), daemon=True)
                         for i in range(len(procs))]
        for t in self._readers:
            t.start()

    def _read(self, i: int, echo: TextIO | None) -> None:
        stream = self.procs[i].stdout
        if stream is None:
            return
        for line in stream:
            self._outputs[i].append(line)
            if echo is not None:
                echo.write(f"[node {i}] {line}")
                echo.flush()

    def output(self, node: int) -> str:
        """What node ``node`` has printed so far."""
        return "".join(self._outputs[node])

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def kill_node(self, node: int) -> None:
        """Node ``node`` dies: SIGKILL to every process in it (torchrun and its ranks)."""
        self._net.kill_node(node)

    def kill_ranks(self, node: int) -> None:
        """Node ``node``'s ranks die (SIGKILL), its torchrun lives on: with
        ``max_restarts`` it starts them again."""
        self._net.kill_node(node, spare=self.procs[node].pid)

    def stop(self, nodes: Sequence[int] | None = None) -> None:
        """SIGTERM to the torchrun of every node (or of ``nodes``; it stops its
        ranks), SIGKILL to what is left of them after a grace period."""
        which = range(len(self.procs)) if nodes is None else nodes
        for i in which:
            if self.procs[i].poll() is None:
                try:
                    os.killpg(self.procs[i].pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + _GRACE_S
        while any(self.procs[i].poll() is None for i in which) and time.monotonic() < deadline:
            time.sleep(0.05)
        for i in which:
            self._net.kill_node(i)
        for i in which:
            self.procs[i].wait()

    def wait(self, timeout: float | None = None, fail_grace: float = 60.0) -> RunResult:
        """Wait until every node's torchrun has exited, and say how each ended.

        After ``timeout`` seconds every node still running is stopped
        (:meth:`stop`).  Once a node has failed, the others get ``fail_grace``
        seconds to end by themselves (their ranks' collectives fail when a peer
        is lost) and are then stopped: a node whose ranks succeeded would
        otherwise wait in torchrun's exit barrier for the failed node, 300 s.
        ``RunResult.stopped`` says which nodes were stopped.
        """
        start = time.monotonic()
        stopped = [False] * len(self.procs)
        first_failure: float | None = None
        timed_out = False
        while any(p.poll() is None for p in self.procs):
            now = time.monotonic()
            if first_failure is None and any(p.poll() not in (None, 0) for p in self.procs):
                first_failure = now
            over_time = timeout is not None and now - start > timeout
            over_grace = first_failure is not None and now - first_failure > fail_grace
            if over_time or over_grace:
                running = [i for i, p in enumerate(self.procs) if p.poll() is None]
                for i in running:
                    stopped[i] = True
                timed_out = over_time
                self.stop(running)
                break
            time.sleep(0.05)
        for t in self._readers:
            t.join(timeout=5)
        end = self._net.link_bytes()
        return RunResult(
            returncodes=[int(p.returncode) for p in self.procs],
            outputs=["".join(o) for o in self._outputs],
            link_bytes=[e - s for e, s in zip(end, self._start_bytes)],
            seconds=time.monotonic() - self._t0,
            timed_out=timed_out,
            stopped=stopped,
        )


class Cluster:
    """``nodes`` network namespaces joined by rate-limited links, as a context manager.

    ``rate``: every node's link rate in ``tc``'s words (``"1gbit"``,
    ``"200mbit"``; ``None`` or ``"unlimited"``: no limit), or one per node.
    ``delay``: added one-way delay on what each node sends (``"1ms"``).
    Entering raises :class:`TestbedUnavailable` (one line: why) where namespaces
    cannot be made.
    """

    def __init__(self, nodes: int = 2, rate: str | Sequence[str | None] | None = None,
                 delay: str | None = None) -> None:
        rates = [rate] * nodes if rate is None or isinstance(rate, str) else list(rate)
        if len(rates) != nodes:
            raise ValueError(f"{len(rates)} link rates for {nodes} nodes: give one rate, or "
                             "one per node")
        self.rates = [parse_rate(r) for r in rates]  # validated before anything is made
        self.delay_s = parse_delay(delay)
        self.nodes_count = nodes
        self.network: Network | None = None
        self._runs: list[Run] = []
        self._old_handlers: dict[int, Any] = {}

    # -- the context -------------------------------------------------------

    def __enter__(self) -> Cluster:
        reason = unavailable_reason()
        if reason is not None:
            raise TestbedUnavailable(reason)
        remove_stale()
        self._catch_signals()
        try:
            self.network = Network(self.nodes_count, self.rates, self.delay_s)
            self.network.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop every run, remove the network, restore the signal handlers.
        Idempotent; ``__exit__`` calls it."""
        try:
            for run in self._runs:
                run.stop()
            self._runs.clear()
        finally:
            try:
                if self.network is not None:
                    self.network.destroy()
            finally:
                self._restore_signals()

    def _catch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread

        def handler(signum: int, frame: FrameType | None) -> None:
            raise Interrupted(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signals(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    # -- using it ----------------------------------------------------------

    @property
    def nodes(self) -> list[NodeLink]:
        return self._net().nodes

    @property
    def run_name(self) -> str:
        """The prefix of every name this cluster made (``fwt<pid><tag>``)."""
        return self._net().run

    def _net(self) -> Network:
        if self.network is None:
            raise RuntimeError("the cluster is not open: use it inside 'with Cluster(...)'")
        return self.network

    def link_bytes(self) -> list[LinkBytes]:
        """Every node's link counters now (bytes since the cluster was made)."""
        return self._net().link_bytes()

    def start(self, cmd: Sequence[str], nproc_per_node: int = 1, *,
              env: dict[str, str] | None = None, max_restarts: int = 0,
              torchrun_args: Sequence[str] = (), echo: TextIO | None = None,
              rdzv_timeout: float = 120,
              node_envs: Sequence[dict[str, str]] | None = None) -> Run:
        """Start ``cmd`` on every rank of every node; see :meth:`run`."""
        net = self._net()
        env = dict(env or {})
        if node_envs is not None and len(node_envs) != len(net.nodes):
            raise ValueError(f"node_envs: expected one dict per node ({len(net.nodes)}) but "
                             f"got {len(node_envs)}")
        if max_restarts > 0:
            # torchrun's restarted ranks read the previous ranks' addresses from
            # the store they share with its rendezvous and fail to connect
            # (pytorch/pytorch#135712, #167288; gloo too, torch 2.13): a store
            # of their own per rendezvous round
            env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        if not cmd:
            raise ValueError("give the command each rank runs, e.g. [sys.executable, 'train.py']")
        procs = []
        try:
            for node in net.nodes:
                argv = ["ip", "netns", "exec", node.namespace,
                        *torchrun_argv(node, net.nodes[0].address, len(net.nodes), nproc_per_node,
                                       run_id=net.run, max_restarts=max_restarts,
                                       rdzv_timeout=rdzv_timeout, extra=torchrun_args),
                        *cmd]
                own = {**env, **node_envs[node.index]} if node_envs is not None else env
                procs.append(subprocess.Popen(
                    argv, env=node_env(node, len(net.nodes), own), stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, start_new_session=True, bufsize=1))
        except BaseException:
            for p in procs:
                p.kill()
            raise
        run = Run(net, procs, echo)
        self._runs.append(run)
        return run

    def run(self, cmd: Sequence[str], nproc_per_node: int = 1, *, timeout: float | None = None,
            env: dict[str, str] | None = None, max_restarts: int = 0,
            torchrun_args: Sequence[str] = (), echo: TextIO | None = None,
            on_start: Callable[[Run], None] | None = None, fail_grace: float = 60.0,
            node_envs: Sequence[dict[str, str]] | None = None) -> RunResult:
        """Run ``cmd`` (``[sys.executable, "train.py", ...]``) on ``nproc_per_node``
        ranks of every node under torchrun, and wait for it (at most ``timeout``
        seconds, then stop it and say so).  ``env`` is added to this process's
        environment, then ``node_envs[i]`` (one dict per node) to node ``i``'s
        (nodes launched differently); ``max_restarts`` is torchrun's; ``echo``: a stream every
        node's output goes to as it comes, each line prefixed ``[node i]``;
        ``on_start(run)`` is called once it has started; ``fail_grace``: see
        :meth:`Run.wait`."""
        run = self.start(cmd, nproc_per_node, env=env, max_restarts=max_restarts,
                         torchrun_args=torchrun_args, echo=echo, node_envs=node_envs)
        try:
            if on_start is not None:
                on_start(run)
            return run.wait(timeout, fail_grace)
        finally:
            run.stop()
            self._runs.remove(run)


def torchrun_argv(node: NodeLink, host_address: str, nodes: int, nproc_per_node: int, *,
                  run_id: str, max_restarts: int, rdzv_timeout: float,
                  extra: Sequence[str] = ()) -> list[str]:
    """torchrun's command line on ``node`` (the command to run follows it)."""
    is_host = int(node.index == 0)
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nodes), "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host_address}:{RDZV_PORT}",
        "--rdzv-id", run_id,
        "--rdzv-conf", f"is_host={is_host},join_timeout={rdzv_timeout:g}",
        "--local-addr", node.address,
        "--max-restarts", str(max_restarts),
        *extra,
        "--no-python",
    ]


def node_env(node: NodeLink, nodes: int, extra: dict[str, str] | None) -> dict[str, str]:
    """The environment of ``node``'s torchrun (its ranks inherit it)."""
    env = dict(os.environ)
    env.update(extra or {})
    env.update({
        "GLOO_SOCKET_IFNAME": node.ifname,
        "NCCL_SOCKET_IFNAME": node.ifname,
        ENV_IFNAME: node.ifname,
        ENV_NODE: str(node.index),
        ENV_NODES: str(nodes),
        "PYTHONUNBUFFERED": "1",
    })
    return env
