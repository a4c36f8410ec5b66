"""Running one benchmark job on fresh gloo ranks, and printing its tables.

Shared by ``bench_checkpoint.py``, ``bench_pretrained.py`` and
``bench_lora.py``: :func:`launch` spawns ``cfg["nproc"]`` processes (one
thread each, or ``cfg["threads"]``), runs ``job(rank, cfg)`` on every rank
and returns every rank's result (JSON-able) in rank order; :func:`rst_table`
formats rows as a reStructuredText simple table.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_wrap.comm.teardown import exit_now

Job = Callable[[int, dict[str, Any]], Any]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, job: Job, cfg: dict[str, Any], port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=cfg["nproc"])
    try:
        result = job(rank, cfg)
        everyone: list[Any] = [None] * cfg["nproc"]
        dist.all_gather_object(everyone, result)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(everyone, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    exit_now()  # see fsdp_wrap/comm/teardown.py: gloo's threads vs interpreter shutdown


def launch(job: Job, cfg: dict[str, Any]) -> list[Any]:
    """``job(rank, cfg)`` on ``cfg["nproc"]`` fresh spawned ranks; their results.

    ``job`` must be a module-level function (it is pickled by name)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(job, cfg, _free_port(), out), nprocs=cfg["nproc"],
                           join=True, start_method="spawn")
        with open(out) as f:
            result: list[Any] = json.load(f)
            return result


def rst_table(header: list[str], rows: list[list[str]]) -> str:
    """``rows`` under ``header`` as a reStructuredText simple table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join("=" * w for w in widths)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([line, fmt.format(*header), line, *(fmt.format(*r) for r in rows), line])
