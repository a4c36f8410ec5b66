"""Read the ranks' profiles of a few steps: each unit's collectives on a time axis.

Input: ``trace_rank{R}.json`` files (``torch.profiler``'s Chrome/Perfetto
JSON, as ``$FSDP_WRAP_TRACE`` writes them: :mod:`fsdp_wrap.runtime.step_trace`).
Every rank's times are put on one clock (the profile's ``baseTimeNanoseconds``
plus each event's ``ts``: the host's clock, shared by the ranks of one
machine, the test bed's namespaces included).

What is read (:mod:`fsdp_wrap.comm.labels` names the labels):

* the steps: ``ProfilerStep#k`` spans;
* communication: the spans of ``FSDP::all_gather``, ``FSDP::all_gather_wait``,
  ``FSDP::post_backward_reduce`` and ``FSDP::post_backward_rs_wait``, with the
  units each names.  An asynchronous gather is *in flight* from its
  ``all_gather`` (the issue) to the end of the next ``all_gather_wait`` of
  its unit;
* the phases: forward until the step's first ``FSDP::pre_backward``,
  backward until the end of ``FSDP::root_post_backward_callback``, then the
  rest (the optimizer step, loading the next batch).

**Exposed communication** is the time the training thread spends inside
those four labels (issuing a collective, doing a synchronous one, or waiting
for one in flight), overlaps counted once: the communication compute did not
hide.  Communication in flight meanwhile is hidden.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Comm", "Phase", "RankTimeline", "StepStats", "Timeline", "load", "merge_traces"]

GATHER_LABELS = ("FSDP::all_gather", "FSDP::all_gather_wait")
REDUCE_LABELS = ("FSDP::post_backward_reduce", "FSDP::post_backward_rs_wait")
_LABEL = re.compile(r"^(FSDP::[a-z_]+)(?: \((.*)\))?$")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


@dataclass(frozen=True)
class Comm:
    """One collective label on a rank: ``kind`` "gather" or "reduce"; ``wait``:
    a wait for one in flight; times in ms from the timeline's start."""

    kind: str
    units: tuple[str, ...]
    start: float
    end: float
    wait: bool
    in_flight_until: float  # (= end unless an asynchronous gather waited for later)


@dataclass(frozen=True)
class StepStats:
    step: int
    start: float
    end: float
    exposed_ms: float  # communication not hidden (see the module docstring)
    forward_ms: float
    backward_ms: float

    @property
    def ms(self) -> float:
        return self.end - self.start


class Phase(NamedTuple):
    """Part of a step: ``name`` "forward", "backward" or "other" (the rest)."""

    name: str
    start: float
    end: float


@dataclass
class RankTimeline:
    """One rank's steps, collectives and phases."""

    rank: int
    steps: list[StepStats] = field(default_factory=list)
    comms: list[Comm] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)


@dataclass
class Timeline:
    """Every rank's steps, collectives and phases, on one clock (ms from the first step)."""

    ranks: list[RankTimeline]
    units: list[str]  # in order of first appearance (colours follow it)

    def summary(self) -> str:
        """One line per step: its time and the exposed communication per rank, then the sums."""
        lines = []
        steps = min(len(r.steps) for r in self.ranks) if self.ranks else 0
        for i in range(steps):
            per = [r.steps[i] for r in self.ranks]
            cells = "  ".join(f"rank {r.rank}: {s.ms:7.1f} ms, exposed {s.exposed_ms:6.1f} ms "
                              f"({s.exposed_ms / max(s.ms, 1e-9):4.0%})"
                              for r, s in zip(self.ranks, per))
            lines.append(f"step {i + 1}: {cells}")
        for r in self.ranks:
            total = sum(s.ms for s in r.steps[:steps])
            exposed = sum(s.exposed_ms for s in r.steps[:steps])
            lines.append(f"rank {r.rank}: {steps} steps {total:.1f} ms, exposed communication "
                         f"{exposed:.1f} ms ({exposed / max(total, 1e-9):.0%}), per step "
                         f"{total / max(steps, 1):.1f} ms / {exposed / max(steps, 1):.1f} ms")
        return "\n".join(lines)

    def mean_per_step(self) -> tuple[float, float]:
        """(step ms, exposed communication ms), averaged over steps and ranks."""
        steps = [s for r in self.ranks for s in r.steps]
        if not steps:
            return 0.0, 0.0
        return (sum(s.ms for s in steps) / len(steps),
                sum(s.exposed_ms for s in steps) / len(steps))


def load(paths: str | Sequence[str]) -> Timeline:
    """The timeline of a directory of ``trace_rank*.json`` files, or of those files."""
    files = sorted(glob.glob(os.path.join(paths, "trace_rank*.json"))) \
        if isinstance(paths, str) else list(paths)
    if not files:
        raise FileNotFoundError(f"no trace_rank*.json in {paths!r}: did the run reach its "
                                "profiled steps (a forward with grad after the warm-up ones)?")
    raw = [(_rank_of(f), _events(f)) for f in files]
    origin = min((e["t0"] for _, evs in raw for e in evs if _STEP.match(e["name"])), default=0.0)
    ranks, units = [], _Units()
    for rank, events in sorted(raw):
        ranks.append(_rank_timeline(rank, events, origin, units))
    return Timeline(ranks, units.order)


