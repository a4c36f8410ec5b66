"""The offline checkpoint tool (``fsdp-wrap ckpt``, ``python -m fsdp_wrap ckpt``).

Checkpoints are written for real by 2-rank gloo jobs of torch's FSDP1 and of
fsdp_wrap; the tool then reads them in the test process, which has no process
group.  Consolidated files must equal the FULL state dicts the same jobs
produce, bit for bit; a full checkpoint converted to DCP must resume at other
world sizes exactly as torch's FSDP1 resumes it; damaged and foreign inputs get
one clear error line.  The streaming claim (peak about the largest tensor) is
checked against ``dcp_to_torch_save`` in a fresh process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import textwrap
from typing import Any

import pytest
import torch

from fsdp_wrap import cli
from fsdp_wrap.checkpoint import offline
from tests import _ckpt_common as C
from tests import test_checkpoint_interop as I
from tests._proc import run_bounded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ------------------------------------------------------------ rank side


def _write_both(root: str) -> dict[str, Any]:
    """Each library trains 'tied' (use_orig_params both ways) and writes DCP + FULL."""
    out: dict[str, Any] = {}
    for impl in ("torch", "ours"):
        for uop in (False, True):
            model, opt = I._build(impl, "tied", uop)
            C.train(model, opt, "tied", range(2))
            path = os.path.join(root, f"{impl}-{uop}")
            I._save(model, opt, "dcp", path + "-dcp")
            I._save(model, opt, "full", path + "-full")
    return out


def _save_full_and_continue(path: str) -> list[float]:
    model, opt = I._build("ours", "seq", False)
    C.train(model, opt, "seq", range(2))
    I._save(model, opt, "full", path)
    return C.train(model, opt, "seq", range(2, 5))


def _resume_dcp(path: str, impls: tuple[str, ...]) -> list[list[float]]:
    out = []
    for impl in impls:
        model, opt = I._resume(impl, "seq", True, "dcp", path)
        out.append(C.train(model, opt, "seq", range(2, 5)))
    return out


# ------------------------------------------------------------- helpers


def _same(a: Any, b: Any, where: str = "") -> list[str]:
    """Differences between two nested state objects (tensors compared exactly)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        )
        return [] if ok else [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _ckpt(*argv: str) -> tuple[int, str, str]:
    proc = run_bounded(
        [sys.executable, "-m", "fsdp_wrap", "ckpt", *argv], env=_env(), cwd=REPO, timeout=300,
    )
    return proc.returncode, proc.stdout, proc.stderr


def _ckpt_here(*argv: str) -> tuple[int, str, str]:
    """The same command in this process (``fsdp_wrap.cli.main``, what
    ``python -m fsdp_wrap ckpt`` runs): for the error cases, where starting a
    Python per case would cost seconds each; :func:`_ckpt` covers the entry point."""
    from fsdp_wrap.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["ckpt", *argv])
        except SystemExit as e:  # argparse's usage errors
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def both_written(pool2: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The checkpoints of :func:`_write_both`, written once for the tests that read them."""
    root = str(tmp_path_factory.mktemp("both"))
    pool2.run(_write_both, root)
    return root


def test_consolidate_equals_full_state_dict_for_both_writers(both_written: str, tmp_path: Any) -> None:
    """DCP from torch's FSDP1 and from fsdp_wrap -> one file equal to the job's FULL dicts."""
    root = both_written
    for impl in ("torch", "ours"):
        for uop in (False, True):
            base = os.path.join(root, f"{impl}-{uop}")
            want = torch.load(os.path.join(base + "-full", "full.pt"), weights_only=True)
            got_file = str(tmp_path / f"{impl}-{uop}-consolidated.pt")
            offline.consolidate(base + "-dcp", got_file)
            got = torch.load(got_file, weights_only=True)
            # the FULL optimizer dict of use_orig_params=False shares one ``step`` per flat
            # parameter and FULL keeps param_groups' extra keys: compare state and params
            assert _same(got["model"], want["model"], "model") == []
            assert _same(got["optim"]["state"], want["optim"]["state"], "optim.state") == []
            assert [g["params"] for g in got["optim"]["param_groups"]] == [
                g["params"] for g in want["optim"]["param_groups"]
            ]
            # the Hugging Face layout holds the same model tensors under clean names
            hf = str(tmp_path / f"{impl}-{uop}-hf")
            offline.consolidate(base + "-dcp", hf, fmt="safetensors", max_shard_size=200)
            from safetensors.torch import load_file

            index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))
            files = sorted(set(index["weight_map"].values()))
            assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
            loaded: dict[str, torch.Tensor] = {}
            for f in files:
                loaded.update(load_file(os.path.join(hf, f)))
            assert _same(loaded, dict(want["model"]), "hf") == []
            # and a plain model loads it
            plain = C.make_model("tied", seed=5)
            plain.load_state_dict(loaded)


def test_inspect_reports_format_world_size_and_optimizer(both_written: str) -> None:
    root = both_written
    dcp_dir = os.path.join(root, "torch-False-dcp")
    rc, out, err = _ckpt("inspect", dcp_dir)  # the entry point, in a fresh interpreter
    assert rc == 0, err
    assert "DCP" in out and "world size:   2" in out and "optimizer:    yes" in out
    assert "exp_avg" in out and "model.emb.weight" in out and "_fsdp_wrapped_module" not in out
    info = offline.inspect(dcp_dir)
    assert info["world_size"] == 2 and info["optimizer_state"]
    assert info["model_tensors"] == 7  # emb, body.0.w/b, body.2.w/b, head (tied), scale
    full = offline.inspect(os.path.join(root, "ours-True-full", "full.pt"))
    assert full["world_size"] is None and full["format"].startswith("torch.save")
    assert full["model_bytes"] == info["model_bytes"]
    rc, out, _ = _ckpt_here("inspect", "--json", os.path.join(root, "ours-True-full", "full.pt"))
    assert rc == 0 and json.loads(out)["optimizer_state"] is True


def test_convert_full_to_dcp_resumes_at_any_world_size(
    pool2: Any, pool3: Any, tmp_path: Any
) -> None:
    full = str(tmp_path / "full")
    want = pool2.run(_save_full_and_continue, full)[0]
    dcp_dir = str(tmp_path / "as-dcp")
    assert cli.main(["ckpt", "convert", os.path.join(full, "full.pt"), dcp_dir, "--quiet"]) == 0
    # same world size: exactly the run that never stopped
    got = pool2.run(_resume_dcp, dcp_dir, ("ours",))[0][0]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6, (got, want)
    # three ranks: fsdp_wrap and torch's FSDP1 resume the converted files identically
    ours, ref = pool3.run(_resume_dcp, dcp_dir, ("ours", "torch"))[0]
    assert max(abs(a - b) for a, b in zip(ours, ref)) <= 1e-6, (ours, ref)
    # and back: DCP -> torch.save gives the original file's tensors
    back = str(tmp_path / "back.pt")
    assert cli.main(["ckpt", "convert", dcp_dir, back, "--quiet"]) == 0
    a = torch.load(back, weights_only=True)
    b = torch.load(os.path.join(full, "full.pt"), weights_only=True)
    assert _same(a["model"], b["model"]) == [] and _same(a["optim"]["state"], b["optim"]["state"]) == []


def test_damaged_and_foreign_inputs_get_one_clear_error(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    good = str(tmp_path / "good")
    state = {"model": {"w": torch.randn(64, 8), "b": torch.randn(8)}}
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=good, no_dist=True)
    rc, out, err = _ckpt_here("consolidate", good, str(tmp_path / "ok.pt"), "--progress")
    assert rc == 0 and "100.0%" in err and "2 tensors" in out, (out, err)
    # truncated data file
    trunc = str(tmp_path / "trunc")
    os.makedirs(trunc)
    for name in os.listdir(good):
        data = open(os.path.join(good, name), "rb").read()
        with open(os.path.join(trunc, name), "wb") as f:
            f.write(data[: len(data) // 2] if name.endswith(".distcp") else data)
    rc, _, err = _ckpt_here("consolidate", trunc, str(tmp_path / "o1.pt"))
    assert rc == 1 and "is truncated" in err and "__0_0.distcp" in err and "Traceback" not in err
    # .metadata missing: the save never finished
    os.remove(os.path.join(trunc, ".metadata"))
    rc, _, err = _ckpt_here("inspect", trunc)
    assert rc == 1 and "incomplete" in err and "no .metadata" in err
    # a foreign directory and a file that is no checkpoint
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hello")
    rc, _, err = _ckpt_here("inspect", str(foreign))
    assert rc == 1 and "is not a checkpoint" in err
    rc, _, err = _ckpt_here("inspect", str(foreign / "notes.txt"))
    assert rc == 1 and "torch.load failed" in err
    # an existing output is never overwritten, and nothing partial is left behind
    out = tmp_path / "exists.pt"
    out.write_text("keep me")
    rc, _, err = _ckpt_here("consolidate", good, str(out))
    assert rc == 1 and "already exists" in err and out.read_text() == "keep me"
    # a truncated safetensors shard
    hf = str(tmp_path / "hf")
    offline.consolidate(good, hf, fmt="safetensors")
    shard = os.path.join(hf, "model-00001-of-00001.safetensors")
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:-10])
    rc, _, err = _ckpt_here("convert", hf, str(tmp_path / "x"))
    # (the conversion's marker records each file's size and CRC-32)
    assert rc == 1 and "model-00001-of-00001.safetensors holds" in err and "truncated" in err
    # without the marker, the file's own seal (its CRC-32 in its header) still says it
    os.remove(os.path.join(hf, "fsdp_wrap_checkpoint.json"))
    rc, _, err = _ckpt_here("convert", hf, str(tmp_path / "x"))
    assert rc == 1 and "model-00001-of-00001.safetensors does not hold what fsdp_wrap wrote" \
        in err and "truncated" in err, err
    # a .safetensors name for a torch.save file (the default format) is refused up front
    named = tmp_path / "model.safetensors"
    rc, _, err = _ckpt_here("consolidate", good, str(named))
    assert rc == 2 and "Hugging Face layout" in err and "--format safetensors" in err
    assert not named.exists()


_PEAK_SCRIPT = textwrap.dedent(
    """
    import ctypes, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    from fsdp_wrap.checkpoint import offline
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch._subclasses.fake_tensor  # imports are not data: load them before the window

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))

    src, out, how = sys.argv[1:4]
    # warm up on a tiny checkpoint: imports and caches are code, not data
    import os, tempfile
    import torch.distributed.checkpoint as dcp
    tiny = tempfile.mkdtemp()
    dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=os.path.join(tiny, "d"), no_dist=True)
    (offline.consolidate if how == "ours" else dcp_to_torch_save)(
        os.path.join(tiny, "d"), os.path.join(tiny, "o.pt"))
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    if how == "ours":
        offline.consolidate(src, out)
    else:
        dcp_to_torch_save(src, out)
    print(status("VmHWM") - before)
    """
)


def test_consolidate_peak_is_about_the_largest_tensor(tmp_path: Any) -> None:
    """8 tensors of 16 MiB: ours grows by a few tensors, dcp_to_torch_save by all of them."""
    import torch.distributed.checkpoint as dcp

    src = str(tmp_path / "src")
    mib16 = 4 * 2**20
    state = {"model": {f"layer{i}.weight": torch.full((mib16,), float(i)) for i in range(8)}}
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=src, no_dist=True)
    del state
    growth = {}
    for how in ("ours", "torch"):
        out = str(tmp_path / f"{how}.pt")
        proc = run_bounded(
            [sys.executable, "-c", _PEAK_SCRIPT, src, out, how], env=_env(), timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        growth[how] = int(proc.stdout.split()[-1])
        got = torch.load(out, weights_only=True, mmap=True)
        assert all(float(got["model"][f"layer{i}.weight"][-1]) == i for i in range(8))
    total = 8 * 16 * 2**20
    assert growth["ours"] < 3 * 16 * 2**20, growth
    assert growth["torch"] > 0.9 * total, growth  # the comparison the docs quote


def test_reads_dcp_metadata_of_a_newer_torch(tmp_path: Any, monkeypatch: Any) -> None:
    """torch 2.15 pickles six fields per ``TensorProperties`` (the strides); an
    older torch cannot read such a ``.metadata`` at all.  The tool reads it on any
    torch: written here as 2.15 writes it, it consolidates to the same tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorProperties

    from fsdp_wrap import _compat
    from fsdp_wrap.checkpoint import _dcp

    if not _compat.dcp_properties_have_strides():  # write what torch 2.15 writes
        five = TensorProperties.__getstate__
        monkeypatch.setattr(TensorProperties, "__getstate__",
                            lambda self: (*five(self), (8, 1)))
    newer = str(tmp_path / "newer")
    state = {"model": {"w": torch.randn(16, 8), "b": torch.randn(8)}}
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=newer, no_dist=True)
    monkeypatch.undo()
    if not _compat.dcp_properties_have_strides():  # torch itself cannot read it
        with pytest.raises(ValueError, match="too many values to unpack"):
            FileSystemReader(newer).read_metadata()
    md = _dcp.read_metadata(newer)
    props = [m.properties for m in md.state_dict_metadata.values() if hasattr(m, "properties")]
    assert len(props) == 2 and all(type(p) is TensorProperties for p in props), props
    out = str(tmp_path / "out.pt")
    rc, _, err = _ckpt_here("consolidate", newer, out)
    assert rc == 0, err
    got = torch.load(out, weights_only=True)
    assert _same(got["model"], state["model"]) == []


