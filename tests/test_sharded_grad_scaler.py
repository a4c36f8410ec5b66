"""``ShardedGradScaler`` in one process, against torch's: its signature, the
CUDA-less fallback, scaling, the scale's update rule and its errors, where
the inf check is reduced, and the error without a process group.  The
multi-process checks are in ``tests/test_sharded_grad_scaler_dist.py``.
"""

from __future__ import annotations

import inspect
import random
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

from fsdp_wrap.sharded_grad_scaler import ShardedGradScaler, _reduction_device

CPU = torch.device("cpu")
SCALERS: dict[str, type] = {"torch": TorchScaler, "ours": ShardedGradScaler}


# ---------------------------------------------------------------------------
# Single-process checks
# ---------------------------------------------------------------------------


def test_signature_and_base_class() -> None:
    ours = inspect.signature(ShardedGradScaler.__init__).parameters
    theirs = inspect.signature(TorchScaler.__init__).parameters
    assert list(ours) == list(theirs)
    # torch evaluates dist.group.WORLD at import, i.e. None before init.
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]
    assert [p.default for p in ours.values()][1:] == ["cuda", 2.0**16, 0.5, 2.0, 2000, True, None]
    assert issubclass(ShardedGradScaler, torch.amp.GradScaler)
    sc = ShardedGradScaler("cpu", 8.0, 0.25, 4.0, 3)  # positional: backoff before growth
    assert (sc.get_backoff_factor(), sc.get_growth_factor(), sc.get_growth_interval()) == (
        0.25,
        4.0,
        3,
    )
    assert sc.process_group is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CUDA-less fallback")
def test_cuda_scaler_without_cuda_disables_itself_like_torch() -> None:
    for cls in (TorchScaler, ShardedGradScaler):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sc = cls()
        assert not sc.is_enabled()
        assert any("CUDA is not available" in str(w.message) for w in caught)
        loss = torch.tensor(3.0)
        assert sc.scale(loss) is loss
        assert sc.state_dict() == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(), (3,)])
