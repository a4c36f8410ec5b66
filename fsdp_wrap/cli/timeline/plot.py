"""The step timeline picture: per rank, compute, all-gathers and reductions per unit."""

from __future__ import annotations

from fsdp_wrap._compat import matplotlib_figure
from fsdp_wrap.cli.timeline.analysis import Comm, Timeline

__all__ = ["plot_timeline"]

_PHASE_COLOURS = {"forward": "#c6dbef", "backward": "#fdd0a2", "other": "#e5e5e5"}
_LANES = ("compute", "all-gathers", "reductions")


def plot_timeline(timeline: Timeline, path: str, title: str = "") -> None:
    """Write the picture of ``timeline`` to ``path`` (PNG, SVG or PDF).

    One band per rank, three lanes each: the phases of every step (forward,
    backward, the rest: optimizer step, next batch), the all-gathers and the
    reductions, a colour per unit.  A solid bar is exposed communication (the
    training thread issues, does or waits for a collective); a light bar
    behind it is a gather in flight while compute runs (asynchronous).
    Dotted lines mark the steps; the title gives the exposed communication
    per step.

    Raises:
        ImportError: without matplotlib (saying how to get it).
    """
    Figure = matplotlib_figure("fsdp-wrap trace's timeline picture")
    n = len(timeline.ranks)
    fig = Figure(figsize=(14, 0.9 + 1.25 * n), layout="constrained")
    ax = fig.subplots()
    colours = _unit_colours(timeline.units)
    span = max((s.end for r in timeline.ranks for s in r.steps), default=1.0)
    ticks, names = [], []
    for i, r in enumerate(timeline.ranks):
        base = (n - 1 - i) * 4  # (rank 0 on top)
        y = {lane: base + 2 - k for k, lane in enumerate(_LANES)}
        for name, lo, hi in r.phases:
            if hi > lo:
                ax.broken_barh([(lo, hi - lo)], (y["compute"] - 0.4, 0.8),
                               facecolors=_PHASE_COLOURS[name], edgecolor="none")
        for c in r.comms:
            row = y["all-gathers" if c.kind == "gather" else "reductions"]
            colour = colours.get(c.units[0], "#777777") if c.units else "#777777"
            if c.in_flight_until > c.end:
                ax.broken_barh([(c.start, c.in_flight_until - c.start)], (row - 0.25, 0.5),
                               facecolors=colour, alpha=0.3, edgecolor="none")
            ax.broken_barh([(c.start, max(c.end - c.start, 1e-3))], (row - 0.4, 0.8),
                           facecolors=colour, edgecolor="black" if c.wait else "none",
                           linewidth=0.4)
            _name(ax, c, row, span)
        for s in r.steps:
            ax.axvline(s.start, color="#555555", linestyle=":", linewidth=0.8)
        for lane in _LANES:
            ticks.append(y[lane])
            names.append(f"rank {r.rank}  {lane}")
    ax.set_yticks(ticks, names, fontsize=8)
    _legend(ax, colours)
    ax.set_xlabel("ms")
    ax.set_xlim(0, span)
    step_ms, exposed_ms = timeline.mean_per_step()
    head = title or "fsdp_wrap step timeline"
    ax.set_title(f"{head}\nper step: {step_ms:.1f} ms, exposed communication {exposed_ms:.1f} ms "
                 f"({exposed_ms / max(step_ms, 1e-9):.0%}); solid: exposed, light: in flight",
                 fontsize=10)
    fig.savefig(path, dpi=110)


def _unit_colours(units: list[str]) -> dict[str, str]:
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf"]
    return {u: palette[i % len(palette)] for i, u in enumerate(units)}


def _name(ax: object, c: Comm, lane: float, span: float) -> None:
    """The unit's name on a solid bar wide enough to hold it."""
    width = c.end - c.start
    if width < span / 40 or not c.units:
        return
    text = c.units[0] if len(c.units) == 1 else f"{c.units[0]}+{len(c.units) - 1}"
    ax.text(c.start + width / 2, lane, text, ha="center", va="center",  # type: ignore[attr-defined]
            fontsize=6, clip_on=True)


def _legend(ax: object, colours: dict[str, str]) -> None:
    """The phases' and the units' colours, outside the plot on the right."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, label=name) for name, c in _PHASE_COLOURS.items()]
    handles += [Patch(facecolor=c, label=unit) for unit, c in colours.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0),  # type: ignore[attr-defined]
              fontsize=7, frameon=False, ncols=1 + len(handles) // 14)