def test_an_unfinished_save_names_the_last_complete_checkpoint_beside_it(
        tmp_path: Any, monkeypatch: Any) -> None:
    """Whatever the working directory: the sibling is looked for beside the
    checkpoint.  (Found by mutation testing: the parent directory computed as
    ``"."`` survived every checkpoint test of the fast selection.)"""
    from fsdp_wrap.checkpoint import _atomic

    ckpts = tmp_path / "ckpts"
    good = str(ckpts / "step-1")
    tmp = _atomic.begin(good, 1, "full-safetensors", {})
    (ckpts / "step-1.incomplete" / "data.bin").write_bytes(b"x")
    _atomic.commit(tmp, good, {})
    _atomic.begin(str(ckpts / "step-2"), 2, "full-safetensors", {})  # never committed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ValueError) as err:
        _atomic.check_complete(str(ckpts / "step-2"))
    assert "is incomplete: ranks 0, 1 never finished" in str(err.value), err.value
    assert f"the last complete one is {good}" in str(err.value), err.value
    assert _atomic.check_complete(good)["complete"] is True  # (and it verifies)
    # ranks that reported: the one that failed is named with its error's first
    # line (at most 500 characters), the one that finished is not
    tmp3 = _atomic.begin(str(ckpts / "step-3"), 3, "full-safetensors", {})
    _atomic.report(tmp3, 0, None)
    _atomic.report(tmp3, 1, RuntimeError("boom " + "x" * 600 + "\nsecond line"))
    with pytest.raises(ValueError) as err:
        _atomic.check_complete(str(ckpts / "step-3"))
    msg = str(err.value)
    assert f"is incomplete: rank 2 never finished; rank 1 failed (RuntimeError: boom {'x' * 481})" \
        f"; the last complete one is {good}" in msg, msg


