#!/usr/bin/env python
"""torch.compile of an FSDP model on CUDA (NCCL, world size 1): torch's FSDP1 vs fsdp_wrap.

    python benchmarks/compile_cuda.py        # needs one GPU; results in docs/frameworks/torch_compile.rst

A 4-block MLP (512-2048-512) wrapped one unit per block with use_orig_params=True,
eager and torch.compile'd, fp32 and bf16 mixed precision, 12 Adam steps each;
prints Dynamo's graph count, the median step time of steps 5-12 and the largest
relative loss difference between the two implementations (torch's runs first,
then fsdp_wrap.install()).
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(512, 2048)
        self.l2 = nn.Linear(2048, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l2(torch.relu(self.l1(x)))


def run(mode: str, bf16: bool) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = nn.Sequential(*[Block() for _ in range(4)], nn.Linear(512, 8)).cuda()
    kw = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)} if bf16 else {}
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                 device_id=0, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step_fn = torch.compile(model) if mode == "compile" else model
    gen = torch.Generator(device="cuda").manual_seed(0)
    losses, times = [], []
    for _ in range(12):
        x = torch.randn(64, 512, device="cuda", generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step_fn(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    timed = sorted(times[4:])
    return {"losses": losses, "graphs": counters["stats"]["unique_graphs"],
            "median_ms": timed[len(timed) // 2] * 1e3}


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    res = {}
    for impl in ("torch", "ours"):
        if impl == "ours":
            import fsdp_wrap

            fsdp_wrap.install()
        for mode in ("eager", "compile"):
            for bf16 in (False, True):
                res[f"{impl}/{mode}/{'bf16' if bf16 else 'fp32'}"] = run(mode, bf16)
    for k, v in res.items():
        print(f"{k:22s} graphs {v['graphs']}  median {v['median_ms']:.2f} ms  "
              f"loss first {v['losses'][0]:.6f} last {v['losses'][-1]:.6f}")
    for mode in ("eager", "compile"):
        for dt in ("fp32", "bf16"):
            a, b = res[f"torch/{mode}/{dt}"]["losses"], res[f"ours/{mode}/{dt}"]["losses"]
            worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
            print(f"{mode} {dt}: largest relative loss difference {worst:.2e}")
    with open(os.path.join(os.environ.get("OUT", "."), "compile.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
