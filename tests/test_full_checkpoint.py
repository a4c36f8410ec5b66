"""``save_full_checkpoint`` / ``load_full_checkpoint``: the full model straight to disk.

Real 2- and 3-rank gloo jobs write Hugging Face safetensors checkpoints; the
files must hold exactly the FULL state dict fsdp_wrap returns, whatever the
window parameters travel in (checked with the
``safetensors`` package, and ``transformers`` loads a GPT-2 saved this way),
load back at another world size and ``use_orig_params`` mode, and be refused,
before the model is touched, when they do not match it.  A 2-rank job started
as subprocesses has one rank SIGKILLed in the middle of a save: the previous
checkpoint still loads and the partial one is rejected by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap
from fsdp_wrap.checkpoint import load_full_checkpoint, save_full_checkpoint, verify_full_checkpoint
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests import _ckpt_common as C
from tests._proc import run_bounded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 12)
        self.norm = nn.LayerNorm(12)
        self.fc2 = nn.Linear(12, d)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, d))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.norm(self.fc1(x)))) * self.gain


class Net(nn.Module):
    """Embedding tied to the head (at the root), ``n`` nested block units."""

    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, d)
        self.blocks = nn.Sequential(*(Block(d) for _ in range(n)))
        self.head = nn.Linear(d, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(x)))


def build(
    seed: int = 0, uop: bool = False, n: int = 3, d: int = 8, dtype: torch.dtype = torch.float32,
    **kw: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = fsdp_wrap.FullyShardedDataParallel(
        Net(n, d).to(dtype), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=CPU,
        use_orig_params=uop, **kw,
    )
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(100 * s + dist.get_rank())
        model(torch.randint(0, 16, (4, 3), generator=g)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full_sd(model: nn.Module) -> dict[str, torch.Tensor]:
    F = fsdp_wrap.FullyShardedDataParallel
    cfg = fsdp_wrap.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with F.state_dict_type(model, fsdp_wrap.StateDictType.FULL_STATE_DICT, cfg):
        return {k: v.clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------ rank side

CONFIGS = [
    (uop, strategy)
    for uop in (False, True)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
]


def _save_all(root: str) -> dict[str, Any]:
    out = {}
    for uop, strategy in CONFIGS:
        model, opt = build(uop=uop, sharding_strategy=fsdp_wrap.ShardingStrategy[strategy])
        train(model, opt, range(2))
        path = os.path.join(root, f"{uop}-{strategy}")
        # windows of 5 floats: parameters arrive in many pieces that straddle shards
        sent = [0]
        real_send = dist.send

        def counting_send(
            tensor: torch.Tensor, *a: Any, sent: list[int] = sent, real: Any = real_send, **k: Any
        ) -> Any:
            sent[0] += tensor.numel() * tensor.element_size()
            return real(tensor, *a, **k)

        dist.send = counting_send  # type: ignore[assignment]
        try:
            save_full_checkpoint(model, path, max_shard_size=600, window_bytes=20 if uop else 2**20)
        finally:
            dist.send = real_send
        shard = sum(
            st._handle.shard_valid_numel * 4
            for st in fsdp_wrap.FullyShardedDataParallel.fsdp_modules(model) if st._handle
        )
        # rank 0 sends nothing; the others send their own shard once (not with NO_SHARD)
        if sent[0] > (0 if dist.get_rank() == 0 or strategy == "NO_SHARD" else shard):
            raise AssertionError(f"rank {dist.get_rank()} sent {sent[0]} bytes, shard {shard}")
        if dist.get_rank() == 1 and strategy != "NO_SHARD" and sent[0] == 0:
            raise AssertionError("rank 1 sent nothing")
        out[path] = _full_sd(model)
    return out


def _load_all(root: str) -> list[str]:
    problems = []
    for uop, strategy in CONFIGS:
        want = torch.load(os.path.join(root, f"{uop}-{strategy}.want.pt"), weights_only=True)
        # the other use_orig_params mode, another seed, this pool's world size
        model, opt = build(seed=7, uop=not uop)
        load_full_checkpoint(model, os.path.join(root, f"{uop}-{strategy}"))
        got = C.full_params(model)
        for k, v in got.items():
            if not torch.equal(v, want[k]):
                problems.append(f"{uop}-{strategy}: {k}")
        for name, b in model.named_buffers():
            key = name.replace("_fsdp_wrapped_module.", "")
            if key in want and not torch.equal(b, want[key]):
                problems.append(f"{uop}-{strategy}: buffer {key}")
        train(model, opt, range(5, 6))  # still trains
    return problems


def _refusals(path: str) -> dict[str, str]:
    """Load into models that do not match; each must fail before touching the model."""
    out = {}
    cases = {
        "shape": dict(d=9),
        "missing": dict(n=4),
        "extra": dict(n=2),
        "dtype": dict(dtype=torch.bfloat16),
    }
    for name, kw in cases.items():
        model, _ = build(seed=3, **kw)  # type: ignore[arg-type]
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            load_full_checkpoint(model, path)
            out[name] = "loaded"
        except (KeyError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        after = model.state_dict()
        if any(not torch.equal(before[k], after[k]) for k in before):
            out[name] += " / MODEL CHANGED"
    model, _ = build(seed=3, n=2)
    try:  # (verify_full_checkpoint is strict by default too)
        verify_full_checkpoint(model, path)
        out["verify extra"] = "verified"
    except (KeyError, ValueError) as e:
        out["verify extra"] = f"{type(e).__name__}: {e}"
    load_full_checkpoint(model, path, strict=False)  # the extra block is ignored
    return out


def _gpt2_save(path: str) -> dict[str, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = fsdp_wrap.FullyShardedDataParallel(
        GPT2LMHeadModel(cfg), auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), device_id=CPU,
    )
    save_full_checkpoint(model, path, max_shard_size=20_000,
                         extra_files={"config.json": cfg.to_json_string()})
    return _full_sd(model)


# ---------------------------------------------------------------- tests


def test_files_hold_the_full_state_dict_and_load_at_other_world_sizes(
    pool2: Any, pool3: Any, tmp_path: Any
) -> None:
    from safetensors.torch import load_file

    root = str(tmp_path)
    wants = pool2.run(_save_all, root)[0]
    for path, want in wants.items():
        index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
        got: dict[str, torch.Tensor] = {}
        for f in files:
            got.update(load_file(os.path.join(path, f)))
        assert list(got) != [] and set(got) == set(want), (set(got) ^ set(want))
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
        marker = json.load(open(os.path.join(path, "fsdp_wrap_checkpoint.json")))
        assert marker["complete"] is True and marker["world_size"] == 2
        assert not os.path.exists(path + ".incomplete")
        torch.save(want, path + ".want.pt")
        # a plain model loads the files with nn.Module's own strict check
        plain = Net()
        plain.load_state_dict(got)
    assert pool3.run(_load_all, root) == [[], [], []]
    assert pool2.run(_load_all, root) == [[], []]


def _save_with_an_ignored_block(path: str) -> list[str]:
    """A model with an ignored block (FSDP leaves its parameters whole on every
    rank): the files hold what the FULL state dict holds, the ignored block's
    parameters included."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    net = Net(2, 8)
    model = fsdp_wrap.FullyShardedDataParallel(
        net, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=CPU,
        ignored_modules=[net.blocks[1]])
    save_full_checkpoint(model, path)
    want = _full_sd(model)
    if dist.get_rank() != 0:
        return []
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    got: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(load_file(os.path.join(path, f)))
    problems = [f"keys: {sorted(set(got) ^ set(want))}"] if set(got) != set(want) else []
    problems += [k for k in want if k in got and not torch.equal(got[k], want[k])]
    if not any(k.startswith("blocks.1.") for k in got):
        problems.append(f"no ignored parameter saved: {sorted(got)}")
    return problems


