"""Every checkpoint writer killed midway: the previous checkpoint loads exactly, the
interrupted one is refused as incomplete, nothing complete-looking is left.

The same three checks ``tests/test_full_checkpoint.py`` makes of the full save
(``test_sigkill_midway_keeps_the_previous_checkpoint``), for the other writers:

* the SHARDED_STATE_DICT recipe through DCP (model and optimizer state);
* the adapter save (``save_full_checkpoint(trainable_only=True)`` of a PEFT model);
* ``fsdp-wrap ckpt``'s conversions to torch.save, safetensors and DCP.

The jobs (tests/_kill_job.py) run as plain subprocesses, all at once: two
2-rank jobs whose rank 1 is SIGKILLed during its second save, then three
conversions that SIGKILL themselves after writing part of their output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import zipfile
from typing import Any

import pytest
import torch

import fsdp_wrap.checkpoint.offline as offline
from fsdp_wrap.checkpoint._atomic import MARKER
from tests._ckpt_common import same_nested
from tests._dist import progress

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


HAS_PEFT = _has("peft") and _has("transformers") and _has("safetensors")


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests._kill_job", *args], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _two_ranks(writer: str, root: str) -> list[subprocess.Popen[str]]:
    init = os.path.join(tempfile.mkdtemp(), "init")
    return [_start([writer, str(r), "2", init, root, "1"]) for r in range(2)]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every kill once; the outputs and each process's exit code and output."""
    base = tmp_path_factory.mktemp("killed")
    roots = {w: str(base / w) for w in ("sharded", "adapter")}
    jobs = {w: _two_ranks(w, roots[w]) for w in roots if w != "adapter" or HAS_PEFT}
    done = {w: [(p.communicate(timeout=400)[0], p.returncode) for p in procs]
            for w, procs in jobs.items()}
    # The offline tool reads the DCP checkpoint that survived: step2 of the sharded job.
    src = os.path.join(roots["sharded"], "step2")
    previous = str(base / "previous.pt")
    offline.convert(src, previous, fmt="torch")  # a complete conversion to fall back to
    outs = {"torch": str(base / "out.pt"), "safetensors": str(base / "out-st"),
            "dcp": str(base / "out-dcp")}
    procs = {f: _start([f"offline-{f}", previous if f == "dcp" else src, out])
             for f, out in outs.items()}
    for f, p in procs.items():
        done[f"offline-{f}"] = [(p.communicate(timeout=400)[0], p.returncode)]
    return {"roots": roots, "done": done, "src": src, "previous": previous, "outs": outs}


def _two_rank_exits(killed: dict[str, Any], writer: str) -> None:
    (out0, code0), (out1, code1) = killed["done"][writer]
    assert code1 == -signal.SIGKILL, out1
    assert code0 == 3, out0  # rank 0 raised (its peer vanished), it did not hang


# --------------------------------------------------------------- SHARDED / DCP


