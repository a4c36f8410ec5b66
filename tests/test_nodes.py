"""Two nodes of two ranks on this machine, through torchrun's multi-node path.

The nodes are network namespaces made by :mod:`fsdp_wrap.cli.testbed` (a veth pair
per node into a bridge, ``tc`` on each link); every node runs torchrun with the
c10d rendezvous, which numbers the nodes and sets ``LOCAL_WORLD_SIZE``, from
which fsdp_wrap builds its default hybrid groups.  The job is
``tests/_nodes_job.py``.  Checked:

* HYBRID_SHARD and _HYBRID_SHARD_ZERO2, with the default groups and with a 2-D
  ``device_mesh``, train bit for bit as torch's FSDP1 does with the same
  strategy on 4 ranks of one host (the suite's pool; each level of the
  reduction sums 2 ranks, one commutative add), and so do FULL_SHARD,
  SHARD_GRAD_OP and NO_SHARD: every unit of the job's model is larger than
  fsdp_wrap's 1 MiB gradient buckets, so each reduction is one all-reduce of
  one unit's gradient over the same 4 ranks, as torch's (gloo's ring sums in
  the same order wherever the ranks run; a bucket of several units would sum
  some elements in another order, docs/performance/step.rst);
* the bytes each node's link sends per step equal what the strategy must send
  (:func:`fsdp_wrap.cli.testbed.wire.step_bytes`) times the link's protocol
  overhead, measured in the same run by exchanging a known payload, within 5%;
* a node whose ranks are killed mid-step makes every rank of the other node
  fail within the process group's timeout with an error naming the lost
  node's address, and ``torchrun --max-restarts 1`` with
  :func:`fsdp_wrap.checkpoint.save_full_checkpoint` /
  :func:`~fsdp_wrap.checkpoint.load_full_checkpoint` resumes from the last
  complete checkpoint to the losses of an uninterrupted run;
* nodes launched with different settings (another
  ``$FSDP_WRAP_QUANTIZE_COLLECTIVES`` or ``$FSDP_WRAP_BUCKET_CAP_MB`` on node 1)
  get a RuntimeError on every rank at construction naming the setting, the
  values and the ranks, in well under the process group's timeout;
* nothing of a cluster is left behind on success, failure, timeout, Ctrl-C or
  SIGTERM, and ``fsdp-wrap cluster`` runs a command on every rank and says how
  each node ended.

Where network namespaces cannot be made (not root, no iproute2, a container
that refuses them) every test here skips with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from fsdp_wrap.cli import testbed
from fsdp_wrap.cli.testbed import wire
from tests import _nodes_job as job
from tests._dist import progress

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REASON = testbed.unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no test-bed cluster: {_REASON}")

NODES, PER_NODE = 2, 2
RUN_TIMEOUT_S = 240
# How far the bytes a step sends may be from the strategy's count times the
# measured protocol overhead (the target).
BYTES_TOL = 0.05

CASES = [
    dict(strategy="HYBRID_SHARD", groups="default", idx=0),
    dict(strategy="HYBRID_SHARD", groups="mesh", idx=0),
    dict(strategy="_HYBRID_SHARD_ZERO2", groups="default", idx=1),
    dict(strategy="_HYBRID_SHARD_ZERO2", groups="mesh", idx=1),
    dict(strategy="FULL_SHARD", groups="world", idx=2),
    dict(strategy="SHARD_GRAD_OP", groups="world", idx=3),
    dict(strategy="NO_SHARD", groups="world", idx=4),
]
STEPS = 3

# The nodes are launched differently: node 1 with another quantization and
# gradient-bucket cap in its environment (the sweep's cases give both as
# keywords, which win).  Each ``disagree`` case: its keywords, and the setting
# every rank's RuntimeError must name with its values per node (None: accepted).
NODE_ENVS = [{"FSDP_WRAP_QUANTIZE_COLLECTIVES": "off", "FSDP_WRAP_BUCKET_CAP_MB": "1"},
             {"FSDP_WRAP_QUANTIZE_COLLECTIVES": "grads", "FSDP_WRAP_BUCKET_CAP_MB": "0"}]
KEYWORDS = dict(quantize_collectives="off", bucket_cap_mb=1.0)
_QUANT = ("quantize_collectives (or $FSDP_WRAP_QUANTIZE_COLLECTIVES) is off on rank(s) [0, 1] "
          "and grads=int8/2048,where=cross_node on rank(s) [2, 3]")
DISAGREE = [
    # FULL_SHARD: node 1 alone would create the sub-groups of a routed reduction
    (dict(strategy="FULL_SHARD", groups="world", kw=dict(bucket_cap_mb=1.0)), _QUANT),
    # hybrid groups built from LOCAL_WORLD_SIZE after the check
    (dict(strategy="HYBRID_SHARD", groups="default", kw=dict(bucket_cap_mb=1.0)), _QUANT),
    (dict(strategy="FULL_SHARD", groups="world", kw=dict(quantize_collectives="off")),
     "bucket_cap_mb (or $FSDP_WRAP_BUCKET_CAP_MB) is 1.0 on rank(s) [0, 1] and 0.0 on "
     "rank(s) [2, 3]"),
    (dict(strategy="FULL_SHARD", groups="world", kw=KEYWORDS), None),  # the keywords win
]


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": REPO + (os.pathsep + path if path else "")}


def _job_cmd(config: dict[str, Any], where: str) -> list[str]:
    path = os.path.join(where, "config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return [sys.executable, "-m", "tests._nodes_job", path]


def _load(out: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = torch.load(os.path.join(out, name), weights_only=False)
    return result


def _failed(result: testbed.RunResult) -> str:
    return result.summary() + "".join(
        f"\n--- node {i} ---\n{o[-6000:]}" for i, o in enumerate(result.outputs))


# ---------------------------------------------------------------------------
# one run of every case across the nodes; the reference on one host
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def across_nodes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = str(tmp_path_factory.mktemp("nodes_sweep"))
    cases = [dict(c, steps=STEPS, kw=KEYWORDS) for c in CASES]
    config = dict(mode="sweep", out=out, cases=cases, disagree=[c for c, _ in DISAGREE])
    with testbed.Cluster(NODES, rate="1gbit") as cluster:
        result = cluster.run(_job_cmd(config, out), PER_NODE, timeout=RUN_TIMEOUT_S,
                             env=_env(), node_envs=NODE_ENVS)
        name = cluster.run_name
    assert result.ok, _failed(result)
    assert not testbed.leftovers(name), testbed.leftovers(name)
    return [_load(out, f"rank{r}.pt") for r in range(NODES * PER_NODE)]


def _reference(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch's FSDP1 on 4 ranks of one host: the hybrid groups as a 2-D mesh."""
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = "4"  # one node, as torchrun --nproc-per-node 4 says
    try:
        out = []
        for c in cases:
            groups = "mesh" if "HYBRID" in c["strategy"] else "world"
            out.append(job.train_case(dict(c, groups=groups), "torch", on_step=progress))
        return out
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)


