"""``fsdp_wrap.install()`` and PEFT (``fsdp_wrap/frameworks/peft.py``).

PEFT's ``get_peft_model_state_dict`` / ``set_peft_model_state_dict`` on models
wrapped by fsdp_wrap, in a 2-rank pool, through the wrappers ``install()``
sets (called directly: the pool's processes are not installed into): a tiny
LLaMA with LoRA on ``q_proj``/``v_proj``, wrapped with nested units the way
the ``Trainer`` does (PEFT's policy: each LoRA ``Linear`` and each decoder
layer a unit), with a unit per decoder layer, and at the root alone, with
either ``use_orig_params``.  What PEFT as shipped finds is recorded beside
(nothing, with nested units).  Then the install step itself, in fresh
interpreters: every module binding the two functions gets the wrappers,
``uninstall()`` gives PEFT's back (the start-up hook reaching PEFT:
``tests/test_install.py``).
``PeftModel.from_pretrained`` on a wrapped base (inference) loads its adapter.

The TRL trainers that run these paths for real: ``tests/test_trl.py``.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests._dist import progress
from tests._install_common import ok as _ok
from tests._install_common import python as _python

pytest.importorskip("peft")
pytest.importorskip("transformers")

WRAPPINGS = [(policy, uop) for policy in ("peft", "layers", "root") for uop in (True, False)]


def _reference() -> nn.Module:
    """The tiny LoRA LLaMA with every adapter away from its initial value
    (seed 1: the same on every rank)."""
    from benchmarks._lora_models import lora_llama

    model = lora_llama("tiny")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def _policy(name: str) -> Any:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fsdp_wrap.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy

    if name == "layers":
        return ModuleWrapPolicy({LlamaDecoderLayer})
    if name == "peft":  # PEFT's fsdp_auto_wrap_policy, the Trainer's with PEFT
        def unit(m: nn.Module) -> bool:
            leaf_trains = (not list(m.children()) and getattr(m, "weight", None) is not None
                           and m.weight.requires_grad)
            return isinstance(m, LlamaDecoderLayer) or leaf_trains

        return functools.partial(lambda_auto_wrap_policy, lambda_fn=unit)
    return None


def _gathered_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    import fsdp_wrap

    with fsdp_wrap.FullyShardedDataParallel.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _file_key(key: str) -> str:
    return key.replace(".default", "")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _one_wrapping(policy: str, uop: bool, get: Any, set_: Any, orig_get: Any) -> dict[str, Any]:
    import fsdp_wrap
    from fsdp_wrap import FullStateDictConfig, StateDictType
    from fsdp_wrap import FullyShardedDataParallel as FSDP

    ref = _reference()
    want = orig_get(ref)  # PEFT's own answer on the plain model
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=_policy(policy), use_orig_params=uop,
                 device_id=torch.device("cpu"))
    rank, out = dist.get_rank(), {}
    full = FullStateDictConfig(rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full):
        got = get(model)
        out["shipped_keys"] = len(orig_get(model))
        state = model.state_dict()
    out["get_root_full"] = _same(got, want) if rank == 0 else got == {}
    # The Trainer's save_model: save_pretrained on the PeftModel with the root's FULL dict
    inner = get(model.module, state_dict=state)
    out["get_inner_with_state"] = _same(inner, want) if rank == 0 else inner == {}
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = get(model)
    out["get_sharded_keys"] = sorted(sharded) == sorted(want)
    # Loads: every rank's shard must take the new values
    new = {k: v + 1 for k, v in want.items()}
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full):
        result = set_(model, new)
    out["set_root_full"] = _same({_file_key(k): v for k, v in _gathered_adapters(model).items()}, new)
    out["set_unexpected"] = list(result.unexpected_keys)
    twice = {k: 2 * v for k, v in want.items()}
    set_(model.module, twice)  # load_adapter's path: the PeftModel, no state-dict type set
    out["set_inner"] = _same({_file_key(k): v for k, v in _gathered_adapters(model).items()}, twice)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        template = get(model)
        for v in template.values():  # (Accelerate's DCP load fills the template in place)
            for shard in v.local_shards():
                shard.tensor.add_(1)
        set_(model, template)
    out["set_sharded"] = _same({_file_key(k): v for k, v in _gathered_adapters(model).items()},
                               {k: v + 1 for k, v in twice.items()})
    out["installed"] = fsdp_wrap.installed()
    out["view"] = _view_checks(ref, model)
    return out


def _view_checks(ref: nn.Module, model: nn.Module) -> list[bool]:
    """What the view shows PEFT: the plain model's module names, state-dict keys
    and shapes (on the meta device: nothing gathered), parameter names."""
    from fsdp_wrap.frameworks.peft import PeftView

    view = PeftView.of(model.module, keys_only=True)
    assert view is not None and PeftView.of(ref, keys_only=True) is None
    keys, plain = view.state_dict(), ref.state_dict()
    return [
        [n for n, _ in view.named_modules()] == [n for n, _ in ref.named_modules()],
        sorted(keys) == sorted(plain),
        all(keys[k].is_meta and keys[k].shape == plain[k].shape for k in keys),
        [n for n, _ in view.named_parameters()] == [n for n, _ in ref.named_parameters()],
        view.peft_config is ref.peft_config or list(view.peft_config) == list(ref.peft_config),
    ]


def _torch_fsdp1(get: Any, set_: Any, orig_get: Any, orig_set: Any) -> dict[str, Any]:
    """torch's own FSDP1: the wrappers call PEFT's functions unchanged."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = TorchFSDP(_reference(), auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                      use_orig_params=True, device_id=torch.device("cpu"))
    cfg = FullStateDictConfig(rank0_only=True)
    with TorchFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        ours, theirs = get(model), orig_get(model)
        loaded = [set_(model, {"x": torch.zeros(1)}), orig_set(model, {"x": torch.zeros(1)})]
    return {"get": sorted(ours) == sorted(theirs),
            "set": [sorted(r.unexpected_keys) for r in loaded]}


