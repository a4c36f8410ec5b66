"""A 2-rank job started as plain subprocesses (not the pool): save full checkpoints,
and on request SIGKILL one rank in the middle of the second save.

``python -m tests._full_ckpt_job RANK WORLD INIT_FILE ROOT KILL_RANK``
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    rank, world, init_file, root, kill_rank = sys.argv[1:6]
    rank_i, world_i, kill = int(rank), int(world), int(kill_rank)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank_i, world_size=world_i,
        timeout=timedelta(seconds=60),
    )
    from fsdp_wrap.checkpoint import save_full_checkpoint
    from tests import _ckpt_common as C
    from tests.test_full_checkpoint import build, train

    model, opt = build(seed=0)
    train(model, opt, range(2))
    save_full_checkpoint(model, os.path.join(root, "step2"), max_shard_size=600)
    ref = C.full_params(model)
    if rank_i == 0:
        torch.save(ref, os.path.join(root, "step2-params.pt"))
    train(model, opt, range(2, 4))

    def on_unit(name: str, done: int, total: int) -> None:
        if rank_i == kill and done == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush: a real crash

    try:
        save_full_checkpoint(model, os.path.join(root, "step4"), max_shard_size=600, on_unit=on_unit)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)  # the peer is gone: do not wait for the group to shut down
    os._exit(0)


if __name__ == "__main__":
    main()
