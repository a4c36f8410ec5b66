"""The oracle's CPU lifts for ``verl_engine_run.py``: where torch's FSDP1, as
it is, stops verl's engine on a CPU, and what the oracle run changes there
(each one a check made a no-op or a method made to do on a CPU what it does
across devices; docs/frameworks/verl.rst, "What torch's FSDP1 does on a
CPU").  fsdp_wrap's run uses none of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: torch's FSDP1 checks that stop verl's engine on a CPU machine, each lifted
#: for the oracle run only (torch's own code otherwise): module, function,
#: why it stops and why lifting it leaves torch's computation as it is.
TORCH_CPU_LIFTS: tuple[tuple[str, str, str], ...] = (
    ("torch.distributed.fsdp._init_utils", "_check_module_states_for_sync_module_states",
     "verl builds every FSDP1 unit with sync_module_states=True; torch's FSDP1 refuses CPU "
     "parameters there ('requires them to be on GPU'), though the broadcast it guards runs on gloo"),
)


#: torch's FSDP1 methods that stop verl's engine on a CPU machine, each
#: replaced for the oracle run by what torch does on a GPU machine.
TORCH_CPU_FIXES: tuple[tuple[str, str], ...] = (
    ("FlatParamHandle.to_cpu",
     "summon_full_params(offload_to_cpu=True) and FullStateDictConfig(offload_to_cpu=True) (verl's HF "
     "export and its LoRA sync's fallback): to_cpu() 'moves' the unsharded flat parameter to CPU, on "
     "CPU the same storage, then frees that storage (RuntimeError: setStorage ... storage of size 0; "
     "with rank0_only the ranks then disagree and gloo aborts the process); the oracle moves it as "
     "across devices, to a copy.  On the way back to_cpu() copies into the padded unsharded "
     "buffer under the caller's grad mode: for parameters that require grad (LoRA) the buffer "
     "joins the autograd graph, and the unit's next unshard on gloo (all_gather into split views "
     "of it) fails ('Output 0 of Split is a view and is being modified inplace'); the oracle "
     "copies back under no_grad"),
    ("Tensor.cpu",
     "the LoRA sync's base weights (collect_lora_params before the first sync) keep "
     "param.detach().cpu() of summoned parameters past summon_full_params: from a GPU a copy, on "
     "CPU the parameter itself, whose storage the summon's exit frees (a segmentation fault when "
     "read); the oracle's .cpu() copies, as from a GPU"),
    ("Tensor.pin_memory",
     "CPUOffload(offload_params=True) (verl's reference model): the lazy init pins the CPU shard "
     "and gradient (RuntimeError: Cannot access accelerator device when none is available); "
     "the oracle copies them unpinned (pinning only speeds host-device copies up)"),
)


def _to_cpu_as_across_devices(orig: Callable[..., Any]) -> Callable[..., Any]:
    import contextlib
    import functools

    from torch.distributed.fsdp._flat_param import FlatParamHandle

    @contextlib.contextmanager
    def to_cpu(self: Any) -> Any:
        if self.flat_param.device.type == "cpu":  # a copy, as flat_param_to(cpu) gives from a GPU
            self.flat_param_to = functools.partial(FlatParamHandle.flat_param_to, self, copy=True)
        try:
            cm = orig(self)
            cm.__enter__()
        finally:
            self.__dict__.pop("flat_param_to", None)
        try:
            yield
        finally:
            with torch.no_grad():  # (the copy back: see TORCH_CPU_FIXES)
                cm.__exit__(None, None, None)

    return to_cpu


class lifted:
    """torch's GPU-only checks of :data:`TORCH_CPU_LIFTS` made no-ops and the
    methods of :data:`TORCH_CPU_FIXES` made to do on CPU what they do across
    devices (the oracle run)."""

    def __enter__(self) -> None:
        import importlib

        from torch.distributed.fsdp._flat_param import FlatParamHandle

        self.saved = []
        for mod_name, fn, _ in TORCH_CPU_LIFTS:
            mod = importlib.import_module(mod_name)
            self.saved.append((mod, fn, getattr(mod, fn)))
            setattr(mod, fn, lambda *a, **k: None)
        self.saved.append((FlatParamHandle, "to_cpu", FlatParamHandle.to_cpu))
        FlatParamHandle.to_cpu = _to_cpu_as_across_devices(FlatParamHandle.to_cpu)  # type: ignore[method-assign]
        if not torch.accelerator.is_available():
            self.saved.append((torch.Tensor, "pin_memory", torch.Tensor.pin_memory))
            torch.Tensor.pin_memory = lambda self, *a, **k: self.clone()  # type: ignore[method-assign]
            cpu = torch.Tensor.cpu
            self.saved.append((torch.Tensor, "cpu", cpu))
            torch.Tensor.cpu = lambda self, *a, **k: (  # type: ignore[method-assign]
                self.clone() if self.device.type == "cpu" else cpu(self, *a, **k))

    def __exit__(self, *exc: object) -> None:
        for owner, fn, orig in reversed(self.saved):
            setattr(owner, fn, orig)
