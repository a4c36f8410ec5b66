"""TRL's ``SFTTrainer`` on FSDP1 through Accelerate's plugin: full fine-tune, LoRA, QLoRA.

torch's FSDP1 first (SHARDED: its FULL save with ``offload_to_cpu`` crashes on
CPU), then fsdp_wrap after ``install()`` over both state-dict types and both
``use_orig_params``.  Each run: 3 steps with a checkpoint at step 2 (losses;
each rank's trainable pieces changed from their first values); a second
trainer resumes from step 2 (its losses and final pieces against the
uninterrupted run's; on torch's FSDP1 for LoRA only, to show that its resume
restores no adapter); on fsdp_wrap, ``save_model`` (under SHARDED after
``set_state_dict_type("FULL_STATE_DICT")``, the documented recipe: the
Trainer saves nothing of an FSDP model otherwise) reloaded in a plain
process, and ``load_adapter`` into the wrapped model.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist
from _common import OUT, record
from _trl import (
    SAVE_EVERY,
    Snapshot,
    args,
    base_dir,
    build,
    changed,
    check_load_adapter,
    check_saved,
    load,
    lora,
    losses,
    max_diff,
    sentences,
    tokenizer,
    trainable,
)


def trainer(base: str, out: str, kind: str, sdt: str, uop: bool, snap: object = None,
            save: bool = True) -> object:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": sentences(16, 4, 12, seed=0)})
    return build(SFTTrainer, SFTConfig, args(out, sdt, uop, save, learning_rate=5e-2, max_length=16),
                 model=load(base, kind), train_dataset=data, processing_class=tokenizer(),
                 peft_config=lora(kind), callbacks=[snap] if snap is not None else None)


def run(impl: str, kind: str, sdt: str, uop: bool) -> None:
    t0 = time.perf_counter()
    base = base_dir(OUT)
    key = f"sft/{impl}/{kind}/{sdt}/{uop}"
    out = os.path.join(OUT, key.replace("/", "_"))
    snap = Snapshot()
    tr = trainer(base, out, kind, sdt, uop, snap)
    tr.train()
    record(key + "/class", type(tr.model_wrapped).__module__)
    record(key + "/losses", losses(tr))
    done = trainable(tr.model_wrapped)
    record(key + "/trained", changed(snap.first, done))
    t1 = time.perf_counter()
    if impl == "torch" and kind != "lora":
        return
    again = trainer(base, out, kind, sdt, uop, save=False)
    again.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE_EVERY}"))
    record(key + "/resumed", losses(again))
    record(key + "/resumed_vs_whole", max_diff(done, trainable(again.model_wrapped)))
    del again
    t2 = time.perf_counter()
    record(key + "/seconds", [t1 - t0, t2 - t1])
    if impl == "torch":
        return
    final = os.path.join(out, "final")
    if sdt != "FULL_STATE_DICT":
        tr.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    tr.save_model(final)
    dist.barrier()
    check_saved(key, kind, base, final, tr.model_wrapped, tr.args.bf16)
    if kind != "full":
        check_load_adapter(key, final, tr.model_wrapped)
    dist.barrier()
    record(key + "/seconds", [t1 - t0, t2 - t1, time.perf_counter() - t2])


def torch_part() -> None:
    for kind, uop in (("lora", True), ("qlora", True), ("full", True), ("full", False)):
        run("torch", kind, "SHARDED_STATE_DICT", uop)


def ours_part() -> None:
    for kind, sdt, uop in (("lora", "FULL_STATE_DICT", True), ("lora", "SHARDED_STATE_DICT", False),
                           ("lora", "FULL_STATE_DICT", False), ("lora", "SHARDED_STATE_DICT", True),
                           ("qlora", "FULL_STATE_DICT", False), ("qlora", "SHARDED_STATE_DICT", True),
                           ("full", "FULL_STATE_DICT", True), ("full", "SHARDED_STATE_DICT", False)):
        run("ours", kind, sdt, uop)
