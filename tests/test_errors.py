"""Misuse raises torch's exception type and message text, on every rank, before any hang.

Each case builds the same misuse with torch's FSDP1 and with fsdp_wrap inside
one pool run (2 ranks); every rank records ``(type, message)`` for both.  The
tests then check that both raised, with the same type, and that our message
contains torch's text (matched with ``pytest.raises(..., match=...)`` on the
torch part, re-raised from the recorded message) plus the rank/FQN where
fsdp_wrap adds them.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.conftest import requires_cuda
from tests.models import fsdp_api, fsdp_cls, fsdp_kwargs, wrap_api

Outcome = Optional[tuple[str, str]]  # (exception type name, message) or None if no error


def _lin_pair() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))


def _scalar() -> nn.Module:
    m = _lin_pair()
    m.register_parameter("p", nn.Parameter(torch.tensor(2.0)))
    return m


def _integer() -> nn.Module:
    m = _lin_pair()
    m.register_parameter(
        "steps", nn.Parameter(torch.ones(3, dtype=torch.int64), requires_grad=False)
    )
    return m


def _mixed_dtype() -> nn.Module:
    m = _lin_pair()
    m[2].double()
    return m


def _mixed_grad() -> nn.Module:
    m = _lin_pair()
    m[2].bias.requires_grad_(False)
    return m


# Each case: fn(impl) performing the misuse; it returns nothing if no error.
def _case_already_wrapped_child(impl: str) -> None:
    m = _lin_pair()
    cls = fsdp_cls(impl)
    m[0] = cls(m[0], **fsdp_kwargs(impl))
    cls(m, auto_wrap_policy=wrap_api(impl).ModuleWrapPolicy({nn.Linear}), **fsdp_kwargs(impl))


def _case_scalar(impl: str) -> None:
    fsdp_cls(impl)(_scalar(), **fsdp_kwargs(impl))


def _case_integer(impl: str) -> None:
    fsdp_cls(impl)(_integer(), **fsdp_kwargs(impl))


def _case_mixed_dtype(impl: str) -> None:
    fsdp_cls(impl)(_mixed_dtype(), **fsdp_kwargs(impl))


def _case_mixed_requires_grad(impl: str) -> None:
    fsdp_cls(impl)(_mixed_grad(), **fsdp_kwargs(impl, use_orig_params=False))


def _case_mixed_requires_grad_policy(impl: str) -> None:
    m = nn.Sequential(_mixed_grad(), nn.Linear(2, 2))
    fsdp_cls(impl)(
        m,
        auto_wrap_policy=wrap_api(impl).ModuleWrapPolicy({nn.Sequential}),
        **fsdp_kwargs(impl, use_orig_params=False),
    )


def _wrapped(impl: str) -> nn.Module:
    m = _lin_pair()
    return fsdp_cls(impl)(
        m, auto_wrap_policy=wrap_api(impl).ModuleWrapPolicy({nn.Linear}), **fsdp_kwargs(impl)
    )


def _case_clip_on_non_root(impl: str) -> None:
    m = _wrapped(impl)
    m(torch.randn(2, 3)).sum().backward()
    m[0].clip_grad_norm_(1.0)


def _case_no_sync_on_non_root(impl: str) -> None:
    m = _wrapped(impl)
    m(torch.randn(2, 3)).sum().backward()
    with m[0].no_sync():
        pass


_MESH: Any = None
_MESH_2D: Any = None


def _case_pg_and_mesh(impl: str) -> None:
    fsdp_cls(impl)(
        _lin_pair(), process_group=dist.group.WORLD, device_mesh=_MESH, **fsdp_kwargs(impl)
    )


def _case_ignored_both(impl: str) -> None:
    m = _lin_pair()
    fsdp_cls(impl)(m, ignored_modules=[m[0]], ignored_states=[m[2]], **fsdp_kwargs(impl))


def _case_ignored_states_mixed_types(impl: str) -> None:
    m = _lin_pair()
    fsdp_cls(impl)(m, ignored_states={m[0], m[2].weight, m[2].bias, m[2]}, **fsdp_kwargs(impl))


def _case_ignored_modules_not_modules(impl: str) -> None:
    m = _lin_pair()
    fsdp_cls(impl)(m, ignored_modules={m[0].weight, m[0].bias}, **fsdp_kwargs(impl))


def _case_ignored_modules_not_iterable(impl: str) -> None:
    m = _lin_pair()
    fsdp_cls(impl)(m, ignored_modules=5, **fsdp_kwargs(impl))


def _case_fsdp_in_ignored(impl: str) -> None:
    m = _lin_pair()
    cls = fsdp_cls(impl)
    m[0] = cls(m[0], **fsdp_kwargs(impl))
    cls(m, ignored_modules=[m[0]], **fsdp_kwargs(impl))


def _case_wrong_state_dict_config(impl: str) -> None:
    api = fsdp_api(impl)
    m = _wrapped(impl)
    with api.FullyShardedDataParallel.state_dict_type(
        m, api.StateDictType.FULL_STATE_DICT, api.ShardedStateDictConfig()
    ):
        pass


def _case_wrong_optim_state_dict_config(impl: str) -> None:
    api = fsdp_api(impl)
    m = _wrapped(impl)
    api.FullyShardedDataParallel.set_state_dict_type(
        m,
        api.StateDictType.SHARDED_STATE_DICT,
        api.ShardedStateDictConfig(),
        api.FullOptimStateDictConfig(),
    )


def _case_nested_summon(impl: str) -> None:
    m = _wrapped(impl)
    m(torch.randn(2, 3))
    cls = fsdp_cls(impl)
    with cls.summon_full_params(m):
        with cls.summon_full_params(m):
            pass


def _case_summon_writeback_rank0_only(impl: str) -> None:
    m = _wrapped(impl)
    with fsdp_cls(impl).summon_full_params(m, writeback=True, rank0_only=True):
        pass


def _case_summon_offload_no_shard(impl: str) -> None:
    m = fsdp_cls(impl)(_lin_pair(), **fsdp_kwargs(impl, sharding_strategy="NO_SHARD"))
    with fsdp_cls(impl).summon_full_params(m, offload_to_cpu=True):
        pass


def _case_summon_with_grads_flat(impl: str) -> None:
    m = _wrapped(impl)
    with fsdp_cls(impl).summon_full_params(m, with_grads=True):
        pass


def _case_param_init_fn_not_callable(impl: str) -> None:
    with torch.device("meta"):
        m = _lin_pair()
    fsdp_cls(impl)(m, param_init_fn=3, **fsdp_kwargs(impl))


def _case_apply_in_summon(impl: str) -> None:
    m = _wrapped(impl)
    with fsdp_cls(impl).summon_full_params(m):
        m.apply(lambda mod: None)


def _nested_disagreeing(impl: str, **inner: Any) -> None:
    m = _lin_pair()
    cls = fsdp_cls(impl)
    m[2] = cls(m[2], **fsdp_kwargs(impl, **inner))
    cls(m, **fsdp_kwargs(impl))(torch.randn(2, 3))


def _case_mixed_use_orig_params(impl: str) -> None:
    _nested_disagreeing(impl, use_orig_params=True)


def _case_mixed_limit_all_gathers(impl: str) -> None:
    _nested_disagreeing(impl, limit_all_gathers=False)


def _case_mixed_full_prec_in_eval(impl: str) -> None:
    import os

    m = _lin_pair()
    cls = fsdp_cls(impl)
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        m[2] = cls(m[2], **fsdp_kwargs(impl))
    finally:
        del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
    cls(m, **fsdp_kwargs(impl))(torch.randn(2, 3))


def _case_local_state_dict_with_mesh(impl: str) -> None:
    api = fsdp_api(impl)
    m = fsdp_cls(impl)(
        _lin_pair(), device_mesh=_MESH_2D,
        **fsdp_kwargs(impl, sharding_strategy=api.ShardingStrategy.HYBRID_SHARD),
    )
    with api.FullyShardedDataParallel.state_dict_type(m, api.StateDictType.LOCAL_STATE_DICT):
        m.state_dict()


def _case_local_optim_state_dict_with_mesh(impl: str) -> None:
    """torch's test_raises_warning_or_errors: the optimizer API refuses it too."""
    api = fsdp_api(impl)
    m = fsdp_cls(impl)(_lin_pair(), device_mesh=_MESH, **fsdp_kwargs(impl))
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    with api.FullyShardedDataParallel.state_dict_type(m, api.StateDictType.LOCAL_STATE_DICT):
        api.FullyShardedDataParallel.optim_state_dict(m, opt)


