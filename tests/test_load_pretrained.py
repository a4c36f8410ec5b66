"""``load_pretrained``: Hugging Face checkpoints straight into the shards of a meta-built model.

Real ``transformers`` models (tiny LLaMA with its rotary buffers, GPT-2 with its
head tied to the token embedding, BERT with its position-id buffers and tied
decoder) are saved with ``save_pretrained`` in bf16 and fp32, as one file and
as several (an index).  On 2 and 3 gloo ranks each is built on the meta
device, wrapped (nested units, every sharding strategy, ``use_orig_params``
both ways, CPU offload, mixed precision) with ``pretrained_init`` and filled
with ``load_pretrained``; every rank's flat shards must equal, bit for bit,
those of ``from_pretrained(..., dtype=float32)`` wrapped the same way, and so
must every buffer (non-persistent ones included) and the forward's logits.
Then the wrapper prefixes (the base model alone, PEFT's LoRA model) and the
refusals: a missing tensor, a mis-shaped one, one only some ranks see wrong,
each named on every rank with the model untouched.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests._sweep import any_rank, run_sweep

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
FSDP = fsdp_wrap.FullyShardedDataParallel


# ------------------------------------------------------------------ models


def _arch(name: str) -> tuple[Any, Any, set[type], set[type]]:
    """``(config, model class, unit classes, nested unit classes)``."""
    T = transformers
    if name == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

        cfg = T.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=40,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            max_position_embeddings=32, tie_word_embeddings=False)
        return cfg, T.LlamaForCausalLM, {LlamaDecoderLayer}, {LlamaDecoderLayer, LlamaMLP}
    if name == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Block

        cfg = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
        return cfg, T.GPT2LMHeadModel, {GPT2Block}, {GPT2Block, GPT2MLP}
    from transformers.models.bert.modeling_bert import BertIntermediate, BertLayer

    cfg = T.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=40, max_position_embeddings=24)
    return cfg, T.BertForMaskedLM, {BertLayer}, {BertLayer, BertIntermediate}


ARCHS = ("llama", "gpt2", "bert")
CKPTS = [(dtype, layout) for dtype in ("bf16", "fp32") for layout in ("single", "sharded")]


def _save(root: str, arch: str, dtype: str, layout: str, model_cls: Any = None) -> str:
    """``save_pretrained`` of a model whose every tensor is distinct (random, not
    the init's ones and zeros), tied weights tied."""
    cfg, cls, _, _ = _arch(arch)
    cls = model_cls or cls
    torch.manual_seed(0)
    model = cls(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    path = os.path.join(root, f"{arch}-{cls.__name__}-{dtype}-{layout}")
    model.save_pretrained(path, max_shard_size="3KB" if layout == "sharded" else "5GB")
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: Any) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("hf"))
    out = {f"{a}-{d}-{lay}": _save(root, a, d, lay) for a in ARCHS for d, lay in CKPTS}
    T = transformers
    out["llama-base"] = _save(root, "llama", "fp32", "single", T.LlamaModel)
    return out


