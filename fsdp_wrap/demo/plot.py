"""The demo's picture: the loss of both runs and the training speed, step by step."""

from __future__ import annotations

from fsdp_wrap._compat import matplotlib_figure


def plot_losses(baseline: dict[int, float], resumed: dict[int, float],
                tokens_per_s: dict[int, float], path: str, title: str) -> None:
    """Write the loss curves (uninterrupted, and resumed from the checkpoint on top of
    it) and the tokens/s of the uninterrupted run to ``path`` (PNG, SVG or PDF).

    Raises:
        ImportError: without matplotlib (saying how to get it).
    """
    Figure = matplotlib_figure("the demo's loss plot")
    fig = Figure(figsize=(9, 6), layout="constrained")
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    steps = sorted(baseline)
    loss_ax.plot(steps, [baseline[i] for i in steps], color="#2171b5", marker=".",
                 label="uninterrupted")
    again = sorted(resumed)
    loss_ax.plot(again, [resumed[i] for i in again], color="#d94801", linestyle="none",
                 marker="x", label="resumed from the checkpoint")
    if again:
        loss_ax.axvline(again[0] - 0.5, color="#888888", linestyle=":",
                        label=f"checkpoint (step {again[0] - 1})")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(title)
    loss_ax.legend()
    speed_ax.plot(steps, [tokens_per_s.get(i, float("nan")) for i in steps], color="#238b45",
                  marker=".")
    speed_ax.set_ylabel("tokens/s (all ranks)")
    speed_ax.set_xlabel("step")
    speed_ax.set_ylim(bottom=0)
    fig.savefig(path)
