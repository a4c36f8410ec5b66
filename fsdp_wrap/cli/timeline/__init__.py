"""See the overlap: a picture of a few training steps, per rank and per unit.

``fsdp-wrap trace`` (``fsdp_wrap.cli.trace``) profiles a few steps of a
training script, or of the demo's GPT, and writes, in its output directory:

* ``trace_rank{R}.json``: each rank's ``torch.profiler`` trace (Chrome /
  Perfetto JSON, TensorBoard's profiler plugin reads it too), in which
  fsdp_wrap's labels (``fsdp_wrap.comm.labels``) name every unit's
  all-gathers, reductions and hooks;
* ``trace.json``: the ranks' traces merged on one clock (a process per rank);
* ``timeline.png``: per rank, the phases of each step, the all-gathers and
  the reductions, a colour per unit, exposed and in-flight communication
  told apart (:func:`plot_timeline`), and the exposed communication per step.

In a script, the same from Python::

    import fsdp_wrap.cli.timeline as tl

    # run the training with FSDP_WRAP_TRACE=DIR (fsdp_wrap.runtime.step_trace), then:
    timeline = tl.load("DIR")          # every rank's steps and collectives
    print(timeline.summary())          # step time and exposed communication per step
    tl.plot_timeline(timeline, "DIR/timeline.png")

This package is a tool above the library; nothing in the library imports it.
"""

from fsdp_wrap.cli.timeline.analysis import (
    Comm,
    Phase,
    RankTimeline,
    StepStats,
    Timeline,
    load,
    merge_traces,
)
from fsdp_wrap.cli.timeline.plot import plot_timeline

__all__ = ["Comm", "Phase", "RankTimeline", "StepStats", "Timeline", "load", "merge_traces",
           "plot_timeline"]