def test_ignored_modules_parameters_are_saved(pool2: Any, tmp_path: Any) -> None:
    assert pool2.run(_save_with_an_ignored_block, str(tmp_path / "ck")) == [[], []]


def test_mismatched_model_is_refused_before_it_is_touched(pool2: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "ck")
    pool2.run(_save_one, path)
    for got in pool2.run(_refusals, path):
        assert got["shape"].startswith("ValueError") and "'emb.weight' has shape [16, 8]" in got["shape"]
        assert "expects [16, 9]" in got["shape"] and "[rank " in got["shape"]
        assert got["missing"].startswith("KeyError") and "has no tensor 'blocks.3.fc1.weight'" in got["missing"]
        assert got["extra"].startswith("KeyError") and "first 'blocks.2.fc1.weight'" in got["extra"]
        assert "strict=False" in got["extra"]
        assert got["verify extra"].startswith("KeyError") and "strict=False" in got["verify extra"]
        assert got["dtype"].startswith("ValueError") and "torch.float32 but the model expects torch.bfloat16" in got["dtype"]
        assert all("MODEL CHANGED" not in v and "_fsdp_wrapped_module" not in v for v in got.values())


def _save_one(path: str) -> None:
    model, opt = build()
    train(model, opt, range(1))
    save_full_checkpoint(model, path, max_shard_size=600)


