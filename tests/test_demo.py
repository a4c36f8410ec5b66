"""The demo (``python -m fsdp_wrap.demo``) end to end, in subprocesses.

Each run spawns its own gloo ranks, trains, checkpoints, resumes in a fresh
model and compares the losses; the demo exits non-zero if they differ.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_wrap import demo
from fsdp_wrap.cli.demo import parse_args
from tests._proc import run_bounded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_LINE = re.compile(r"^train\s+\[[#.]+\] step\s+(\d+)/(\d+)\s+loss\s+(\S+)\s+([\d,]+) tok/s$")
TABLE_LINE = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(\S+)$")
RESUME_OK = re.compile(r"^resume: OK \(max \|diff\| = (\S+) over steps (\d+)\.\.(\d+)\)$")


def _run_demo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # never mistake pytest for torchrun
        env.pop(var, None)
    return run_bounded(
        [sys.executable, "-m", "fsdp_wrap.demo", *args],
        cwd=REPO, env=env, timeout=timeout,
    )


def _check_output(proc: subprocess.CompletedProcess[str], steps: int, k: int) -> list[float]:
    """Exit 0, one finite falling loss per step, and a resume table that matches."""
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    train = [m for m in map(TRAIN_LINE.match, lines) if m]
    assert [int(m.group(1)) for m in train] == list(range(1, steps + 1)), proc.stdout
    assert all(int(m.group(2)) == steps for m in train)
    losses = [float(m.group(3)) for m in train]
    assert all(math.isfinite(x) for x in losses), losses
    assert all(float(m.group(4).replace(",", "")) > 0 for m in train)
    # The synthetic task is learnable: the loss falls, from about ln(64).
    assert abs(losses[0] - math.log(64)) < 0.2, losses
    assert losses[-1] < losses[0] - 0.1, losses
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= (steps - 1) * 2 // 3, losses

    ok = [m for m in map(RESUME_OK.match, lines) if m]
    assert len(ok) == 1, proc.stdout
    assert float(ok[0].group(1)) <= demo.RESUME_TOLERANCE
    assert (int(ok[0].group(2)), int(ok[0].group(3))) == (k + 1, steps)
    header = lines.index("step   uninterrupted   resumed       |diff|")
    table = [TABLE_LINE.match(line) for line in lines[header + 1 : header + 1 + steps - k]]
    assert all(table), proc.stdout
    for m in table:
        assert m is not None
        step, base, resumed = int(m.group(1)), float(m.group(2)), float(m.group(3))
        assert abs(base - losses[step - 1]) < 1e-4  # the table repeats the first run's loss
        assert abs(resumed - base) <= demo.RESUME_TOLERANCE
    memory = [line for line in lines if re.match(r"^\s+rank \d+: params", line)]
    assert len(memory) == 2, proc.stdout
    return losses


def _plain_model() -> torch.nn.Module:
    s = parse_args(["--model-size", "tiny"])
    return demo.TinyGPT(s.vocab, s.seq_len, s.layers, s.width, s.heads)


def _check_model_file(ckpt: str) -> torch.nn.Module:
    """The model file is an ordinary full state dict: a plain, unwrapped model loads it."""
    plain = _plain_model()
    sd = torch.load(os.path.join(ckpt, "model.pt"), weights_only=True)
    assert list(sd) == list(plain.state_dict())
    plain.load_state_dict(sd, strict=True)
    assert torch.equal(sd["head.weight"], sd["tok_emb.weight"])
    return plain


def test_demo_full_shard_full_optim_state(tmp_path: Path) -> None:
    ckpt = str(tmp_path)
    proc = _run_demo("--steps", "6", "--model-size", "tiny", "--checkpoint-dir", ckpt)
    _check_output(proc, steps=6, k=3)
    assert "FULL_SHARD" in proc.stdout
    # FULL_SHARD on 2 ranks: each rank holds half of the parameters (+ padding).
    for m in re.finditer(r"\(\s*([\d.]+)%\)", proc.stdout):
        assert 50.0 <= float(m.group(1)) < 51.0, proc.stdout
    written = sorted(os.listdir(ckpt))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert written == ["meta.json", "model.pt", "optim.pt"]
        assert "plot: skipped (the demo's loss plot needs matplotlib" in proc.stdout
    else:  # the loss curves and tokens/s next to the checkpoint (a real PNG)
        assert written == ["loss.png", "meta.json", "model.pt", "optim.pt"]
        assert f"plot: wrote {os.path.join(ckpt, 'loss.png')}" in proc.stdout
        with open(os.path.join(ckpt, "loss.png"), "rb") as f:
            png = f.read()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    plain = _check_model_file(ckpt)
    # FSDP.optim_state_dict: keyed by the unwrapped model's names, full shapes, 3 steps taken.
    osd = torch.load(os.path.join(ckpt, "optim.pt"), weights_only=True)
    shapes = {n: p.shape for n, p in plain.named_parameters()}  # the tied head is not repeated
    assert sorted(osd["state"]) == sorted(shapes)
    for name, st in osd["state"].items():
        assert st["exp_avg"].shape == shapes[name] == st["exp_avg_sq"].shape
        assert float(st["step"]) == 3.0


@pytest.mark.slow  # a second demo run (15 s on 2 cores); CI runs it
def test_demo_shard_grad_op_orig_params_per_rank_optim(tmp_path: Path) -> None:
    ckpt = str(tmp_path)
    flags = "--steps 5 --checkpoint-step 2 --model-size tiny --strategy SHARD_GRAD_OP"
    proc = _run_demo(
        *flags.split(), "--use-orig-params", "--optim-state", "per-rank", "--checkpoint-dir", ckpt
    )
    _check_output(proc, steps=5, k=2)
    assert sorted(set(os.listdir(ckpt)) - {"loss.png"}) == ["meta.json", "model.pt", "optim_rank0.pt",
                                                        "optim_rank1.pt"]
    plain = _check_model_file(ckpt)
    # Each rank's optimizer state covers that rank's shards: together, every element once.
    total = 0
    for r in range(2):
        osd = torch.load(os.path.join(ckpt, f"optim_rank{r}.pt"), weights_only=True)
        numel = sum(st["exp_avg"].numel() for st in osd["state"].values())
        assert 0 < numel < sum(p.numel() for p in plain.parameters())
        total += numel
    assert total == sum(p.numel() for p in plain.parameters())


def test_make_batch_is_a_pure_function_of_step_and_rank() -> None:
    a = demo.make_batch(3, 1, 2, 4, 8, 64, seed=0)
    b = demo.make_batch(3, 1, 2, 4, 8, 64, seed=0)
    c = demo.make_batch(3, 0, 2, 4, 8, 64, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    x, y = a
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    stride = (x[:, 1] - x[:, 0]) % 64
    full = torch.cat([x, y[:, -1:]], dim=1)
    assert torch.equal((x[:, :1] + stride[:, None] * torch.arange(9)) % 64, full)


def test_parse_args_rejects_bad_checkpoint_step() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--steps", "4", "--checkpoint-step", "4"])
    s = parse_args(["--ranks", "3", "--layers", "1", "--width", "32"])
    assert (s.nprocs, s.layers, s.width, s.checkpoint_step) == (3, 1, 32, 10)
