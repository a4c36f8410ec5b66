"""Models and helpers shared by the checkpoint tests (state dicts, optimizer state, DCP)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

import fsdp_wrap
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests._sweep import injected

CPU = torch.device("cpu")


class Tied(nn.Module):
    """Embedding whose weight the output head shares, plus a buffer and a nested unit."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) * self.scale
        return self.head(self.body(h))


def problem(what: str, failed: bool) -> list[str]:
    """``[what]`` if a comparison failed, else ``[]``: the comparison helper of the
    checkpoint sweeps, so it reports an injected failure first (tests/_sweep.py).

    Only a report: a sweep decides nothing on it that gates a collective (or
    agrees on it first with :func:`tests._sweep.any_rank`).
    """
    hit = injected(what)
    if hit:
        return [hit]
    return [what] if failed else []


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "seq":
        m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.LayerNorm(3))
        m.register_buffer("buf", torch.arange(3, dtype=torch.float32))
        return m
    if kind == "tied":
        return Tied()
    if kind == "lora":  # units mixing frozen and trainable parameters (split by fsdp_wrap)
        from tests.models import LoraNet

        return LoraNet()
    if kind == "tiny":  # one unit of 2 elements: a shard of 1 on 2 ranks, like a 0-dim state
        return nn.Linear(1, 1)
    raise ValueError(kind)


def policy(kind: str) -> Any:
    if kind == "seq":
        return ModuleWrapPolicy({nn.Linear})
    if kind == "lora":
        from tests.models import LoraBlock

        return ModuleWrapPolicy({LoraBlock})
    if kind == "tiny":
        return None
    return ModuleWrapPolicy({nn.Sequential})


def wrap_ours(kind: str, uop: bool, seed: int = 0, **kw: Any) -> nn.Module:
    return fsdp_wrap.FullyShardedDataParallel(
        make_model(kind, seed), auto_wrap_policy=policy(kind), device_id=CPU,
        use_orig_params=uop, **kw,
    )


def wrap_torch(kind: str, uop: bool, seed: int = 0, **kw: Any) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    return TorchFSDP(
        make_model(kind, seed), auto_wrap_policy=policy(kind), device_id=CPU,
        use_orig_params=uop, **kw,
    )


def batch(kind: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    if kind == "seq":
        return torch.randn(5, 4, generator=g)
    if kind == "lora":
        return torch.randn(3, 4, 5, generator=g)
    if kind == "tiny":
        return torch.randn(3, 1, generator=g)
    return torch.randint(0, 10, (3, 2), generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, kind: str, steps: range) -> list[float]:
    losses = []
    for s in steps:
        loss = model(batch(kind, s)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item())
    return losses


def _torch_lists(offsets: list[int], sizes: list[int]) -> bool:
    """Whether torch's FSDP1 lists this shard: it lists none past ``torch.chunk``'s
    last piece, where fsdp_wrap lists an empty one (fsdp_wrap/state_dict/chunks.py);
    an empty tensor's one shard is listed by both."""
    return not sizes or sizes[0] > 0 or offsets[0] == 0


def describe(v: Any) -> Any:
    """A comparable description of a state-dict value (type, shapes, local data).

    ShardedTensors are described in torch's FSDP1 convention: the empty shards
    fsdp_wrap adds for ranks past a small tensor's last row are left out
    (``tests/test_state_dict.py::test_every_rank_holds_a_shard`` checks them).
    """
    if isinstance(v, ShardedTensor):
        md = [
            (list(s.shard_offsets), list(s.shard_sizes), str(s.placement))
            for s in v.metadata().shards_metadata
            if _torch_lists(list(s.shard_offsets), list(s.shard_sizes))
        ]
        loc = [(list(s.metadata.shard_offsets), s.tensor.tolist()) for s in v.local_shards()
               if _torch_lists(list(s.metadata.shard_offsets), list(s.metadata.shard_sizes))]
        return ("ST", tuple(v.size()), str(v.dtype), md, loc)
    if isinstance(v, DTensor):
        mesh = v.device_mesh
        return ("DT", tuple(v.shape), str(v.placements), tuple(mesh.shape), mesh.mesh_dim_names,
                v.to_local().tolist())
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), str(v.dtype), v.tolist())
    return ("obj", v)


def describe_sd(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: describe(v) for k, v in sd.items()}


def describe_ordered(sd: dict[str, Any]) -> list[tuple[str, Any]]:
    """Like :func:`describe_sd` but order-sensitive (DCP file layout follows key order)."""
    return [(k, describe(v)) for k, v in sd.items()]


def describe_osd(osd: dict[str, Any]) -> Any:
    """An order-sensitive description of an optimizer state dict (``{}`` stays ``{}``)."""
    if not osd:
        return osd
    return (
        [(k, describe_ordered(st)) for k, st in osd["state"].items()],
        [{k: v for k, v in g.items()} for g in osd["param_groups"]],
    )


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Clean-FQN full parameters of an FSDP model (ours or torch's)."""
    cls: Any = type(model)
    with cls.summon_full_params(model):
        return {
            k.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for k, p in model.named_parameters()
        }


def same_nested(a: Any, b: Any) -> bool:
    """Whether two nested state dicts (dicts, lists, tuples, tensors, numbers)
    are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_nested(x, y) for x, y in zip(a, b))
    return bool(a == b)