def merge_traces(paths: Iterable[str], out: str) -> None:
    """One Chrome/Perfetto JSON of every rank (a process per rank, named
    ``rank R``; times on the shared clock), for viewing the ranks together."""
    merged: list[dict[str, Any]] = []
    base: float | None = None
    for path in sorted(paths):
        rank = _rank_of(path)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        offset_us = data.get("baseTimeNanoseconds", 0) / 1000.0
        base = offset_us if base is None else min(base, offset_us)
        merged.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        for e in data.get("traceEvents", []):
            if not isinstance(e, dict) or "ph" not in e:
                continue
            e = dict(e, pid=rank)
            if "ts" in e:
                e["ts"] = float(e["ts"]) + offset_us
            merged.append(e)
    for e in merged:  # (small numbers again: the earliest base is 0)
        if "ts" in e and base is not None:
            e["ts"] -= base
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)


# ------------------------------------------------------------------ reading


class _Units:
    def __init__(self) -> None:
        self.order: list[str] = []

    def note(self, names: Iterable[str]) -> None:
        for n in names:
            if n not in self.order:
                self.order.append(n)


def _rank_of(path: str) -> int:
    m = re.search(r"trace_rank(\d+)\.json$", os.path.basename(path))
    return int(m.group(1)) if m else 0


def _events(path: str) -> list[dict[str, Any]]:
    """The complete ("X") events with names, their times in absolute ms."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    base_ms = data.get("baseTimeNanoseconds", 0) / 1e6
    out = []
    for e in data.get("traceEvents", []):
        if not isinstance(e, dict) or e.get("ph") != "X" or "name" not in e:
            continue
        t0 = base_ms + float(e["ts"]) / 1000.0
        out.append({"name": e["name"], "t0": t0, "t1": t0 + float(e.get("dur", 0)) / 1000.0,
                    "tid": e.get("tid")})
    return out


def _rank_timeline(rank: int, events: list[dict[str, Any]], origin: float,
                   units: _Units) -> RankTimeline:
    steps = sorted(((int(m.group(1)), e) for e in events if (m := _STEP.match(e["name"]))),
                   key=lambda x: x[1]["t0"])
    labels = sorted((e for e in events if _LABEL.match(e["name"])), key=lambda e: e["t0"])
    comms = _comms(labels, origin, units)
    out = RankTimeline(rank, comms=comms)
    for i, (_, e) in enumerate(steps):
        s, t = e["t0"] - origin, e["t1"] - origin
        mine = [c for c in comms if c.start < t and c.end > s]
        fwd_end, bwd_end = _phase_ends(labels, e["t0"], e["t1"], origin)
        out.steps.append(StepStats(i + 1, s, t, _union(mine, s, t), fwd_end - s,
                                   bwd_end - fwd_end))
        out.phases += [Phase("forward", s, fwd_end), Phase("backward", fwd_end, bwd_end),
                       Phase("other", bwd_end, t)]
    return out


def _comms(labels: list[dict[str, Any]], origin: float, units: _Units) -> list[Comm]:
    out: list[Comm] = []
    issued: dict[str, int] = {}  # unit -> index in ``out`` of its gather awaiting a wait
    for e in labels:
        m = _LABEL.match(e["name"])
        if m is None or m.group(1) not in GATHER_LABELS + REDUCE_LABELS:
            continue
        label, who = m.group(1), tuple((m.group(2) or "").split(", ")) if m.group(2) else ()
        units.note(who)
        start, end = e["t0"] - origin, e["t1"] - origin
        kind = "gather" if label in GATHER_LABELS else "reduce"
        wait = label.endswith("_wait")
        if label == "FSDP::all_gather_wait":
            for u in who:  # the issue it waits for was in flight until now
                j = issued.pop(u, None)
                if j is not None and out[j].in_flight_until < end:
                    c = out[j]
                    out[j] = Comm(c.kind, c.units, c.start, c.end, c.wait, end)
        out.append(Comm(kind, who, start, end, wait, end))
        if label == "FSDP::all_gather":
            for u in who:
                issued[u] = len(out) - 1
    return out


def _phase_ends(labels: list[dict[str, Any]], t0: float, t1: float,
                origin: float) -> tuple[float, float]:
    """Where the step's forward and backward end (ms from ``origin``)."""
    inside = [e for e in labels if t0 <= e["t0"] < t1]
    pre_bwd = [e["t0"] for e in inside if e["name"].startswith("FSDP::pre_backward")]
    post = [e["t1"] for e in inside if e["name"] == "FSDP::root_post_backward_callback"]
    fwd_end = min(pre_bwd) if pre_bwd else t1
    bwd_end = max(post) if post else fwd_end
    return fwd_end - origin, max(bwd_end, fwd_end) - origin


def _union(comms: list[Comm], lo: float, hi: float) -> float:
    """Total length of the comms' spans within ``[lo, hi)``, overlaps once."""
    spans = sorted((max(c.start, lo), min(c.end, hi)) for c in comms)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return total
