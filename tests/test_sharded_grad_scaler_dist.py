"""``fsdp_wrap.sharded_grad_scaler.ShardedGradScaler`` against torch's FSDP1 scaler, on 2 gloo ranks.

Oracle: ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` driving
the same model (a plain replicated model with all-reduced grads, or torch's FSDP1
next to fsdp_wrap's FSDP) on the same per-rank data.  Every step compares the
scale, the state dict and the parameters; key scenarios also assert hard-coded
expectations (the reference doc's section-5 printout, hand-computed scale
sequences) so that a mistake shared with the oracle cannot hide.  The
single-process checks are in ``tests/test_sharded_grad_scaler.py``.

Not covered on CPU: the scaler with ``CPUOffload(offload_params=True)`` (CPU
gradients under a CUDA scaler), which the CUDA-only test at the end and
``tests/test_cuda_features.py`` exercise on a GPU.

Deviations from torch that the tests pin down (see the module docstring of
``fsdp_wrap/sharded_grad_scaler.py``): inf flags are reduced with MAX in one
collective (0/1 flags, so fused optimizers skip correctly) and the fused-optimizer
path (``Adam(fused=True)``) is agreed across ranks too.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

import fsdp_wrap
import fsdp_wrap.comm.collectives as _collectives
from fsdp_wrap.sharded_grad_scaler import ShardedGradScaler
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests.conftest import requires_cuda

CPU = torch.device("cpu")
SCALERS: dict[str, type] = {"torch": TorchScaler, "ours": ShardedGradScaler}


# ---------------------------------------------------------------------------
# Multi-process: plain replicated model
# ---------------------------------------------------------------------------

# Per step: what to do to the grads, per rank ("inf", "nan", "nograd").
PLAIN_SCHEDULE: list[dict[int, str]] = [
    {}, {}, {1: "inf"}, {0: "nan"}, {}, {1: "nograd"}, {0: "inf", 1: "nograd"}, {}, {}
]  # fmt: skip
# init_scale=1024, growth_interval=2, by hand:
PLAIN_SCALES = [1024.0, 2048.0, 1024.0, 512.0, 512.0, 1024.0, 512.0, 512.0, 1024.0]
PLAIN_STEPPED = {
    0: [True, True, False, False, True, True, False, True, True],
    1: [True, True, False, False, True, False, False, True, True],
}


def _small_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).to(dtype)


def _inject(params: list[nn.Parameter], what: str | None) -> None:
    if what is None:
        return
    if what == "nograd":
        for p in params:
            p.grad = None
        return
    for p in params:
        if p.grad is not None and p.grad.numel():
            p.grad.view(-1)[0] = float("inf") if what == "inf" else float("nan")
            return
    raise AssertionError("no grad to inject into")


def _plain_run(scaler_name: str, dtype: torch.dtype, variant: str) -> dict[str, Any]:
    """Replicated model, grads averaged by hand; one scaler drives 1 or 2 optimizers."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _small_model(dtype)
    params = list(model.parameters())
    if variant == "two_optimizers":
        opts = [
            torch.optim.SGD(model[0].parameters(), lr=0.01),
            torch.optim.SGD(model[2].parameters(), lr=0.01),
        ]
    else:
        opts = [torch.optim.SGD(params, lr=0.01, momentum=0.5)]
    sc = SCALERS[scaler_name](device="cpu", init_scale=1024.0, growth_interval=2)
    rec: dict[str, Any] = {"scale": [], "sd": [], "stepped": [], "params": [], "loss_dtype": []}
    for step, inject in enumerate(PLAIN_SCHEDULE):
        for opt in opts:
            opt.zero_grad()
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x.to(dtype)).sum()
        scaled = sc.scale(loss)
        rec["loss_dtype"].append(scaled.dtype)
        stepped: list[bool] = []
        scaled.backward()
        for p in params:
            g = p.grad.float()  # type: ignore[union-attr]
            dist.all_reduce(g)
            p.grad.copy_(g / ws)  # type: ignore[union-attr]
        # two_optimizers: the inf goes into the second optimizer's params only.
        _inject(params[2:] if variant == "two_optimizers" else params, inject.get(rank))
        for opt in opts:
            before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
            if variant == "unscale_then_clip":
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            sc.step(opt)
            after = opt.param_groups[0]["params"]
            stepped.append(any(not torch.equal(a, p) for a, p in zip(before, after)))
        sc.update()
        rec["scale"].append(sc.get_scale())
        rec["sd"].append(sc.state_dict())
        rec["stepped"].append(stepped)
        rec["params"].append([p.detach().clone() for p in params])
    return rec


