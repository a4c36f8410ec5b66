"""A CPU platform for verl, registered through verl's own plugin API
(``verl.plugin.platform.PlatformRegistry``) and chosen with
``VERL_PLATFORM=cpu``: verl runs on CPU without a change to verl.
Test harness only (tests/frameworks/verl_engine_run.py)."""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _cpu_device_module() -> ModuleType:
    """``torch.cpu`` with the memory calls verl makes on its device module
    (there is no device cache on CPU: they do nothing, report nothing)."""
    mod = ModuleType("verl_cpu_device")
    mod.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    for name in ("empty_cache", "reset_peak_memory_stats", "ipc_collect"):
        setattr(mod, name, lambda *a, **k: None)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(mod, name, lambda *a, **k: 0)
    mod.mem_get_info = lambda *a, **k: (0, 0)
    mod.is_available = lambda: True
    mod.get_device_name = lambda *a, **k: "CPU"  # (verl's FLOPs table: unknown, infinite)
    # verl's checkpoint manager saves the RNG state under the device's name ("cpu")
    # and restores it through the device module
    mod.get_rng_state = torch.get_rng_state
    mod.set_rng_state = torch.set_rng_state
    mod.current_device = lambda: CPU_DEVICE_ID
    return mod


_DEVICE = _cpu_device_module()


class CpuDeviceId(str):
    """The device id verl's ``get_device_id()`` hands out on this platform.

    verl uses the id two ways: ``tensor.to(get_device_id())`` (and
    ``device_id=`` / ``torch.device(...)``), where an int would name an
    accelerator torch does not have on a CPU machine, and
    ``f"{get_device_name()}:{get_device_id()}"``, where it must be an index.
    A string ``"cpu"`` that formats as ``0`` serves both ("cpu" and
    "cpu:0" are the same device to torch).
    """

    def __new__(cls) -> CpuDeviceId:
        return super().__new__(cls, "cpu")

    def __format__(self, spec: str) -> str:
        return format(0, spec)


CPU_DEVICE_ID = CpuDeviceId()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        return CPU_DEVICE_ID

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str) -> Any:
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
