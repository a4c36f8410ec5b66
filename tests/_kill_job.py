"""Checkpoint writers killed midway, started as plain subprocesses (not the pool).

``python -m tests._kill_job sharded|adapter RANK WORLD INIT_FILE ROOT KILL_RANK``: a
2-rank job saves a checkpoint after step 2 (``ROOT/step2``, the one to fall back
to, with the reference values rank 0 records next to it), trains 2 more steps
and SIGKILLs rank ``KILL_RANK`` in the middle of the save of ``ROOT/step4``:

* ``sharded``: the SHARDED_STATE_DICT recipe of docs/checkpointing.rst (model
  and optimizer state dicts, ``dcp.save``), killed while DCP writes the data;
* ``adapter``: ``save_full_checkpoint(..., trainable_only=True)`` of a PEFT
  LoRA model (PEFT's adapter layout), killed after its first unit.

``python -m tests._kill_job offline-torch|offline-safetensors|offline-dcp SRC OUT``:
``fsdp-wrap ckpt``'s conversion of ``SRC`` to ``OUT`` in that format, the
process SIGKILLing itself after the first tensor (for DCP output: after the
data files, before ``.metadata``).

The survivor of a 2-rank job exits 3 (its peer vanished: it raised, it did
not hang).  Nothing here checks anything: tests/test_kill_a_rank.py does.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush: a real crash


def sharded_save(model: Any, optim: Any, path: str, planner: Any = None) -> None:
    """The recipe's save: SHARDED model and optimizer state dicts through DCP."""
    import torch.distributed.checkpoint as dcp

    import fsdp_wrap

    fsdp = fsdp_wrap.FullyShardedDataParallel
    with fsdp.state_dict_type(model, fsdp_wrap.StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": fsdp.optim_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=path, planner=planner)


def full_optim(model: Any, optim: Any) -> Any:
    """The FULL optimizer state dict on rank 0 (a collective)."""
    import fsdp_wrap

    fsdp = fsdp_wrap.FullyShardedDataParallel
    cfg = fsdp_wrap.FullOptimStateDictConfig(rank0_only=True)
    with fsdp.state_dict_type(model, fsdp_wrap.StateDictType.FULL_STATE_DICT,
                              optim_state_dict_config=cfg):
        return fsdp.optim_state_dict(model, optim)


def _sharded(rank: int, kill: int, root: str) -> None:
    from torch.distributed.checkpoint import DefaultSavePlanner

    from tests import _ckpt_common as C
    from tests.test_full_checkpoint import build, train

    model, opt = build(seed=0)
    train(model, opt, range(2))
    sharded_save(model, opt, os.path.join(root, "step2"))
    params, optim_sd = C.full_params(model), full_optim(model, opt)
    if rank == 0:
        torch.save({"params": params, "optim": optim_sd}, os.path.join(root, "step2-ref.pt"))
    train(model, opt, range(2, 4))

    class KillingPlanner(DefaultSavePlanner):
        written = 0

        def resolve_data(self, write_item: Any) -> Any:
            KillingPlanner.written += 1
            if rank == kill and KillingPlanner.written == 3:
                _die()
            return super().resolve_data(write_item)

    sharded_save(model, opt, os.path.join(root, "step4"), planner=KillingPlanner())


def _adapter(rank: int, kill: int, root: str) -> None:
    from fsdp_wrap.checkpoint import save_full_checkpoint
    from tests.test_adapter_checkpoint import _full_state, _train, _wrap, tiny_lora

    model = _wrap(tiny_lora(), True, "FULL_SHARD")
    _train(model)
    save_full_checkpoint(model, os.path.join(root, "step2"), trainable_only=True)
    full = _full_state(model)
    if rank == 0:
        trained = {k: v for k, v in full.items() if "lora_" in k}
        torch.save({"params": trained}, os.path.join(root, "step2-ref.pt"))
    _train(model)

    def on_unit(name: str, done: int, total: int) -> None:
        if rank == kill and done == 1:
            _die()

    save_full_checkpoint(model, os.path.join(root, "step4"), trainable_only=True, on_unit=on_unit)


def _offline(fmt: str, src: str, out: str) -> None:
    import fsdp_wrap.checkpoint.offline as offline

    if fmt == "dcp":
        from torch.distributed.checkpoint import FileSystemWriter

        FileSystemWriter.finish = lambda *a, **k: _die()  # the data are down; .metadata never
    else:
        real = offline.Progress.step

        def step(self: Any, nbytes: int) -> None:
            real(self, nbytes)
            _die()  # after the first tensor

        offline.Progress.step = step  # type: ignore[method-assign]
    offline.convert(src, out, fmt=fmt)


def main() -> None:
    what = sys.argv[1]
    if what.startswith("offline-"):
        _offline(what.split("-", 1)[1], sys.argv[2], sys.argv[3])
        os._exit(0)
    rank, world, init_file, root, kill = sys.argv[2:7]
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world),
        timeout=timedelta(seconds=60),
    )
    try:
        {"sharded": _sharded, "adapter": _adapter}[what](int(rank), int(kill), root)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)  # the peer is gone: do not wait for the group to shut down
    os._exit(0)


if __name__ == "__main__":
    main()