def _plain_sweep() -> dict[tuple[Any, ...], dict[str, Any]]:
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for variant in ("one_optimizer", "unscale_then_clip", "two_optimizers"):
            for name in SCALERS:
                out[(name, dtype, variant)] = _plain_run(name, dtype, variant)
    return out


def test_plain_replicated_parity(pool2) -> None:
    results = pool2.run(_plain_sweep)
    for rank, res in enumerate(results):
        for (name, dtype, variant), rec in res.items():
            if name != "ours":
                continue
            ref = res[("torch", dtype, variant)]
            where = (rank, dtype, variant)
            assert rec["scale"] == ref["scale"], where
            assert rec["sd"] == ref["sd"], where
            assert rec["stepped"] == ref["stepped"], where
            assert rec["loss_dtype"] == [dtype] * len(PLAIN_SCHEDULE), where
            for step, (ours, theirs) in enumerate(zip(rec["params"], ref["params"])):
                for a, b in zip(ours, theirs):
                    assert a.dtype == dtype
                    assert torch.equal(a, b), (where, step)
            # Hard-coded: an inf/NaN on either rank skips the step on both.
            assert rec["scale"] == PLAIN_SCALES, where
            if variant != "two_optimizers":
                assert [s[0] for s in rec["stepped"]] == PLAIN_STEPPED[rank], where
            else:
                # Infs and missing grads are put into the second optimizer's params only:
                # the first always steps, the second as the single optimizer does.
                assert [s[0] for s in rec["stepped"]] == [True] * len(PLAIN_SCHEDULE), where
                assert [s[1] for s in rec["stepped"]] == PLAIN_STEPPED[rank], where
            # Parameters agree across ranks until rank 1 first lacks grads (step 5).
            other = results[1 - rank][(name, dtype, variant)]
            for step in range(5):
                for a, b in zip(rec["params"][step], other["params"][step]):
                    assert torch.equal(a, b), (where, step)


# ---------------------------------------------------------------------------
# Multi-process: flags, collectives, errors, groups, fused optimizers
# ---------------------------------------------------------------------------


def _one_param_setup() -> tuple[nn.Parameter, Any]:
    p = nn.Parameter(torch.ones(3))
    return p, torch.optim.SGD([p], lr=0.5)


