"""Workloads and framework builders for ``bench_fsdp.py``.

Every model is a stack of pre-norm transformer :class:`Block` s built only from
``nn.Linear`` and ``nn.LayerNorm`` (both have ``reset_parameters``, so torch's
meta-device initialisation works on them).  Each framework wraps one ``Block``
per FSDP unit plus the root, so all of them shard the same units.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# The FSDP1 wrappers compared: torch's, ours, torch's FSDP2, DDP, and (world
# size 1 only) the plain module with no wrapper at all.
FRAMEWORKS = ("torch_fsdp1", "fsdp_wrap", "fsdp2", "ddp", "plain")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")  # bench_nodes.py adds the hybrid ones


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model shape and the batch each rank feeds it every step."""

    name: str
    layers: int
    dim: int
    heads: int
    batch: int
    seq: int
    what: str

    def params(self) -> int:
        # Per block: qkv (3d^2+3d), proj (d^2+d), fc1 (4d^2+4d), fc2 (4d^2+d),
        # two LayerNorms (4d); the final LayerNorm and head add 2d and d^2+d.
        d = self.dim
        per_block = 12 * d * d + 13 * d
        return self.layers * per_block + d * d + 3 * d


WORKLOADS = {
    "compute": Workload("compute", 6, 384, 6, 4, 128, "compute-heavy transformer"),
    "small": Workload("small", 48, 48, 4, 4, 16, "many small units: framework overhead dominates"),
    "large": Workload("large", 8, 1024, 16, 1, 16, "about 100M parameters, for peak memory"),
    "meta1b": Workload("meta1b", 20, 2048, 16, 1, 8, "1B parameters built on the meta device"),
    # GPU only: a few hundred million parameters, enough compute per step that
    # the wrapper's own overhead is measured against a realistic step.
    "gpu": Workload("gpu", 24, 1024, 16, 8, 512, "about 300M parameters, for the GPU overhead row"),
}

# ``--tiny``: the same structure at toy sizes, for the smoke test.
TINY = {
    "compute": Workload("compute", 2, 32, 2, 2, 8, "compute-heavy transformer (tiny)"),
    "small": Workload("small", 6, 8, 2, 2, 4, "many small units (tiny)"),
    "large": Workload("large", 2, 64, 2, 2, 8, "memory workload (tiny)"),
    "meta1b": Workload("meta1b", 2, 64, 2, 1, 4, "meta-device construction (tiny)"),
    "gpu": Workload("gpu", 2, 64, 2, 2, 8, "GPU overhead workload (tiny)"),
}


