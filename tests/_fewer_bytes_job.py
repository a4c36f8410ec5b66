"""The job of tests/test_fewer_bytes_nodes.py, on every rank of a test-bed cluster.

Run as ``python -m tests._fewer_bytes_job OUT_DIR`` by torchrun in each node of
:class:`fsdp_wrap.cli.testbed.Cluster` (2 nodes x 2 ranks, ``LOCAL_WORLD_SIZE=2``
from torchrun): the sweeps of tests/test_quantized_collectives.py (2 nodes x 2)
and tests/test_accumulation.py, each fsdp_wrap configuration against its
emulation, tolerance 0.  Each rank writes its failures to ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist


def main(out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    from tests import test_accumulation, test_quantized_collectives

    fails = test_quantized_collectives._sweep(test_quantized_collectives._configs(4))
    fails += test_accumulation._sweep(test_accumulation._configs())
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"fails": fails, "local_world_size": os.environ.get("LOCAL_WORLD_SIZE")}, f)
    dist.barrier()
    from fsdp_wrap.comm.teardown import exit_now

    exit_now()


if __name__ == "__main__":
    main(sys.argv[1])
