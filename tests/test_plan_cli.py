"""``fsdp-wrap plan``: the table, JSON and ``--compare``; Hugging Face configs
(a LLaMA-7B plan on the meta device); PEFT LoRA; the errors a person can act
on; and a plan refusing what the constructor refuses.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

import fsdp_wrap as fw
from fsdp_wrap.wrap import (
    ModuleWrapPolicy,
)
from tests._plan_common import (
    Stack,
    make_stack,
)
from tests.models import Block

# ---------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------




def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    from fsdp_wrap.cli import main

    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_cli_table_json_and_compare(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    out = _cli(capsys, "tests._plan_common:make_stack", "--factory-kwargs", '{"n": 3}',
               "--world-size", "8", "--policy", "transformer:Block")
    assert "blocks.0 .. blocks.2 (3 units)" in out and "peak, without activations" in out
    data = json.loads(_cli(capsys, "tests._plan_common:make_stack", "--world-size", "4",
                           "--policy", "transformer:Block", "--mixed-precision", "bf16",
                           "--offload", "--json"))
    want = fw.plan(make_stack(), 4, auto_wrap_policy=ModuleWrapPolicy({Block}),
                   mixed_precision=fw.MixedPrecision(param_dtype=torch.bfloat16),
                   cpu_offload=fw.CPUOffload(True))
    assert data == json.loads(json.dumps(want.to_dict()))
    out = _cli(capsys, "tests._plan_common:make_stack", "--world-size", "8", "--policy",
               "size:1000", "--compare", "--gpu-memory", "0.0001")
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        assert out.count(strategy) == 4  # offload x precision
    assert "fits" in out and " no" in out


def test_cli_hf_config_and_auto_policy(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    import json

    cfg = json.dumps({"model_type": "gpt2", "n_layer": 3, "n_embd": 64, "n_head": 4,
                      "vocab_size": 1000, "n_positions": 32})
    data = json.loads(_cli(capsys, "--hf-config", cfg, "--world-size", "4", "--json"))
    # auto: transformers' _no_split_modules (GPT2Block) become the units.
    assert [u["fqn"] for u in data["units"]] == ["", "transformer.h.0", "transformer.h.1",
                                                 "transformer.h.2"]
    assert data["units"][1]["module"] == "GPT2Block"


def test_cli_llama_7b_config_plans_on_the_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    """A 7B-class model is planned without allocating it (the docs' worked example)."""
    pytest.importorskip("transformers")
    import json

    cfg = json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                      "num_hidden_layers": 32, "num_attention_heads": 32,
                      "num_key_value_heads": 32, "vocab_size": 32000})
    data = json.loads(_cli(capsys, "--hf-config", cfg, "--world-size", "64", "--json",
                           "--mixed-precision", "bf16"))
    assert data["total_params"] == 6_738_415_616
    assert len(data["units"]) == 33
    # Parameters fp32, sharded over 64 ranks; Adam: two states of the same size.
    assert data["memory"]["params_device"] == sum(u["shard_bytes"] for u in data["units"])
    assert data["memory"]["optimizer_device"] == 2 * data["memory"]["params_device"]


def test_cli_peft_lora(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--peft lora:...``: the adapters are the only trainable parameters; the
    plan equals ``fw.plan`` of the same PEFT model built by hand; a bad spec is a
    usage error before anything is built; without peft the error names the extra."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import json

    from fsdp_wrap.cli import main

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    data = json.loads(_cli(capsys, "--hf-config", json.dumps(cfg), "--world-size", "2",
                           "--json", "--peft", "lora:r=4,targets=q_proj,v_proj,alpha=8"))
    # Per layer: q_proj and v_proj (64 -> 64) each get A (4 x 64) and B (64 x 4).
    assert [u["trainable_params"] for u in data["units"]] == [0, 2 * 2 * 4 * 64, 2 * 2 * 4 * 64]
    assert [[f["requires_grad"] for f in u["flat_params"]] for u in data["units"]] == [
        [False], [True, False], [True, False]]
    layer = data["units"][1]["flat_params"][0]
    assert data["memory"]["grads_device"] == 2 * layer["shard_numel"] * 4
    assert data["memory"]["optimizer_device"] == 2 * data["memory"]["grads_device"]
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                                 target_modules=["q_proj", "v_proj"]))
    want = fw.plan(model, 2, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    assert data == json.loads(json.dumps(want.to_dict()))

    for spec, text in (("lora:r=0", "r must be at least 1"), ("ia3:r=4", "supports lora"),
                       ("lora:r=4,bogus=1", "unknown key 'bogus'"),
                       ("lora:q_proj", "is not KEY=VALUE"), ("lora:r=four", "is not int")):
        assert main(["plan", "tests._plan_common:no_such_factory", "--world-size", "2",
                     "--peft", spec]) == 2, spec  # before the factory is looked up
        assert text in capsys.readouterr().err, spec
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    assert main(["plan", "tests._plan_common:make_stack", "--world-size", "2",
                 "--peft", "lora:r=4,targets=mix"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'fsdp_wrap[finetune]'" in err and err.count("\n") == 1, err


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Usage errors exit 2, failures 1, each one line on stderr (tests/test_cli.py: the rest)."""
    from fsdp_wrap.cli import main

    cases = [
        (1, "no module class named", ["tests._plan_common:make_stack", "--policy", "transformer:Nope"]),
        (2, "either MODULE:FACTORY or --hf-config", []),
        (2, "unknown --policy", ["tests._plan_common:make_stack", "--policy", "bogus"]),
        (1, "cannot import 'no_such_module_here'", ["no_such_module_here:build"]),
        (2, "expected MODULE:FACTORY", ["tests.test_plan"]),
    ]
    for code, text, argv in cases:
        assert main(["plan", "--world-size", "2", *argv]) == code, argv
        err = capsys.readouterr().err
        assert text in err and "Traceback" not in err and err.count("\n") == 1, err


def test_plan_refuses_what_the_constructor_refuses_without_a_policy() -> None:
    """The handle's own checks run for every planned unit, not only the wrap pass's."""
    with torch.device("meta"):
        scalar = Stack()
        scalar.register_parameter("gain", nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(ValueError, match="doesn't support scalar parameters. Change gain"):
        fw.plan(scalar, 2)
