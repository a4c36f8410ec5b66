"""``fsdp_wrap.install()``: torch's FSDP1 names point at fsdp_wrap's, and back
(``fsdp_wrap/frameworks/installer.py`` and ``torch_fsdp.py``; each framework's
own patches have a test file of their own, ``tests/test_install_<framework>.py``).

Installing changes process-wide module state, so every check runs in a fresh
interpreter (one per scenario, many checks each).
"""

from __future__ import annotations

import os
import sys

import pytest

from tests._install_common import ROOT
from tests._install_common import ok as _ok
from tests._install_common import python as _python
from tests._proc import run_bounded

# The names install() must set, module by module (torch's FSDP1 public surface).
SURFACE = """
PKG = "torch.distributed.fsdp"
API = ["ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload", "StateDictType",
       "StateDictConfig", "FullStateDictConfig", "LocalStateDictConfig", "ShardedStateDictConfig",
       "OptimStateDictConfig", "FullOptimStateDictConfig", "LocalOptimStateDictConfig",
       "ShardedOptimStateDictConfig", "StateDictSettings"]
SURFACE = {
    PKG: API + ["FullyShardedDataParallel", "OptimStateKeyType"],
    PKG + ".fully_sharded_data_parallel": API + ["FullyShardedDataParallel", "OptimStateKeyType"],
    PKG + ".api": API,
    PKG + ".wrap": ["always_wrap_policy", "lambda_auto_wrap_policy", "transformer_auto_wrap_policy",
                    "size_based_auto_wrap_policy", "enable_wrap", "wrap", "CustomPolicy",
                    "ModuleWrapPolicy"],
    PKG + ".sharded_grad_scaler": ["ShardedGradScaler"],
}
import importlib
def names_now():
    return {(m, n): getattr(importlib.import_module(m), n) for m, ns in SURFACE.items() for n in ns}
def ours(obj):
    return getattr(obj, "__module__", "").startswith("fsdp_wrap")
"""


def test_install_rebinds_every_name_and_uninstall_restores_them() -> None:
    """Also: install() logs one line, on stderr, with the rank (it is called twice here)."""
    proc = _python(prelude=SURFACE, env={"RANK": "3"}, code="""
    import sys, types, torch
    import torch.distributed.checkpoint.state_dict as dcp_sd
    import torch.distributed.fsdp._init_utils as torch_init
    # A user module that imported torch's class before install().
    early = types.ModuleType("early_user_module")
    exec("from torch.distributed.fsdp import FullyShardedDataParallel as FSDP", early.__dict__)
    sys.modules["early_user_module"] = early
    before = names_now()
    kept = [torch_init.ShardingStrategy]  # in a list: install() rebinds module globals only
    assert not any(ours(v) for v in before.values())

    import fsdp_wrap
    fsdp_wrap.install()
    fsdp_wrap.install()  # idempotent: no second log line, nothing changes
    assert fsdp_wrap.installed()
    after = names_now()
    wrong = [k for k, v in after.items() if not ours(v)]
    assert not wrong, wrong
    assert after[("torch.distributed.fsdp", "FullyShardedDataParallel")] is fsdp_wrap.FullyShardedDataParallel
    assert early.FSDP is fsdp_wrap.FullyShardedDataParallel, "an earlier import was not rebound"
    assert dcp_sd.FSDP is fsdp_wrap.FullyShardedDataParallel
    # torch's own FSDP1 internals keep torch's objects: torch's FSDP1 still works.
    assert torch_init.ShardingStrategy is kept[0]

    fsdp_wrap.uninstall()
    assert not fsdp_wrap.installed()
    restored = names_now()
    changed = [k for k in before if restored[k] is not before[k]]
    assert not changed, changed
    assert early.FSDP is before[("torch.distributed.fsdp", "FullyShardedDataParallel")]
    assert dcp_sd.FSDP is early.FSDP
    print("OK")
    """)
    assert _ok(proc).strip().endswith("OK")
    lines = [ln for ln in proc.stderr.splitlines() if "fsdp_wrap.install()" in ln]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("[rank 3]") and "now point at fsdp_wrap" in lines[0], lines


