"""Adapter checkpoints: ``save_full_checkpoint(..., trainable_only=True)`` (issue 20 item 4).

A tiny LLaMA (2 layers, hidden 32) with PEFT LoRA (r=4 on ``q_proj`` and
``v_proj``) on 2 gloo ranks, one unit per decoder layer, both
``use_orig_params`` and FULL_SHARD / SHARD_GRAD_OP: 2 AdamW steps, then the
adapter is saved.  In a plain process (no FSDP; rank 0 of the pool, a fresh
base model built with the same seed), ``PeftModel.from_pretrained(base,
path)`` must hold every adapter weight bit for bit as the FULL state dict
gathered from the FSDP model, and compute the FSDP model's logits exactly.
Each rank's bytes sent during the save are counted: exactly its own shard of
the trainable parameters (frozen bytes never leave their rank), against the
full save's.  Then the plain layout for a non-PEFT model whose only trainable
parameter lives on rank 0 (rank 1's shard is padding), and the refusals
(nothing trainable, ranks disagreeing, an optimizer), each raised on every
rank before anything moves.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap
from fsdp_wrap.checkpoint import save_full_checkpoint
from fsdp_wrap.checkpoint._adapter import find_peft, peft_key
from tests._dist import DistPool, progress

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

FSDP = fsdp_wrap.FullyShardedDataParallel
CONFIGS = [(uop, strategy) for strategy in ("FULL_SHARD", "SHARD_GRAD_OP") for uop in (True, False)]
PROMPT = torch.arange(16).reshape(2, 8) % 64


def tiny_lora(quantized: bool = False) -> nn.Module:
    """Seed 0: the base model, then PEFT's LoRA (its A drawn after the base)."""
    from peft import LoraConfig, get_peft_model

    model = _base()
    if quantized:
        from benchmarks._lora_models import quantize_nf4 as _quantize

        model = _quantize(model.to(torch.bfloat16))
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))


def _base() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def _wrap(model: nn.Module, uop: bool, strategy: str) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fsdp_wrap.wrap import ModuleWrapPolicy

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), use_orig_params=uop,
                sharding_strategy=getattr(fsdp_wrap.ShardingStrategy, strategy),
                device_id=torch.device("cpu"))


def _train(model: nn.Module, steps: int = 2) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        ids = torch.randint(0, 64, (2, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _sent_bytes(fn: Any, *args: Any, **kwargs: Any) -> int:
    """Bytes this rank sends point to point while ``fn(*args, **kwargs)`` runs."""
    real = dist.send
    sent = [0]

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent[0] += tensor.numel() * tensor.element_size()
        return real(tensor, *args, **kwargs)

    dist.send = counting
    try:
        fn(*args, **kwargs)
    finally:
        dist.send = real
    return sent[0]


def _trainable_shard_bytes(model: nn.Module) -> int:
    """Bytes of real (not padding) trainable elements in this rank's shards."""
    total = 0
    for m in FSDP.fsdp_modules(model):
        for h in m._handles:
            if h.flat_param.requires_grad:
                for i in range(len(h.infos)):
                    sl = h.param_shard_slice(i)
                    total += 0 if sl is None else (sl[1] - sl[0]) * h.local_shard.element_size()
    return total


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    cfg = fsdp_wrap.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, fsdp_wrap.StateDictType.FULL_STATE_DICT, cfg):
        return {k: v.clone() for k, v in model.state_dict().items()}


def _plain_load(path: str, full: dict[str, torch.Tensor], want: torch.Tensor,
                quantized: bool = False) -> dict[str, Any]:
    """PEFT loads the adapter into a fresh base: which keys, which differ, the logits."""
    from peft import PeftModel
    from safetensors.torch import load_file

    base = _base()
    if quantized:
        from benchmarks._lora_models import quantize_nf4 as _quantize

        base = _quantize(base.to(torch.bfloat16))
        # The kernel the wrapped model ran (fsdp_wrap keeps flattened 4-bit
        # weights off bitsandbytes' AVX512-BF16 repacking, which also fails
        # outright on this model's 32-wide layers: narrower than a 64 block).
        for m in base.modules():
            if hasattr(m, "support_avx512bf16_for_cpu"):
                m.support_avx512bf16_for_cpu = False
    loaded = PeftModel.from_pretrained(base, path).eval()
    sd = loaded.state_dict()
    adapters = sorted(k for k in full if "lora_" in k)
    with torch.no_grad():
        got = loaded(input_ids=PROMPT).logits
    return {
        "adapters": adapters,
        "loaded_adapters": sorted(k for k in sd if "lora_" in k),
        "differ": [k for k in adapters if not torch.equal(sd[k], full[k])],
        "trained_b_zero": [k for k in adapters if "lora_B" in k and not full[k].any()],
        "logits_equal": bool(torch.equal(got, want)),
        "files": sorted(os.listdir(path)),
        "file_keys": sorted(load_file(os.path.join(path, "adapter_model.safetensors"))),
        "config": json.load(open(os.path.join(path, "adapter_config.json"))),
    }


def _peft_rows(tmp: str) -> list[dict[str, Any]]:
    warnings.simplefilter("ignore")
    rows = []
    for uop, strategy in CONFIGS:
        model = _wrap(tiny_lora(), uop, strategy)
        _train(model)
        path = os.path.join(tmp, f"adapter-{uop}-{strategy}")
        row: dict[str, Any] = {"config": (uop, strategy)}
        row["sent"] = _sent_bytes(save_full_checkpoint, model, path, trainable_only=True)
        row["trainable_shard"] = _trainable_shard_bytes(model)
        if (uop, strategy) == CONFIGS[0]:
            full_path = os.path.join(tmp, "full")
            row["full_sent"] = _sent_bytes(save_full_checkpoint, model, full_path)
            row["full_files"] = sum(os.path.getsize(os.path.join(full_path, f))
                                    for f in os.listdir(full_path) if f.endswith(".safetensors"))
        full = _full_state(model)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=PROMPT).logits
        dist.barrier()
        if dist.get_rank() == 0:
            row.update(_plain_load(path, full, logits))
            row["adapter_file"] = os.path.getsize(os.path.join(path, "adapter_model.safetensors"))
        rows.append(row)
        progress()
    return rows


