"""CPUOffload(offload_params=True) against a plain replicated reference (2 ranks).

torch's FSDP1 cannot offload on a CPU-only host (it pins memory, which needs
an accelerator; reference section 12), so the oracle here is a plain copy of
the model whose gradients are all-reduced to the mean: what every FSDP
strategy must compute.  Each step compares the loss, the clip norm, the full
parameters (read through ``summon_full_params``) and, with
``use_orig_params=True``, the full gradients (``with_grads=True``); it also
checks that parameters, gradients and optimizer state live on CPU.  The same
sweep runs fsdp_wrap without offload beside it: offloading must not change a
single bit of the sharded gradients or parameters.

GPU-only paths (pinned shards, a CUDA compute device with CPU-resident shards)
are tested at the end and skip cleanly without CUDA.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests._options_common import (
    Replicated,
    cmp,
    fsdp_grads_full,
    fsdp_params_full,
    longest_sum,
    loss_of,
    rank_tag,
    replicated_tol,
    run_configs,
)
from tests._sweep import Injection, any_rank
from tests.conftest import requires_cuda
from tests.models import build, make_input, new_model

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _configs() -> list[dict[str, Any]]:
    out = []
    for k, (model, s, uop) in enumerate(itertools.product(["transformer", "deep"], STRATEGIES, [False, True])):
        out.append(dict(model=model, strategy=s, uop=uop, nosync=k % 2 == 0, accum=k % 3 == 0,
                        clip=(None, 2.0, math.inf)[k % 3], idx=k))
    return out


def _describe(cfg: dict[str, Any]) -> str:
    keys = ("model", "strategy", "uop", "nosync", "accum", "clip")
    return "{" + ", ".join(f"{k}={cfg[k]}" for k in keys) + "}"


MAX_NORM = {2.0: 0.05, math.inf: 0.01}


class _Ref(Replicated):
    """Replicated reference with FSDP's accumulation semantics.

    Gradients already reduced in earlier steps are put aside, the new local
    gradients (including any ``no_sync`` ones) are averaged over ranks, and
    the two are added, exactly as FSDP adds a new reduced shard to the old.
    """

    def begin(self) -> None:
        self._stash = [None if p.grad is None else p.grad.clone() for p in self.module.parameters()]
        for p in self.module.parameters():
            p.grad = None

    def finish(self) -> None:
        self.sync()
        for p, old in zip(self.module.parameters(), self._stash):
            if old is not None:
                p.grad = old if p.grad is None else p.grad + old


def _devices_ok(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    errs = [f"param {n} on {p.device}" for n, p in model.named_parameters() if p.device.type != "cpu"]
    errs += [f"grad of {n} on {p.grad.device}" for n, p in model.named_parameters()
             if p.grad is not None and p.grad.device.type != "cpu"]
    for st in opt.state.values():
        errs += [f"optimizer state {k} on {v.device}" for k, v in st.items()
                 if torch.is_tensor(v) and v.device.type != "cpu"]
    return errs


def _run_config(cfg: dict[str, Any]) -> list[str]:
    import fsdp_wrap as fw

    tag = f"{rank_tag()} {_describe(cfg)}"
    torch.manual_seed(cfg["idx"])
    base = new_model(cfg["model"])
    kw = dict(sharding_strategy=cfg["strategy"], use_orig_params=cfg["uop"])
    off = build(cfg["model"], "ours", base, cpu_offload=fw.CPUOffload(offload_params=True), **kw)
    plain = build(cfg["model"], "ours", base, **kw)
    ref = _Ref(base)
    if any_rank(off.cpu_offload.offload_params is not True):  # agreed: training is collectives
        return [f"{tag}: cpu_offload attribute is {off.cpu_offload}"]
    names = list(dict(ref.module.named_parameters()))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (off, plain, ref.module)]
    gen = torch.Generator().manual_seed(1000 + 7919 * dist.get_rank() + cfg["idx"])
    for step in range(3):
        x, x2 = make_input(cfg["model"], gen), make_input(cfg["model"], gen)
        where = f"{tag} step {step}"
        ref.begin()
        res = []
        for model in (off, plain, ref.module):
            if cfg["nosync"]:
                ctx = model.no_sync() if model is not ref.module else _nullctx()
                with ctx:
                    loss_of(model(x2)).backward()
            loss = loss_of(model(x))
            loss.backward()
            if model is ref.module:
                ref.finish()
            norm = None
            if cfg["clip"] is not None:
                clip = ref.clip_grad_norm_ if model is ref.module else model.clip_grad_norm_
                norm = clip(MAX_NORM[cfg["clip"]], cfg["clip"])
            res.append((loss.detach(), norm))
        # Against the replicated reference (2 ranks: the reduction is one
        # add): a 2-norm clip sums the squares of all gradients per parameter
        # there, per flat shard and then over ranks here -- the same sum in
        # another order, which differs in the last bits (measured: 2e-6 on
        # norms of 12-36, 0.3% of this bound at most) and carries into the
        # clipped gradients, the parameters and later losses; that sum over
        # every parameter is then the longest (longest_sum).  Unclipped or
        # with the inf norm (a max) it is bit-exact on the machines measured
        # so far; the bound still covers a BLAS blocking the same sums
        # differently for flat-parameter views (see replicated_tol).  Against
        # no offload: bit-exact, the same ops on the same shards.
        tol = replicated_tol(step, dist.get_world_size(), longest_sum(cfg["model"], base, cfg["clip"]))
        errs = [cmp("loss vs reference", res[2][0], res[0][0], tol),
                cmp("loss vs no offload", res[1][0], res[0][0], 0.0)]
        if cfg["clip"] is not None:
            errs.append(cmp("clip norm vs reference", res[2][1], res[0][1], tol))
        # Offloading must not change a bit of the sharded grads.
        errs += [cmp(f"sharded grad #{i} vs no offload", a.grad, b.grad, 0.0)
                 for i, (a, b) in enumerate(zip(plain.parameters(), off.parameters()))]
        if cfg["uop"]:
            full = fsdp_grads_full(off)
            errs += [cmp(f"full grad of {n} vs reference", p.grad, g, tol)
                     for n, p, g in zip(names, ref.module.parameters(), full)]
        for o in opts:
            o.step()
            if not cfg["accum"]:
                o.zero_grad()
        errs += _devices_ok(off, opts[0])
        got = fsdp_params_full(off)
        if list(got) != names:
            errs.append(f"summoned names {list(got)} vs {names}")
        errs += [cmp(f"param {n} vs reference", p, got.get(n), tol) for n, p in ref.module.named_parameters()]
        errs += [cmp(f"sharded param #{i} vs no offload", a, b, 0.0)
                 for i, (a, b) in enumerate(zip(plain.parameters(), off.parameters()))]
        errs = [e for e in errs if e]
        # agreed: a rank stopping alone would leave the others in the next step's collectives
        if any_rank(bool(errs)):
            if not errs:
                return []
            return [f"{where}: " + "; ".join(errs[:5]) + (f" (+{len(errs) - 5} more)" if len(errs) > 5 else "")]
    return []


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def _sweep(configs: list[dict[str, Any]],
           inject: Injection | None = None) -> tuple[list[str], dict[str, int]]:
    """The failures, and how many configurations ran."""
    warnings.simplefilter("ignore")
    ran = {"configs": 0}

    def one(cfg: dict[str, Any]) -> list[str]:
        fails = _run_config(cfg)
        ran["configs"] += 1
        return fails

    fails = run_configs(configs, one, lambda c: f"{rank_tag()} {_describe(c)}", inject)
    return fails, ran


def _state_dict_and_summon_with_offload(uops: list[bool], inject: Injection | None = None) -> list[str]:
    """FULL state dict and summon_full_params of an offloaded model equal the plain one's.

    No decision here gates a collective: every comparison only appends."""
    import fsdp_wrap as fw

    warnings.simplefilter("ignore")

    def one(uop: bool) -> list[str]:
        fails: list[str] = []
        torch.manual_seed(3)
        base = new_model("transformer")
        off = build("transformer", "ours", base, use_orig_params=uop, cpu_offload=fw.CPUOffload(True))
        plain = build("transformer", "ours", base, use_orig_params=uop)
        gen = torch.Generator().manual_seed(dist.get_rank())
        for m in (off, plain):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            loss_of(m(make_input("transformer", copy.deepcopy(gen)))).backward()
            opt.step()
        sd1, sd2 = off.state_dict(), plain.state_dict()
        if list(sd1) != list(sd2):
            fails.append(f"{rank_tag()} uop={uop}: state_dict keys {list(sd1)} vs {list(sd2)}")
        fails += [e for e in (cmp(f"uop={uop} state_dict[{k}]", sd2[k], sd1.get(k), 0.0) for k in sd2) if e]
        # writeback through summon_full_params lands in the CPU shard.
        with fw.FullyShardedDataParallel.summon_full_params(off):
            off.module.emb.weight.data.fill_(0.5)
        with fw.FullyShardedDataParallel.summon_full_params(off, writeback=False):
            if not bool((off.module.emb.weight == 0.5).all()):
                fails.append(f"{rank_tag()} uop={uop}: summon writeback to offloaded shard lost")
        return fails

    return run_configs(uops, one, lambda uop: f"{rank_tag()} uop={uop}", inject)  # type: ignore[arg-type]


def test_offload_matches_replicated_reference(pool2: Any) -> None:
    results = pool2.run(_sweep, _configs())
    fails = [f for r, _ in results for f in r]
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)
    assert all(ran["configs"] == len(_configs()) for _, ran in results)


def test_offload_state_dict_and_summon(pool2: Any) -> None:
    fails = [f for r in pool2.run(_state_dict_and_summon_with_offload, [False, True]) for f in r]
    assert not fails, "\n".join(fails)


def test_configs_cover_the_options() -> None:
    cfgs = _configs()
    assert {(c["strategy"], c["uop"]) for c in cfgs} == set(itertools.product(STRATEGIES, [False, True]))
    assert any(c["nosync"] and c["accum"] for c in cfgs) and any(c["clip"] for c in cfgs)


# ---------------------------------------------------------------------------
# GPU-only paths: pinned CPU shards, CUDA compute with CPU-resident shards
# ---------------------------------------------------------------------------


def _gpu_worker(rank: int, world_size: int, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    import fsdp_wrap as fw

    warnings.simplefilter("ignore")
    errs: list[str] = []
    try:
        dev = torch.device("cuda", rank)
        for uop in (False, True):
            torch.manual_seed(0)
            base = new_model("transformer")
            off = build("transformer", "ours", base, use_orig_params=uop, device_id=dev,
                        cpu_offload=fw.CPUOffload(True))
            plain = build("transformer", "ours", base, use_orig_params=uop, device_id=dev)
            for n, p in off.named_parameters():
                if p.device.type != "cpu":
                    errs.append(f"uop={uop}: {n} on {p.device}, want cpu")
            for h in (u._handle for u in fw.FullyShardedDataParallel.fsdp_modules(off)):
                if h is not None and not h.local_shard.is_pinned():
                    errs.append(f"uop={uop}: an offloaded shard is not pinned")
            opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (off, plain)]
            gen = torch.Generator().manual_seed(rank)
            for _ in range(3):
                x = make_input("transformer", gen)
                losses = []
                for m, o in zip((off, plain), opts):
                    y = m(x.to(dev) if m is plain else x)
                    if y.device != dev:
                        errs.append(f"uop={uop}: output on {y.device}, want {dev}")
                    loss = loss_of(y)
                    loss.backward()
                    o.step()
                    o.zero_grad()
                    losses.append(float(loss))
                if abs(losses[0] - losses[1]) > 1e-5:
                    errs.append(f"uop={uop}: loss offload {losses[0]} vs on-device {losses[1]}")
            for a, b in zip(off.parameters(), plain.parameters()):
                if (a.detach() - b.detach().cpu()).abs().max() > 1e-5:
                    errs.append(f"uop={uop}: params differ after 3 steps")
                    break
    finally:
        out.put((rank, errs))
        dist.destroy_process_group()


def _spawn_gpu(world_size: int) -> list[str]:
    import socket

    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    tmp.start_processes(_gpu_worker, args=(world_size, port, q), nprocs=world_size, start_method="spawn")
    results = [q.get(timeout=60) for _ in range(world_size)]
    return [f"[rank {r}] {e}" for r, errs in sorted(results) for e in errs]


@requires_cuda
def test_offload_pinned_shards_and_cuda_compute_one_gpu() -> None:
    fails = _spawn_gpu(1)
    assert not fails, "\n".join(fails)


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_offload_pinned_shards_and_cuda_compute_two_gpus() -> None:
    fails = _spawn_gpu(2)
    assert not fails, "\n".join(fails)