@pytest.fixture(scope="module")
def one_host(pool4: Any) -> list[list[dict[str, Any]]]:
    return pool4.run(_reference, [dict(c, steps=STEPS) for c in CASES])


def _differences(ours: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    errs = []
    if ours["losses"] != ref["losses"]:
        errs.append(f"losses {ours['losses']} vs {ref['losses']}")
    for k, (a, b) in enumerate(zip(ours["shards"], ref["shards"])):
        if a.shape != b.shape or not torch.equal(a, b):
            diff = (a - b).abs().max().item() if a.shape == b.shape else f"{a.shape} vs {b.shape}"
            errs.append(f"shard {k}: max |diff| {diff}")
    if len(ours["shards"]) != len(ref["shards"]):
        errs.append(f"{len(ours['shards'])} shards vs {len(ref['shards'])}")
    return errs


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "FULL_SHARD",
                                      "SHARD_GRAD_OP", "NO_SHARD"])
def test_across_nodes_trains_as_on_one_host(across_nodes: list[dict[str, Any]],
                                            one_host: list[list[dict[str, Any]]],
                                            strategy: str) -> None:
    fails = []
    for k, case in enumerate(CASES):
        if case["strategy"] != strategy:
            continue
        for rank in range(NODES * PER_NODE):
            errs = _differences(across_nodes[rank]["cases"][k], one_host[rank][k])
            fails += [f"{case['groups']} groups, rank {rank}: {e}" for e in errs]
    assert not fails, f"{strategy} across 2 nodes vs torch's FSDP1 on one host:\n" + "\n".join(fails)