def test_lora_adapter_saves_in_peft_layout_and_loads_in_one_process(pool2: Any, tmp_path: Any) -> None:
    ranks = pool2.run(_peft_rows, str(tmp_path))
    for rank, rows in enumerate(ranks):
        assert len(rows) == len(CONFIGS)
        for row in rows:
            # Exactly this rank's trainable shard left it (rank 0 sends nothing):
            # no frozen byte moved.
            want = 0 if rank == 0 else row["trainable_shard"]
            assert row["sent"] == want and (rank == 0 or want > 0), row
            if "full_sent" in row and rank == 1:
                assert row["full_sent"] > 20 * row["sent"], row
    for row in ranks[0]:
        assert len(row["adapters"]) == 8, row  # 2 layers x (q, v) x (A, B)
        assert row["loaded_adapters"] == row["adapters"], row
        # PEFT's names: the adapter's name taken out (PEFT would also load the
        # model's own names, so this is checked here and against PEFT below)
        assert row["file_keys"] == sorted(k.replace(".default.", ".") for k in row["adapters"]), row
        assert row["differ"] == [], row
        assert row["trained_b_zero"] == [], row  # the steps moved lora_B off PEFT's zeros
        assert row["logits_equal"], row
        assert {"adapter_model.safetensors", "adapter_config.json"} <= set(row["files"]), row
        assert not any(f.startswith("model") for f in row["files"]), row
        assert row["config"]["r"] == 4 and row["config"]["inference_mode"] is True, row
        assert sorted(row["config"]["target_modules"]) == ["q_proj", "v_proj"], row
    first = ranks[0][0]
    print(f"adapter file {first['adapter_file']} B, full files {first['full_files']} B; "
          f"rank 1 sent {ranks[1][0]['sent']} B for the adapter, {ranks[1][0]['full_sent']} B "
          "for the full save")


