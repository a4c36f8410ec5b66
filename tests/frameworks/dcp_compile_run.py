"""DCP's ``torch.distributed.checkpoint.state_dict`` helpers and ``torch.compile``,
on torch's FSDP1 and then on fsdp_wrap (installed), same script, same data.

DCP: train 2 steps, take the state with ``get_state_dict`` (sharded: saved with
``dcp.save``; full: kept in memory, rank 0's also loaded into the plain model),
train 2 more (reference), then a fresh model and optimizer get it back
(``dcp.load`` + ``set_model_state_dict``/``set_optimizer_state_dict``, or
``set_state_dict`` with full state dicts) and train the same 2 steps.
``cpu_offload=True`` (rank 0 only; it saves the file every rank loads) runs
on fsdp_wrap only: torch's FSDP1 crashes there on CPU.  Compile: ``torch.compile(FSDP(model, use_orig_params=True))`` and blocks
compiled before wrapping, 4 steps each, with Dynamo's graph counts.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from _common import OUT, RANK, Block, mlp, record


def build(uop: bool, compile_blocks: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    net = mlp()
    if compile_blocks:
        for b in net[:2]:
            b.compile()
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=uop,
                 device_id=torch.device("cpu"))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
    g = torch.Generator().manual_seed(10 * i + RANK)
    loss = model(torch.randn(4, 16, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def dcp_run(impl: str, full: bool, uop: bool, offload: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    kind = "full_offload" if offload else "full" if full else "sharded"
    key = f"dcp/{impl}/{kind}/{uop}"
    model, opt = build(uop)
    record(key + "/train", [step(model, opt, i) for i in range(2)])
    opts = StateDictOptions(full_state_dict=full, cpu_offload=offload)
    msd, osd = get_state_dict(model, opt, options=opts)
    if offload:  # rank 0 holds the whole state on CPU; the others hold nothing
        record(key + "/keys", len(msd))
    if full:
        with torch.no_grad():  # a collective: every rank runs it
            x = torch.ones(2, 16)
            want = model(x)
    if full and (RANK == 0 or not offload):
        msd, osd = copy.deepcopy(msd), copy.deepcopy(osd)
        plain = mlp()
        plain.load_state_dict(msd)  # strict: every key, every shape
        with torch.no_grad():
            record(key + "/plain_vs_model", (plain(x) - want).abs().max().item())
    if offload:  # what rank 0 saves; every rank loads it back below
        path = os.path.join(OUT, f"full_{impl}_{uop}.pt")
        if RANK == 0:
            torch.save({"model": msd, "optim": osd}, path)
        dist.barrier()
    if not full:
        path = os.path.join(OUT, f"dcp_{impl}_{uop}")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    record(key + "/ref", [step(model, opt, i) for i in range(2, 4)])
    model2, opt2 = build(uop)
    if full:
        if offload:
            saved = torch.load(path, weights_only=True)
            msd, osd = saved["model"], saved["optim"]
        set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd,
                       options=StateDictOptions(full_state_dict=True))
    else:
        state = {"model": get_model_state_dict(model2, options=opts),
                 "optim": get_optimizer_state_dict(model2, opt2, options=opts)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model2, state["model"], options=opts)
        set_optimizer_state_dict(model2, opt2, state["optim"], options=opts)
    record(key + "/resumed", [step(model2, opt2, i) for i in range(2, 4)])
    dist.barrier()


def compile_run(impl: str, mode: str) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, opt = build(True, compile_blocks=mode == "blocks")
    run = torch.compile(model) if mode == "whole" else model
    key = f"compile/{impl}/{mode}"
    record(key + "/losses", [step(run, opt, i) for i in range(4)])
    record(key + "/graphs", counters["stats"]["unique_graphs"])
    dist.barrier()


def _runs(impl: str) -> None:
    for full, uop in ((False, False), (False, True), (True, False), (True, True)):
        dcp_run(impl, full, uop)
    if impl == "ours":  # torch's FSDP1 crashes here on CPU (FULL with offload_to_cpu)
        dcp_run(impl, True, True, offload=True)
    for mode in ("whole", "blocks"):
        compile_run(impl, mode)


def torch_part() -> None:
    _runs("torch")


def ours_part() -> None:
    _runs("ours")
