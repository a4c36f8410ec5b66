"""``iter_full_weights``: the FULL state dict as a stream, one unit unsharded at a time.

On 2 and 3 gloo ranks, after a training step (so every shard holds its own
values), the stream must give exactly the FULL state dict's names and tensors,
bit for bit (tied aliases once each, as the same tensor; buffers in their
original dtype; ignored modules' parameters), for nested units, every sharding
strategy, ``use_orig_params`` both ways, CPU offload and mixed precision, on
every rank or rank 0 only, in the original dtype or another one; and a GPT-2
from transformers.  The memory test counts live heap bytes (glibc's
``mallinfo2``) after every op of the iteration: the peak above the sharded
state stays within one unit plus one parameter, where a FULL state dict of
the same model needs the whole model.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_wrap
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests._sweep import run_sweep

CPU = torch.device("cpu")
FSDP = fsdp_wrap.FullyShardedDataParallel


class Sub(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.sub = Sub(d)  # a unit nested in the block's unit
        self.register_buffer("gain", torch.linspace(0.5, 1.5, d))
        self.register_buffer("steps", torch.arange(3))  # integer: never cast
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub(x + self.fc2(torch.relu(self.norm(self.fc1(x)))) * self.gain)


class Net(nn.Module):
    """Embedding tied to the head (root unit), nested block units, an ignored module."""

    def __init__(self, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, d)
        self.blocks = nn.Sequential(*(Block(d) for _ in range(n)))
        self.side = nn.Linear(d, d)  # ignored by FSDP: every rank holds it whole
        self.head = nn.Linear(d, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.emb(x))
        return self.head(self.side(h.float()).to(h.dtype))  # (side: fp32 under mixed precision)


def _build(cfg: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    net = Net()
    kw: dict[str, Any] = dict(
        auto_wrap_policy=ModuleWrapPolicy({Block, Sub}), device_id=CPU,
        use_orig_params=cfg["uop"], sharding_strategy=fsdp_wrap.ShardingStrategy[cfg["strategy"]],
        ignored_modules=[net.side],
    )
    if cfg["extra"] == "offload":
        kw["cpu_offload"] = fsdp_wrap.CPUOffload(offload_params=True)
    if cfg["extra"] == "mp":
        kw["mixed_precision"] = fsdp_wrap.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(net, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    model(torch.randint(0, 16, (4, 5), generator=g)).float().pow(2).mean().backward()
    opt.step()
    return model


def _gpt2(cfg: dict[str, Any]) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16))
    return FSDP(hf, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), device_id=CPU,
                use_orig_params=cfg["uop"])


def _full_sd(model: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor]:
    cfg = fsdp_wrap.FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)
    with FSDP.state_dict_type(model, fsdp_wrap.StateDictType.FULL_STATE_DICT, cfg):
        return dict(model.state_dict())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _one(cfg: dict[str, Any]) -> list[str]:
    warnings.simplefilter("ignore")
    model = _gpt2(cfg) if cfg["model"] == "gpt2" else _build(cfg)
    what = f"[rank {dist.get_rank()}] {cfg}"
    want = _full_sd(model, cfg["rank0_only"])
    shards = [m._handle.local_shard.clone() for m in FSDP.fsdp_modules(model) if m._handle]
    stream = list(fsdp_wrap.iter_full_weights(
        model, rank0_only=cfg["rank0_only"], dtype=cfg["dtype"], offload_to_cpu=True))
    fails = []
    names = [n for n, _ in stream]
    got = dict(stream)
    if len(names) != len(got):
        fails.append(f"{what}: a name came twice")
    if sorted(got) != sorted(want):
        fails.append(f"{what}: names {sorted(set(got) ^ set(want))} differ from the FULL state dict's")
    if cfg["rank0_only"] and dist.get_rank() != 0 and got:
        fails.append(f"{what}: rank0_only yielded on another rank")
    for k in got.keys() & want.keys():
        w = want[k]
        if cfg["dtype"] is not None and w.is_floating_point():
            w = w.to(cfg["dtype"])
        if got[k].dtype != w.dtype or got[k].shape != w.shape or not torch.equal(
                _bits(got[k]), _bits(w)):
            fails.append(f"{what}: {k} differs ({got[k].dtype} {tuple(got[k].shape)} against "
                         f"{w.dtype} {tuple(w.shape)})")
        if got[k].device != CPU:
            fails.append(f"{what}: {k} on {got[k].device} despite offload_to_cpu")
    tied = ("lm_head.weight", "transformer.wte.weight") if cfg["model"] == "gpt2" else (
        "head.weight", "emb.weight")
    if got and got[tied[0]] is not got[tied[1]]:
        fails.append(f"{what}: the tied names are not one tensor")
    after = [m._handle.local_shard for m in FSDP.fsdp_modules(model) if m._handle]
    if not all(torch.equal(a, b) for a, b in zip(shards, after)):
        fails.append(f"{what}: the shards changed")
    if any(m._handle.is_unsharded for m in FSDP.fsdp_modules(model) if m._handle):
        fails.append(f"{what}: a unit was left unsharded")
    return fails


def _configs(world: int) -> list[dict[str, Any]]:
    out = []
    i = 0
    for uop in (False, True):
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            for extra in (None, "offload", "mp"):
                if world == 3 and (i % 3):
                    i += 1
                    continue
                out.append(dict(model="net", uop=uop, strategy=strategy, extra=extra,
                                rank0_only=i % 2 == 1, dtype=torch.bfloat16 if i % 4 == 2 else None))
                i += 1
    out.append(dict(model="gpt2", uop=True, strategy="FULL_SHARD", extra=None,
                    rank0_only=False, dtype=None))
    out.append(dict(model="gpt2", uop=False, strategy="FULL_SHARD", extra=None,
                    rank0_only=True, dtype=torch.float16))
    return out


def _sweep(configs: list[dict[str, Any]]) -> list[str]:
    return run_sweep(configs, _one)


def test_stream_is_the_full_state_dict_2_ranks(pool2: Any) -> None:
    configs = _configs(2)
    assert {c["rank0_only"] for c in configs} == {False, True}
    assert {c["dtype"] for c in configs} >= {None, torch.bfloat16}
    fails = pool2.run(_sweep, configs)
    assert fails == [[], []], "\n".join(f for r in fails for f in r)


@pytest.mark.slow  # (the 2-rank sweep covers every case in the default run)
def test_stream_is_the_full_state_dict_3_ranks(pool3: Any) -> None:
    fails = pool3.run(_sweep, _configs(3))
    assert fails == [[], [], []], "\n".join(f for r in fails for f in r)


def test_refuses_bad_use() -> None:
    with pytest.raises(TypeError, match="root fsdp_wrap FullyShardedDataParallel"):
        fsdp_wrap.iter_full_weights(nn.Linear(2, 2))


def _refusals() -> list[str]:
    warnings.simplefilter("ignore")
    model = _build(dict(uop=False, strategy="FULL_SHARD", extra=None))
    fails = []
    try:
        fsdp_wrap.iter_full_weights(model, dtype=torch.int8)
        fails.append("an integer dtype was accepted")
    except ValueError as e:
        if "floating-point" not in str(e):
            fails.append(str(e))
    with FSDP.summon_full_params(model):
        try:
            fsdp_wrap.iter_full_weights(model)
            fails.append("iterating inside summon_full_params was accepted")
        except RuntimeError as e:
            if "SUMMON_FULL_PARAMS" not in str(e) or f"[rank {dist.get_rank()}, " not in str(e):
                fails.append(str(e))
    return fails


def test_refuses_inside_summon_and_integer_dtypes(pool2: Any) -> None:
    assert pool2.run(_refusals) == [[], []]


# ------------------------------------------------------------------ memory

_libc = ctypes.CDLL("libc.so.6")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc.mallinfo2.restype = _MallInfo2


def _live() -> int:
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _Peak(TorchDispatchMode):
    """The most live heap bytes seen after any op (and whenever ``sample`` is called)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = _live()

    def sample(self) -> None:
        self.peak = max(self.peak, _live())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