def test_a_save_over_an_old_copy_that_cannot_be_removed_still_completes(
        tmp_path: Any, monkeypatch: Any) -> None:
    """Replacing a checkpoint moves the old copy aside, renames the new one into
    place, then removes the old copy; that removal failing (a file of it still
    open over NFS, a busy mount) must not fail a save that is already complete.
    (Found by mutation testing: ``ignore_errors=False`` there survived every
    checkpoint test, since ``rmtree`` cannot fail for root on a local disk.)"""
    import errno

    from fsdp_wrap.checkpoint import _atomic

    real_rmdir = os.rmdir

    def busy(p: Any, *args: Any, **kwargs: Any) -> None:
        if ".replaced-" in os.fspath(p):
            raise OSError(errno.EBUSY, "Device or resource busy", os.fspath(p))
        real_rmdir(p, *args, **kwargs)

    path = str(tmp_path / "step-1")
    for payload in (b"old", b"new"):
        tmp = _atomic.begin(path, 1, "full-safetensors", {})
        (tmp_path / "step-1.incomplete" / "data.bin").write_bytes(payload)
        if payload == b"new":
            monkeypatch.setattr(os, "rmdir", busy)
        _atomic.commit(tmp, path, {})  # no error: the new checkpoint is in place
    monkeypatch.undo()
    assert (tmp_path / "step-1" / "data.bin").read_bytes() == b"new"
    assert _atomic.check_complete(path)["complete"] is True
    assert not os.path.exists(path + ".incomplete")
    left = [n for n in os.listdir(tmp_path) if ".replaced-" in n]
    assert len(left) == 1, os.listdir(tmp_path)  # the old copy, left where it was