class Block(nn.Module):
    """Pre-norm self-attention + 4x MLP, residual; one FSDP unit."""

    def __init__(self, dim: int, heads: int, device: Any = None) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim, device=device)
        self.qkv = nn.Linear(dim, 3 * dim, device=device)
        self.proj = nn.Linear(dim, dim, device=device)
        self.ln2 = nn.LayerNorm(dim, device=device)
        self.fc1 = nn.Linear(dim, 4 * dim, device=device)
        self.fc2 = nn.Linear(4 * dim, dim, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, w: Workload, device: Any = None) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(w.dim, w.heads, device) for _ in range(w.layers)))
        self.norm = nn.LayerNorm(w.dim, device=device)
        self.head = nn.Linear(w.dim, w.dim, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


def make_model(w: Workload, seed: int = 0, device: Any = None) -> Model:
    """The same initial weights on every rank and for every framework."""
    torch.manual_seed(seed)
    return Model(w, device=device)


def make_batches(w: Workload, rank: int, n: int, device: torch.device) -> list[torch.Tensor]:
    """``n`` distinct batches for ``rank`` (different per rank, equal across frameworks)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(w.batch, w.seq, w.dim, generator=g).to(device) for _ in range(n)]


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


# ---------------------------------------------------------------------------
# framework builders
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """One wrapped configuration: framework, sharding strategy, use_orig_params
    (and, for fsdp_wrap, ``bucket_cap_mb`` / ``all_gather_batch_mb``; ``None``:
    the library's default)."""

    framework: str
    strategy: str  # "-" where the framework has no such choice (DDP, plain)
    orig: bool | None  # use_orig_params; None where it does not apply
    bucket_cap_mb: float | None = None
    all_gather_batch_mb: float | None = None

    @property
    def key(self) -> str:
        o = "-" if self.orig is None else ("T" if self.orig else "F")
        fw = self.framework
        if self.bucket_cap_mb is not None:
            fw += f"@{self.bucket_cap_mb:g}"  # e.g. fsdp_wrap@0: per-unit reduction
        if self.all_gather_batch_mb is not None:
            fw += f"+ag{self.all_gather_batch_mb:g}"  # e.g. fsdp_wrap@25+ag1
        return f"{fw}/{self.strategy}/{o}"


def variants_for(world_size: int, frameworks: tuple[str, ...], strategies: tuple[str, ...],
                 origs: tuple[bool, ...],
                 bucket_caps: tuple[float | None, ...] = (None,),
                 gather_batches: tuple[float | None, ...] = (None,)) -> list[Variant]:
    """Every configuration one workload runs, interleaved (fsdp_wrap once per
    bucket cap and all-gather batch cap)."""
    out: list[Variant] = []
    for strategy in strategies:
        for orig in origs:
            if "torch_fsdp1" in frameworks:
                out.append(Variant("torch_fsdp1", strategy, orig))
            if "fsdp_wrap" in frameworks:
                out += [Variant("fsdp_wrap", strategy, orig, cap, ag)
                        for cap in bucket_caps for ag in gather_batches]
        # FSDP2 has no NO_SHARD (that is DDP's / replicate's job) and always
        # behaves like use_orig_params=True.
        if "fsdp2" in frameworks and strategy != "NO_SHARD":
            out.append(Variant("fsdp2", strategy, None))
    if "ddp" in frameworks:
        out.append(Variant("ddp", "-", None))
    if "plain" in frameworks and world_size == 1:
        out.append(Variant("plain", "-", None))
    return out


def low_precision() -> torch.dtype | None:
    """``bench_fsdp.py --mixed-precision bf16`` (inherited by the ranks through the environment).

    The FSDPs get ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`` of
    this dtype; DDP and the plain module run their forward under
    ``torch.autocast`` of it instead (fp32 master weights either way).
    """
    name = os.environ.get("FSDP_BENCH_MIXED_PRECISION", "")
    return {"": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def build(v: Variant, model: nn.Module, device: torch.device, device_mesh: Any = None) -> nn.Module:
    """Wrap ``model`` (already on ``device``) as ``v`` says; one unit per Block + root.

    ``device_mesh``: given to both FSDP1s (``bench_nodes.py``: a 2-D mesh for the
    hybrid strategies, whose default groups torch's FSDP1 cannot build on CPU)."""
    dtype = low_precision()
    if v.framework in ("torch_fsdp1", "fsdp_wrap"):
        if v.framework == "torch_fsdp1":
            import torch.distributed.fsdp as api
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        else:
            import fsdp_wrap as api
            from fsdp_wrap.wrap import ModuleWrapPolicy
        extra: dict[str, Any] = {}
        if v.bucket_cap_mb is not None:
            extra["bucket_cap_mb"] = v.bucket_cap_mb
        if v.all_gather_batch_mb is not None:
            extra["all_gather_batch_mb"] = v.all_gather_batch_mb
        if device_mesh is not None:
            extra["device_mesh"] = device_mesh
        return api.FullyShardedDataParallel(
            model,
            **extra,
            sharding_strategy=api.ShardingStrategy[v.strategy],
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=device,
            use_orig_params=bool(v.orig),
            mixed_precision=api.MixedPrecision(dtype, dtype, dtype) if dtype else None,
            # Set by bench_fsdp.py --no-limit-all-gathers (both FSDP1s get it).
            limit_all_gathers=os.environ.get("FSDP_BENCH_LIMIT_ALL_GATHERS", "1") == "1",
        )
    if v.framework == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        reshard = v.strategy == "FULL_SHARD"
        mp = MixedPrecisionPolicy(dtype, dtype) if dtype else MixedPrecisionPolicy()
        for m in model.modules():
            if isinstance(m, Block):
                fully_shard(m, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        # torch's FSDP1 keeps the root unsharded after forward; so does this.
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        return model
    if v.framework == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    if v.framework == "plain":
        return model
    raise ValueError(f"unknown framework {v.framework!r}")


def variant_of(key: str) -> Variant:
    """``framework/STRATEGY/F|T`` (``-`` where a choice does not apply, as in
    ``plain/-/-``) as a :class:`Variant`."""
    fw, strategy, orig = key.split("/")
    return Variant(fw, strategy, None if orig == "-" else orig == "T")


def trainer(key: str, w: Workload, device: torch.device,
            dtype: torch.dtype | None) -> tuple[nn.Module, torch.optim.Optimizer, bool]:
    """The wrapped model for ``key``, its AdamW (foreach) and whether its step
    runs under ``torch.autocast(dtype)``: the plain module and DDP with a low
    precision (the FSDPs get it from ``build``'s ``MixedPrecision``)."""
    v = variant_of(key)
    model = build(v, make_model(w, device=device), device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt, v.framework in ("plain", "ddp") and dtype is not None


def build_meta(framework: str, w: Workload, device: torch.device) -> nn.Module:
    """Build ``w`` on the meta device and let ``framework`` materialise it."""
    with torch.device("meta"):
        model = Model(w)
    v = Variant(framework, "FULL_SHARD", False)
    return build(v, model, device)