def _from_pretrained_on_wrapped(path: str, set_: Any) -> list[float]:
    """``PeftModel.from_pretrained`` on a wrapped base (adapters injected after
    wrapping, then loaded through the set wrapper): the reference's logits."""
    from peft import PeftModel
    from peft import peft_model as pm
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks._lora_models import SIZES
    from fsdp_wrap import FullyShardedDataParallel as FSDP

    ref = _reference().eval()
    if dist.get_rank() == 0:
        ref.save_pretrained(path)
    dist.barrier()
    ids = torch.arange(16).view(1, 16)
    out = []
    shipped = pm.set_peft_model_state_dict
    pm.set_peft_model_state_dict = set_  # (what install() does to this binding)
    try:
        for uop in (True, False):
            torch.manual_seed(0)
            base = FSDP(LlamaForCausalLM(LlamaConfig(**SIZES["tiny"])), auto_wrap_policy=_policy("layers"),
                        use_orig_params=uop, device_id=torch.device("cpu"))
            model = PeftModel.from_pretrained(base, path).eval()
            with torch.no_grad():
                out.append((model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item())
    finally:
        pm.set_peft_model_state_dict = shipped
    return out


def _peft_rows(path: str) -> list[Any]:
    from peft.utils import save_and_load as sl

    import fsdp_wrap.frameworks.peft as fp

    get, set_ = fp.wrap_get(sl.get_peft_model_state_dict), fp.wrap_set(sl.set_peft_model_state_dict)
    rows: list[Any] = [_from_pretrained_on_wrapped(path, set_)]
    for policy, uop in WRAPPINGS:
        rows.append(_one_wrapping(policy, uop, get, set_, sl.get_peft_model_state_dict))
        progress()
    rows.append(_torch_fsdp1(get, set_, sl.get_peft_model_state_dict, sl.set_peft_model_state_dict))
    plain = _reference()
    rows.append(_same(get(plain), sl.get_peft_model_state_dict(plain)))
    return rows


def test_adapters_save_and_load_in_wrapped_models(pool2: Any, tmp_path: Any) -> None:
    # The workers import transformers and PEFT with this module, which on a busy
    # 2-core machine outlasts the pool's 60 s no-progress timeout (as bitsandbytes
    # does: tests/test_peft.py): a longer one for this run.  An exception on a
    # rank is still reported at once.
    timeout, pool2.timeout = pool2.timeout, max(pool2.timeout, 600.0)
    try:
        results = pool2.run(_peft_rows, str(tmp_path / "adapter"))
    finally:
        pool2.timeout = timeout
    for rank, per_rank in enumerate(results):
        from_pretrained, *rows, torch_row, plain_same = per_rank
        assert from_pretrained == [0.0, 0.0], (rank, from_pretrained)
        for (policy, uop), r in zip(WRAPPINGS, rows):
            where = (policy, uop, rank, r)
            assert not r["installed"], where
            for check in ("get_root_full", "get_inner_with_state", "get_sharded_keys",
                          "set_root_full", "set_inner", "set_sharded"):
                assert r[check] is True, (check, where)
            assert r["set_unexpected"] == [], where
            assert r["view"] == [True] * 5, where
            if policy != "root":
                # PEFT as shipped: the nested units hide every adapter
                assert r["shipped_keys"] == 0 or rank != 0, where
        assert torch_row["get"] and torch_row["set"][0] == torch_row["set"][1], torch_row
        assert plain_same


PEFT_CHECK = """
import sys
import fsdp_wrap
from fsdp_wrap.frameworks import _patches
def holders():
    import peft, peft.utils, peft.utils.save_and_load, peft.peft_model, peft.functional
    return [peft.utils.save_and_load, peft.utils, peft, peft.peft_model, peft.functional]
def wrapped(f):
    return hasattr(f, _patches.MARK)
"""


def test_install_wraps_peft_state_dict_functions() -> None:
    """Both functions are wrapped in every module that binds them, PEFT imported
    after install() (by the import finder) or before; uninstall() undoes both.
    One fresh interpreter (each costs seconds of imports): first install() with
    PEFT not yet imported, uninstall(), then install() again with it imported,
    uninstall()."""
    out = _ok(_python(prelude=PEFT_CHECK, code="""
    for when in ("after", "before"):
        if when == "before":
            mods = holders()
            assert not any(wrapped(m.get_peft_model_state_dict) for m in mods), when
            fsdp_wrap.install(verbose=False)
        else:
            fsdp_wrap.install(verbose=False)
            assert "peft" not in sys.modules
            mods = holders()
        for name in ("get_peft_model_state_dict", "set_peft_model_state_dict"):
            fns = [getattr(m, name) for m in mods]
            assert all(wrapped(f) and f is fns[0] for f in fns), (when, name, fns)
        originals = [getattr(mods[0].get_peft_model_state_dict, _patches.MARK),
                     getattr(mods[0].set_peft_model_state_dict, _patches.MARK)]
        fsdp_wrap.uninstall()
        for m in mods:
            assert [m.get_peft_model_state_dict, m.set_peft_model_state_dict] == originals, (when, m)
        print("OK", when)
    """, timeout=300))
    assert [ln for ln in out.splitlines() if ln.startswith("OK")] == ["OK after", "OK before"], out


# The start-up hook (``FSDP_WRAP_INSTALL=1``) reaching PEFT: in the hook's own
# fresh interpreter, tests/test_install.py::test_startup_hook_and_fsdp_wrap_run.
