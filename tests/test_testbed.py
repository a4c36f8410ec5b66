"""The multi-node test bed's parts that need no namespaces (``fsdp_wrap.cli.testbed``).

Its values (link rates and delays in ``tc``'s words, node addresses that sort
as the nodes do), the bytes each sharding strategy must send across the link
(:mod:`fsdp_wrap.cli.testbed.wire`), what a rank reads inside a node, and
``fsdp-wrap cluster``'s one line where namespaces cannot be made.  The
clusters themselves are tested in ``tests/test_nodes.py``.
"""

from __future__ import annotations

import ast
import os
import sys

import pytest

from fsdp_wrap.cli import main
from fsdp_wrap.cli.testbed import link, network, wire

TESTBED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "fsdp_wrap", "cli", "testbed")


def test_rates_and_delays_in_tc_words() -> None:
    assert network.parse_rate("200mbit") == 200_000_000
    assert network.parse_rate("1Gbit") == 10**9
    assert network.parse_rate("1.5gbit") == 1_500_000_000
    for none in (None, "", "unlimited", "0"):
        assert network.parse_rate(none) is None
    for bad in ("fast", "200", "200mb", "-1gbit", "1bit"):
        with pytest.raises(ValueError, match="link rate"):
            network.parse_rate(bad)
    assert network.parse_delay("1ms") == pytest.approx(1e-3)
    assert network.parse_delay("500us") == pytest.approx(5e-4)
    assert network.parse_delay(None) is None
    with pytest.raises(ValueError, match="link delay"):
        network.parse_delay("1 ms later")
    # a list of rates must give one per node, checked before anything is made
    from fsdp_wrap.cli.testbed import Cluster

    with pytest.raises(ValueError, match="1 link rates for 2 nodes"):
        Cluster(2, rate=["1gbit"])
    assert Cluster(2, rate=["1gbit", None]).rates == [10**9, None]


def test_node_addresses_sort_as_the_nodes_do() -> None:
    # torchrun's c10d rendezvous numbers the nodes by sorting their --local-addr
    addrs = [network.node_address(i) for i in range(network.MAX_NODES)]
    assert sorted(addrs) == addrs and len(set(addrs)) == len(addrs)
    with pytest.raises(ValueError):
        network.node_address(network.MAX_NODES)


def test_what_each_strategy_sends_across_the_link() -> None:
    p, root = 100.0, 10.0  # bytes of every unit together, and the root unit's
    units = [45.0, 45.0, root]
    two_by_two = {s: wire.step_bytes(s, units, root, 2, 2) for s in wire.STRATEGIES}
    # ring all-gather 3/4 of the output, ring all-reduce 2 * 3/4 of the tensor
    assert two_by_two["FULL_SHARD"] == pytest.approx(0.75 * (2 * p - root) + 1.5 * p)
    assert two_by_two["SHARD_GRAD_OP"] == pytest.approx(0.75 * p + 1.5 * p)
    assert two_by_two["NO_SHARD"] == two_by_two["DDP"] == pytest.approx(1.5 * p)
    # each of a node's 2 ranks all-reduces its half with its peer: p per node
    assert two_by_two["HYBRID_SHARD"] == two_by_two["_HYBRID_SHARD_ZERO2"] == pytest.approx(p)
    # one node: nothing crosses; 4 nodes of 8 ranks
    assert all(wire.step_bytes(s, units, root, 1, 8) == 0.0 for s in wire.STRATEGIES)
    assert wire.step_bytes("HYBRID_SHARD", units, root, 4, 8) == pytest.approx(2 * 3 / 4 * p)
    assert wire.step_bytes("NO_SHARD", units, root, 4, 8) == pytest.approx(2 * 31 / 32 * p)
    with pytest.raises(ValueError, match="strategy"):
        wire.step_bytes("FULLSHARD", units, root, 2, 2)


def test_a_rank_outside_a_cluster_reads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(link.ENV_IFNAME, raising=False)
    monkeypatch.delenv(link.ENV_NODE, raising=False)
    assert link.node_link_bytes() is None and link.node_index() is None
    assert link.node_resent_segments() is None and link.node_frame_bytes() is None
    assert link.link_during(lambda: 7, lambda: None) == (7, None)
    monkeypatch.setenv(link.ENV_IFNAME, "lo")  # any interface's counters read the same way
    monkeypatch.setenv(link.ENV_NODE, "1")
    sent, received = link.node_link_bytes()  # type: ignore[misc]
    assert sent >= 0 and received >= 0 and link.node_index() == 1
    resent = link.node_resent_segments()
    assert isinstance(resent, int) and resent >= 0
    with open("/sys/class/net/lo/mtu") as f:
        assert link.node_frame_bytes() == int(f.read()) + 14
    monkeypatch.setenv("LOCAL_RANK", "0")  # the rank that reads its node's counters
    result, (sent_then, resent_then) = link.link_during(lambda: 7, lambda: None)  # type: ignore[misc]
    assert result == 7 and sent_then >= 0 and resent_then >= 0


def test_cluster_command_says_in_one_line_where_namespaces_cannot_be_made(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network, "_reason_cache", ["network namespaces need root"])
    for argv in (["cluster", "--", "true"], ["cluster", "--check"]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["fsdp-wrap cluster: error: network namespaces cannot be made here: "
                       "network namespaces need root"], err


def test_cluster_command_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster"]) == 2
    assert "give the command every rank runs" in capsys.readouterr().err
    assert main(["cluster", "--rate", "fast", "--", "true"]) == 2
    assert "link rate 'fast'" in capsys.readouterr().err


def test_cluster_command_exit_code() -> None:
    from fsdp_wrap.cli.cluster import exit_code

    assert exit_code([0, 0], False) == 0
    assert exit_code([0, 0], True) == 124
    assert exit_code([-9, 3], False) == 3  # the node that failed, not the one stopped after it
    assert exit_code([-9, 0], False) == 1


def _imports(path: str) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_testbed_needs_only_the_standard_library() -> None:
    # torch runs in the nodes (torchrun, as a subprocess), never in the test bed itself
    stdlib = getattr(sys, "stdlib_module_names", None)
    if stdlib is None:
        pytest.skip("sys.stdlib_module_names needs Python 3.10")
    for name in os.listdir(TESTBED):
        if name.endswith(".py"):
            for mod in _imports(os.path.join(TESTBED, name)):
                top = mod.split(".")[0]
                assert top in stdlib or mod.startswith("fsdp_wrap.cli.testbed") or (
                    top == "__future__"), f"fsdp_wrap/cli/testbed/{name} imports {mod}"