def test_checkpoints_are_what_save_pretrained_writes(ckpts: dict[str, str]) -> None:
    for name, path in ckpts.items():
        files = os.listdir(path)
        if "sharded" in name:
            assert "model.safetensors.index.json" in files, name
            assert sum(f.endswith(".safetensors") for f in files) > 2, name
        else:
            assert "model.safetensors" in files, name
    # the tied heads are stored once
    from safetensors import safe_open

    with safe_open(os.path.join(ckpts["gpt2-fp32-single"], "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    with safe_open(os.path.join(ckpts["bert-bf16-single"], "model.safetensors"), "pt") as f:
        assert f.get_tensor("bert.embeddings.word_embeddings.weight").dtype == torch.bfloat16


# ------------------------------------------------------------ rank side


def _wrap_kw(units: set[type], uop: bool, strategy: str, extra: str | None) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        auto_wrap_policy=ModuleWrapPolicy(units), device_id=CPU, use_orig_params=uop,
        sharding_strategy=fsdp_wrap.ShardingStrategy[strategy],
    )
    if extra == "offload":
        kw["cpu_offload"] = fsdp_wrap.CPUOffload(offload_params=True)
    if extra == "mp":
        kw["mixed_precision"] = fsdp_wrap.MixedPrecision(param_dtype=torch.bfloat16,
                                                         buffer_dtype=torch.bfloat16)
    return kw


def _meta_model(path: str, cls: Any) -> nn.Module:
    cfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return cls._from_config(cfg, dtype=torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _compare(ours: nn.Module, ref: nn.Module, arch: str, what: str) -> list[str]:
    """Every rank's shards, buffers and logits, bit for bit."""
    fails = []
    a_units, b_units = FSDP.fsdp_modules(ours), FSDP.fsdp_modules(ref)
    if len(a_units) != len(b_units):
        return [f"{what}: {len(a_units)} units against {len(b_units)}"]
    for i, (a, b) in enumerate(zip(a_units, b_units)):
        ha, hb = a._handle, b._handle
        if (ha is None) != (hb is None):
            fails.append(f"{what}: unit {i} handle presence differs")
        elif ha is not None and not torch.equal(_bits(ha.local_shard), _bits(hb.local_shard)):
            fails.append(f"[rank {dist.get_rank()}] {what}: unit {i} ({ha.unit_fqn!r}) shard differs")
    vocab = {"llama": 64, "gpt2": 50, "bert": 60}[arch]
    x = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(dist.get_rank()))
    ours.eval(), ref.eval()  # (no dropout)
    with torch.no_grad():
        la, lb = ours(x).logits, ref(x).logits
    if not torch.equal(la, lb):
        fails.append(f"[rank {dist.get_rank()}] {what}: logits differ by {(la - lb).abs().max()}")
    # after the forward: both trees lazily initialised (buffer_dtype casts made)
    bufs_a, bufs_b = dict(ours.named_buffers()), dict(ref.named_buffers())
    if sorted(bufs_a) != sorted(bufs_b):
        fails.append(f"{what}: buffers {sorted(bufs_a)} against {sorted(bufs_b)}")
    for k in bufs_a.keys() & bufs_b.keys():
        if bufs_a[k].dtype != bufs_b[k].dtype or not torch.equal(bufs_a[k], bufs_b[k]):
            fails.append(f"[rank {dist.get_rank()}] {what}: buffer {k} differs")
    return fails


def _quiet() -> None:
    warnings.simplefilter("ignore")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _one_load(case: tuple[Any, ...]) -> list[str]:
    path, arch, uop, strategy, nested, extra = case
    _quiet()
    cfg, cls, units, nested_units = _arch(arch)
    kw = _wrap_kw(nested_units if nested else units, uop, strategy, extra)
    meta = _meta_model(path, cls)
    ours = FSDP(meta, param_init_fn=fsdp_wrap.pretrained_init(meta, path), **kw)
    result = fsdp_wrap.load_pretrained(ours, path)
    ref = FSDP(cls.from_pretrained(path, dtype=torch.float32), **kw)
    what = f"{os.path.basename(path)} uop={uop} {strategy} nested={nested} {extra}"
    fails = _compare(ours, ref, arch, what)
    if result.missing_keys or result.unexpected_keys:
        fails.append(f"{what}: {result}")
    return fails


def _load_cases(ckpts: dict[str, str], world: int) -> list[tuple[Any, ...]]:
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
    extras = [None, "offload", None, "mp"]
    cases = []
    i = 0
    for arch in ARCHS:
        for dtype, layout in CKPTS:
            if world == 3 and i % 2:  # fewer at 3 ranks: every arch, dtype and layout still
                i += 1
                continue
            path = ckpts[f"{arch}-{dtype}-{layout}"]
            cases.append((path, arch, bool(i % 2) ^ (world == 3), strategies[i % 3],
                          i % 3 == 0, extras[i % 4]))
            i += 1
    return cases


def _sweep_loads(cases: list[tuple[Any, ...]]) -> list[str]:
    return run_sweep(cases, _one_load)


def test_loads_bit_for_bit_like_from_pretrained_2_ranks(pool2: Any, ckpts: dict[str, str]) -> None:
    cases = _load_cases(ckpts, 2)
    assert {c[2] for c in cases} == {False, True} and {c[5] for c in cases} >= {"offload", "mp"}
    fails = pool2.run(_sweep_loads, cases)
    assert fails == [[], []], "\n".join(f for r in fails for f in r)


@pytest.mark.slow  # (the 2-rank sweep covers every case in the default run)
def test_loads_bit_for_bit_like_from_pretrained_3_ranks(pool3: Any, ckpts: dict[str, str]) -> None:
    fails = pool3.run(_sweep_loads, _load_cases(ckpts, 3))
    assert fails == [[], [], []], "\n".join(f for r in fails for f in r)


# ---------------------------------------------------- prefixes and PEFT


def _outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _full_sd(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.state_dict_type(model, fsdp_wrap.StateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in model.state_dict().items()}


def _prefixes(paths: dict[str, str]) -> list[str]:
    """The base model alone from a checkpoint of the model with a head, and back."""
    _quiet()
    T = transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    fails: list[str] = []
    kw = _wrap_kw({LlamaDecoderLayer}, True, "FULL_SHARD", None)
    full = paths["llama-bf16-sharded"]
    # LlamaModel from LlamaForCausalLM's checkpoint: 'model.' prepended, lm_head not read
    meta = _meta_model(full, T.LlamaModel)
    ours = FSDP(meta, param_init_fn=fsdp_wrap.pretrained_init(meta, full), **kw)
    got = fsdp_wrap.load_pretrained(ours, full)
    ref = FSDP(T.LlamaModel.from_pretrained(full, dtype=torch.float32), **kw)
    if got != ([], []):
        fails.append(f"base model: {got}")
    x = torch.randint(0, 64, (2, 5))
    if not torch.equal(_outputs(ours, x), _outputs(ref, x)):
        fails.append("base model: outputs differ from LlamaModel.from_pretrained")
    for (k, a), (_, b) in zip(sorted(_full_sd(ours).items()), sorted(_full_sd(ref).items())):
        if not torch.equal(a, b):
            fails.append(f"base model: {k} differs")
    # LlamaForCausalLM from LlamaModel's checkpoint: 'model.' dropped, the head missing
    base = paths["llama-base"]
    meta = _meta_model(base, T.LlamaForCausalLM)
    ours = FSDP(meta, param_init_fn=fsdp_wrap.pretrained_init(meta, base), **kw)
    try:
        fsdp_wrap.load_pretrained(ours, base)
        fails.append("a head missing from the checkpoint was not refused")
    except RuntimeError as e:
        if 'Missing key(s) in state_dict: "lm_head.weight"' not in str(e):
            fails.append(f"missing head: {e}")
    got = fsdp_wrap.load_pretrained(ours, base, strict=False)
    if got != (["lm_head.weight"], []):
        fails.append(f"head model from base checkpoint: {got}")
    sd = _full_sd(ours)
    want = T.LlamaModel.from_pretrained(base, dtype=torch.float32).state_dict()
    for k, v in want.items():
        if not torch.equal(sd["model." + k], v):
            fails.append(f"head model from base checkpoint: model.{k} differs")
    head = sd["lm_head.weight"]
    # the head drawn by the model's own init (normal, std initializer_range = 0.02):
    # the sample std of n draws is within 6 standard errors (0.02 / sqrt(2n))
    se = 0.02 / (2 * head.numel()) ** 0.5
    if not torch.isfinite(head).all() or abs(head.std().item() - 0.02) > 6 * se:
        fails.append(f"head not initialised by _init_weights: std {head.std().item()}")
    return fails


def test_base_model_prefix_both_ways(pool2: Any, ckpts: dict[str, str]) -> None:
    fails = pool2.run(_prefixes, ckpts)
    assert fails == [[], []], "\n".join(f for r in fails for f in r)


def _peft(path: str) -> list[str]:
    """A LoRA model built on meta, the base checkpoint loaded under PEFT's names."""
    _quiet()
    peft = pytest.importorskip("peft")
    T = transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    kw = _wrap_kw({LlamaDecoderLayer}, True, "FULL_SHARD", None)
    meta = peft.get_peft_model(_meta_model(path, T.LlamaForCausalLM), lora)
    ours = FSDP(meta, param_init_fn=fsdp_wrap.pretrained_init(meta, path), **kw)
    got = fsdp_wrap.load_pretrained(ours, path)
    ref = peft.get_peft_model(T.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32), lora)
    ref = FSDP(ref, **kw)
    a, b = _full_sd(ours), _full_sd(ref)
    fails = []
    adapters = sorted(k for k in a if "lora_" in k)
    if sorted(got.missing_keys) != adapters or len(adapters) != 8 or got.unexpected_keys:
        fails.append(f"PEFT: {got} (adapters {adapters})")
    if sorted(a) != sorted(b):
        fails.append(f"PEFT: keys {sorted(set(a) ^ set(b))}")
    for k in a.keys() & b.keys():
        if "lora_B" in k and not torch.equal(a[k], torch.zeros_like(a[k])):
            fails.append(f"PEFT: {k} is not PEFT's zero init")
        elif "lora_A" in k:
            # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = a[k].shape[1] ** -0.5
            if not (a[k].abs() <= bound).all() or a[k].std() == 0:
                fails.append(f"PEFT: {k} is not PEFT's kaiming init")
        elif not torch.equal(a[k], b[k]):
            fails.append(f"PEFT: base weight {k} differs")
    return fails


def test_peft_lora_model_reads_the_base_checkpoint(pool2: Any, ckpts: dict[str, str]) -> None:
    pytest.importorskip("peft")
    fails = pool2.run(_peft, ckpts["llama-bf16-sharded"])
    assert fails == [[], []], "\n".join(f for r in fails for f in r)


# ------------------------------------------------------------- refusals


def _edit(src: str, dst: str, change: Any) -> str:
    """A copy of the single-file checkpoint ``src`` with ``change(tensors)`` applied."""
    import shutil

    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    tensors = safetensors_torch.load_file(f)
    change(tensors)
    safetensors_torch.save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def broken(ckpts: dict[str, str], tmp_path_factory: Any) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("broken"))
    src = ckpts["llama-bf16-single"]
    up, q = "model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"

    def drop(t: dict[str, torch.Tensor]) -> None:
        del t[up]

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t[q] = t[q][:8].clone()

    def extra(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.extra.weight"] = torch.ones(3, dtype=torch.bfloat16)

    def to_int(t: dict[str, torch.Tensor]) -> None:
        t[up] = t[up].to(torch.int32)

    return {
        "good": src,
        "missing": _edit(src, os.path.join(root, "missing"), drop),
        "shape": _edit(src, os.path.join(root, "shape"), reshape),
        "extra": _edit(src, os.path.join(root, "extra"), extra),
        "int": _edit(src, os.path.join(root, "int"), to_int),
        "nowhere": os.path.join(root, "nowhere"),
    }


def _shards(model: nn.Module) -> list[torch.Tensor]:
    return [m._handle.local_shard.clone() for m in FSDP.fsdp_modules(model) if m._handle]


def _refusals(paths: dict[str, str]) -> list[str]:
    _quiet()
    T = transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    rank = dist.get_rank()
    kw = _wrap_kw({LlamaDecoderLayer}, False, "FULL_SHARD", None)
    good = paths["good"]
    meta = _meta_model(good, T.LlamaForCausalLM)
    model = FSDP(meta, param_init_fn=fsdp_wrap.pretrained_init(meta, good), **kw)
    fsdp_wrap.load_pretrained(model, good)
    before = _shards(model)
    fails: list[str] = []
    cases = [
        # (path on this rank, expected exception, words every rank's message holds)
        (paths["missing"], RuntimeError,
         ['Missing key(s) in state_dict: "model.layers.1.mlp.up_proj.weight"', "strict=False"]),
        (paths["shape"], RuntimeError,
         ["size mismatch for model.layers.0.self_attn.q_proj.weight: copying a param with "
          "shape [8, 16] from checkpoint, the shape in current model is [16, 16]"]),
        (paths["extra"], RuntimeError,
         ['Unexpected key(s) in state_dict: "model.layers.0.extra.weight"']),
        (paths["int"], RuntimeError,
         ["dtype mismatch for model.layers.1.mlp.up_proj.weight", "torch.int32"]),
        (paths["nowhere"], FileNotFoundError, ["no checkpoint at"]),
        # only rank 1 sees a broken checkpoint: every rank refuses, none loads
        (paths["missing"] if rank == 1 else good, RuntimeError,
         ["model.layers.1.mlp.up_proj.weight", "rank" if rank == 1 else "refused on rank(s) [1]"]),
    ]
    for path, exc, words in cases:
        try:
            fsdp_wrap.load_pretrained(model, path)
            fails.append(f"[rank {rank}] {path}: not refused")
        except exc as e:
            missing = [w for w in words if w not in str(e)]
            if missing or f"[rank {rank}]" not in str(e):
                fails.append(f"[rank {rank}] {path}: message lacks {missing}: {e}")
        if any_rank(not all(torch.equal(a, b) for a, b in zip(before, _shards(model)))):
            fails.append(f"[rank {rank}] {path}: the model was touched before the refusal")
    got = fsdp_wrap.load_pretrained(model, paths["extra"], strict=False)
    if got != ([], ["model.layers.0.extra.weight"]):
        fails.append(f"strict=False: {got}")
    if not all(torch.equal(a, b) for a, b in zip(before, _shards(model))):
        fails.append("strict=False: the shards differ from the good checkpoint's")
    try:
        fsdp_wrap.load_pretrained(T.LlamaForCausalLM(T.AutoConfig.from_pretrained(good)), good)
        fails.append("an unwrapped model was not refused")
    except TypeError as e:
        if "FullyShardedDataParallel" not in str(e):
            fails.append(f"unwrapped: {e}")
    return fails


def test_refusals_are_agreed_and_named_before_touching_the_model(
    pool2: Any, broken: dict[str, str]
) -> None:
    fails = pool2.run(_refusals, broken)
    assert fails == [[], []], "\n".join(f for r in fails for f in r)


# ---------------------------------------------------------- frameworks


@pytest.mark.slow
@pytest.mark.framework_scenario("pretrained")
def test_accelerate_and_trainer_train_the_same_from_a_meta_load(request: pytest.FixtureRequest) -> None:
    """tests/frameworks/pretrained_run.py under torchrun: Accelerate (pretrained_init as the
    plugin's param_init_fn, load_pretrained after prepare) and the Trainer (a model wrapped
    and loaded before it is built) train exactly as from from_pretrained."""
    from tests._framework_runs import results

    for r in results(request):
        assert r["accelerate/class"] == r["trainer/class"] == "fsdp_wrap.fully_sharded_data_parallel"
        assert r["accelerate/load"] == r["trainer/load"] == [[], []]
        assert r["trainer/same_object"] is True  # Accelerate left the wrapped model as it was
        for name in ("accelerate", "trainer"):
            assert len(r[f"{name}/meta"]) == 3
            assert r[f"{name}/meta"] == r[f"{name}/from_pretrained"], (name, r)


class _NoInit(nn.Module):
    """A module whose buffer nothing can compute once it is on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0))


def _no_init_is_refused() -> list[str]:
    with torch.device("meta"):
        model = nn.Sequential(_NoInit())
    # parameters only on meta (the buffer built for real) is fine: the buffer is kept
    kept = nn.Sequential(_NoInit())
    kept[0].lin.to_empty(device="meta")
    try:
        FSDP(model, device_id=CPU, param_init_fn=fsdp_wrap.pretrained_init(model))
        return ["a meta buffer with no init was accepted"]
    except ValueError as e:
        if "module '0' (_NoInit)" not in str(e) or "['table']" not in str(e):
            return [str(e)]
    wrapped = FSDP(kept, device_id=CPU, param_init_fn=fsdp_wrap.pretrained_init(kept))
    if not torch.equal(wrapped.module[0].table, torch.arange(4.0)):
        return ["a buffer built on a real device was not kept"]
    return []


def test_pretrained_init_refuses_a_buffer_it_cannot_compute(pool2: Any) -> None:
    assert pool2.run(_no_init_is_refused) == [[], []]