def _sharded_after_kill(root: str) -> dict[str, str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import fsdp_wrap
    from fsdp_wrap.checkpoint import init_optim_state_from_checkpoint
    from tests import _ckpt_common as C
    from tests._kill_job import full_optim
    from tests.test_full_checkpoint import build

    fsdp = fsdp_wrap.FullyShardedDataParallel
    model, opt = build(seed=5)
    step2, step4 = os.path.join(root, "step2"), os.path.join(root, "step4")

    def load(path: str) -> None:  # the recipe, into a fresh model and optimizer
        init_optim_state_from_checkpoint(model, opt, path, key="optim")
        with fsdp.state_dict_type(model, fsdp_wrap.StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": fsdp.optim_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
            opt.load_state_dict(fsdp.optim_state_dict_to_load(model, opt, state["optim"]))

    progress()
    load(step2)  # the previous checkpoint loads, exactly
    progress()
    ref = torch.load(os.path.join(root, "step2-ref.pt"), weights_only=False)
    got_params, got_optim = C.full_params(model), full_optim(model, opt)
    assert all(torch.equal(got_params[k], v) for k, v in ref["params"].items())
    if torch.distributed.get_rank() == 0:
        assert same_nested(got_optim, ref["optim"]), "step2's optimizer state did not load exactly"
    out: dict[str, str] = {}
    try:  # the model loaded from step2: torch's dcp.load refuses step4 itself
        with fsdp.state_dict_type(model, fsdp_wrap.StateDictType.SHARDED_STATE_DICT):
            dcp.load({"model": model.state_dict()}, checkpoint_id=step4)
        out["dcp.load"] = "loaded"
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (torch's answer, recorded)
        out["dcp.load"] = type(e).__name__  # (CheckpointException is a BaseException)
    after = C.full_params(model)  # the refused load touched nothing
    assert all(torch.equal(after[k], v) for k, v in ref["params"].items())
    progress()
    model, opt = build(seed=6)  # a fresh job resuming: the recipe starts with the template
    before = C.full_params(model)
    try:
        load(step4)
        out["recipe"] = "loaded"
    except ValueError as e:  # init_optim_state_from_checkpoint reads .metadata first
        out["recipe"] = str(e)
    after = C.full_params(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    return out



def test_killed_sharded_save(pool2: Any, killed: dict[str, Any]) -> None:
    _two_rank_exits(killed, "sharded")
    root = killed["roots"]["sharded"]
    step4 = os.path.join(root, "step4")
    # nothing complete-looking: DCP writes .metadata last, after every rank finished
    assert os.path.isdir(step4) and ".metadata" not in os.listdir(step4)
    for rank, out in enumerate(pool2.run(_sharded_after_kill, root)):
        assert out["recipe"].startswith(f"[rank {rank}] init_optim_state_from_checkpoint: "
                                        f"checkpoint {step4} is incomplete"), out
        assert "no .metadata" in out["recipe"] and "the save was interrupted" in out["recipe"]
        assert out["dcp.load"] == "CheckpointException", out  # torch's own refusal
    with pytest.raises(ValueError, match="is incomplete: it holds .* but no .metadata"):
        offline.inspect(step4)


# --------------------------------------------------------------- adapter


def _adapter_after_kill(root: str) -> dict[str, str]:
    progress()
    from peft import PeftModel

    from tests.test_adapter_checkpoint import _base

    progress()

    step2, step4 = os.path.join(root, "step2"), os.path.join(root, "step4")
    ref = torch.load(os.path.join(root, "step2-ref.pt"), weights_only=False)["params"]
    loaded = PeftModel.from_pretrained(_base(), step2)  # the previous one, in one process
    got = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    out: dict[str, str] = {}
    try:
        PeftModel.from_pretrained(_base(), step4 + ".incomplete")
        out["peft"] = "loaded"
    except Exception as e:  # noqa: BLE001  (PEFT's / safetensors' answer, recorded)
        out["peft"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.skipif(not HAS_PEFT, reason="needs peft, transformers and safetensors")
def test_killed_adapter_save(pool2: Any, killed: dict[str, Any]) -> None:
    from safetensors import safe_open

    _two_rank_exits(killed, "adapter")
    root = killed["roots"]["adapter"]
    step4 = os.path.join(root, "step4")
    assert not os.path.exists(step4) and os.path.isdir(step4 + ".incomplete")
    marker = json.load(open(os.path.join(step4 + ".incomplete", MARKER)))
    assert marker["complete"] is False and marker["kind"] == "adapter-safetensors"
    weights = os.path.join(step4 + ".incomplete", "adapter_model.safetensors")
    with pytest.raises(Exception):  # noqa: B017  (safetensors' own error type)
        safe_open(weights, "pt")  # its header length is still 0: no reader takes it
    for out in pool2.run(_adapter_after_kill, root):
        assert out["peft"] != "loaded", out
    with pytest.raises(ValueError, match=f"checkpoint {step4}.incomplete is incomplete: "
                                         "rank 1 never finished"):
        offline.inspect(step4)


# --------------------------------------------------------------- offline tool


def test_killed_offline_conversions(killed: dict[str, Any]) -> None:
    from safetensors import safe_open

    for f, out in killed["outs"].items():
        (text, code), = killed["done"][f"offline-{f}"]
        assert code == -signal.SIGKILL, text
        tmp = out + ".incomplete"
        assert not os.path.exists(out) and os.path.exists(tmp), (f, os.listdir(os.path.dirname(out)))
        for path in (out, tmp):
            with pytest.raises(ValueError, match="is incomplete"):
                offline.inspect(path)
        if f == "torch":
            with pytest.raises(zipfile.BadZipFile):
                zipfile.ZipFile(tmp)
            with pytest.raises(Exception):  # noqa: B017  (torch's own error type)
                torch.load(tmp, weights_only=True)
        else:
            marker = json.load(open(os.path.join(tmp, MARKER)))
            assert marker["complete"] is False and marker["kind"] == f"convert-{f}"
            if f == "dcp":
                assert ".metadata" not in os.listdir(tmp)
            for name in (n for n in os.listdir(tmp) if n.endswith(".safetensors")):
                with pytest.raises(Exception):  # noqa: B017  (safetensors' own error type)
                    safe_open(os.path.join(tmp, name), "pt")
    # the previous conversion (and the DCP checkpoint it came from) load exactly
    ref = torch.load(os.path.join(killed["roots"]["sharded"], "step2-ref.pt"), weights_only=False)
    previous = torch.load(killed["previous"], weights_only=True)
    assert all(torch.equal(previous["model"][k], v) for k, v in ref["params"].items())
    # and running a conversion again replaces what the killed one left
    again = killed["outs"]["torch"]
    offline.convert(killed["src"], again, fmt="torch")
    assert not os.path.exists(again + ".incomplete")
    redone = torch.load(again, weights_only=True)
    assert all(torch.equal(redone["model"][k], v) for k, v in ref["params"].items())
