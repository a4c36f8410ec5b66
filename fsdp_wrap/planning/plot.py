"""A picture of a plan: one rank's device memory over one training step.

:func:`plot_plan` draws :attr:`RankMemory.timeline <fsdp_wrap.planning.RankMemory.timeline>`
on top of what the rank holds all the time (its parameter shards, optimizer
state and ignored tensors), moment by moment: forward unit by unit, backward
unit by unit (gradients appearing, buckets filling), the optimizer step.  The
highest point is the plan's ``peak_device``; ``gpu_memory`` draws the device's
capacity, so one sees where the peak is, how far it is from the limit and what
makes it (a phase, a unit).  Needs matplotlib (an optional extra).
"""

from __future__ import annotations

from fsdp_wrap._compat import matplotlib_figure
from fsdp_wrap.planning._report import Plan

GIB = 2**30


def plot_plan(plan: Plan, path: str, *, gpu_memory_gib: float | None = None,
              title: str | None = None) -> float:
    """Write the plan's memory over one step as a picture (PNG, SVG or PDF by ``path``).

    Returns the plotted peak in bytes (equal to ``plan.memory.peak_device``).
    """
    Figure = matplotlib_figure("fsdp-wrap plan --plot")
    m = plan.memory
    held = m.params_device + m.optimizer_device + m.ignored_device
    labels = [label for label, _ in m.timeline]
    total = [held + b for _, b in m.timeline]
    x = list(range(len(total)))
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.fill_between(x, 0, [held / GIB] * len(x), step="mid", color="#9ecae1",
                    label="parameter shards + optimizer state")
    ax.fill_between(x, [held / GIB] * len(x), [t / GIB for t in total], step="mid",
                    color="#fdae6b", label="in flight: unsharded parameters, gradients, buffers")
    ax.step(x, [t / GIB for t in total], where="mid", color="#d94801", linewidth=1)
    peak_at = max(x, key=lambda i: total[i]) if x else 0
    peak = total[peak_at] if x else held
    ax.annotate(f"peak {peak / GIB:.2f} GiB\n{labels[peak_at] if x else ''}",
                xy=(peak_at, peak / GIB), xytext=(0.02, 0.95), textcoords="axes fraction",
                va="top", arrowprops={"arrowstyle": "->", "color": "#555555"})
    if gpu_memory_gib is not None:
        ax.axhline(gpu_memory_gib, color="#cb181d", linestyle="--",
                   label=f"device memory ({gpu_memory_gib:g} GiB)")
    _phase_ticks(ax, labels)
    ax.set_ylabel("GiB per rank (activations not counted)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or _title(plan))
    ax.legend(loc="lower right", fontsize="small")
    fig.savefig(path)
    return float(peak)


def _phase_ticks(ax: object, labels: list[str]) -> None:
    """Ticks where each phase starts (forward, backward, end of backward, optimizer step)."""
    ticks, names, last = [], [], None
    for i, label in enumerate(labels):
        phase = label.split(" ", 1)[0] if not label.startswith("end") else "end"
        if phase != last:
            ticks.append(i)
            names.append({"end": "end of backward", "optimizer": "optimizer step"}.get(
                phase, phase))
            last = phase
    ax.set_xticks(ticks, names)  # type: ignore[attr-defined]
    ax.set_xlabel("one training step, unit by unit")  # type: ignore[attr-defined]


def _title(plan: Plan) -> str:
    s = plan.settings
    return (f"{plan.total_params:,} parameters, {len(plan.units)} units, {s['sharding_strategy']}"
            f" on {plan.world_size} ranks, {s['param_dtype']} compute")
