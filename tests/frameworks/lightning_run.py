"""Lightning Fabric and the Lightning Trainer with ``FSDPStrategy``, on fsdp_wrap.

Lightning refuses FSDP on CPU (an exact-type check on the strategy; a subclass
passes), and torch's FSDP1 then refuses a CPU ``device_id``, so torch's FSDP1
cannot run under Lightning here.  The oracle is torch's FSDP1 driven directly:
after ``uninstall()``, the batches each run saw are replayed through torch's
class with the same wrapping, optimizer, clipping and accumulation, and the
losses must agree.

Fabric: 3 steps (the first accumulating 2 micro-batches under
``no_backward_sync``, every step clipping the gradient norm), ``fabric.save``,
2 more steps (reference), a fresh model ``fabric.load`` and the same 2 steps.
Trainer: ``fit`` 3 steps, ``save_checkpoint``, a fresh ``fit`` to step 6 from
it (Lightning restarts the epoch's batches: torch replays what it saw after
the first 3 steps), and an uninterrupted 6-step ``fit``.  FULL checkpoints are also loaded
into the plain model.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from _common import (
    OUT,
    RANK,
    Block,
    full_params_match,
    record,
    tiny_gpt2,
)
from _common import mlp as net

# (result key, steps of micro-batches, use_orig_params, clip): replayed on torch's FSDP1.
REPLAYS: list[tuple[str, list[list[torch.Tensor]], bool, bool]] = []


def batch(step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + RANK)
    return torch.randn(4, 16, generator=g)


def torch_replay(steps: list[list[torch.Tensor]], uop: bool, clip: bool) -> list[float]:
    """torch's FSDP1, no framework: one entry per optimizer step (micro-batches)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    assert FullyShardedDataParallel.__module__.startswith("torch."), "uninstall() first"
    model = FullyShardedDataParallel(net(), auto_wrap_policy=ModuleWrapPolicy({Block}),
                                     use_orig_params=uop, device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for micro in steps:
        for i, x in enumerate(micro):
            ctx = model.no_sync() if i < len(micro) - 1 else _null()
            with ctx:
                loss = model(x).pow(2).mean()
                loss.backward()
        if clip:
            model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ------------------------------------------------------------------- Fabric


def fabric_run(uop: bool, sdt: str) -> None:
    import lightning as L
    from lightning.fabric.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning gates FSDP to GPUs by the strategy's exact type."""

    def make() -> tuple[object, nn.Module, torch.optim.Optimizer]:
        strategy = CPUFSDPStrategy(auto_wrap_policy={Block}, use_orig_params=uop,
                                   process_group_backend="gloo", state_dict_type=sdt)
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        model = fabric.setup_module(net())
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        return fabric, model, opt

    def step(fabric: object, model: nn.Module, opt: torch.optim.Optimizer,
             micro: list[torch.Tensor]) -> float:
        for i, x in enumerate(micro):
            with fabric.no_backward_sync(model, enabled=i < len(micro) - 1):  # type: ignore[attr-defined]
                loss = model(x).pow(2).mean()
                fabric.backward(loss)  # type: ignore[attr-defined]
        fabric.clip_gradients(model, opt, max_norm=1.0)  # type: ignore[attr-defined]
        opt.step()
        opt.zero_grad()
        return loss.item()

    key = f"fabric/{sdt}/{uop}"
    plan = [[batch(0, 0), batch(0, 1)]] + [[batch(s)] for s in range(1, 5)]
    fabric, model, opt = make()
    record(key + "/class", type(model._forward_module).__module__)  # type: ignore[union-attr]
    train = [step(fabric, model, opt, plan[s]) for s in range(3)]
    path = os.path.join(OUT, f"fabric_{sdt}_{uop}")
    fabric.save(path, {"model": model, "optimizer": opt, "step": 3})  # type: ignore[attr-defined]
    if sdt == "full":
        full = torch.load(path, map_location="cpu", weights_only=True)["model"]
        plain = net()
        plain.load_state_dict(full)
        record(key + "/plain_vs_trained", full_params_match(model._forward_module, full))  # type: ignore[union-attr]
    ref = [step(fabric, model, opt, plan[s]) for s in range(3, 5)]
    fabric2, model2, opt2 = make()
    rest = fabric2.load(path, {"model": model2, "optimizer": opt2})  # type: ignore[attr-defined]
    resumed = [step(fabric2, model2, opt2, plan[s]) for s in range(3, 5)]
    record(key + "/train", train)
    record(key + "/ref", ref)
    record(key + "/resumed", resumed)
    record(key + "/remainder", rest)
    REPLAYS.append((key + "/torch", plan, uop, True))


# ------------------------------------------------------------------ Trainer


def trainer_run(uop: bool, sdt: str) -> None:
    import lightning as L
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning gates FSDP to GPUs by the strategy's exact type."""

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.seen: list[torch.Tensor] = []
            self.losses: list[float] = []

        def training_step(self, b: list[torch.Tensor], i: int) -> torch.Tensor:
            self.seen.append(b[0].clone())
            loss = self.net(b[0]).pow(2).mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 16, generator=g))

    def fit(steps: int, ckpt: str | None = None) -> tuple[LM, object]:
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_steps=steps, logger=False,
            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
            strategy=CPUFSDPStrategy(auto_wrap_policy={Block}, use_orig_params=uop,
                                     process_group_backend="gloo", state_dict_type=sdt))
        lm = LM()
        trainer.fit(lm, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt)
        return lm, trainer

    key = f"trainer/{sdt}/{uop}"
    whole, _ = fit(6)
    first, trainer = fit(3)
    path = os.path.join(OUT, f"lightning_{sdt}_{uop}.ckpt")
    trainer.save_checkpoint(path)  # type: ignore[attr-defined]
    if sdt == "full":
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        plain = LM()
        plain.load_state_dict(ckpt["state_dict"])
        record(key + "/plain_vs_trained",
               full_params_match(trainer.strategy.model, ckpt["state_dict"]))  # type: ignore[attr-defined]
    second, _ = fit(6, ckpt=path)
    record(key + "/whole", whole.losses)
    record(key + "/first", first.losses)
    record(key + "/resumed", second.losses)
    REPLAYS.append((key + "/torch", [[x] for x in whole.seen], uop, False))
    # Lightning restarts a non-resumable dataloader's epoch on resume: the
    # oracle for the resumed run is the first run's batches, then its own.
    REPLAYS.append((key + "/torch_resumed", [[x] for x in first.seen + second.seen], uop, False))


