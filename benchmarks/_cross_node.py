"""What ``bench_cross_node.py`` and ``convergence_cross_node.py`` share.

The driver side launches a job on the multi-node test bed
(:mod:`fsdp_wrap.cli.testbed`: 2 nodes as network namespaces, a ``tc``-limited
link, torchrun's c10d rendezvous); the job side reads the bytes its node's
link carried and builds the configurations compared: torch's FSDP1 or
fsdp_wrap, a sharding strategy, how gradients are accumulated over the
micro-batches of an optimizer step, and ``quantize_collectives``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any, Callable

NODES, PER_NODE = 2, 2


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: ``accumulate`` is ``"every"`` (reduce every
    micro-batch), ``"no_sync"`` (all but the last under ``no_sync()``) or
    ``"sharded"`` (``set_requires_all_reduce`` on the last only)."""

    name: str
    framework: str  # "torch_fsdp1" | "fsdp_wrap"
    strategy: str
    accumulate: str = "every"
    quant: str | None = None

    def build(self, model: Any, mesh: Any, policy_classes: set[type]) -> Any:
        import torch

        if self.framework == "torch_fsdp1":
            import torch.distributed.fsdp as api
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            extra: dict[str, Any] = {}
        else:
            import fsdp_wrap as api
            from fsdp_wrap.wrap import ModuleWrapPolicy
            extra = {"quantize_collectives": self.quant or "off"}
        return api.FullyShardedDataParallel(
            model, sharding_strategy=api.ShardingStrategy[self.strategy],
            auto_wrap_policy=ModuleWrapPolicy(policy_classes), device_id=torch.device("cpu"),
            device_mesh=mesh if "HYBRID" in self.strategy else None, **extra)

    @contextlib.contextmanager
    def micro_batch(self, model: Any, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward."""
        if self.accumulate == "sharded":
            model.set_requires_all_reduce(last)
        if self.accumulate == "no_sync" and not last:
            with model.no_sync():
                yield
        else:
            yield


def gradient_bytes(model: Any) -> int:
    """Bytes of every gradient the model holds now: ``.grad`` of its (flat)
    parameters, torch's FSDP1 ``_saved_grad_shard``, fsdp_wrap's parked
    gradients and sharded partial sums."""
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if t is None:
            return
        storage = t.untyped_storage()  # (gradients may be views of one bucket)
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for p in model.parameters():
        add(p.grad)
        add(getattr(p, "_saved_grad_shard", None))
    for h in getattr(model, "_all_handles", []):
        grads = getattr(h, "grads", None)  # (fsdp_wrap's handles; torch's have none)
        if grads is not None:
            add(grads._partial)
            add(grads._saved_grad_shard)
    return total


def mesh_2d() -> Any:
    """``(replicate, shard)``: replicas across the nodes, shards within each."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))


def launch(script: str, cfg: dict[str, Any], rate: str, timeout: float) -> dict[str, Any]:
    """Run ``script --job CONFIG`` on every rank of 2 nodes x 2 with the link at
    ``rate``; return what rank 0 wrote to ``cfg["out"]``."""
    from fsdp_wrap.cli import testbed

    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(cfg, out=os.path.join(tmp, "result.json"))
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        with testbed.Cluster(NODES, rate=rate) as cluster:
            res = cluster.run([sys.executable, os.path.abspath(script), "--job", path], PER_NODE,
                              timeout=timeout)
        if not res.ok:
            tail = "\n".join(f"--- node {i} ---\n{o[-4000:]}" for i, o in enumerate(res.outputs))
            raise RuntimeError(f"{os.path.basename(script)} at {rate} failed:\n"
                               f"{res.summary()}\n{tail}")
        with open(cfg["out"]) as f:
            result: dict[str, Any] = json.load(f)
        return result


def job_setup() -> None:
    """Inside a node, before the job: one thread per rank, gloo, quiet."""
    import datetime
    import warnings

    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))


def job_finish(result: dict[str, Any], out: str) -> None:
    import torch

    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()
    from fsdp_wrap.comm.teardown import exit_now

    exit_now()


def rst_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    rule = "  ".join("=" * n for n in widths)

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(n) for c, n in zip(cells, widths)).rstrip()

    return "\n".join([rule, fmt(header), rule, *(fmt(r) for r in rows), rule])


def nothing_more_to_do(prog: str, job: str | None, job_main: Callable[[str], None]) -> bool:
    """The start of each cross-node benchmark's ``main``: run ``job_main`` where
    this process is one of the nodes' ranks (``--job``), or say why network
    namespaces cannot be made here; ``True`` where ``main`` should return."""
    if job:
        job_main(job)
        return True
    from fsdp_wrap.cli import testbed

    reason = testbed.unavailable_reason()
    if reason is not None:
        print(f"{prog}: network namespaces cannot be made here: {reason}")
        return True
    return False


def chosen_names(prog: str, only: str, sep: str, configs: Sequence[Config]) -> list[str]:
    """The configurations ``--only`` names (separated by ``sep``), else all;
    ``SystemExit`` naming the known ones for a name that is not."""
    known = [c.name for c in configs]
    names = [n.strip() for n in only.split(sep) if n.strip()] or known
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"{prog}: --only expects names among {known} but got {unknown}")
    return names