class Wide(nn.Module):
    """Six units of 2 MiB (fp32) each and a small root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(512, 1024, bias=False) for _ in range(6)))
        self.out = nn.Linear(1024, 4)


def _memory(rank0_only: bool) -> dict[str, int]:
    torch.manual_seed(0)
    model = FSDP(Wide(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=CPU,
                 use_orig_params=True)
    unit = 512 * 1024 * 4  # the largest unit (one block), unpadded bytes
    param = unit  # its one parameter: the copy the consumer is handed
    model._lazy_init()
    with _Peak():  # the first dispatch mode of a process imports and caches ~9 MB
        torch.ones(4).add_(1).sum()
    total = 0
    base = _live()
    with _Peak() as peak:
        for _, t in fsdp_wrap.iter_full_weights(model, rank0_only=rank0_only):
            peak.sample()
            total += t.numel() * t.element_size()
            del t
    stream_peak = peak.peak - base
    base = _live()
    with _Peak() as peak:
        sd = _full_sd(model, rank0_only)
        peak.sample()
        del sd
    return dict(stream=stream_peak, full_sd=peak.peak - base, unit=unit, param=param, total=total)


@pytest.mark.parametrize("rank0_only", [False, True])
def test_peak_is_one_unit_above_the_shards(pool2: Any, rank0_only: bool) -> None:
    for rank, m in enumerate(pool2.run(_memory, rank0_only)):
        model_bytes = 6 * m["unit"]
        if rank == 0 or not rank0_only:
            assert m["total"] >= model_bytes  # the whole model went through
            # the gathered unit and the consumer's copy of its parameter, plus
            # allocator slack of at most 1 MiB
            assert m["unit"] <= m["stream"] <= m["unit"] + m["param"] + 2**20, m
            # the measure sees what a FULL state dict holds: the whole model
            assert m["full_sd"] >= model_bytes, m
        else:
            # the other ranks only send: no unit, no copy
            assert m["stream"] <= 2**20, m