def _case_optim_in_backward_flat(impl: str) -> None:
    from torch.distributed.optim import _apply_optimizer_in_backward

    m = _wrapped(impl)
    _apply_optimizer_in_backward(torch.optim.SGD, m.parameters(), {"lr": 0.1})
    m(torch.randn(2, 3))


CASES: dict[str, Callable[[str], None]] = {
    name[len("_case_") :]: fn for name, fn in globals().items() if name.startswith("_case_")
}


def _run_cases(names: list[str]) -> dict[str, dict[str, Outcome]]:
    global _MESH, _MESH_2D
    warnings.simplefilter("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    _MESH = init_device_mesh("cpu", (dist.get_world_size(),))  # collective: every rank, up front
    _MESH_2D = init_device_mesh("cpu", (1, dist.get_world_size()))  # HSDP: replicate x shard
    out: dict[str, dict[str, Outcome]] = {}
    for name in names:
        out[name] = {}
        for impl in ("torch", "ours"):
            try:
                CASES[name](impl)
                out[name][impl] = None
            except Exception as e:  # noqa: BLE001
                out[name][impl] = (type(e).__name__, str(e))
    return out


# (torch's text we expect in both messages, extra things ours must name)
EXPECTED: dict[str, tuple[str, list[str]]] = {
    "already_wrapped_child": (
        "FSDP auto wrapping requires modules to not already have FSDP applied",
        ["rank", "'0'", "without auto_wrap_policy"],
    ),
    "param_init_fn_not_callable": ("to be callable but got <class 'int'>", ["rank", "lambda m"]),
    "apply_in_summon": (
        "expected to be in states [<TrainingState.IDLE: 1>] but current state is "
        "TrainingState.SUMMON_FULL_PARAMS",
        ["rank", "outside summon_full_params"],
    ),
    "mixed_use_orig_params": (
        "Expects one homogeneous value for _use_orig_params but got {False, True}",
        ["rank", "'2': True", "'<root>': False", "same use_orig_params"],
    ),
    "mixed_limit_all_gathers": (
        "Expects one homogeneous value for limit_all_gathers but got {False, True}",
        ["rank", "'2': False", "'<root>': True", "same limit_all_gathers"],
    ),
    "mixed_full_prec_in_eval": (
        "Expects one homogeneous value for _use_full_prec_in_eval but got {False, True}",
        ["rank", "'2': True", "FSDP_USE_FULL_PREC_IN_EVAL"],
    ),
    "local_state_dict_with_mesh": (
        "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with "
        "LOCAL_STATE_DICT. Please set state_dict_type to SHARDED_STATE_DICT",
        ["rank", "device_mesh"],
    ),
    "local_optim_state_dict_with_mesh": (
        "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with "
        "LOCAL_STATE_DICT. Please set state_dict_type to SHARDED_STATE_DICT",
        ["rank", "device_mesh"],
    ),
    "optim_in_backward_flat": (
        "FSDP optimizer in backward only supported with use_orig_params=True!",
        ["rank", "'0'", "'2'", "use_orig_params=True"],
    ),
    "scalar": ("FSDP doesn't support scalar parameters. Change", ["rank", "p"]),
    "integer": ("Cannot flatten integer dtype tensors", ["rank", "steps"]),
    "mixed_dtype": (
        "Must flatten tensors with uniform dtype but got torch.float32 and torch.float64",
        ["rank", "2.weight"],
    ),
    "mixed_requires_grad": (
        "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`",
        ["rank", "2.bias"],
    ),
    "mixed_requires_grad_policy": (
        "has both parameters with requires_grad=True and False. FSDP does not support wrapping such "
        "modules when use_orig_params=False.",
        [],
    ),
    "clip_on_non_root": ("`clip_grad_norm_()` should only be called on the root FSDP instance", []),
    "no_sync_on_non_root": (
        "`no_sync()` on inner FSDP instances is not supported. Please call "
        "`no_sync()` on root FSDP module.",
        [],
    ),
    "pg_and_mesh": (
        "Cannot pass both process_group and device_mesh at the same time. Please just pass "
        "only one of them.",
        [],
    ),
    "ignored_both": (
        "Cannot pass both ignored_modules and ignored_states at the same time. Please just "
        "pass ignored_states.",
        [],
    ),
    "ignored_states_mixed_types": (
        "ignored_states expects all nn.Parameter or all nn.Module list elements but got types "
        "[<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.parameter.Parameter'>]",
        ["rank"],
    ),
    "ignored_modules_not_modules": (
        "ignored_modules expects nn.Module list elements but got types "
        "[<class 'torch.nn.parameter.Parameter'>]",
        ["rank"],
    ),
    # torch's text here is Python's own ("'int' object is not iterable"); we only
    # require the type, and that ours names the argument.
    "ignored_modules_not_iterable": ("", ["ignored_modules"]),
    "fsdp_in_ignored": ("`ignored_modules` should not include FSDP modules", []),
    "wrong_state_dict_config": (
        "Expected state_dict_config of type",
        ["FullStateDictConfig", "ShardedStateDictConfig"],
    ),
    "wrong_optim_state_dict_config": (
        "Expected optim_state_dict_config of type",
        ["ShardedOptimStateDictConfig", "FullOptimStateDictConfig"],
    ),
    "nested_summon": ("Cannot manually unshard parameters when already unsharding parameters", []),
    "summon_writeback_rank0_only": ("writeback=True and rank0_only=True is not supported yet", []),
    "summon_offload_no_shard": ("offload_to_cpu=True and NO_SHARD is not supported yet", []),
    "summon_with_grads_flat": (
        "with_grads=True, use_orig_params=False, offload_to_cpu=False is not supported yet",
        [],
    ),
}

_RESULTS: list[dict[str, dict[str, Outcome]]] = []


def _results(pool: Any) -> list[dict[str, dict[str, Outcome]]]:
    if not _RESULTS:
        _RESULTS.extend(pool.run(_run_cases, sorted(CASES)))
    return _RESULTS


def test_every_case_has_an_expectation() -> None:
    assert set(CASES) == set(EXPECTED)


XFAIL: dict[str, str] = {}

# Cases torch refuses and fsdp_wrap accepts on purpose: a unit mixing dtypes or
# frozen and trainable parameters gets one flat parameter per kind
# (docs/fine_tuning.rst); training them is tested in tests/test_split_flat.py.
ACCEPTED: set[str] = {"mixed_dtype", "mixed_requires_grad", "mixed_requires_grad_policy"}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_split_units_accept_what_torch_refuses(pool2: Any, case: str) -> None:
    text, _ = EXPECTED[case]
    for rank, res in enumerate(_results(pool2)):
        torch_out, ours = res[case]["torch"], res[case]["ours"]
        assert torch_out is not None and _words(text) in _words(torch_out[1]), (
            f"torch no longer refuses {case}? it said: {torch_out}"
        )
        assert ours is None, f"fsdp_wrap refused {case} on rank {rank}: {ours}"


def _words(message: str) -> str:
    return " ".join(re.sub(r"[()',.]", " ", message).split())


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=XFAIL[c])) if c in XFAIL else c
        for c in sorted(EXPECTED) if c not in ACCEPTED
    ],
)
def test_misuse_matches_torch(pool2: Any, case: str) -> None:
    text, extras = EXPECTED[case]
    for rank, res in enumerate(_results(pool2)):
        torch_out, ours = res[case]["torch"], res[case]["ours"]
        assert torch_out is not None, f"torch did not raise for {case} on rank {rank}"
        # torch < 2.13 words some messages as a tuple of strings: compare words there
        assert _words(text) in _words(torch_out[1]), (
            f"reference text changed? torch said: {torch_out[1]}"
        )
        assert ours is not None, (
            f"fsdp_wrap did not raise for {case} on rank {rank} (torch: {torch_out})"
        )
        assert ours[0] == torch_out[0], (rank, ours, torch_out)
        exc_type = {
            "ValueError": ValueError,
            "RuntimeError": RuntimeError,
            "TypeError": TypeError,
            "AssertionError": AssertionError,
            "NotImplementedError": NotImplementedError,
        }[ours[0]]
        with pytest.raises(exc_type, match=re.escape(text) if text else None):
            raise exc_type(ours[1])
        if text and text in torch_out[1]:
            # torch's sentence first, filled as torch fills it (tests match its start)
            start = torch_out[1][: torch_out[1].index(text) + len(text)]
            assert ours[1].startswith(start), (rank, ours[1], start)
        assert "_fsdp_wrapped_module" not in ours[1], f"{case}: internals leak: {ours[1]}"
        for extra in extras:
            assert extra in ours[1], f"{case}: our message should name {extra!r}: {ours[1]}"
            if extra == "rank":
                assert f"rank {rank}" in ours[1], ours[1]