def gpt2_replay(steps: list[torch.Tensor], wrap_root: bool) -> list[float]:
    """fsdp_wrap without a framework: blocks (and the root) wrapped as the user does, AdamW."""
    import fsdp_wrap

    model = tiny_gpt2()
    for i, b in enumerate(model.transformer.h):
        model.transformer.h[i] = fsdp_wrap.FullyShardedDataParallel(b, use_orig_params=True)
    if wrap_root:
        model = fsdp_wrap.FullyShardedDataParallel(model, use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for x in steps:
        loss = model(input_ids=x, labels=x).loss
        out.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return out


def trainer_gpt2_run(sdt: str, wrap_root: bool) -> None:
    """Issue 23's case: GPT-2 blocks wrapped by the user, use_orig_params=True,
    AdamW, resumed from its step-4 checkpoint.  Lightning does not wrap the root
    then: unless the user does (``wrap_root``), the embeddings, final norm and tied
    head stay outside FSDP with no gradient synchronisation, so every rank gets the
    same batches (no distributed sampler) to keep them equal across ranks (with
    different batches they differ by rank and no checkpoint, holding one copy, can
    resume them exactly).  With the root wrapped each rank gets its own batches."""
    import lightning as L
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning gates FSDP to GPUs by the strategy's exact type."""

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()
            self.seen: list[torch.Tensor] = []
            self.losses: list[float] = []

        def configure_model(self) -> None:
            for i, b in enumerate(self.model.transformer.h):
                self.model.transformer.h[i] = FullyShardedDataParallel(b, use_orig_params=True)
            if wrap_root:
                self.model = FullyShardedDataParallel(self.model, use_orig_params=True)

        def training_step(self, b: list[torch.Tensor], i: int) -> torch.Tensor:
            self.seen.append(b[0].clone())
            loss = self.model(input_ids=b[0], labels=b[0]).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (64, 8), generator=g))

    def fit(steps: int, ckpt: str | None = None) -> tuple[LM, object]:
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_steps=steps, logger=False,
            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
            use_distributed_sampler=wrap_root,
            strategy=CPUFSDPStrategy(use_orig_params=True, process_group_backend="gloo",
                                     state_dict_type=sdt))
        lm = LM()
        trainer.fit(lm, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt)
        return lm, trainer

    key = f"gpt2/{sdt}/{'root' if wrap_root else 'blocks'}"
    first, trainer = fit(4)
    path = os.path.join(OUT, f"gpt2_{sdt}_{wrap_root}.ckpt")
    trainer.save_checkpoint(path)  # type: ignore[attr-defined]
    second, _ = fit(7, ckpt=path)
    record(key + "/first", first.losses)
    record(key + "/resumed", second.losses)
    # the oracle: the same batches through fsdp_wrap without Lightning, uninterrupted
    record(key + "/replay", gpt2_replay(first.seen + second.seen, wrap_root))


def ours_part() -> None:
    """fsdp_wrap under Lightning, then (uninstalled) torch's FSDP1 replays: runs last."""
    for uop, sdt in ((False, "full"), (True, "sharded"), (False, "sharded"), (True, "full")):
        fabric_run(uop, sdt)
    for uop, sdt in ((True, "full"), (True, "sharded"), (False, "sharded")):
        trainer_run(uop, sdt)
    for sdt in ("full", "sharded"):
        for wrap_root in (False, True):
            trainer_gpt2_run(sdt, wrap_root)
    import fsdp_wrap

    fsdp_wrap.uninstall()  # torch's FSDP1 class nests whatever its module's names say
    for key, steps, uop, clip in REPLAYS:
        record(key, torch_replay(steps, uop, clip))