def _gpt2_load(path: str) -> list[str]:
    """A directory written by transformers' save_pretrained (the tied head is not stored)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    torch.manual_seed(1)
    model = fsdp_wrap.FullyShardedDataParallel(
        GPT2LMHeadModel(cfg), auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), device_id=CPU,
    )
    load_full_checkpoint(model, path)
    want = GPT2LMHeadModel.from_pretrained(path).state_dict()
    got = _full_sd(model)  # a collective; {} off rank 0
    return [k for k, v in got.items() if not torch.equal(v, want[k])]


def test_transformers_from_pretrained_reads_it(pool2: Any, tmp_path: Any) -> None:
    from transformers import GPT2LMHeadModel

    path = str(tmp_path / "gpt2")
    want = pool2.run(_gpt2_save, path)[0]
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    model = GPT2LMHeadModel.from_pretrained(path)
    got = model.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # and the other way: what transformers writes loads into the wrapped model
    hf_dir = str(tmp_path / "hf-written")
    model.save_pretrained(hf_dir, max_shard_size="20KB")
    assert "lm_head.weight" not in json.load(
        open(os.path.join(hf_dir, "model.safetensors.index.json")))["weight_map"]
    assert pool2.run(_gpt2_load, hf_dir) == [[], []]


def test_sigkill_midway_keeps_the_previous_checkpoint(pool2: Any, tmp_path: Any) -> None:
    root = str(tmp_path)
    init = os.path.join(tempfile.mkdtemp(), "init")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._full_ckpt_job", str(r), "2", init, root, "1"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert procs[1].returncode == -signal.SIGKILL, outs[1]
    assert procs[0].returncode == 3, outs[0]  # rank 0 raised (its peer vanished), did not hang
    step2, step4 = os.path.join(root, "step2"), os.path.join(root, "step4")
    assert os.path.isdir(step2) and not os.path.exists(step4)
    assert os.path.isdir(step4 + ".incomplete")
    errors = pool2.run(_load_after_kill, root)
    for err in errors:
        assert err.startswith("ValueError: checkpoint ") and f"{step4}.incomplete is incomplete" in err
        assert "rank 1 never finished" in err and "rank 0 failed" in err
        assert f"the last complete one is {step2}" in err
    # the offline tool says the same and refuses it (a failure: exit 1, one line)
    proc = run_bounded(
        [sys.executable, "-m", "fsdp_wrap", "ckpt", "inspect", step4], env=env, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 1 and "rank 1 never finished" in proc.stderr, proc.stderr
    assert proc.stderr.startswith("fsdp-wrap ckpt: error: checkpoint ") and proc.stderr.count("\n") == 1


def _load_after_kill(root: str) -> str:
    model, _ = build(seed=5)
    load_full_checkpoint(model, os.path.join(root, "step2"))  # the previous one loads
    want = torch.load(os.path.join(root, "step2-params.pt"), weights_only=True)
    got = C.full_params(model)
    if any(not torch.equal(got[k], want[k]) for k in want):
        raise AssertionError("step2 did not load exactly")
    try:
        load_full_checkpoint(model, os.path.join(root, "step4"))
    except ValueError as e:
        return f"ValueError: {e}"
    return "loaded"


@pytest.mark.parametrize("bad", ["not-a-size"])
def test_bad_arguments_raise_before_any_collective(bad: str) -> None:
    with pytest.raises(TypeError, match="root fsdp_wrap FullyShardedDataParallel"):
        save_full_checkpoint(nn.Linear(2, 2), "/tmp/x")


def _hybrid_round_trip(path: str) -> list[str]:
    """HYBRID_SHARD on a 2x2 mesh: only rank 0's replica sends; loads into FULL_SHARD."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, opt = build(sharding_strategy=fsdp_wrap.ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
    train(model, opt, range(2))
    save_full_checkpoint(model, path, max_shard_size=600, window_bytes=24)
    want = C.full_params(model)
    other, _ = build(seed=4)
    load_full_checkpoint(other, path)
    got = C.full_params(other)
    return [k for k in want if not torch.equal(want[k], got[k])]


