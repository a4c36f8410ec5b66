"""Ranks constructed with different settings are refused on every rank, before any collective.

Each case gives rank 1 another value of one construction setting that
changes which collectives a rank issues (by keyword, or through the
environment variable a launcher would set differently on one node) and
checks that every rank raises a ``RuntimeError`` at construction naming the
setting, both values and the ranks holding each (fsdp_wrap/runtime/agreement.py).
Without the check these end in a hang (``sync_module_states``' broadcasts, the
hybrid groups built from ``LOCAL_WORLD_SIZE``, a quantized reduction's
sub-groups), or in collectives of different sizes or orders.  Neighbours: the
same settings everywhere, and an environment that differs where a keyword
given on every rank wins, are accepted.  Across real nodes:
tests/test_nodes.py (``test_nodes_launched_differently_are_refused_on_every_rank``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tests._dist import progress

# (setting named in the error, rank 0's and rank 1's keywords or environment,
# the values the message gives); env entries start with "$".
CASES: list[tuple[str, dict[str, Any], dict[str, Any], str, str]] = [
    ("quantize_collectives (or $FSDP_WRAP_QUANTIZE_COLLECTIVES)", {},
     {"$FSDP_WRAP_QUANTIZE_COLLECTIVES": "grads,where=all"}, "off", "grads=int8/2048,where=all"),
    ("bucket_cap_mb (or $FSDP_WRAP_BUCKET_CAP_MB)", {}, {"$FSDP_WRAP_BUCKET_CAP_MB": "0"},
     "1.0", "0.0"),
    ("all_gather_batch_mb (or $FSDP_WRAP_ALL_GATHER_BATCH_MB)", {},
     {"all_gather_batch_mb": 4}, "1.0", "4.0"),
    ("$LOCAL_WORLD_SIZE", {"$LOCAL_WORLD_SIZE": "1", "sharding_strategy": "HYBRID_SHARD"},
     {"$LOCAL_WORLD_SIZE": "2", "sharding_strategy": "HYBRID_SHARD"}, "'1'", "'2'"),
    ("sharding_strategy", {}, {"sharding_strategy": "SHARD_GRAD_OP"}, "FULL_SHARD",
     "SHARD_GRAD_OP"),
    ("backward_prefetch", {}, {"backward_prefetch": "BACKWARD_POST"}, "BACKWARD_PRE",
     "BACKWARD_POST"),
    ("forward_prefetch", {}, {"forward_prefetch": True}, "False", "True"),
    ("limit_all_gathers", {}, {"limit_all_gathers": False}, "True", "False"),
    ("mixed_precision.param_dtype", {}, {"param_dtype": torch.bfloat16}, "None",
     "torch.bfloat16"),
    ("sync_module_states", {}, {"sync_module_states": True}, "False", "True"),
    ("use_orig_params", {}, {"use_orig_params": True}, "False", "True"),
    ("$FSDP_USE_FULL_PREC_IN_EVAL", {}, {"$FSDP_USE_FULL_PREC_IN_EVAL": "1"}, "'<unset>'",
     "'1'"),
]
# accepted: equal everywhere; the environment differs but the keyword wins
ACCEPTED: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"sharding_strategy": "SHARD_GRAD_OP"}, {"sharding_strategy": "SHARD_GRAD_OP"}),
    ({"bucket_cap_mb": 1}, {"$FSDP_WRAP_BUCKET_CAP_MB": "0", "bucket_cap_mb": 1}),
    ({"quantize_collectives": "off"},
     {"$FSDP_WRAP_QUANTIZE_COLLECTIVES": "grads", "quantize_collectives": "off"}),
]


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _build(settings: dict[str, Any]) -> str:
    """Construct (and run one forward and backward of) a small model with
    ``settings``; ``"accepted"`` or the error."""
    import fsdp_wrap
    from tests.models import TinyTransformer, transformer_input, transformer_policy

    env = {k[1:]: v for k, v in settings.items() if k.startswith("$")}
    kw = {k: v for k, v in settings.items() if not k.startswith("$")}
    if "sharding_strategy" in kw:
        kw["sharding_strategy"] = fsdp_wrap.ShardingStrategy[kw["sharding_strategy"]]
    if "backward_prefetch" in kw:
        kw["backward_prefetch"] = fsdp_wrap.BackwardPrefetch[kw["backward_prefetch"]]
    if "param_dtype" in kw:
        kw["mixed_precision"] = fsdp_wrap.MixedPrecision(param_dtype=kw.pop("param_dtype"))
    torch.manual_seed(0)
    with _environment(env):
        try:
            model = fsdp_wrap.FullyShardedDataParallel(
                TinyTransformer(), auto_wrap_policy=transformer_policy("ours"), **kw)
            model(transformer_input(torch.Generator().manual_seed(0))).sum().backward()
        except (RuntimeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
    return "accepted"


def _sweep() -> list[str]:
    mine = 1 if dist.get_rank() == 1 else 0
    out = []
    for case in CASES:
        out.append(_build(case[1 + mine]))
        progress()
    for pair in ACCEPTED:
        out.append(_build(pair[mine]))
        progress()
    return out


def test_ranks_with_different_settings_are_refused_on_every_rank(pool2: Any) -> None:
    results = pool2.run(_sweep)
    for rank, res in enumerate(results):
        for (name, _, _, a, b), got in zip(CASES, res):
            assert got.startswith(f"RuntimeError: [rank {rank}] FSDP was constructed with "
                                  "settings that differ between ranks [0, 1]"), (name, got)
            assert f"{name} is {a} on rank(s) [0] and {b} on rank(s) [1]" in got, (name, got)
            # only the setting that differs is named
            assert got.count(" on rank(s) [0] and ") == 1, (name, got)
        for pair, got in zip(ACCEPTED, res[len(CASES):]):
            assert got == "accepted", (pair, got)