def test_install_is_all_or_nothing() -> None:
    """A failure midway leaves every name as it was (never half-installed)."""
    out = _ok(_python(prelude=SURFACE, code="""
    import fsdp_wrap
    from fsdp_wrap.frameworks._patches import Patch
    before = names_now()
    calls = {"n": 0}
    real_apply = Patch.apply
    def failing_apply(self):
        calls["n"] += 1
        if calls["n"] == 20:
            raise RuntimeError("injected failure")
        real_apply(self)
    Patch.apply = failing_apply
    try:
        fsdp_wrap.install()
    except RuntimeError as e:
        assert "injected" in str(e)
    else:
        raise AssertionError("install() did not raise")
    Patch.apply = real_apply
    assert calls["n"] == 20 and not fsdp_wrap.installed()
    now = names_now()
    assert all(now[k] is before[k] for k in before), [k for k in before if now[k] is not before[k]]
    fsdp_wrap.install()  # and a clean retry works
    assert all(ours(v) for v in names_now().values())
    print("OK")
    """))
    assert out.strip().endswith("OK")


def test_install_on_a_torch_without_fsdp1() -> None:
    """FSDP1 removed from torch (simulated): install() provides the modules and
    names; a script using only torch's names trains, checkpoints its activations
    and scales fp16 losses on fsdp_wrap; uninstall() removes what it created."""
    out = _ok(_python(prelude=SURFACE, code="""
    import importlib.abc, sys, torch
    import torch.distributed.fsdp as pkg
    GONE = [PKG + s for s in (".fully_sharded_data_parallel", ".api", ".wrap", ".sharded_grad_scaler")]
    for name in GONE:
        sys.modules.pop(name, None)
        if hasattr(pkg, name.rsplit(".", 1)[1]):
            delattr(pkg, name.rsplit(".", 1)[1])
    for n in SURFACE[PKG]:
        if hasattr(pkg, n):
            delattr(pkg, n)
    class Gone(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname in GONE:
                raise ModuleNotFoundError(f"No module named {fullname!r}")
            return None
    sys.meta_path.insert(0, Gone())
    try:
        import torch.distributed.fsdp.wrap  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("the simulation did not remove FSDP1")

    import fsdp_wrap
    fsdp_wrap.install()
    assert all(ours(v) for v in names_now().values())

    # A script written for torch's FSDP1, using only torch's names.
    import os
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref.load_state_dict(model.state_dict())
    fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True)
    apply_activation_checkpointing(fsdp, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    assert "CheckpointWrapper" in repr(fsdp)
    assert isinstance(fsdp, fsdp_wrap.FullyShardedDataParallel)
    scaler = ShardedGradScaler(enabled=False)
    assert isinstance(scaler, fsdp_wrap.sharded_grad_scaler.ShardedGradScaler)
    x = torch.randn(4, 8)
    fsdp(x).sum().backward(); ref(x).sum().backward()
    with FSDP.summon_full_params(fsdp, with_grads=True):
        got = [p.grad.clone() for p in fsdp.parameters()]
    want = [p.grad for p in ref.parameters()]
    assert all(torch.allclose(a, b) for a, b in zip(got, want))
    dist.destroy_process_group()

    fsdp_wrap.uninstall()
    for name in GONE:
        assert name not in sys.modules, name
    assert not hasattr(pkg, "FullyShardedDataParallel")
    print("OK")
    """))
    assert out.strip().endswith("OK")


# With the start-up hook, PEFT imported by a script that never calls install():
# its two state-dict functions are wrapped in every module that binds them.
PEFT_PROBE = """
import fsdp_wrap
from fsdp_wrap.frameworks import _patches
import peft, peft.utils, peft.utils.save_and_load, peft.peft_model, peft.functional
mods = [peft.utils.save_and_load, peft.utils, peft, peft.peft_model, peft.functional]
print("peft wrapped:", fsdp_wrap.installed() and all(
    hasattr(m.get_peft_model_state_dict, _patches.MARK)
    and hasattr(m.set_peft_model_state_dict, _patches.MARK) for m in mods))
"""


