"""register_comm_hook against torch's FSDP1 with the same hook (2 ranks; errors on 4).

torch's default hooks (``torch.distributed.algorithms._comm_hooks.default_hooks``:
``allreduce_hook`` for NO_SHARD, ``reduce_scatter_hook`` for sharded
strategies, ``fp16_compress_hook`` / ``bf16_compress_hook`` for both) are
registered on torch's FSDP1 and on fsdp_wrap; both train in lockstep and must
agree every step.  A custom hook that counts its calls and reduces by hand
checks the call protocol.  The errors (non-root, already registered, hybrid
strategy, non-callable) must be torch's.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks import default_hooks as dh

from tests._options_common import compare_step, loss_of, rank_tag, run_configs, train_step
from tests._sweep import Injection, any_rank, injected
from tests.conftest import requires_cuda
from tests.models import build, make_input, new_model

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _cpu_low_precision_hook(prec: torch.dtype) -> Any:
    """torch's fp16/bf16 compress hook without its ``record_stream`` call.

    ``default_hooks._decompress`` calls ``Tensor.record_stream``, which fails
    for CPU tensors ("unknown parameter type"), in torch's FSDP1 and ours
    alike; the real hooks are tested on CUDA below.  Everything else is
    torch's code path: ``grad.data``/``output.data`` swapped to ``prec``, the
    default reduce hook, then back to ``state.parameter_type``.
    """

    def hook(state: Any, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
        grad.data = grad.data.to(prec)
        if output is not None:
            output.data = output.data.to(prec)
            dh.reduce_scatter_hook(state, grad, output)
            output.data = output.data.to(state.parameter_type)
        else:
            dh.allreduce_hook(state, grad)
            grad.data = grad.data.to(state.parameter_type)

    return hook


def _hook(name: str, strategy: str) -> tuple[Any, Any]:
    group = dist.group.WORLD
    if name == "default":
        fn = dh.allreduce_hook if strategy == "NO_SHARD" else dh.reduce_scatter_hook
        return dh.DefaultState(process_group=group), fn
    state = dh.LowPrecisionState(process_group=group)
    prec = torch.float16 if name == "fp16" else torch.bfloat16
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return state, dh.fp16_compress_hook if name == "fp16" else dh.bf16_compress_hook
    return state, _cpu_low_precision_hook(prec)


class Counting:
    """A hand-written hook: sums, then averages; counts its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, state: Any, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
        ws = dist.get_world_size()
        if output is None:
            self.calls.append(("all_reduce", grad.numel()))
            dist.all_reduce(grad)
            grad.div_(ws)
        else:
            self.calls.append(("reduce_scatter", grad.numel()))
            dist.reduce_scatter_tensor(output, grad)
            output.div_(ws)


def _run(cfg: dict[str, Any]) -> list[str]:
    tag = f"{rank_tag()} {cfg}"
    torch.manual_seed(cfg["idx"])
    base = new_model(cfg["model"])
    kw = dict(sharding_strategy=cfg["strategy"], use_orig_params=cfg["uop"])
    ref, ours = build(cfg["model"], "torch", base, **kw), build(cfg["model"], "ours", base, **kw)
    counters = []
    for m in (ref, ours):
        if cfg["hook"] == "counting":
            c = Counting()
            counters.append(c)
            m.register_comm_hook(None, c)
        else:
            m.register_comm_hook(*_hook(cfg["hook"], cfg["strategy"]))
    names = [n for n, _ in ref.named_parameters()]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, ours)]
    gen = torch.Generator().manual_seed(1000 + 7919 * dist.get_rank() + cfg["idx"])
    fails: list[str] = []
    for step in range(3):
        x = make_input(cfg["model"], gen)
        res = []
        for m, o in zip((ref, ours), opts):
            res.append(train_step(m, o, loss_of(m(x))))
        # Bit-exact, every hook: both models call the same hook on the same flat
        # gradients (fp16/bf16 ones round the same values the same way), and a
        # 2-rank reduction is one commutative add.
        fails += compare_step(f"{tag} step {step}", names, res[0], res[1], 0.0)
        # agreed: a rank stopping alone would leave the others in the next step's collectives
        if any_rank(bool(fails)):
            break
    if counters:
        if counters[0].calls != counters[1].calls:
            fails.append(f"{tag}: hook calls torch {counters[0].calls} vs ours {counters[1].calls}")
        if not counters[1].calls:
            fails.append(f"{tag}: the hook was never called")
    return fails


