"""Arguments this machine cannot honour are refused at construction, naming the argument.

A device the machine lacks, a process group whose backend cannot carry the
compute device's tensors, a mixed-precision dtype the device cannot compute
in: torch's FSDP1 fails deep inside torch (at construction or at the first
collective) with a message that names no argument.  fsdp_wrap refuses each
one while the unit is built, on every rank, with the argument, the value, the
rank and what would work here (:mod:`fsdp_wrap.runtime.capability`).  The
CUDA cases (a device index past the GPUs, a CPU mesh for a GPU unit) are in
``tests/test_cuda.py``.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import fsdp_api, fsdp_cls, fsdp_kwargs

Outcome = tuple[str, str] | None


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))


def _train(impl: str, **kw: Any) -> None:
    # A group of its own with a short timeout: torch's FSDP1 (the oracle) may
    # fail inside a collective on one rank only, and the other rank must then
    # time out here rather than leave a collective open on the default group.
    kw.setdefault("process_group", dist.new_group(timeout=datetime.timedelta(seconds=10)))
    model = fsdp_cls(impl)(_net(), **kw)
    model(torch.randn(5, 4)).sum().backward()


def _mp(impl: str, **kw: Any) -> dict[str, Any]:
    return fsdp_kwargs(impl, mixed_precision=fsdp_api(impl).MixedPrecision(**kw))


def _cuda_only_group() -> Any:
    """A process group whose backend claims CUDA tensors only (NCCL's shape), over gloo."""
    def make(store: Any, rank: int, size: int, timeout: Any) -> Any:
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    if "cudaonly" not in dist.Backend.backend_list:
        dist.Backend.register_backend("cudaonly", make, devices=["cuda"])
    return dist.new_group(backend="cudaonly")


F8 = getattr(torch, "float8_e4m3fn", None)

# name -> (fn(impl), expected type, fragments our message must contain)
CASES: dict[str, tuple[Callable[[str], None], str, tuple[str, ...]]] = {
    "cuda_device": (lambda i: _train(i, device_id=torch.device("cuda")), "RuntimeError",
                    ("device_id=torch.device('cuda')", "cannot be used on this machine",
                     "no cuda device", "device_id=torch.device('cpu')")),
    "cuda_index": (lambda i: _train(i, device_id="cuda:3"), "RuntimeError",
                   ("device_id='cuda:3'", "cannot be used on this machine")),
    "int_index": (lambda i: _train(i, device_id=0), "RuntimeError",
                  ("device_id=0", "cannot be used on this machine")),
    "unknown_type": (lambda i: _train(i, device_id="gpu"), "RuntimeError",
                     ("device_id='gpu' is not a device torch knows", "devices here")),
    "not_a_device": (lambda i: _train(i, device_id=1.5), "TypeError",
                     ("device_id expects an int", "got 1.5 of type float")),
    "negative_index": (lambda i: _train(i, device_id=-1), "ValueError",
                       ("device_id=-1 is not a device index",)),
    "meta_device": (lambda i: _train(i, device_id="meta"), "ValueError",
                    ("device_id=meta cannot hold the unit's parameters",)),
    "param_dtype_fp8": (lambda i: _train(i, **_mp(i, param_dtype=F8)), "ValueError",
                        ("mixed_precision.param_dtype=torch.float8_e4m3fn cannot be used on cpu",
                         "fails", "Floating dtypes cpu computes in: float16, bfloat16")),
    "reduce_dtype_fp8": (lambda i: _train(i, **_mp(i, reduce_dtype=F8)), "ValueError",
                         ("mixed_precision.reduce_dtype=torch.float8_e4m3fn cannot be used",)),
    "buffer_dtype_fp8": (lambda i: _train(i, **_mp(i, buffer_dtype=F8)), "ValueError",
                         ("mixed_precision.buffer_dtype=torch.float8_e4m3fn cannot be used",)),
    "param_dtype_int": (lambda i: _train(i, **_mp(i, param_dtype=torch.int8)), "ValueError",
                        ("mixed_precision.param_dtype=torch.int8 is not a floating-point dtype",)),
    "param_dtype_str": (lambda i: _train(i, **_mp(i, param_dtype="bf16")), "TypeError",
                        ("mixed_precision.param_dtype expects a torch.dtype", "'bf16'")),
    "group_backend": (lambda i: _train(i, **fsdp_kwargs(i, process_group=_cuda_only_group())),
                      "RuntimeError",
                      ("process_group's backend ('cudaonly') cannot carry cpu tensors",
                       "the unit computes on cpu", "'gloo'")),
}


def _outcomes(names: list[str]) -> dict[str, dict[str, Outcome]]:
    import warnings

    out: dict[str, dict[str, Outcome]] = {}
    for name in names:
        fn = CASES[name][0]
        for impl in ("torch", "ours"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    fn(impl)
                    result: Outcome = None
                except Exception as e:  # noqa: BLE001  (recorded for the test)
                    result = (type(e).__name__, str(e))
            out.setdefault(name, {})[impl] = result
            dist.barrier()  # both ranks done with this case (a failed collective left nothing open)
    return out


@pytest.mark.skipif(F8 is None or torch.cuda.is_available(), reason="CPU-only cases")
def test_arguments_this_machine_cannot_honour(pool2: Any) -> None:
    names = sorted(CASES)
    for rank, out in enumerate(pool2.run(_outcomes, names)):
        for name in names:
            _, kind, fragments = CASES[name]
            ours, theirs = out[name]["ours"], out[name]["torch"]
            assert theirs is not None, (name, "torch's FSDP1 accepted it")  # the oracle fails too
            assert ours is not None and ours[0] == kind, (name, ours)
            for fragment in (*fragments, f"[rank {rank}]"):
                assert fragment in ours[1], (name, fragment, ours[1])
            assert "_fsdp_wrapped_module" not in ours[1]
