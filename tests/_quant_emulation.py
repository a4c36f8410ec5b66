"""A plain replicated model that applies fsdp_wrap's quantize/dequantize itself.

The reference for quantized collectives (tests/test_quantized_collectives.py)
and for sharded accumulation (tests/test_accumulation.py): every rank keeps
a full master copy of the model and a compute copy; per step it

1. builds each flat parameter from the master copy in the fsdp_wrap model's
   layout, and gives the compute copy what a rank gathers: each shard passed
   through :func:`fsdp_wrap.comm.quant.codec.roundtrip` where the
   documentation says the unit's weights are coded, else the shard as it is,
   cast to the compute dtype;
2. runs forward and backward on this rank's data;
3. all-gathers every rank's local flat gradient exactly (``dist.all_gather``)
   and computes, for every shard, the mean gradient with the same operations
   in the same order as the fsdp_wrap path: cast to ``reduce_dtype``, divide
   by ``pre``, then the sums (exact ones as gloo adds two ranks, ``a + b``;
   coded ones as decoded float32 values added in source-rank order), the
   replicas' sum, divide by ``post``;
4. steps its optimizer on the master copy.

What is coded where (which collective, routed through the nodes or flat,
which units) comes from the documented rules (:mod:`tests._quant_rules`),
the strategy's sharding and the dtypes from the configuration: never from
fsdp_wrap's decisions.  Two production pieces are used, each pinned by a test
of its own: the codec's pure functions (tests/test_quant_codec.py, against
the error bound) and the flat layout, read from the handles (which
parameters a unit holds, their order, offsets and padding:
tests/test_flat_param.py compares it with torch's FSDP1's
``FlatParamHandle``; a wrong layout here would only move block boundaries).
The exact sums are written for groups of at most two ranks (gloo's order
of a longer sum is its own), which is what the tests use: 2 ranks, or 4 as
2 nodes x 2.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_wrap.comm.collectives import divide_factors
from fsdp_wrap.comm.quant.codec import Codec, roundtrip
from tests._quant_rules import EXACT_CODING, Coding, documented_coding


@dataclass
class Unit:
    """One flat parameter of the fsdp_wrap model, as the emulation needs it."""

    names: list[str]  # the plain model's parameter names, in flat order
    offsets: list[int]
    numels: list[int]
    padded: int
    shard: int
    trainable: bool
    sharded: bool
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    wire: Coding  # from the documentation (tests._quant_rules), not from the handle


@dataclass(frozen=True)
class Plan:
    """What the test configured: the strategy's name, the ``quantize_collectives``
    string, ``MixedPrecision``'s ``param_dtype`` / ``reduce_dtype`` (``None``:
    unset)."""

    strategy: str
    quant: str | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def _floating(p: torch.Tensor) -> bool:
    """Values a coded collective may code ("What stays exact": not integer
    data, not a 4-bit base's packed bytes)."""
    return p.dtype.is_floating_point and type(p).__name__ != "Params4bit"


def units_of(model: nn.Module, base: nn.Module, plan: Plan, layout: Layout) -> list[Unit]:
    """The flat parameters of an (initialised) fsdp_wrap model: their layout
    read from its handles (pinned by tests/test_flat_param.py), everything
    else from ``plan`` and the documentation (FSDP1's rules for the dtypes:
    compute in ``param_dtype``, reduce in ``reduce_dtype``, else in the
    compute dtype)."""
    params = dict(base.named_parameters())
    per_node = int(os.environ["LOCAL_WORLD_SIZE"]) if os.environ.get("LOCAL_WORLD_SIZE") else None
    out = []
    for h in model._all_handles:  # type: ignore[attr-defined]
        prefix = h.unit_fqn + "." if h.unit_fqn else ""
        names = [prefix + i.fqn for i in h.infos]
        mine = [params[n] for n in names]
        compute = plan.param_dtype or mine[0].dtype
        coding = documented_coding(plan.quant, plan.strategy, layout.my_group(),
                                   layout.my_replicas(), per_node,
                                   floating=all(_floating(p) for p in mine))
        out.append(Unit(
            names=names, offsets=[i.offset for i in h.infos],
            numels=[i.numel for i in h.infos], padded=h.padded_numel, shard=h.shard_numel,
            trainable=all(p.requires_grad for p in mine), sharded=plan.strategy != "NO_SHARD",
            compute_dtype=compute, reduce_dtype=plan.reduce_dtype or compute, wire=coding))
    return out


def fold(values: list[torch.Tensor]) -> torch.Tensor:
    """``((v0 + v1) + v2) + ...`` in the first value's dtype."""
    acc = values[0].clone()
    for v in values[1:]:
        acc.add_(v)
    return acc


def decoded_sum(values: list[torch.Tensor], codec: Codec) -> torch.Tensor:
    """Each value through the codec, added in float32 in order (a coded reduce-scatter)."""
    return fold([roundtrip(v, codec) for v in values])


def coded_all_reduce(values: list[torch.Tensor], codec: Codec) -> torch.Tensor:
    """What :func:`fsdp_wrap.comm.quant.collectives.all_reduce` returns for the
    ranks' ``values``: pieces summed decoded, then each piece coded again."""
    ws, n = len(values), values[0].numel()
    piece = -(-n // ws)
    padded = []
    for v in values:
        p = torch.zeros(ws * piece)
        p[:n] = v.float()
        padded.append(p)
    sums = [decoded_sum([p[j * piece:(j + 1) * piece] for p in padded], codec) for j in range(ws)]
    return torch.cat([roundtrip(s, codec) for s in sums])[:n]


class Layout:
    """Where the ranks sit: ``shard_groups[k]`` (global ranks, group order) and,
    for hybrid strategies, the replicas; ``nodes``: ranks per node (2 x 2 at 4)."""

    def __init__(self, hybrid: bool, per_node: int = 2) -> None:
        ws = dist.get_world_size()
        self.hybrid, self.per_node = hybrid, per_node
        if hybrid:
            self.shard_groups = [list(range(i, i + per_node)) for i in range(0, ws, per_node)]
        else:
            self.shard_groups = [list(range(ws))]
        self.total = ws

    def my_group(self) -> list[int]:
        me = dist.get_rank()
        return next(g for g in self.shard_groups if me in g)

    def my_replicas(self) -> list[int] | None:
        """This rank's replicate group (hybrid): the ranks of its shard-group index."""
        if not self.hybrid:
            return None
        index = self.my_group().index(dist.get_rank())
        return [g[index] for g in self.shard_groups]


class Emulation:
    """See the module docstring.  ``make_opt(params)`` builds the optimizer."""

    def __init__(self, base: nn.Module, fsdp_model: nn.Module, layout: Layout, plan: Plan,
                 make_opt: Callable[[Any], torch.optim.Optimizer],
                 buffer_dtype: torch.dtype | None = None) -> None:
        self.master = copy.deepcopy(base)
        self.compute = copy.deepcopy(base)
        if buffer_dtype is not None:  # (MixedPrecision.buffer_dtype)
            for b in self.compute.buffers():
                if b.is_floating_point():
                    b.data = b.data.to(buffer_dtype)
        self.units = units_of(fsdp_model, base, plan, layout)
        self.layout = layout
        self.params = dict(self.master.named_parameters())
        self.cparams = dict(self.compute.named_parameters())
        self.opt = make_opt(self.master.parameters())
        # the largest change coding made to a weight and to a gradient (tests
        # check it is not zero: a comparison that coding never touched proves little)
        self.moved = {"weights": 0.0, "grads": 0.0}

    # ------------------------------------------------------------ weights

    def _flat(self, u: Unit, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(u.padded, dtype=dtype)
        for name, off, n in zip(u.names, u.offsets, u.numels):
            t = tensors.get(name)
            if t is not None:
                flat[off:off + n] = t.detach().reshape(-1).to(dtype)
        return flat

    def load_compute(self) -> None:
        """The compute copy gets what a rank of each unit gathers."""
        for u in self.units:
            master = self._flat(u, self.params, self.params[u.names[0]].dtype)
            codec = u.wire.weights
            if codec is None:
                values = master.to(u.compute_dtype)
            else:
                shards = master.view(-1, u.shard)
                coded = torch.cat([roundtrip(s, codec) for s in shards])
                self._moved("weights", coded, master)
                values = coded.to(u.compute_dtype)
            with torch.no_grad():
                for name, off, n in zip(u.names, u.offsets, u.numels):
                    p = self.cparams[name]
                    p.data = values[off:off + n].view(p.shape).clone()

    # --------------------------------------------------------- gradients

    def reduce(self, u: Unit, grads: list[torch.Tensor], replicas: bool = True) -> torch.Tensor:
        """The mean flat gradient (all shards) from every rank's local one.
        ``replicas=False`` (hybrid): this rank's shard group's part, divided
        by ``post`` (what sharded accumulation adds up)."""
        pre, post = divide_factors(self.layout.total)
        scaled = [(g.to(u.reduce_dtype) / pre) if pre > 1 else g.to(u.reduce_dtype)
                  for g in grads]
        if not u.sharded and not self.layout.hybrid:
            total = self._all_reduce(scaled, u)
            return total / post if post > 1 else total
        shard_sums = []  # per shard group: its sum over the group, flat
        for group in self.layout.shard_groups:
            chunks = [scaled[r].view(len(group), u.shard) for r in group]
            shard_sums.append(torch.cat([self._group_sum([c[d] for c in chunks], u)
                                         for d in range(len(group))]))
        if not replicas:
            mine = shard_sums[self.layout.shard_groups.index(self.layout.my_group())]
            return mine / post if post > 1 else mine
        if self.layout.hybrid and len(self.layout.shard_groups) > 1:
            total = self.sum_over_replicas(u, shard_sums)
        else:
            total = shard_sums[0]
        return total / post if post > 1 else total

    def sum_over_replicas(self, u: Unit, per_group: list[torch.Tensor],
                          cast: bool = False) -> torch.Tensor:
        """Every shard's sum over the replicas (``per_group``: each shard group's
        flat values, in replicate-group order); ``cast``: first to the dtype
        the replicas' all-reduce moves (sharded accumulation's float32 sums)."""
        width = len(self.layout.shard_groups[0])
        cols = []
        for d in range(width):
            piece = [s.view(width, u.shard)[d] for s in per_group]
            if u.wire.replicas is not None:
                cols.append(coded_all_reduce(piece, u.wire.replicas))
            else:
                if cast:
                    dtype = u.wire.sum_dtype(u.reduce_dtype)
                    piece = [p.to(dtype) for p in piece]
                cols.append(fold(piece))
        return torch.cat(cols)

    def _moved(self, what: str, coded: torch.Tensor, exact: torch.Tensor) -> None:
        diff = (coded.double() - exact.double()).abs().nan_to_num(0.0)
        self.moved[what] = max(self.moved[what], float(diff.max()) if diff.numel() else 0.0)

    def _all_reduce(self, values: list[torch.Tensor], u: Unit) -> torch.Tensor:
        """NO_SHARD's sum over all ranks (exact, coded, or coded between nodes)."""
        codec = u.wire.grads
        if codec is None:
            return fold(values)
        if not u.wire.routed:
            return coded_all_reduce(values, codec)
        per, n = self.layout.per_node, values[0].numel()
        piece = -(-n // per)
        padded = [torch.cat([v, v.new_zeros(per * piece - n)]) for v in values]
        nodes = [padded[i:i + per] for i in range(0, len(padded), per)]
        parts = []
        for local in range(per):  # the ranks of one local index, node after node
            node_sums = [fold([p[local * piece:(local + 1) * piece] for p in node])
                         for node in nodes]
            parts.append(coded_all_reduce(node_sums, codec))
        return torch.cat(parts)[:n]

    def _group_sum(self, rows: list[torch.Tensor], u: Unit) -> torch.Tensor:
        """One shard's sum over a shard group (rows in group-rank order)."""
        codec = u.wire.grads
        if codec is None:
            return fold(rows)
        if not u.wire.routed:
            return decoded_sum(rows, codec)
        per = self.layout.per_node
        node_sums = [fold(rows[i:i + per]) for i in range(0, len(rows), per)]
        return decoded_sum(node_sums, codec)

    def step_accumulated(self, xs: list[torch.Tensor],
                         loss_of: Callable[[torch.Tensor], torch.Tensor],
                         cast_input: torch.dtype | None = None,
                         no_sync: int = 0,
                         before: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """One optimizer step over the micro-batches ``xs`` with sharded
        accumulation (hybrid): the first ``no_sync`` are not reduced (their
        local gradients add up, as under ``no_sync()``), the others are
        reduced over the shard group and added in float32, the last all-reduced
        over the replicas; ``before(i)`` runs before micro-batch ``i``.  Returns
        the losses."""
        self.load_compute()
        partial: dict[int, torch.Tensor] = {}
        unreduced: dict[int, torch.Tensor] = {}
        losses = []
        world = dist.get_world_size()
        for i, x in enumerate(xs):
            if before is not None:
                before(i)
            self.compute.zero_grad(set_to_none=True)
            inp = x.to(cast_input) if cast_input is not None and x.is_floating_point() else x
            loss = loss_of(self.compute(inp))
            loss.backward()
            losses.append(loss.detach())
            cgrads = {n: p.grad for n, p in self.cparams.items() if p.grad is not None}
            for k, u in enumerate(self.units):
                if not u.trainable:
                    continue
                local = self._flat(u, cgrads, u.compute_dtype)
                if k in unreduced:
                    local = unreduced.pop(k).add_(local)
                if i < no_sync:
                    unreduced[k] = local
                    continue
                everyone = [torch.empty_like(local) for _ in range(world)]
                dist.all_gather(everyone, local)
                part = self.reduce(u, everyone, replicas=False)
                if k not in partial:
                    partial[k] = part.to(torch.promote_types(part.dtype, torch.float32))
                else:
                    partial[k].add_(part)
        for k, u in enumerate(self.units):
            if k not in partial:
                continue
            everyone = [torch.empty_like(partial[k]) for _ in range(world)]
            dist.all_gather(everyone, partial[k])
            per_group = [everyone[g[0]] for g in self.layout.shard_groups]
            mean = self.sum_over_replicas(u, per_group, cast=True)
            for name, off, n in zip(u.names, u.offsets, u.numels):
                p = self.params[name]
                p.grad = mean[off:off + n].view(p.shape).to(p.dtype).clone()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return losses

    def step(self, x: torch.Tensor, loss_of: Callable[[torch.Tensor], torch.Tensor],
             cast_input: torch.dtype | None = None) -> torch.Tensor:
        """One optimizer step on this rank's ``x``; returns the loss."""
        self.load_compute()
        self.compute.zero_grad(set_to_none=True)
        inp = x.to(cast_input) if cast_input is not None and x.is_floating_point() else x
        loss = loss_of(self.compute(inp))
        loss.backward()
        cgrads = {n: p.grad for n, p in self.cparams.items() if p.grad is not None}
        for u in self.units:
            if not u.trainable:
                continue
            local = self._flat(u, cgrads, u.compute_dtype)
            everyone = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, local)
            mean = self.reduce(u, everyone)
            if not u.wire.is_exact and u.trainable:
                self._moved("grads", mean, self.reduce(dataclasses.replace(u, wire=EXACT_CODING),
                                                       everyone))
            for name, off, n in zip(u.names, u.offsets, u.numels):
                p = self.params[name]
                p.grad = mean[off:off + n].view(p.shape).to(p.dtype).clone()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


# ---------------------------------------------------------------------------
# building a model pair for a configuration (tests of quantization and accumulation)
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def nodes_of(per_node: int | None) -> Iterator[None]:
    """Inside: the environment torchrun gives ``per_node`` ranks per node
    (``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``; ``None``: unset); restored after."""
    saved = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    if per_node is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        os.environ.pop("LOCAL_RANK", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
        os.environ["LOCAL_RANK"] = str(dist.get_rank() % per_node)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_MESHES: dict[int, tuple[Any, Any]] = {}


def mesh_2x2() -> Any:
    """A ``(replicate, shard)`` mesh over 4 ranks, made once per process group
    (each new mesh creates process groups: slow on a busy machine)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.distributed_c10d._get_default_group()
    cached = _MESHES.get(id(world))
    if cached is None or cached[0] is not world:
        cached = (world, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
        _MESHES[id(world)] = cached
    return cached[1]


def model_input(model: str, gen: torch.Generator) -> torch.Tensor:
    from tests.models import float_input, transformer_input

    return float_input(gen) if model == "lora" else transformer_input(gen)


class SkippingTransformer(nn.Module):
    """``TinyTransformer`` whose block ``skip`` (an attribute, ``None``: none)
    is left out of the forward: a unit unused in some micro-batches."""

    def __init__(self) -> None:
        from tests.models import TinyTransformer

        super().__init__()
        self.inner = TinyTransformer()
        self.skip: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.inner
        h = t.emb(x)
        for i, b in enumerate(t.blocks):
            if i != self.skip:
                h = b(h)
        return t.head(t.norm(h) * t.scale)


def build_pair(cfg: dict[str, Any], lr: float = 0.1) -> tuple[nn.Module, Emulation,
                                                                torch.optim.Optimizer]:
    """fsdp_wrap and its :class:`Emulation` for ``cfg``: ``model``
    ("transformer" | "lora"), ``strategy``, ``uop``, optional ``groups``
    ("mesh" | "tuple": hybrid 2 x 2), ``mp`` (a dtype: param, reduce and buffer
    dtype; "reduce": fp32 compute, bf16 reduction), ``offload``, ``quant``,
    ``cap``, ``batch``, ``limit``; SGD at ``lr`` on both."""
    import fsdp_wrap
    from tests.models import LoraNet, TinyTransformer, lora_policy, transformer_policy

    torch.manual_seed(cfg.get("seed", 0))
    base: nn.Module = (SkippingTransformer() if cfg["model"] == "skipping"
                       else TinyTransformer() if cfg["model"] == "transformer" else LoraNet())
    policy = lora_policy("ours") if cfg["model"] == "lora" else transformer_policy("ours")
    kw: dict[str, Any] = dict(
        sharding_strategy=fsdp_wrap.ShardingStrategy[cfg["strategy"]],
        use_orig_params=cfg["uop"], auto_wrap_policy=policy,
        bucket_cap_mb=cfg.get("cap"), all_gather_batch_mb=cfg.get("batch"),
        limit_all_gathers=cfg.get("limit", True),
        quantize_collectives=cfg.get("quant") or "off")
    hybrid = "HYBRID" in cfg["strategy"]
    if hybrid:
        mesh = mesh_2x2()
        if cfg.get("groups", "mesh") == "mesh":
            kw["device_mesh"] = mesh
        else:
            kw["process_group"] = (mesh.get_group("shard"), mesh.get_group("replicate"))
    mp, buffer_dtype = cfg.get("mp"), None
    plan = Plan(cfg["strategy"], cfg.get("quant"))
    if mp == "reduce":
        kw["mixed_precision"] = fsdp_wrap.MixedPrecision(reduce_dtype=torch.bfloat16)
        plan = dataclasses.replace(plan, reduce_dtype=torch.bfloat16)
    elif mp is not None:
        kw["mixed_precision"] = fsdp_wrap.MixedPrecision(param_dtype=mp, reduce_dtype=mp,
                                                         buffer_dtype=mp)
        buffer_dtype = mp
        plan = dataclasses.replace(plan, param_dtype=mp, reduce_dtype=mp)
    if cfg.get("offload"):
        kw["cpu_offload"] = fsdp_wrap.CPUOffload(offload_params=True)
    ours = fsdp_wrap.FullyShardedDataParallel(copy.deepcopy(base), **kw)
    ours._lazy_init()
    emu = Emulation(base, ours, Layout(hybrid), plan, lambda ps: torch.optim.SGD(ps, lr=lr),
                    buffer_dtype=buffer_dtype)
    return ours, emu, torch.optim.SGD(ours.parameters(), lr=lr)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """An fsdp_wrap model's full parameters by clean name (an exact gather)."""
    import fsdp_wrap

    with fsdp_wrap.FullyShardedDataParallel.summon_full_params(model, writeback=False):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()}