def _overhead(results: list[dict[str, Any]]) -> float:
    """Bytes on the wire per payload byte, from the calibration exchange (node 0's)."""
    cal = results[0]["calibration"]
    return float(cal["sent"]) / cal["payload"]


def test_protocol_overhead_is_small(across_nodes: list[dict[str, Any]]) -> None:
    for node in range(NODES):
        cal = across_nodes[node * PER_NODE]["calibration"]
        ratio = cal["sent"] / cal["payload"]
        # TCP/IP and Ethernet headers and acks: a few percent at most
        assert 1.0 <= ratio < 1.06, f"node {node}: {cal['sent']} bytes sent for {cal['payload']}"


@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_bytes_across_the_link_match_the_strategy(across_nodes: list[dict[str, Any]],
                                                  case_index: int) -> None:
    case = CASES[case_index]
    f = _overhead(across_nodes)
    lines = []
    for node in range(NODES):
        res = across_nodes[node * PER_NODE]["cases"][case_index]
        want = wire.step_bytes(case["strategy"], res["units"], res["root"], NODES, PER_NODE) * f
        # step 0 also carries the lazy initialisation's exchanges
        for step, sent in enumerate(res["sent"][1:], start=1):
            if abs(sent / want - 1) > BYTES_TOL:
                lines.append(f"node {node} step {step}: sent {sent} bytes, want {want:.0f} "
                             f"({sent / want:.3f}x; overhead {f:.4f})")
    assert not lines, f"{case}:\n" + "\n".join(lines)


@pytest.mark.parametrize("case_index", range(len(DISAGREE)))
def test_nodes_launched_differently_are_refused_on_every_rank(
        across_nodes: list[dict[str, Any]], case_index: int) -> None:
    """A setting that differs between the nodes is a RuntimeError on every rank
    at construction, naming it, its values and the ranks (before the sub-groups
    or hybrid groups it would build on one node only: never a hang)."""
    case, named = DISAGREE[case_index]
    for rank in range(NODES * PER_NODE):
        res = across_nodes[rank]["disagree"][case_index]
        if named is None:
            assert res["got"] == "accepted", (case, rank, res)
            continue
        assert res["got"].startswith(f"RuntimeError: [rank {rank}] FSDP was constructed with "
                                     "settings that differ between ranks [0, 1, 2, 3]"), res
        assert named in res["got"], (named, res["got"])
        assert res["after_s"] < job.PG_TIMEOUT_S, (case, rank, res)


# ---------------------------------------------------------------------------
# a node dies mid-step; torchrun restarts; training resumes from a checkpoint
# ---------------------------------------------------------------------------

RESUME = dict(strategy="HYBRID_SHARD", seed=7, steps=5, ckpt_every=2, kill_at=3)


def _uninterrupted(cfg: dict[str, Any]) -> list[float]:
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    case = dict(strategy=cfg["strategy"], groups="mesh", idx=cfg["seed"], steps=cfg["steps"])
    return list(job.train_case(case, "torch")["losses"])


