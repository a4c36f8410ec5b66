"""``fsdp-wrap trace [-- CMD ...]``: a picture of a few training steps, per rank and unit.

With a command, it runs it with ``$FSDP_WRAP_TRACE`` set, so the script's
first FSDP root profiles its steps (:mod:`fsdp_wrap.runtime.step_trace`);
without one, it profiles the demo's GPT on local ranks
(:mod:`fsdp_wrap.cli.timeline.run`).  Then it merges the ranks' traces, draws
the timeline and prints the exposed communication per step
(:mod:`fsdp_wrap.cli.timeline`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any

from fsdp_wrap.cli._common import CommandError, add_command, usage_error

DESCRIPTION = """\
Profile a few training steps and draw them: per rank, the forward, backward
and the rest of each step, and every FSDP unit's all-gathers and reductions
on a time axis (a colour per unit; solid: exposed communication, the
training thread waits for it; light: in flight behind compute).  Writes
OUT/timeline.png, OUT/trace.json (every rank, for Perfetto or
chrome://tracing) and OUT/trace_rank*.json (torch.profiler's, one per rank),
and prints each step's time and exposed communication.

With CMD, the command runs with FSDP_WRAP_TRACE=OUT: in every process the
first FSDP root profiles steps W+1..W+N (a step: from one forward with grad
to the next).  Without CMD, the demo's GPT trains on local CPU ranks (or, under
torchrun, this process is one rank: fsdp-wrap cluster -- python -m fsdp_wrap
trace ...).  Needs matplotlib for the picture (pip install matplotlib).

examples:
  fsdp-wrap trace --out /tmp/tl                           # the demo, 2 CPU ranks
  fsdp-wrap trace --prefetch-ahead 2 --no-limit-all-gathers
  fsdp-wrap trace --out /tmp/tl -- torchrun --nproc-per-node 2 train.py
  fsdp-wrap cluster --nodes 2 --rate 100mbit -- python -m fsdp_wrap trace --out /tmp/tl
"""


def add_parser(sub: Any) -> None:
    p = add_command(sub, "trace", help="profile a few steps and draw each unit's gathers and "
                    "reductions per rank on a time axis", description=DESCRIPTION)
    p.add_argument("--out", default=None,
                   help="output directory (default: a new temporary directory, kept)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the profiled ones")
    p.add_argument("--steps", type=int, default=3, help="steps profiled")
    p.add_argument("--title", default=None, help="the picture's title")
    demo = p.add_argument_group("the demo (without CMD)")
    demo.add_argument("--nprocs", type=int, default=2, help="local ranks to spawn")
    demo.add_argument("--layers", type=int, default=4, help="GPT blocks (one FSDP unit each)")
    demo.add_argument("--width", type=int, default=128, help="model width")
    demo.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    demo.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    demo.add_argument("--strategy", default="FULL_SHARD",
                      choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
                      help="the sharding strategy")
    demo.add_argument("--prefetch-ahead", type=int, default=0,
                      help="FSDP2's explicit prefetch: each unit gathers the next K units "
                      "(0: the default schedule)")
    demo.add_argument("--no-limit-all-gathers", action="store_true",
                      help="limit_all_gathers=False: asynchronous all-gathers on CPU")
    demo.add_argument("--all-gather-batch-mb", type=float, default=None,
                      help="all_gather_batch_mb (default: fsdp_wrap's)")
    demo.add_argument("--bucket-cap-mb", type=float, default=None,
                      help="bucket_cap_mb (default: fsdp_wrap's)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD ...",
                   help="the training command ('--' before it); none: the demo")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fsdp_wrap.runtime.step_trace import ENV_DIR, ENV_STEPS

    if args.warmup < 0 or args.steps < 1:
        usage_error(f"--warmup {args.warmup} --steps {args.steps}: need 0 or more warm-up "
                    "steps and at least 1 profiled step")
    if args.out is None and os.environ.get("RANK") and not args.cmd:
        usage_error("under torchrun every rank must write to one directory: give --out DIR "
                    "(on a file system every node sees)")
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="fsdp_wrap_trace_"))
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else list(args.cmd)
    os.makedirs(out, exist_ok=True)
    if cmd:
        _clear(out)
        env = dict(os.environ, **{ENV_DIR: out, ENV_STEPS: f"{args.warmup},{args.steps}"})
        if cmd[0].endswith(".py"):
            cmd = [sys.executable, *cmd]
        try:
            code = subprocess.call(cmd, env=env)
        except FileNotFoundError:
            raise CommandError(f"command not found: {cmd[0]}") from None
        if code != 0:
            raise CommandError(f"the command exited with code {code}; no picture drawn "
                               f"(its traces, if any, are in {out})")
    else:
        from fsdp_wrap.cli.timeline.run import DemoTrace, run_demo

        if args.nprocs < 1 or args.prefetch_ahead < 0:
            usage_error("--nprocs must be positive and --prefetch-ahead 0 or more")
        cfg = DemoTrace(
            out=out, nprocs=args.nprocs, warmup=args.warmup, steps=args.steps,
            layers=args.layers, width=args.width, seq_len=args.seq_len, batch=args.batch_size,
            strategy=args.strategy, prefetch_ahead=args.prefetch_ahead,
            limit_all_gathers=not args.no_limit_all_gathers,
            all_gather_batch_mb=args.all_gather_batch_mb, bucket_cap_mb=args.bucket_cap_mb)
        if not os.environ.get("RANK"):
            _clear(out)
        if not run_demo(cfg):
            return 0  # (a rank under torchrun other than the first: rank 0 draws)
    return draw(out, args.title or "")


def draw(out: str, title: str = "") -> int:
    """Merge, analyse and draw ``out``'s traces; print the summary."""
    import glob

    import fsdp_wrap.cli.timeline as tl

    files = sorted(glob.glob(os.path.join(out, "trace_rank*.json")))
    try:
        timeline = tl.load(files)
    except FileNotFoundError as e:
        raise CommandError(str(e)) from None
    if not any(r.steps for r in timeline.ranks):
        raise CommandError(f"the traces in {out} hold no step: did the run reach its profiled "
                           "steps (a forward with grad after the warm-up ones)?")
    tl.merge_traces(files, os.path.join(out, "trace.json"))
    print(timeline.summary())
    picture = os.path.join(out, "timeline.png")
    try:
        tl.plot_timeline(timeline, picture, title)
    except ImportError as e:
        print(f"picture: skipped ({e})", file=sys.stderr)
        return 0
    print(f"wrote {picture} and {os.path.join(out, 'trace.json')} (all ranks; Perfetto)")
    return 0


def _clear(out: str) -> None:
    """Old profiles in ``out`` would be read as this run's."""
    for name in os.listdir(out):
        if name.startswith("trace_rank") and name.endswith(".json"):
            os.remove(os.path.join(out, name))