def test_the_documented_file_size_bound_is_the_default() -> None:
    """The docstring's "default 5 GiB" is the signature's default.  (Found by
    mutation testing: no test saves 5 GiB, so a changed default survived.)"""
    import inspect

    assert "``max_shard_size`` (bytes,\n    default 5 GiB)" in (save_full_checkpoint.__doc__ or "")
    default = inspect.signature(save_full_checkpoint).parameters["max_shard_size"].default
    assert default == 5 * 2**30, default


def test_hybrid_sharding_saves_from_one_replica(pool4: Any, tmp_path: Any) -> None:
    assert pool4.run(_hybrid_round_trip, str(tmp_path / "hybrid")) == [[], [], [], []]


def _with_optimizer(root: str) -> list[str]:
    """Model + Adam to disk; the files hold the FULL optimizer state dict; it loads back
    (other use_orig_params mode) and the resumed run equals the uninterrupted one."""
    problems = []
    F = fsdp_wrap.FullyShardedDataParallel
    for uop in (False, True):
        path = os.path.join(root, f"optim-{uop}")
        model, opt = build(uop=uop)
        train(model, opt, range(2))
        synced: set[str] = set()  # the files flushed to disk (os.fsync) during the save
        real_fsync = os.fsync

        def fsync(fd: int, synced: set[str] = synced, real: Any = real_fsync) -> None:
            with contextlib.suppress(OSError):
                synced.add(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
            real(fd)

        os.fsync = fsync
        try:
            save_full_checkpoint(model, path, opt, max_shard_size=700, window_bytes=24)
        finally:
            os.fsync = real_fsync
        if dist.get_rank() == 0:  # (the docstring: the files are flushed before path appears)
            unsynced = [f for f in sorted(os.listdir(path))
                        if f.endswith(".safetensors") and f not in synced]
            if unsynced:
                problems.append(f"{uop}: not flushed to disk: {unsynced}")
        with F.state_dict_type(model, fsdp_wrap.StateDictType.FULL_STATE_DICT,
                               fsdp_wrap.FullStateDictConfig(rank0_only=True),
                               fsdp_wrap.FullOptimStateDictConfig(rank0_only=True)):
            full_osd = F.optim_state_dict(model, opt)
        if dist.get_rank() == 0:
            from safetensors.torch import load_file

            index = json.load(open(os.path.join(path, "optimizer.safetensors.index.json")))
            files = sorted(set(index["weight_map"].values()))
            if len(files) < 2:
                problems.append(f"{uop}: one optimizer file")
            got: dict[str, torch.Tensor] = {}
            for f in files:
                got.update(load_file(os.path.join(path, f)))
            for fqn, st in full_osd["state"].items():
                for name, v in st.items():
                    t = got.get(f"state.{fqn}.{name}")
                    if t is None or not torch.equal(t, v):
                        problems.append(f"{uop}: state.{fqn}.{name}")
            groups = index["metadata"]["objects"]["param_groups"]
            if [g["params"] for g in groups] != [g["params"] for g in full_osd["param_groups"]]:
                problems.append(f"{uop}: param_groups {groups}")
            # the offline tool turns it into one torch.save file with the same state
            from fsdp_wrap.checkpoint import offline

            offline.convert(path, path + ".pt", fmt="torch")
            one = torch.load(path + ".pt", weights_only=True)
            for fqn, st in full_osd["state"].items():
                for name, v in st.items():
                    if not torch.equal(one["optim"]["state"][fqn][name], v):
                        problems.append(f"{uop}: converted state.{fqn}.{name}")
            if [g["params"] for g in one["optim"]["param_groups"]] != [g["params"] for g in groups]:
                problems.append(f"{uop}: converted param_groups")
        want = C.train(model, opt, "tied", range(5, 8))  # token ids
        other, other_opt = build(seed=8, uop=not uop)
        load_full_checkpoint(other, path, other_opt)
        got_losses = C.train(other, other_opt, "tied", range(5, 8))
        if got_losses != want:
            problems.append(f"{uop}: resumed {got_losses} != {want}")
        # a model without optimizer files: one clear error
        try:
            load_full_checkpoint(other, os.path.join(root, "no-optim"), other_opt)
            problems.append("loaded optimizer state that is not there")
        except FileNotFoundError as e:
            if "holds no optimizer state" not in str(e):
                problems.append(str(e))
    return problems


def test_optimizer_state_saved_and_resumed(pool2: Any, tmp_path: Any) -> None:
    pool2.run(_save_one, str(tmp_path / "no-optim"))
    assert pool2.run(_with_optimizer, str(tmp_path)) == [[], []]