def test_scale_keeps_dtype_and_matches_torch(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    out = torch.arange(1, 1 + (shape[0] if shape else 1), dtype=torch.float32).reshape(shape)
    out = out.to(dtype)
    for cls in (TorchScaler, ShardedGradScaler):
        sc = cls(device="cpu", init_scale=1024.0)
        scaled = sc.scale(out)
        assert scaled.dtype == dtype
        assert scaled.shape == out.shape
        assert torch.equal(scaled.float(), out.float() * 1024.0)
    ours = ShardedGradScaler(device="cpu", init_scale=3.0).scale(out)
    theirs = TorchScaler(device="cpu", init_scale=3.0).scale(out)
    assert torch.equal(ours, theirs)


def test_scale_iterables_like_torch() -> None:
    a = torch.tensor(2.0, dtype=torch.float16)
    b = torch.tensor([1.0, 3.0])
    c = torch.tensor(5.0, dtype=torch.bfloat16)
    for cls in (TorchScaler, ShardedGradScaler):
        sc = cls(device="cpu", init_scale=4.0)
        got = sc.scale([a, (b, [c])])
        assert isinstance(got, list) and isinstance(got[1], tuple) and isinstance(got[1][1], list)
        assert got[0].dtype == torch.float16 and got[0].item() == 8.0
        assert torch.equal(got[1][0], torch.tensor([4.0, 12.0]))
        assert got[1][1][0].dtype == torch.bfloat16 and got[1][1][0].item() == 20.0
        lazy = sc.scale(t for t in (a, b))
        assert not isinstance(lazy, (list, tuple))
        assert [t.dtype for t in lazy] == [torch.float16, torch.float32]
        with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
            sc.scale([a, 3])
    disabled = ShardedGradScaler(device="cpu", enabled=False)
    assert disabled.scale(b) is b
    assert disabled.state_dict() == {}


def test_cpu_update_matches_torch_python_update() -> None:
    """Random inf patterns through update(): scale and growth tracker equal torch's every step."""
    rng = random.Random(0)
    for trial in range(30):
        interval = rng.choice([1, 2, 3, 5])
        kwargs = dict(
            device="cpu",
            init_scale=rng.choice([1.0, 1024.0, 2.0**16]),
            backoff_factor=rng.choice([0.5, 0.25]),
            growth_factor=rng.choice([2.0, 3.0]),
            growth_interval=interval,
        )
        scalers = [TorchScaler(**kwargs), ShardedGradScaler(**kwargs)]
        for sc in scalers:
            sc.scale(torch.ones(()))
        for step in range(12):
            flags = [float(rng.choice([0, 0, 0, 1, 2])) for _ in range(rng.choice([1, 2]))]
            for sc in scalers:
                for i, f in enumerate(flags):
                    sc._per_optimizer_states[i]["found_inf_per_device"] = {CPU: torch.tensor([f])}
                sc.update()
            states = [sc.state_dict() for sc in scalers]
            assert states[0] == states[1], (trial, step, kwargs, flags)
            assert scalers[1]._scale.dtype == torch.float32  # type: ignore[union-attr]
            assert scalers[1]._growth_tracker.dtype == torch.int32  # type: ignore[union-attr]


def test_update_hand_computed_sequence() -> None:
    sc = ShardedGradScaler(device="cpu", init_scale=16.0, growth_interval=2)
    sc.scale(torch.ones(()))
    got = []
    for flag in [0, 0, 1, 0, 0, 0, 1]:
        sc._per_optimizer_states[0]["found_inf_per_device"] = {CPU: torch.tensor([float(flag)])}
        sc.update()
        got.append((sc.get_scale(), sc._get_growth_tracker()))
    assert got == [(16, 1), (32, 0), (16, 0), (16, 1), (32, 0), (32, 1), (16, 0)]


def test_update_new_scale_and_errors_like_torch() -> None:
    for cls in (TorchScaler, ShardedGradScaler):
        sc = cls(device="cpu", init_scale=8.0)
        sc.scale(torch.ones(()))
        with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
            sc.update()
        sc.update(3.0)
        assert sc.get_scale() == 3.0
        sc.update(torch.tensor(5.0))
        assert sc.get_scale() == 5.0
    ours = ShardedGradScaler(device="cpu", init_scale=8.0)
    ours.scale(torch.ones(()))
    ours.update(torch.tensor([6.0]))  # "1-element tensor": torch's own scaler fails on this shape
    assert ours.get_scale() == 6.0 and ours._scale.shape == ()  # type: ignore[union-attr]
    for cls in (TorchScaler, ShardedGradScaler):
        sc = cls(device="cpu", init_scale=8.0)
        sc.scale(torch.ones(()))
        for bad in (torch.tensor([1.0, 2.0]), torch.tensor([1.0], requires_grad=True)):
            with pytest.raises(AssertionError, match="new_scale should be a float"):
                sc.update(bad)
        fresh = cls(device="cpu")
        with pytest.raises(AssertionError, match="Attempted update but _scale is None"):
            fresh.update()


def test_reduction_device_routing() -> None:
    # CPU flags of an accelerator scaler (CPU offload) are reduced on the accelerator.
    assert _reduction_device(CPU, "cuda") == torch.device("cuda")
    assert _reduction_device(CPU, "cpu") == CPU
    assert _reduction_device(torch.device("cuda", 1), "cuda") == torch.device("cuda", 1)
    assert _reduction_device(torch.device("cuda", 0), "cpu") == torch.device("cuda", 0)


@pytest.mark.skipif(dist.is_initialized(), reason="needs an uninitialized default group")
def test_unscale_without_process_group_names_the_fix() -> None:
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    sc = ShardedGradScaler(device="cpu")
    sc.scale(p.sum()).backward()
    with pytest.raises(RuntimeError, match="init_process_group"):
        sc.unscale_(opt)