def _mechanics_sweep() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}

    # One MAX all-reduce per unscale_, also on a rank without grads; flags 0/1 on every rank.
    calls: list[tuple[torch.Size, Any]] = []
    real = _collectives.all_reduce

    def counting(tensor: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> None:
        calls.append((tensor.shape, op))
        real(tensor, group, op)

    for case in ("both_grads", "rank1_no_grads", "rank1_inf", "rank0_inf_rank1_no_grads"):
        p, opt = _one_param_setup()
        sc = ShardedGradScaler(device="cpu", init_scale=8.0)
        sc.scale(p.sum() * (rank + 1)).backward()
        if rank == 1 and case.endswith("no_grads"):
            p.grad = None
        if (case, rank) in (("rank1_inf", 1), ("rank0_inf_rank1_no_grads", 0)):
            p.grad[0] = float("inf")  # type: ignore[index]
        calls.clear()
        with mock.patch.object(_collectives, "all_reduce", counting):
            sc.unscale_(opt)
        flags = sc._found_inf_per_device(opt)
        out[case] = {
            "calls": [(tuple(s), str(op)) for s, op in calls],
            "flags": {str(d): (tuple(f.shape), f.item()) for d, f in flags.items()},
            "grad": None if p.grad is None else p.grad.tolist(),
        }
        sc.step(opt)
        sc.update()
        out[case]["scale"] = sc.get_scale()
        out[case]["param"] = p.detach().tolist()

    # Errors raised before any collective, same messages as torch.
    errors = {}
    for name, cls in SCALERS.items():
        p, opt = _one_param_setup()
        sc = cls(device="cpu")
        msgs = []
        sc.scale(p.sum()).backward()
        sc.unscale_(opt)
        try:
            sc.unscale_(opt)  # twice
        except RuntimeError as e:
            msgs.append(str(e))
        sc.step(opt)
        try:
            sc.unscale_(opt)  # after step
        except RuntimeError as e:
            msgs.append(str(e))
        errors[name] = msgs
    out["errors"] = errors

    # An explicit process_group is honoured: singleton groups do not share the inf.
    singles = [dist.new_group([0], backend="gloo"), dist.new_group([1], backend="gloo")]
    pair = dist.new_group([0, 1], backend="gloo")
    for label, group in (("single", singles[rank]), ("pair", pair)):
        for name, cls in SCALERS.items():
            p, opt = _one_param_setup()
            sc = cls(device="cpu", init_scale=8.0, process_group=group)
            sc.scale(p.sum()).backward()
            if rank == 1:
                p.grad[1] = float("nan")  # type: ignore[index]
            sc.step(opt)
            sc.update()
            out[(label, name)] = (sc.get_scale(), p.detach().tolist(), sc.process_group is group)

    # Fused Adam unscales itself (step's _check_inf_per_device path): agreed across ranks here.
    for inf_ranks in ((1,), (0, 1), ()):
        p = nn.Parameter(torch.ones(3))
        opt = torch.optim.Adam([p], lr=0.1, fused=True)
        sc = ShardedGradScaler(device="cpu", init_scale=8.0)
        sc.scale(p.sum()).backward()
        if rank in inf_ranks:
            p.grad[2] = float("inf")  # type: ignore[index]
        sc.step(opt)
        flags = [f.item() for f in sc._found_inf_per_device(opt).values()]
        sc.update()
        out[("fused", inf_ranks)] = (p.detach().tolist(), sc.get_scale(), flags)
    return out


def test_flags_collectives_errors_groups_fused(pool2) -> None:
    res = pool2.run(_mechanics_sweep)
    max_op = str(dist.ReduceOp.MAX)
    for rank, r in enumerate(res):
        for case in ("both_grads", "rank1_no_grads", "rank1_inf", "rank0_inf_rank1_no_grads"):
            c = r[case]
            assert c["calls"] == [((1,), max_op)], (rank, case)
            assert list(c["flags"]) == ["cpu"], (rank, case)  # created even without grads
            expect_inf = case in ("rank1_inf", "rank0_inf_rank1_no_grads")
            assert c["flags"]["cpu"] == ((1,), 1.0 if expect_inf else 0.0), (rank, case)
            assert c["scale"] == (4.0 if expect_inf else 8.0), (rank, case)
            has_grad = not (rank == 1 and case.endswith("no_grads"))
            assert (c["grad"] is not None) == has_grad, (rank, case)
            stepped = has_grad and not expect_inf
            assert (c["param"] != [1.0, 1.0, 1.0]) == stepped, (rank, case)
        # Finite grads were unscaled: d/dp of sum*(rank+1) is rank+1.
        assert r["both_grads"]["grad"] == [float(rank + 1)] * 3
        assert r["both_grads"]["param"] == [1.0 - 0.5 * (rank + 1)] * 3

        assert r["errors"]["ours"] == r["errors"]["torch"]
        assert r["errors"]["ours"] == [
            "unscale_() has already been called on this optimizer since the last update().",
            "unscale_() is being called after step().",
        ]

        for name in SCALERS:
            scale, param, same_group = r[("single", name)]
            assert same_group
            assert scale == (4.0 if rank == 1 else 8.0), (rank, name)
            assert (param == [1.0, 1.0, 1.0]) == (rank == 1), (rank, name)
            scale, param, _ = r[("pair", name)]
            assert scale == 4.0 and param == [1.0, 1.0, 1.0], (rank, name)

        for inf_ranks in ((1,), (0, 1)):
            param, scale, flags = r[("fused", inf_ranks)]
            assert param == [1.0, 1.0, 1.0], (rank, inf_ranks)
            assert scale == 4.0 and flags == [1.0], (rank, inf_ranks)
        param, scale, flags = r[("fused", ())]
        assert param != [1.0, 1.0, 1.0] and scale == 8.0 and flags == [0.0]


# ---------------------------------------------------------------------------
# Multi-process: FSDP models (torch FSDP1 + torch scaler vs fsdp_wrap + ours)
# ---------------------------------------------------------------------------


def _probe_model() -> nn.Module:
    """The reference doc's probe model, plus a 1-element unit rank 1 owns none of (uop=True)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.LayerNorm(3), nn.Linear(3, 1),
        nn.Linear(1, 1, bias=False),
    )  # fmt: skip


def _wrap(impl: str, model: nn.Module, uop: bool) -> nn.Module:
    if impl == "torch":
        return TorchFSDP(
            model,
            auto_wrap_policy=TorchModuleWrapPolicy({nn.Linear}),
            device_id=CPU,
            use_orig_params=uop,
        )
    return fsdp_wrap.FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=CPU, use_orig_params=uop
    )


# Per step: {rank: (what, which optimizer's params)}; opt 0 = all but the last unit, opt 1 = last.
FSDP_SCHEDULE: list[dict[int, tuple[str, int]]] = [
    {}, {1: ("inf", 0)}, {}, {0: ("nan", 1)}, {}, {}, {0: ("inf", 0), 1: ("inf", 0)}, {}
]  # fmt: skip


def _fsdp_run(impl: str, uop: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    model = _wrap(impl, _probe_model(), uop)
    last = model.module[5]  # type: ignore[index]
    last_ids = {id(p) for p in last.parameters()}
    groups = [
        [p for p in model.parameters() if id(p) not in last_ids],
        list(last.parameters()),
    ]
    opts = [torch.optim.SGD(g, lr=0.05) for g in groups]
    sc = SCALERS[impl](device="cpu", init_scale=2.0**10, growth_interval=3)
    rec: dict[str, Any] = {"loss": [], "scale": [], "sd": [], "params": [], "stepped": []}
    rec["last_has_grad"] = []
    for step, inject in enumerate(FSDP_SCHEDULE):
        for opt in opts:
            opt.zero_grad()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).pow(2).sum()
        sc.scale(loss).backward()
        rec["loss"].append(loss.item())
        rec["last_has_grad"].append([p.grad is not None for p in groups[1]])
        if rank in inject:
            what, which = inject[rank]
            _inject(groups[which], what)
        before = [p.detach().clone() for p in model.parameters()]
        flags = []
        for opt in opts:
            sc.step(opt)
            flags.append(sum(f.item() for f in sc._found_inf_per_device(opt).values()) > 0)
        sc.update()
        rec["scale"].append(sc.get_scale())
        rec["sd"].append(sc.state_dict())
        rec["stepped"].append(
            [any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), flags]
        )
        rec["params"].append([p.detach().clone() for p in model.parameters()])
    return rec


def _section5_printout(uop: bool) -> list[str]:
    """The reference doc's p_gs.py, on fsdp_wrap with our scaler."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.LayerNorm(3))
    fm = _wrap("ours", m, uop)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    sc = ShardedGradScaler(device="cpu", init_scale=1024.0, growth_interval=1)
    lines = [f"process_group attr: {sc.process_group}"]
    loss = fm(torch.randn(3, 4)).sum()
    sl = sc.scale(loss)
    lines.append(f"scale(loss): {sl.item() / loss.item():.1f}x, dtype {sl.dtype}")
    sl.backward()
    before = [p.detach().clone() for p in fm.parameters()]
    sc.step(opt)
    sc.update()
    changed = any(not torch.equal(a, b) for a, b in zip(before, fm.parameters()))
    lines.append(f"step1 (finite): params changed={changed}, new scale={sc.get_scale()}")
    opt.zero_grad()
    sc.scale(fm(torch.randn(3, 4)).sum()).backward()
    if dist.get_rank() == 1:
        _inject(list(fm.parameters()), "inf")
    before = [p.detach().clone() for p in fm.parameters()]
    sc.step(opt)
    sc.update()
    changed = any(not torch.equal(a, b) for a, b in zip(before, fm.parameters()))
    lines.append(f"step2 (inf only on rank1): params changed={changed}, new scale={sc.get_scale()}")
    lines.append(f"state_dict: {sc.state_dict()}")
    return lines


def _fsdp_sweep() -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for uop in (False, True):
        for impl in ("torch", "ours"):
            out[(impl, uop)] = _fsdp_run(impl, uop)
        out[("printout", uop)] = _section5_printout(uop)
    return out


SECTION5 = [
    "process_group attr: None",
    "scale(loss): 1024.0x, dtype torch.float32",
    "step1 (finite): params changed=True, new scale=2048.0",
    "step2 (inf only on rank1): params changed=False, new scale=1024.0",
    "state_dict: {'scale': 1024.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, "
    "'growth_interval': 1, '_growth_tracker': 0}",
]


def test_fsdp_full_shard_parity_with_torch(pool2) -> None:
    res = pool2.run(_fsdp_sweep)
    for rank, r in enumerate(res):
        for uop in (False, True):
            assert r[("printout", uop)] == SECTION5, (rank, uop)
            ours, ref = r[("ours", uop)], r[("torch", uop)]
            where = (rank, uop)
            assert ours["scale"] == ref["scale"], where
            assert ours["sd"] == ref["sd"], where
            assert ours["stepped"] == ref["stepped"], where
            assert ours["last_has_grad"] == ref["last_has_grad"], where
            torch.testing.assert_close(ours["loss"], ref["loss"], rtol=1e-5, atol=1e-5)
            for step, (a, b) in enumerate(zip(ours["params"], ref["params"])):
                assert [t.shape for t in a] == [t.shape for t in b], (where, step)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{where} {step}")
            # Hard-coded (init 1024, growth_interval 3): ok, inf, ok, nan, ok, ok, inf, ok
            # backs off at steps 1, 3, 6 and never reaches 3 successes in a row.
            assert ours["scale"] == [1024.0, 512.0, 512.0, 256.0, 256.0, 256.0, 128.0, 128.0]
            # Steps with an inf anywhere skip every optimizer it was injected into, on both ranks.
            for step in (1, 6):
                assert ours["stepped"][step][1][0] is True, (where, step)
            assert ours["stepped"][3][1] == [False, True], where
            if uop:
                # Rank 1 owns none of the 1-element unit: its optimizer there has no grads...
                assert ours["last_has_grad"][0] == [rank == 0], where
                # ...yet it learns of rank 0's NaN and skips in step with rank 0.
                assert ours["stepped"][3][1][1] is True, where
        for uop in (False, True):
            assert r[("ours", uop)]["sd"] == res[1 - rank][("ours", uop)]["sd"]


# ---------------------------------------------------------------------------
# CUDA only: a CUDA scaler with CPU grads (what CPU offload produces)
# ---------------------------------------------------------------------------


def _cuda_scaler_cpu_grads() -> dict[str, Any]:
    rank = dist.get_rank()
    out = {}
    for name, cls in SCALERS.items():
        p = nn.Parameter(torch.ones(3))  # CPU param and grad
        opt = torch.optim.SGD([p], lr=0.5)
        sc = cls(device="cuda", init_scale=8.0)
        sc.scale(p.sum()).backward()
        if rank == 1:
            p.grad[0] = float("inf")  # type: ignore[index]
        sc.unscale_(opt)
        flags = {str(d): f.item() for d, f in sc._found_inf_per_device(opt).items()}
        sc.step(opt)
        sc.update()
        out[name] = (flags, sc.get_scale(), p.detach().tolist())
    return out


@requires_cuda
def test_cuda_scaler_with_cpu_grads(pool2) -> None:
    for r in pool2.run(_cuda_scaler_cpu_grads):
        flags, scale, param = r["ours"]
        assert list(flags) == ["cpu"] and list(flags.values())[0] >= 1.0
        assert scale == 4.0 and param == [1.0, 1.0, 1.0]
        assert r["torch"][1:] == r["ours"][1:]