# ---------------------------------------------------------------------------
# ranks that built different units: an error on every rank at lazy init
# ---------------------------------------------------------------------------


def _different_units(uop: bool) -> tuple[str, str]:
    import fsdp_wrap as fw
    from fsdp_wrap.wrap import ModuleWrapPolicy

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    torch.manual_seed(0)
    hidden = 6 if rank == 0 else 8  # rank 1 builds a different model
    m = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    model = fw.FullyShardedDataParallel(
        m, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=uop
    )
    try:
        model(torch.randn(2, 3)).sum().backward()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "", "no error"


@pytest.mark.parametrize("uop", [False, True])
def test_ranks_with_different_units_fail_on_every_rank(pool2: Any, uop: bool) -> None:
    res = pool2.run(_different_units, uop)  # would time out (not return) on a hang
    for rank, (typ, msg) in enumerate(res):
        assert typ == "RuntimeError", (rank, typ, msg)
        assert f"rank {rank}" in msg and f"rank {1 - rank}" in msg, msg
        # names the unit that differs (the first Linear, FQN "0")
        assert re.search(r"unit #?\d|'0'|\b0\.weight\b", msg), msg
        assert "(6, 3)" in msg or "(8, 3)" in msg or "6" in msg, msg


def _refused_tree_stays_refused() -> list[str]:
    m = _lin_pair()
    m[2] = fsdp_cls("ours")(m[2], **fsdp_kwargs("ours", use_orig_params=True))
    model = fsdp_cls("ours")(m, **fsdp_kwargs("ours"))
    messages = []
    for _ in range(2):
        try:
            model(torch.randn(2, 3))
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_disagreeing_units_refused_again_on_retry(pool2: Any) -> None:
    # The check runs before the root is set, so a second forward is refused too
    # (instead of running a half-initialised tree).
    for messages in pool2.run(_refused_tree_stays_refused):
        assert all("Expects one homogeneous value for _use_orig_params" in m for m in messages), (
            messages
        )


# ---------------------------------------------------------------------------
# params on two devices (needs a GPU)
# ---------------------------------------------------------------------------


def _two_devices() -> tuple[Outcome, Outcome]:
    outs = []
    for impl in ("torch", "ours"):
        m = _lin_pair()
        m[2].cuda()
        try:
            fsdp_cls(impl)(copy.deepcopy(m))
            outs.append(None)
        except Exception as e:  # noqa: BLE001
            outs.append((type(e).__name__, str(e)))
    return outs[0], outs[1]


@requires_cuda
def test_params_on_two_devices(pool2: Any) -> None:
    for torch_out, ours in pool2.run(_two_devices):
        assert torch_out is not None and ours is not None and ours[0] == torch_out[0], (
            torch_out,
            ours,
        )
        assert (
            "To support a module with both CPU and GPU params, please pass in device_id argument"
            in ours[1]
        )
