"""Imported first by every torch test file the runner copies (see run.py).

It makes torch's own FSDP1 tests, written for GPUs, run on CPU ranks over
gloo, and (``TORCH_SUITE_IMPL=fsdp_wrap``) points torch's FSDP1 names at
fsdp_wrap before the test file imports them.  It runs in the pytest process
and again in every rank process torch's ``MultiProcessTestCase`` spawns (they
import the test module, which imports this first).

What it changes, in torch's test helpers only:

* ``skip_if_lt_x_gpu(n)`` runs the test instead of skipping it;
* ``common_fsdp``: ``DEVICE_COUNT`` (the world size of ``FSDPTest``) is
  ``TORCH_SUITE_WORLD`` (default 2) and ``FSDPTest`` starts its ranks as
  ``FSDPTestMixin`` does, which accepts a CPU device (torch 2.13's
  ``FSDPTest._run`` skips when there are fewer accelerators than ranks);
* ``instantiate_device_type_tests`` also instantiates the CPU variant (the
  files list only accelerators in ``only_for``);
* ``torch.cuda.set_device`` does nothing (the files call it in ``setUp``);
* with ``TORCH_SUITE_CPU_DEVICE_ID=1`` (``run.py --cpu-device-id``), for files
  whose tests pass no ``device_id`` (the 2-D files): torch's FSDP1 gets
  ``device_id=cpu`` when none is given and no accelerator exists (it refuses
  CPU otherwise: "FSDP needs a non-CPU accelerator device"), and
  ``DTensorTestBase`` tests asking for ``"cpu:gloo,cuda:nccl"`` run on gloo
  (they skip otherwise: "Need at least 4 CUDA devices").
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.testing._internal.common_device_type as _cdt
import torch.testing._internal.common_distributed as _cd

if os.environ.get("TORCH_SUITE_IMPL", "torch") == "fsdp_wrap":
    import fsdp_wrap

    fsdp_wrap.install()

WORLD = int(os.environ.get("TORCH_SUITE_WORLD", "2"))


def _run_anyway(*_args: Any, **_kwargs: Any) -> Any:
    return lambda fn: fn


_cd.skip_if_lt_x_gpu = _run_anyway

import torch.testing._internal.common_fsdp as _cf  # noqa: E402  (after the patch above)

_cf.DEVICE_COUNT = WORLD
_cf.FSDPTest._run = classmethod(_cf.FSDPTestMixin._run.__func__)  # type: ignore[attr-defined]

try:
    import torch.testing._internal.distributed._tensor.common_dtensor as _cdt_dtensor

    _cdt_dtensor.skip_if_lt_x_gpu = _run_anyway  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - older torch layouts
    pass

_instantiate = _cdt.instantiate_device_type_tests


def _instantiate_with_cpu(generic_test_class: Any, scope: Any, except_for: Any = None,
                          only_for: Any = None, *args: Any, **kwargs: Any) -> Any:
    if only_for is not None:
        only_for = tuple(only_for) + ("cpu",) if isinstance(only_for, (tuple, list)) \
            else (only_for, "cpu")
    return _instantiate(generic_test_class, scope, except_for, only_for, *args, **kwargs)


_cdt.instantiate_device_type_tests = _instantiate_with_cpu
torch.cuda.set_device = lambda *_a, **_k: None  # type: ignore[assignment]


if os.environ.get("TORCH_SUITE_CPU_DEVICE_ID") == "1" and not torch.cuda.is_available():
    try:
        _DTensorTestBase = _cdt_dtensor.DTensorTestBase
        _init_pg = _DTensorTestBase.init_pg

        def _init_pg_on_gloo(self: Any, eager_init: Any, backend: Any = None) -> Any:
            backend = self.backend if backend is None else backend
            return _init_pg(self, eager_init, "gloo" if "nccl" in backend else backend)

        _DTensorTestBase.init_pg = _init_pg_on_gloo
    except NameError:  # pragma: no cover - older torch layouts
        pass
    if os.environ.get("TORCH_SUITE_IMPL", "torch") == "torch":
        import torch.distributed.fsdp as _fsdp

        _fsdp_init = _fsdp.FullyShardedDataParallel.__init__

        def _init_on_cpu(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
            if len(args) < 9 and kwargs.get("device_id") is None:
                kwargs["device_id"] = torch.device("cpu")
            _fsdp_init(self, module, *args, **kwargs)

        _fsdp.FullyShardedDataParallel.__init__ = _init_on_cpu  # type: ignore[method-assign]
