"""Run the framework scenarios named on the command line in one ``torchrun`` launch.

``torchrun --nproc-per-node 2 scenarios_run.py OUT accelerate trainer ...``: each
scenario is a module of this folder (``accelerate_run.py`` ...) with a
``torch_part()`` (on torch's FSDP1, optional) and an ``ours_part()`` (on
fsdp_wrap, installed).  Every torch part runs first, in the order given, then
``fsdp_wrap.install()``, then every ours part: a process sees the same install
state for each part as in a launch of its own.  ``lightning`` uninstalls at its
end (its oracle is torch's class), so it comes last.  One process per rank
saves the imports of torch, fsdp_wrap and the frameworks once per scenario
(about 11 s each).

Each scenario records into its own results and output folder; a finished one
writes ``OUT/<name>.rank<r>.json`` after a barrier.  A scenario that raises
writes its traceback to ``OUT/<name>.rank<r>.err`` and ends the rank at once
(``torchrun`` then ends the other: no rank waits in a collective);
``tests/_framework_runs.py`` reports it on its own test and launches the
scenarios after it again, in fresh processes.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any, Callable

import _common
import torch.distributed as dist

BASE = _common.OUT
ORDER = ("dcp_compile", "accelerate", "trainer", "lora", "pretrained", "trl_sft", "trl_rl",
         "lightning")


def _guarded(name: str, part: Callable[[], Any], results: dict[str, Any] | None = None) -> Any:
    """``part()``, recording into ``results`` (and its CPU seconds); a failure ends the rank."""
    _common.RESULTS = {} if results is None else results  # what record() writes to
    with open(os.path.join(BASE, f"progress.rank{_common.RANK}"), "a") as f:
        f.write(f"{name} {getattr(part, '__name__', '')}\n")  # which scenario a hang is in
    c0 = time.process_time()
    try:
        return part()
    except BaseException:
        with open(os.path.join(BASE, f"{name}.rank{_common.RANK}.err"), "w") as f:
            f.write(traceback.format_exc())
        traceback.print_exc()
        _common.exit_now(1)
    finally:  # this rank's CPU seconds in the scenario's parts
        _common.RESULTS["cpu_seconds"] = _common.RESULTS.get("cpu_seconds", 0) + time.process_time() - c0


def _load(name: str) -> Any:
    module = importlib.import_module(f"{name}_run")
    module.OUT = os.path.join(BASE, name)  # each scenario's own folder
    os.makedirs(module.OUT, exist_ok=True)
    return module


def _settle() -> None:
    """Collect, then hide what survives from the collector for good.

    What survives is mostly the imports' (~500,000 objects, and a scenario's
    first run imports more: TRL's trainers, PEFT); it lives as long as the
    process.  Hidden, the ``gc.collect()`` that Accelerate's ``free_memory``
    runs at the end of every ``Trainer.train()`` takes milliseconds instead of
    half a second (about 16 CPU-seconds a rank over TRL's runs).  What the
    scenarios make later is collected as before.
    """
    gc.collect()
    gc.freeze()


def main() -> None:
    names = sys.argv[2:]
    assert names and [n for n in ORDER if n in names] == names, (names, ORDER)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    modules = {name: _guarded(name, lambda name=name: _load(name)) for name in names}
    _settle()
    results: dict[str, dict[str, Any]] = {name: {} for name in names}
    # torch's FSDP1 parts, then fsdp_wrap's (installed)
    for name in names:
        if hasattr(modules[name], "torch_part"):
            _guarded(name, modules[name].torch_part, results[name])
            _settle()
    _guarded("install", _common.use_fsdp_wrap)
    for name in names:
        _guarded(name, modules[name].ours_part, results[name])
        _settle()
        # observed after the scenario ran, not assumed: tests/_framework_runs.py checks it
        results[name]["torch_legacy_optim_apis_removed"] = _common.legacy_optim_apis_removed()
        dist.barrier()
        with open(os.path.join(BASE, f"{name}.rank{_common.RANK}.json"), "w") as f:
            json.dump(results[name], f)
    dist.barrier()


if __name__ == "__main__":
    main()
    _common.exit_now()  # see fsdp_wrap/_teardown.py: gloo's threads vs interpreter shutdown