@pytest.mark.slow  # two torchrun launches of every node and a restart: about a minute unloaded
def test_killed_node_fails_its_peers_and_restart_resumes(tmp_path: Any, pool4: Any) -> None:
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    os.makedirs(out)
    cfg = dict(RESUME, mode="resume", out=out, ckpt_dir=ckpt)
    killed: list[float] = []

    def kill_mid_step(run: testbed.Run) -> None:
        # node 1's ranks die once both have begun step kill_at; torchrun on node 1 lives on
        marks = [os.path.join(out, f"step{cfg['kill_at']}-rank{r}-from0") for r in (2, 3)]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not all(os.path.exists(m) for m in marks):
            if time.monotonic() > deadline or any(rc is not None for rc in run.poll()):
                return
            time.sleep(0.02)
        run.kill_ranks(1)
        killed.append(time.monotonic())

    with testbed.Cluster(NODES, rate="1gbit") as cluster:
        lost = cluster.nodes[1].address
        result = cluster.run(_job_cmd(cfg, out), PER_NODE, timeout=RUN_TIMEOUT_S, env=_env(),
                             max_restarts=1, on_start=kill_mid_step)
        name = cluster.run_name
    assert not testbed.leftovers(name)
    assert killed, "node 1 never reached the step it was to die in:\n" + _failed(result)
    assert result.ok, _failed(result)

    # every rank of node 0 failed by itself, naming node 1, within the group's timeout
    for rank in range(PER_NODE):
        first = _load(out, f"rank{rank}-from0.pt")
        err = first["error"]
        assert err is not None, f"rank {rank} did not fail when node 1 died: {first}"
        assert lost in err["error"], f"rank {rank}'s error does not name {lost}: {err['error']}"
        assert err["after_s"] < job.PG_TIMEOUT_S, f"rank {rank}: reported after {err['after_s']:.1f} s"

    want = pool4.run(_uninterrupted, cfg)
    last_ckpt = (cfg["kill_at"] // cfg["ckpt_every"]) * cfg["ckpt_every"]
    for rank in range(NODES * PER_NODE):
        after = _load(out, f"rank{rank}-from{last_ckpt}.pt")
        assert after["error"] is None and sorted(after["losses"]) == list(range(last_ckpt, cfg["steps"])), (
            f"rank {rank} after the restart: {after}")
        # node 1's ranks were killed: only node 0's wrote what they did before
        before = _load(out, f"rank{rank}-from0.pt")["losses"] if rank < PER_NODE else {}
        for step, loss in sorted({**before, **after["losses"]}.items()):
            assert loss == want[rank][step], (
                f"rank {rank} step {step}: loss {loss} vs {want[rank][step]} uninterrupted "
                f"(before the restart {before}, after {after['losses']})")


# ---------------------------------------------------------------------------
# nothing left behind; the command line
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_removes_the_cluster_and_what_runs_in_it(sig: signal.Signals) -> None:
    # in this process: SIGINT is KeyboardInterrupt, SIGTERM the cluster's Interrupted
    inside = None
    handler = signal.getsignal(signal.SIGTERM)
    # (a shell's background job starts with SIGINT ignored: Python's own handler then)
    int_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _signal_round(sig, inside, handler)
    finally:
        signal.signal(signal.SIGINT, int_handler)


def _signal_round(sig: signal.Signals, inside: Any, handler: Any) -> None:
    with pytest.raises(KeyboardInterrupt) as caught:
        with testbed.Cluster(NODES, rate="100mbit") as cluster:
            name = cluster.run_name
            inside = subprocess.Popen(["ip", "netns", "exec", cluster.nodes[1].namespace,
                                       "sleep", "300"])
            assert testbed.leftovers(name), "the cluster was not made"
            os.kill(os.getpid(), sig)
            time.sleep(30)  # the signal interrupts this
    assert isinstance(caught.value, testbed.Interrupted) == (sig == signal.SIGTERM)
    assert inside is not None and inside.wait(timeout=10) == -signal.SIGKILL
    assert not testbed.leftovers(name), testbed.leftovers(name)
    assert signal.getsignal(signal.SIGTERM) is handler, "the SIGTERM handler was not restored"


def test_an_exception_removes_the_cluster_also_a_half_made_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_wrap.cli.testbed import network

    # an exception inside the block
    with pytest.raises(ValueError, match="in the block"):
        with testbed.Cluster(NODES, rate="1gbit") as cluster:
            name = cluster.run_name
            assert testbed.leftovers(name), "the cluster was not made"
            raise ValueError("in the block")
    assert not testbed.leftovers(name), testbed.leftovers(name)

    # a failure while the nodes are made: the namespaces and links exist, tc fails
    made: list[str] = []
    real_cmd = network._cmd

    def cmd(args: list[str], check: bool = True) -> Any:
        if args[:3] == ["ip", "netns", "add"]:
            made.append(args[3])
        if args[0] == "tc" and len(made) == NODES:
            raise RuntimeError("tc refused (injected)")
        return real_cmd(args, check)

    monkeypatch.setattr(network, "_cmd", cmd)
    with pytest.raises(RuntimeError, match="injected"):
        with testbed.Cluster(NODES, rate="1gbit"):
            pass
    assert len(made) == NODES, made
    run = made[0].rsplit("-n", 1)[0]
    assert not testbed.leftovers(run), testbed.leftovers(run)
    assert not [ns for ns in made if os.path.exists(os.path.join("/etc/netns", ns))]


def test_a_run_past_its_timeout_is_stopped_and_removed() -> None:
    with testbed.Cluster(NODES) as cluster:
        name = cluster.run_name
        result = cluster.run(["sleep", "300"], PER_NODE, timeout=3)
        pids = [p for i in range(NODES) for p in cluster.network.pids(i)]  # type: ignore[union-attr]
    assert result.timed_out and all(result.stopped) and not result.ok, result.summary()
    assert not pids, f"processes left in the nodes after the timeout: {pids}"
    assert not testbed.leftovers(name), testbed.leftovers(name)


def test_stale_clusters_of_dead_processes_are_removed() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    run = f"fwt{dead.stdout.strip()}q"
    subprocess.run(["ip", "netns", "add", f"{run}-n0"], check=True)
    subprocess.run(["ip", "link", "add", f"{run}b", "type", "bridge"], check=True)
    try:
        assert set(testbed.leftovers(run)) == {f"{run}-n0", f"{run}b"}
        removed = testbed.remove_stale()
        assert {f"{run}-n0", f"{run}b"} <= set(removed)
        assert not testbed.leftovers(run)
    finally:
        subprocess.run(["ip", "netns", "del", f"{run}-n0"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{run}b"], capture_output=True)


def _cluster_names(stderr: str) -> str:
    first = stderr.splitlines()[0]  # "cluster fwt<pid><tag>: node 0 ..., node 1 ...; link ..."
    assert first.startswith("cluster fwt"), stderr
    return first.split()[1].rstrip(":")


def test_cluster_command_runs_every_rank_and_stops_on_sigterm() -> None:
    # every rank says who it is and waits; once all have spoken, SIGTERM to the command
    cmd = [sys.executable, "-m", "fsdp_wrap", "cluster", "--nodes", "2", "--nproc-per-node", "2",
           "--rate", "1gbit", "--", "sh", "-c", "echo rank $RANK of $WORLD_SIZE node $GROUP_RANK "
           "local $LOCAL_RANK/$LOCAL_WORLD_SIZE if $GLOO_SOCKET_IFNAME; exec sleep 300"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **_env()))
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        while sum(" rank " in line for line in lines) < 4:
            line = proc.stdout.readline()
            assert line, "the command ended before every rank spoke:\n" + "".join(lines)
            lines.append(line)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err)
    for rank in range(4):
        node = rank // 2
        want = f"[node {node}] rank {rank} of 4 node {node} local {rank % 2}/2 if fwt"
        assert any(line.startswith(want) for line in lines), "".join(lines)
    assert "stopped every node, removed the cluster" in err, err
    assert not testbed.leftovers(_cluster_names(err))
