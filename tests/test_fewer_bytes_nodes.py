"""Quantized collectives and sharded accumulation across real nodes (the test bed).

The sweeps of tests/test_quantized_collectives.py (2 nodes x 2) and
tests/test_accumulation.py run in ``tests/_fewer_bytes_job.py`` on 2 nodes of 2
ranks (network namespaces, a 1 Gbit/s link, torchrun's multi-node rendezvous,
which sets ``LOCAL_WORLD_SIZE``): every configuration equals its emulation bit
for bit there too, with the collectives between nodes crossing the link.
Skipped where network namespaces cannot be made; ``-m slow`` (one cluster
launch, most of a minute on a busy 2-core machine).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from fsdp_wrap import testbed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REASON = testbed.unavailable_reason()


@pytest.mark.slow
@pytest.mark.skipif(_REASON is not None, reason=f"no test-bed cluster: {_REASON}")
def test_equal_to_emulation_across_nodes(tmp_path: object) -> None:
    out = str(tmp_path)
    path = os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": REPO + (os.pathsep + path if path else "")}
    with testbed.Cluster(2, rate="1gbit") as cluster:
        result = cluster.run([sys.executable, "-m", "tests._fewer_bytes_job", out], 2,
                             timeout=600, env=env)
        name = cluster.run_name
    assert result.ok, result.summary() + "".join(
        f"\n--- node {i} ---\n{o[-6000:]}" for i, o in enumerate(result.outputs))
    assert not testbed.leftovers(name)
    for r in range(4):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            got = json.load(f)
        assert got["local_world_size"] == "2", got
        assert got["fails"] == [], got["fails"]
    # the link carried the collectives between the nodes
    assert all(b.sent > 0 for b in result.link_bytes), result.link_bytes
