"""``fsdp-wrap cluster -- CMD ...``: run a command on N nodes of one machine.

The nodes are network namespaces joined by rate-limited links
(:mod:`fsdp_wrap.cli.testbed`); every node runs the command under torchrun's
multi-node rendezvous, the output of each comes back prefixed ``[node i]``,
and a last table says how each node ended and the bytes its link carried.
Whatever happens (a failure, ``--timeout``, Ctrl-C, SIGTERM) the namespaces
and links are removed before the command returns.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fsdp_wrap.cli._common import CommandError, add_command, usage_error

DESCRIPTION = """\
Run CMD on every rank of NODES nodes made on this machine: one Linux network
namespace per node, a veth pair per node into a bridge, the link rate and
delay set with tc.  Every node runs torchrun with the c10d multi-node
rendezvous (node 0 hosts it), so CMD sees what it would see on a cluster
(RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, ...), plus
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set to the node's interface.  Each
node's output is prefixed [node i]; at the end, every node's exit code and the
megabytes its link sent and received.  Everything made is removed on exit,
also on failure, --timeout, Ctrl-C and SIGTERM.  Needs root and iproute2.

examples:
  fsdp-wrap cluster --nodes 2 --nproc-per-node 2 --rate 200mbit -- python train.py
  fsdp-wrap cluster --rate 1gbit --delay 1ms --timeout 600 -- train.py --lr 1e-4
  fsdp-wrap run fsdp-wrap cluster --nodes 2 -- python train_with_torch_fsdp.py
  fsdp-wrap cluster --check        # can this machine make namespaces?
  fsdp-wrap cluster --cleanup      # remove what killed runs left behind
"""

EXIT_TIMEOUT = 124


def add_parser(sub: Any) -> None:
    p = add_command(sub, "cluster", help="run a command on N nodes of this machine (network "
                    "namespaces, a rate-limited link, torchrun's multi-node rendezvous)",
                    description=DESCRIPTION)
    p.add_argument("--nodes", type=int, default=2, help="number of nodes")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    p.add_argument("--rate", default="unlimited",
                   help="each node's link rate in tc's units (1gbit, 200mbit, 500kbit), or a "
                   "comma-separated rate per node")
    p.add_argument("--delay", default=None,
                   help="one-way delay added to what each node sends (e.g. 1ms, 200us)")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop every node after this many seconds (exit code 124)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun's --max-restarts")
    p.add_argument("--quiet", action="store_true",
                   help="do not print the nodes' output, only the summary")
    p.add_argument("--check", action="store_true",
                   help="say whether network namespaces can be made here, and exit")
    p.add_argument("--cleanup", action="store_true",
                   help="remove namespaces and links that runs of dead processes left, and exit")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD ...",
                   help="what every rank runs ('--' before it is optional; a first word "
                   "ending in .py runs with this Python)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import fsdp_wrap.cli.testbed as testbed

    if args.check or args.cleanup:
        reason = testbed.unavailable_reason()
        if reason is not None:
            raise CommandError(f"network namespaces cannot be made here: {reason}")
        if args.cleanup:
            removed = testbed.remove_stale()
            print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
        else:
            print("network namespaces can be made here")
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else list(args.cmd)
    if not cmd:
        usage_error("give the command every rank runs, e.g. fsdp-wrap cluster --nodes 2 "
                    "--nproc-per-node 2 -- python train.py")
    if args.nodes < 1 or args.nproc_per_node < 1:
        usage_error(f"--nodes {args.nodes} --nproc-per-node {args.nproc_per_node}: at least 1 each")
    if cmd[0].endswith(".py"):
        cmd = [sys.executable, *cmd]
    rates = args.rate.split(",") if "," in args.rate else args.rate
    try:
        cluster = testbed.Cluster(args.nodes, rate=rates, delay=args.delay)
    except ValueError as e:
        usage_error(str(e))
    try:
        with cluster:
            names = ", ".join(f"node {n.index} {n.address}" for n in cluster.nodes)
            print(f"cluster {cluster.run_name}: {names}; link {args.rate}"
                  f"{f', delay {args.delay}' if args.delay else ''}", file=sys.stderr, flush=True)
            result = cluster.run(cmd, args.nproc_per_node, timeout=args.timeout,
                                 max_restarts=args.max_restarts,
                                 echo=None if args.quiet else sys.stdout)
    except testbed.TestbedUnavailable as e:
        raise CommandError(f"network namespaces cannot be made here: {e}") from None
    except testbed.Interrupted as e:
        print(f"fsdp-wrap cluster: {e}: stopped every node, removed the cluster", file=sys.stderr)
        return 128 + e.signum
    print(result.summary(), file=sys.stderr, flush=True)
    return exit_code(result.returncodes, result.timed_out)


def exit_code(returncodes: list[int], timed_out: bool) -> int:
    """The command's exit code: 124 at the timeout, else 0 if every node's
    torchrun succeeded, else the first positive code of a node (one that
    failed by itself says more than one killed after it), else 1."""
    if timed_out:
        return EXIT_TIMEOUT
    failed = [rc for rc in returncodes if rc != 0]
    if not failed:
        return 0
    return next((rc for rc in failed if rc > 0), 1)