@pytest.mark.slow  # four fresh interpreters importing torch (20 s on 2 cores); CI runs it
def test_startup_hook_and_fsdp_wrap_run() -> None:
    """``FSDP_WRAP_INSTALL=1`` installs before user code (and reaches PEFT, imported
    later, where PEFT is installed); ``fsdp-wrap run`` sets it."""
    import importlib.util

    from fsdp_wrap.frameworks import installer

    if installer.startup_hook_path() is None:
        pytest.skip(f"{installer.PTH_NAME} is not installed (fsdp_wrap not pip-installed here)")
    probe = ("import torch.distributed.fsdp as f; "
             "print(f.FullyShardedDataParallel.__module__)")
    has_peft = importlib.util.find_spec("peft") is not None
    on = _python(probe + (PEFT_PROBE if has_peft else ""), env={"FSDP_WRAP_INSTALL": "1"},
                 timeout=300)
    lines = _ok(on).strip().splitlines()
    assert lines[0] == "fsdp_wrap.fully_sharded_data_parallel", lines
    assert lines[1:] == (["peft wrapped: True"] if has_peft else []), lines
    assert on.stderr.count("fsdp_wrap.install()") == 1, on.stderr
    off = _python(probe)
    assert _ok(off).strip() == "torch.distributed.fsdp.fully_sharded_data_parallel"
    assert "fsdp_wrap" not in off.stderr
    via_cli = run_bounded(
        [sys.executable, "-m", "fsdp_wrap", "run", "--", sys.executable, "-c", probe],
        cwd=ROOT, timeout=180,
        env={k: v for k, v in os.environ.items() if k != "FSDP_WRAP_INSTALL"})
    assert _ok(via_cli).strip() == "fsdp_wrap.fully_sharded_data_parallel"
    empty = run_bounded([sys.executable, "-m", "fsdp_wrap", "run"], cwd=ROOT,
                           timeout=120)
    assert empty.returncode == 2 and "give the command" in empty.stderr


# torch packages `import fsdp_wrap` must not load: torch's FSDP1 (and composable
# FSDP), which only install() may import, and DCP and DTensor, which import torch's
# FSDP1 and together take about 1.5 s; checkpoint code imports them when it runs.
NOT_AT_IMPORT = ("torch.distributed.fsdp", "torch.distributed._composable",
                 "torch.distributed.checkpoint", "torch.distributed.tensor")


def test_import_loads_neither_torchs_fsdp1_nor_dcp() -> None:
    """``import fsdp_wrap`` (the package and its command line) in a fresh
    interpreter leaves torch's FSDP1, DCP and DTensor unloaded; the lazy paths
    still work there: ``_compat.dcp_properties_have_strides()`` imports DCP,
    and a DTensor made afterwards is recognised as a chunked value."""
    out = _ok(_python(code=f"""
    import sys
    import torch
    import fsdp_wrap, fsdp_wrap.__main__
    from fsdp_wrap import _compat
    from fsdp_wrap.state_dict import chunks
    NOT_AT_IMPORT = {NOT_AT_IMPORT!r}
    def loaded():
        return sorted(m for m in sys.modules if m.startswith(NOT_AT_IMPORT))
    print("at import:", loaded())
    assert not chunks.is_chunked(torch.zeros(2)) and not chunks.is_dtensor(torch.zeros(2))
    assert isinstance(_compat.dcp_properties_have_strides(), bool)
    assert "torch.distributed.checkpoint" in sys.modules
    import os
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    value = DTensor.from_local(torch.ones(2), init_device_mesh("cpu", (1,)), [Shard(0)])
    assert chunks.is_chunked(value) and chunks.is_dtensor(value)
    dist.destroy_process_group()
    print("OK")
    """))
    assert "at import: []" in out, out
    assert out.strip().endswith("OK")


def test_the_start_up_hook_imports_the_frameworks_installer() -> None:
    """The line setup.py writes into the start-up hook imports
    ``fsdp_wrap.frameworks.installer`` (the old shims ``fsdp_wrap.installer``
    and ``fsdp_wrap.installer_accelerate`` are gone: CHANGELOG), and that
    module holds the installer ``fsdp_wrap`` exports."""
    import fsdp_wrap
    import fsdp_wrap.frameworks.installer as installer

    setup_py = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    assert "import_module('fsdp_wrap.frameworks.installer').install_from_env()" in setup_py
    assert fsdp_wrap.install is installer.install and fsdp_wrap.uninstall is installer.uninstall
    assert callable(installer.install_from_env)
    package = os.path.dirname(fsdp_wrap.__file__)
    for old in ("installer.py", "installer_accelerate.py"):
        assert not os.path.exists(os.path.join(package, old)), old