def _configs() -> list[dict[str, Any]]:
    out = []
    for k, (s, uop, hook) in enumerate(
        itertools.product(STRATEGIES, [False, True], ["default", "fp16", "bf16", "counting"])
    ):
        out.append(dict(strategy=s, uop=uop, hook=hook, model=("transformer", "deep")[k % 2], idx=k))
    return out


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    return run_configs(configs, _run, inject=inject)


def _outcome(fn: Any) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


ERROR_CASES = ["non_root", "twice", "hybrid", "not_callable"]


def _same_error(what: str, theirs: str, ours: str) -> str | None:
    """None if torch raised and ours raised the same, else why not."""
    bad = injected(what)
    if bad:
        return bad
    if theirs == "ok" or theirs != ours:
        return f"{rank_tag()} {what}: torch {theirs!r} vs ours {ours!r}"
    return None


def _errors(cases: list[str], inject: Injection | None = None) -> list[str]:
    """Same exception type and message as torch for each misuse.

    The exceptions caught are the misuse errors themselves, raised by
    ``register_comm_hook`` on every rank alike before any collective.
    """
    warnings.simplefilter("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def one(case: str) -> list[str]:
        out = []
        for impl in ("torch", "ours"):
            torch.manual_seed(0)
            kw: dict[str, Any] = {}
            if case == "hybrid":
                kw = dict(sharding_strategy="HYBRID_SHARD", device_mesh=mesh)
            m = build("transformer", impl, new_model("transformer"), **kw)
            state, hook = dh.DefaultState(dist.group.WORLD), dh.reduce_scatter_hook
            if case == "non_root":
                m(make_input("transformer", torch.Generator().manual_seed(0)))  # lazy init sets roots
                out.append(_outcome(lambda m=m, state=state, hook=hook: m.module.blocks[0].register_comm_hook(state, hook)))
            elif case == "twice":
                m.register_comm_hook(state, hook)
                out.append(_outcome(lambda m=m, state=state, hook=hook: m.register_comm_hook(state, hook)))
            elif case == "hybrid":
                out.append(_outcome(lambda m=m, state=state, hook=hook: m.register_comm_hook(state, hook)))
            else:
                out.append(_outcome(lambda m=m, state=state, hook=hook: m.register_comm_hook(state, "not a hook")))
        err = _same_error(case, out[0], out[1])
        return [err] if err else []

    return run_configs(cases, one, lambda c: f"{rank_tag()} {c}", inject)  # type: ignore[arg-type]


def test_comm_hooks_match_torch(pool2: Any) -> None:
    fails = [f for r in pool2.run(_sweep, _configs()) for f in r]
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)


def test_comm_hook_errors_match_torch(pool4: Any) -> None:
    fails = [f for r in pool4.run(_errors, ERROR_CASES) for f in r]
    assert not fails, "\n".join(fails)


# ---------------------------------------------------------------------------
# CUDA: torch's real fp16/bf16 compress hooks (they call record_stream)
# ---------------------------------------------------------------------------


def _cuda_worker(rank: int, port: int, out: Any) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    warnings.simplefilter("ignore")
    fails: list[str] = []
    try:
        for name in ("fp16", "bf16"):
            torch.manual_seed(0)
            base = new_model("transformer").cuda()
            models = [build("transformer", impl, base, device_id=torch.device("cuda", 0)) for impl in ("torch", "ours")]
            for m in models:
                m.register_comm_hook(*_hook(name, "NO_SHARD"))
            gen = torch.Generator().manual_seed(1)
            for _ in range(2):
                x = make_input("transformer", gen).cuda()
                losses = []
                for m in models:
                    loss = loss_of(m(x))
                    loss.backward()
                    losses.append(float(loss))
                    with torch.no_grad():
                        for p in m.parameters():
                            p.sub_(0.1 * p.grad)
                            p.grad = None
                if abs(losses[0] - losses[1]) > 1e-3:
                    fails.append(f"{name}: losses {losses}")
    except Exception as e:  # noqa: BLE001
        fails.append(f"raised {type(e).__name__}: {e}")
    finally:
        out.put(fails)
        dist.destroy_process_group()


@requires_cuda
def test_real_low_precision_hooks_on_cuda() -> None:
    import socket

    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = tmp.get_context("spawn").Queue()
    tmp.start_processes(_cuda_worker, args=(port, q), nprocs=1, start_method="spawn")
    fails = q.get(timeout=60)
    assert not fails, "\n".join(fails)
