"""Warnings a person can act on, and the plan's tables as plain text."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fsdp_wrap.planning._memory import RankMemory
from fsdp_wrap.planning._units import UnitPlan

#: A unit whose unsharded parameters are smaller than this is mostly collective latency.
SMALL_UNIT_BYTES = 1 << 20
#: The root holding more than this share of the parameters means the policy wraps too little.
ROOT_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``FullyShardedDataParallel(model, ...)`` would build, and the memory it needs."""

    units: tuple[UnitPlan, ...]  # root first, then in module order
    world_size: int
    shard_size: int  # ranks one flat parameter is sharded over
    replicate_size: int  # hybrid strategies: shard groups holding replicas
    optimizer: str
    settings: dict[str, Any]
    memory: RankMemory  # the rank needing the most device memory
    per_rank: tuple[RankMemory, ...]  # every rank of one shard group (they differ only
    # in optimizer state with use_orig_params=True); rank 0 alone otherwise
    warnings: tuple[str, ...]

    @property
    def total_params(self) -> int:
        return sum(u.numel for u in self.units)

    def table(self) -> str:
        return render(self)

    def __str__(self) -> str:
        return render(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for ``json.dumps``): settings, units, per-rank bytes, the
        schedule (batches and buckets), warnings."""
        m = self.memory
        return {
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "replicate_size": self.replicate_size,
            "optimizer": self.optimizer,
            "settings": self.settings,
            "total_params": self.total_params,
            "units": [
                {
                    "fqn": u.fqn,
                    "module": u.module_type,
                    "params": u.numel,
                    "strategy": u.strategy.name,
                    "dtype": _dtypes(u),
                    "trainable_params": sum(f.numel for f in u.flats if f.requires_grad),
                    "flat_numel": sum(f.layout.unpadded_numel for f in u.flats),
                    "padded_numel": sum(f.layout.padded_numel for f in u.flats),
                    "shard_numel": sum(f.layout.shard_numel for f in u.flats),
                    "unsharded_bytes": u.unsharded_bytes,
                    "shard_bytes": u.shard_bytes,
                    "flat_params": [
                        {"dtype": _dtype(f.dtype), "requires_grad": f.requires_grad,
                         "params": f.numel, "flat_numel": f.layout.unpadded_numel,
                         "padded_numel": f.layout.padded_numel,
                         "shard_numel": f.layout.shard_numel,
                         "quantized_params": len(f.quantized_numels)}
                        for f in u.flats
                    ],
                }
                for u in self.units
            ],
            "memory": {
                **{f.name: getattr(m, f.name) for f in dataclasses.fields(m)
                   if f.name != "schedule"},
                "persistent_device": m.persistent_device,
                "persistent_cpu": m.persistent_cpu,
                "unsharded_peak": m.unsharded_peak,
                "peak_device": m.peak_device,
            },
            # which flat parameters gather together, which gradients share a
            # bucket: ``[unit FQN, index in flat_params]`` each
            "schedule": dataclasses.asdict(m.schedule),
            "warnings": list(self.warnings),
        }



def _dtype(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _dtypes(u: UnitPlan) -> str:
    """The unit's dtype, or its flat parameters' dtypes joined with ``+``."""
    return "+".join(dict.fromkeys(_dtype(f.dtype) for f in u.flats))


def find_warnings(units: Sequence[UnitPlan], world_size: int) -> list[str]:
    out: list[str] = []
    total = sum(u.numel for u in units)
    if not units or total == 0:
        return ["the model has no parameters FSDP would manage"]
    root = units[0] if units[0].fqn == "" else None
    if len(units) == 1 and root is not None:
        out.append(
            "one unit holds every parameter (no auto_wrap_policy, or it matched nothing): the "
            "whole model is gathered at once, so the peak is the full model. Pass an "
            "auto_wrap_policy, e.g. ModuleWrapPolicy({YourBlock}) or "
            "transformer_auto_wrap_policy."
        )
    elif root is not None and root.numel > ROOT_SHARE * total:
        out.append(
            f"the root unit holds {root.numel / total:.0%} of the parameters: the policy wraps "
            "too little. Make the modules that hold them units of their own (add their classes "
            "to the policy)."
        )
    small = [u for u in units if u.unsharded_bytes < SMALL_UNIT_BYTES]
    if len(small) >= 4 and len(small) > len(units) // 2:
        out.append(
            f"{len(small)} of {len(units)} units are smaller than "
            f"{SMALL_UNIT_BYTES >> 20} MiB unsharded: each costs its own collectives "
            "(all-gathers and a reduce-scatter, or an all-reduce), whose latency dominates "
            "so little data. Wrap larger modules "
            "(a parent class, or size_based_auto_wrap_policy with a larger min_num_params)."
        )
    if len(units) > 2:
        big = max(units, key=lambda u: u.numel)
        if big.numel > total - big.numel:
            out.append(
                f"unit '{big.fqn or '<root>'}' ({big.module_type}) holds {big.numel:,} "
                f"parameters, more than all other units together: its gather sets the peak. "
                "Split it into smaller units if its structure allows."
            )
    if all(not u.sharded for u in units):
        why = "the world size is 1" if world_size == 1 else "the strategy is NO_SHARD"
        out.append(
            f"nothing is sharded ({why}): every rank holds the whole model, its gradients and "
            "optimizer state. Use FULL_SHARD or SHARD_GRAD_OP over more than one rank."
        )
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A plain-text table with right-aligned numbers (reStructuredText-compatible)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    rule = "  ".join("=" * w for w in widths)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if i and _numeric(str(c)) else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([rule, line(header), rule, *(line(r) for r in rows), rule])


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] == "-") and cell not in ("-",)


def unit_rows(units: Sequence[UnitPlan]) -> list[list[str]]:
    """One row per unit; consecutive identical units (same class and sizes) share a row."""
    rows: list[list[str]] = []
    i = 0
    while i < len(units):
        u = units[i]
        j = i + 1
        while j < len(units) and _same_shape(units[j], u) and units[j].fqn and u.fqn:
            j += 1
        name = u.fqn or "<root>"
        if j - i > 1:
            name = f"{u.fqn} .. {units[j - 1].fqn} ({j - i} units)"
        trainable = sum(f.numel for f in u.flats if f.requires_grad)
        rows.append([
            name, u.module_type, f"{u.numel:,}",
            "all" if trainable == u.numel else f"{trainable:,}",
            _dtypes(u),
            fmt_bytes(u.unsharded_bytes),
            fmt_bytes(u.shard_bytes),
            u.strategy.name,
        ])
        i = j
    return rows


def _same_shape(a: UnitPlan, b: UnitPlan) -> bool:
    def shape(u: UnitPlan) -> tuple[Any, ...]:
        return (u.module_type, u.strategy,
                tuple((f.layout, f.dtype, f.requires_grad) for f in u.flats))

    return shape(a) == shape(b)


def render(plan: Plan) -> str:
    m = plan.memory
    s = plan.settings
    out = [
        f"FSDP plan: {plan.total_params:,} parameters in {len(plan.units)} units over "
        f"{plan.world_size} ranks"
        + (f" ({plan.replicate_size} replicas x {plan.shard_size} shard ranks)"
           if plan.replicate_size > 1 else ""),
        f"strategy {s['sharding_strategy']}, use_orig_params={s['use_orig_params']}, "
        f"offload_params={s['offload_params']}, param/reduce dtype {s['param_dtype']}/"
        f"{s['reduce_dtype']}, backward_prefetch {s['backward_prefetch']}, forward_prefetch="
        f"{s['forward_prefetch']}, optimizer {plan.optimizer}",
        "",
        table(unit_rows(plan.units),
              ["unit", "module", "params", "trainable", "dtype", "unsharded", "shard per rank",
               "strategy"]),
        "",
        f"per rank (the largest over ranks; rank {m.rank} shown){'' if s['offload_params'] else ''}:",
        table([
            ["parameters (sharded)", fmt_bytes(m.params_device), fmt_bytes(m.params_cpu)],
            ["gradients (sharded)", fmt_bytes(m.grads_device), fmt_bytes(m.grads_cpu)],
            ["optimizer state", fmt_bytes(m.optimizer_device), fmt_bytes(m.optimizer_cpu)],
            *([["ignored params, grads, state (whole)", fmt_bytes(m.ignored_device), "-"]]
              if m.ignored_device else []),
            *([["4-bit quantization states (whole)", fmt_bytes(m.quant_state_device), "-"]]
              if m.quant_state_device else []),
            ["held between steps", fmt_bytes(m.persistent_device), fmt_bytes(m.persistent_cpu)],
            ["+ unsharded in forward (peak)", fmt_bytes(m.unsharded_forward), "-"],
            ["+ unsharded and grads in backward (peak)", fmt_bytes(m.unsharded_backward), "-"],
            ["peak, without activations", fmt_bytes(m.peak_device), fmt_bytes(m.persistent_cpu)],
        ], ["", "device", "cpu"]),
    ]
    if plan.warnings:
        out += ["", "warnings:"] + [f"  * {w}" for w in plan.warnings]
    return "\n".join(out)