def test_peft_key_names_match_peft() -> None:
    """The key mapping equals PEFT's own ``get_peft_model_state_dict`` on a plain model:
    LoRA, DoRA, ``modules_to_save``."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    for extra in ({}, {"use_dora": True}, {"modules_to_save": ["lm_head"]}):
        model = get_peft_model(_base(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **extra))
        target = find_peft(list(model.named_modules()))
        assert target is not None and target.prefix == "" and target.adapter == "default"
        ours = {target.file_key(n) for n, p in model.named_parameters() if p.requires_grad}
        assert ours == set(get_peft_model_state_dict(model)), extra
    assert peft_key("a.lora_A.default.weight", "default") == "a.lora_A.weight"
    assert peft_key("a.default.lora_A.x.weight", "default") == "a.default.lora_A.x.weight"


# ----------------------------------------------- plain layout and refusals


def _plain_rows(tmp: str) -> dict[str, Any]:
    """A non-PEFT model whose one trainable parameter (a 1-element bias) sits on rank 0."""
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    for n, p in net.named_parameters():
        p.requires_grad_(n == "1.bias")
    model = FSDP(net, use_orig_params=True, device_id=torch.device("cpu"))
    out["trainable_shard"] = _trainable_shard_bytes(model)
    path = os.path.join(tmp, "plain")
    out["sent"] = _sent_bytes(save_full_checkpoint, model, path, trainable_only=True)
    out["full"] = _full_state(model)
    out["files"] = sorted(os.listdir(path)) if os.path.isdir(path) else None
    # refusals, each on every rank before anything moves
    out["errors"] = []
    for case in ("optim", "frozen", "disagree"):
        if case == "frozen":
            for p in model.parameters():
                p.requires_grad_(False)
        if case == "disagree":
            model.module[1].bias.requires_grad_(dist.get_rank() == 0)
        try:
            save_full_checkpoint(
                model, os.path.join(tmp, case), trainable_only=True,
                optim=torch.optim.SGD(model.parameters(), lr=1.0) if case == "optim" else None)
            out["errors"].append(None)
        except (ValueError, RuntimeError) as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
        out["errors"].append(os.path.exists(os.path.join(tmp, case)))
    return out


def test_plain_layout_rank_without_trainable_elements_and_refusals(pool2: Any, tmp_path: Any) -> None:
    from safetensors.torch import load_file

    r0, r1 = pool2.run(_plain_rows, str(tmp_path))
    assert r0["trainable_shard"] == 4 and r1["trainable_shard"] == 0  # rank 1: padding only
    assert r0["sent"] == r1["sent"] == 0
    assert r0["files"] == ["fsdp_wrap_checkpoint.json", "model-00001-of-00001.safetensors",
                           "model.safetensors.index.json"], r0
    stored = load_file(str(tmp_path / "plain" / "model-00001-of-00001.safetensors"))
    assert list(stored) == ["1.bias"] and torch.equal(stored["1.bias"], r0["full"]["1.bias"])
    for r in (r0, r1):
        optim, optim_dir, frozen, frozen_dir, disagree, disagree_dir = r["errors"]
        assert optim.startswith("ValueError") and "optimizer" in optim, optim
        assert frozen.startswith("ValueError") and "nothing to save" in frozen, frozen
        assert disagree.startswith("ValueError") and "different parameters" in disagree, disagree
        assert "'1.bias'" in disagree, disagree
        assert not (optim_dir or frozen_dir or disagree_dir)


# ----------------------------------------------------------------- QLoRA


def _qlora_rows(tmp: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    model = _wrap(tiny_lora(quantized=True), True, "FULL_SHARD")
    _train(model)
    path = os.path.join(tmp, "qlora")
    sent = _sent_bytes(save_full_checkpoint, model, path, trainable_only=True)
    row: dict[str, Any] = {"sent": sent, "trainable_shard": _trainable_shard_bytes(model)}
    full = _full_state(model)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROMPT).logits
    dist.barrier()
    if dist.get_rank() == 0:
        row.update(_plain_load(path, full, logits, quantized=True))
    return row


@pytest.mark.slow
def test_qlora_adapter_round_trip(tmp_path: Any) -> None:
    pytest.importorskip("bitsandbytes")
    pool = DistPool(2, timeout=600)  # importing bitsandbytes is slow (tests/test_peft.py)
    try:
        r0, r1 = pool.run(_qlora_rows, str(tmp_path))
    finally:
        pool.close()
    assert r0["sent"] == 0 and r1["sent"] == r1["trainable_shard"] > 0
    assert len(r0["adapters"]) == 8 and r0["loaded_adapters"] == r0["adapters"], r0
    assert r0["differ"] == [] and r0["trained_b_zero"] == [] and r0["logits_equal"], r0


def test_peft_is_optional(monkeypatch: Any) -> None:
    """Importing fsdp_wrap does not import peft; a model with a ``peft_config`` and no
    peft installed gets an ImportError naming the extra."""
    import subprocess
    import sys

    code = "import sys, fsdp_wrap, fsdp_wrap.checkpoint; print('peft' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         check=True)
    assert out.stdout.strip() == "False", out
    monkeypatch.setitem(sys.modules, "peft", None)  # import fails as if not installed
    holder = nn.Linear(2, 2)
    holder.peft_config = {"default": object()}  # type: ignore[assignment]
    with pytest.raises(ImportError, match=r"needs peft.*\[finetune\]"):
        find_peft([("", holder)])
