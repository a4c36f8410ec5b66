"""The framework scenarios of ``tests/frameworks/``, launched once per test session.

The first test that asks for a scenario's results (:func:`results`) launches
``tests/frameworks/scenarios_run.py`` with ``torchrun`` on 2 CPU ranks (gloo)
for every scenario the session's selected tests ask for (their
``framework_scenario`` marker); the processes and their imports are shared, the
results and output folders are not.  A scenario that fails is reported on its
own test with its ranks' tracebacks (or the launch's output and stacks when it
did not finish); the scenarios after it are launched again in fresh processes,
so each test passes or fails on its own scenario only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._proc import run_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "frameworks")
# scenario -> the packages it needs (its test skips without them); in scenarios_run.ORDER
NEEDS: dict[str, tuple[str, ...]] = {
    "dcp_compile": (),
    "accelerate": ("accelerate", "transformers"),
    "trainer": ("accelerate", "transformers"),
    "lora": ("accelerate", "peft"),
    "pretrained": ("accelerate",),
    "trl_sft": ("trl", "peft", "accelerate", "bitsandbytes", "datasets"),
    "trl_rl": ("trl", "peft", "accelerate", "bitsandbytes", "datasets"),
    "lightning": ("lightning",),
}
RANKS = 2
TIMEOUT = 900  # seconds for one launch (all of its scenarios: about 60 s on a quiet 2-core machine)

_outcomes: dict[str, Any] = {}  # scenario -> list of per-rank results, or a failure message


def _torchrun(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` of tests/frameworks under torchrun (2 CPU ranks); raises AssertionError
    with its processes' stacks when it does not finish within :data:`TIMEOUT`."""
    # CPU ranks: on a machine with one GPU, Accelerate would otherwise give
    # rank 1 a CUDA device that does not exist.
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    env.pop("FSDP_WRAP_INSTALL", None)
    # This checkout's fsdp_wrap, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    # --standalone: torchrun picks a free port itself.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(RANKS), os.path.join(SCRIPTS, script), *args]
    return run_bounded(cmd, cwd=SCRIPTS, env=env, timeout=TIMEOUT)


def _check_no_legacy(out: list[dict[str, Any]]) -> None:
    # torch's legacy optimizer-state functions raised NotImplementedError in the
    # run (tests/frameworks/_common.py; tests/test_legacy_optim_removed.py)
    assert all(r.get("torch_legacy_optim_apis_removed") is True for r in out), out


def _launch(names: list[str], out: Path) -> tuple[int, str]:
    try:
        proc = _torchrun("scenarios_run.py", str(out), *names)
    except AssertionError as e:  # did not finish: the stacks of its processes
        return -1, str(e)
    return proc.returncode, proc.stdout[-3000:] + proc.stderr[-8000:]


def _failed(names: list[str], out: Path) -> str:
    """The scenario that failed in a launch: the one whose rank wrote a traceback,
    else the last one started by the rank that got least far (a crash, a hang)."""
    for name in [*names, "install"]:
        if any((out / f"{name}.rank{r}.err").exists() for r in range(RANKS)):
            return name
    # every rank starts the same parts in the same order; the one behind is where it stopped
    started = [(f.read_text().splitlines() if (f := out / f"progress.rank{r}").exists() else [])
               for r in range(RANKS)]
    behind = min(started, key=len)
    return behind[-1].split()[0] if behind else names[0]


def _run(names: list[str], base: Path) -> None:
    """Launch ``names``; after a failure, again with those left, the failed one out."""
    for launch in range(len(names)):
        if not names:
            return
        out = base / f"launch{launch}"
        out.mkdir()
        rc, output = _launch(names, out)
        for name in names:
            files = [out / f"{name}.rank{r}.json" for r in range(RANKS)]
            if all(f.exists() for f in files):
                _outcomes[name] = [json.loads(f.read_text()) for f in files]
        left = [n for n in names if n not in _outcomes]
        if not left:
            assert rc == 0, f"every scenario finished but the launch ended with {rc}:\n{output}"
            return
        failed = _failed(left, out)
        errors = [f.read_text() for r in range(RANKS) if (f := out / f"{failed}.rank{r}.err").exists()]
        message = (f"{failed!r} failed (launch exit code {rc}):\n" + "\n".join(errors)
                   + f"\n--- the launch's output ---\n{output}")
        if failed not in left:  # not a scenario's part (the install step): all of them
            _outcomes.update(dict.fromkeys(left, message))
            return
        _outcomes[failed] = message
        names = [n for n in left if n != failed]


def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """The results of the test's scenario (its ``framework_scenario`` marker), one dict
    per rank; skips without the scenario's packages."""
    name = request.node.get_closest_marker("framework_scenario").args[0]
    for mod in NEEDS[name]:
        pytest.importorskip(mod)
    if name not in _outcomes:
        wanted = {m.args[0] for item in request.session.items
                  for m in item.iter_markers("framework_scenario")} | {name}
        names = [n for n in NEEDS if n in wanted and n not in _outcomes
                 and all(importlib.util.find_spec(m) for m in NEEDS[n])]
        _run(names, request.getfixturevalue("tmp_path_factory").mktemp("frameworks"))
    outcome = _outcomes[name]
    if isinstance(outcome, str):
        pytest.fail(outcome, pytrace=False)
    _check_no_legacy(outcome)
    return outcome
