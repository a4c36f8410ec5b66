"""SHARDED_STATE_DICT save and load move only the pieces each rank needs.

Every collective fsdp_wrap issues is counted while a SHARDED state dict is
saved and loaded: no unit is ever all-gathered (the only all-gather left is the
8-byte-per-rank collective-call check), each rank sends at most its own flat
shards, and the values equal the dim-0 chunks of the full parameters exactly,
for both ``use_orig_params`` modes, CPU offload, DTensor values and uneven
chunks (3 ranks, rows not divisible).  Interchange with torch's FSDP1, DCP
metadata and resharding are covered unchanged by ``test_checkpoint_interop``,
``test_state_dict`` and ``test_state_dict_hybrid``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

import fsdp_wrap
import fsdp_wrap.comm.collectives as _collectives
from fsdp_wrap.state_dict.chunks import ChunkLayout, chunk_tensor
from tests import _ckpt_common as C
from tests._sweep import Injection, run_sweep
from tests.test_full_checkpoint import build, train

F = fsdp_wrap.FullyShardedDataParallel


@contextmanager
def counting() -> Iterator[Counter[str]]:
    """Count the calls and bytes of fsdp_wrap's collectives (patched at the source)."""
    seen: Counter[str] = Counter()
    originals = {n: getattr(_collectives, n) for n in ("all_gather_into", "gather_into", "all_to_all_into")}

    def wrap(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "all_to_all_into":
                seen["all_to_all calls"] += 1
                seen["sent bytes"] += args[1].numel() * args[1].element_size()
            else:
                shard = args[1]
                seen[f"{name} calls"] += 1
                seen[f"{name} bytes"] += shard.numel() * shard.element_size()
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(_collectives, name, wrap(name))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(_collectives, name, fn)


def _shard_bytes(model: torch.nn.Module) -> int:
    return sum(
        st._handle.shard_valid_numel * st._handle.local_shard.element_size()
        for st in F.fsdp_modules(model) if st._handle is not None
    )


def _configs() -> list[dict[str, bool]]:
    return [dict(uop=uop, offload=offload, dtensor=dtensor)
            for uop in (False, True) for offload in (False, True) for dtensor in (False, True)]


def _one(c: dict[str, bool]) -> list[str]:
    uop, offload, dtensor = c["uop"], c["offload"], c["dtensor"]
    problems = []
    ws = dist.get_world_size()
    where = f"uop={uop} offload={offload} dtensor={dtensor}"
    kw: dict[str, Any] = {}
    if offload:
        kw["cpu_offload"] = fsdp_wrap.CPUOffload(offload_params=True)
    model, opt = build(uop=uop, n=3, d=10, **kw)
    train(model, opt, range(2))
    full = C.full_params(model)
    cfg = fsdp_wrap.ShardedStateDictConfig(_use_dtensor=dtensor)
    with F.state_dict_type(model, fsdp_wrap.StateDictType.SHARDED_STATE_DICT, cfg):
        with counting() as saved:
            sd = model.state_dict()
    # the values: exactly the dim-0 chunks of the full parameters
    layout = ChunkLayout(model.process_group, dist.get_rank(), ws, torch.device("cpu"))
    for k, v in full.items():
        rows = -(-v.shape[0] // ws)
        want_local = v[dist.get_rank() * rows : (dist.get_rank() + 1) * rows]
        value = sd[k]
        if dtensor:
            local = value.to_local()
        else:
            shards = value.local_shards()
            local = shards[0].tensor if shards else v[:0]
            # same metadata as cutting the full tensor
            problems += C.problem(f"{where}: {k} metadata",
                                  C.describe(value) != C.describe(chunk_tensor(v, layout, False)))
        problems += C.problem(f"{where}: {k} local chunk", not torch.equal(local, want_local))
    # nothing gathered: only the 8-byte call check is an all-gather
    problems += C.problem(f"{where}: save gathered {dict(saved)}",
                          saved["all_gather_into bytes"] > 8 or bool(saved["gather_into calls"]))
    problems += C.problem(f"{where}: save sent {saved['sent bytes']} > shard {_shard_bytes(model)}",
                          saved["sent bytes"] > _shard_bytes(model))
    # load into a different model: only pieces move, and the result is exact
    other, _ = build(seed=9, uop=not uop, n=3, d=10, **kw)
    with F.state_dict_type(other, fsdp_wrap.StateDictType.SHARDED_STATE_DICT, cfg):
        with counting() as loaded:
            result = other.load_state_dict(sd)
    problems += C.problem(f"{where}: load {result}",
                          bool(result.missing_keys or result.unexpected_keys))
    problems += C.problem(f"{where}: load gathered {dict(loaded)}",
                          loaded["all_gather_into bytes"] > 8 or bool(loaded["gather_into calls"]))
    problems += C.problem(f"{where}: load sent {loaded['sent bytes']}",
                          loaded["sent bytes"] > _shard_bytes(other))
    problems += C.problem(f"{where}: load exchanged nothing",
                          ws > 1 and not loaded["all_to_all calls"])
    got_full = C.full_params(other)
    for k in full:
        problems += C.problem(f"{where}: loaded {k} differs", not torch.equal(got_full[k], full[k]))
    problems += [f"{where}: optim {p}" for p in _optim_round_trip(model, opt, other, cfg)]
    return problems


def _sweep(configs: list[dict[str, bool]], inject: Injection | None = None) -> list[str]:
    return run_sweep(configs, _one, inject=inject)


def _chunks_of(osd: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """(fqn, state name) -> this rank's local values (chunks, or the 0-dim ``step``)."""
    out = {}
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            if isinstance(v, DTensor):
                local = v.to_local()
            elif isinstance(v, ShardedTensor):
                shards = v.local_shards()
                local = shards[0].tensor if shards else torch.empty(0)
            else:
                local = v
            out[(fqn, name)] = local.tolist()
    return out


def _optim_round_trip(model: Any, opt: Any, other: Any, cfg: Any) -> list[str]:
    """SHARDED optimizer state: save, load into ``other`` (the other use_orig_params
    mode), save again: the same chunks, and no all-gather of state anywhere."""
    problems = []
    sd_type = fsdp_wrap.StateDictType.SHARDED_STATE_DICT
    with F.state_dict_type(model, sd_type, cfg), counting() as saved:
        osd = F.optim_state_dict(model, opt)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.01)
    with F.state_dict_type(other, sd_type, cfg), counting() as loaded:
        other_opt.load_state_dict(F.optim_state_dict_to_load(other, other_opt, osd))
    with F.state_dict_type(other, sd_type, cfg):
        again = F.optim_state_dict(other, other_opt)
    for what, seen in (("save", saved), ("load", loaded)):
        problems += C.problem(f"{what} gathered {dict(seen)}",
                              seen["all_gather_into bytes"] > 8 or bool(seen["gather_into calls"]))
        # exp_avg and exp_avg_sq: each at most one shard
        problems += C.problem(f"{what} sent {seen['sent bytes']} > 2 shards",
                              seen["sent bytes"] > 2 * _shard_bytes(model))
    problems += C.problem(
        f"nothing exchanged: {dict(saved)} {dict(loaded)}",
        dist.get_world_size() > 1 and not (saved["all_to_all calls"] and loaded["all_to_all calls"]))
    problems += C.problem("state differs after a round trip", _chunks_of(osd) != _chunks_of(again))
    full = C.full_params(model)  # a collective: every rank, whatever it found above
    problems += C.problem(f"too little state: {sorted(_chunks_of(osd))}",
                          len(_chunks_of(osd)) < 2 * len(full))
    return problems


def test_sharded_state_dict_moves_only_pieces(pool2: Any, pool3: Any) -> None:
    assert pool2.run(_sweep, _configs()) == [[], []]
    assert pool3.run(_sweep, _configs()) == [[], [], []]


def _mismatch() -> str:
    model, _ = build(n=2, d=8)
    with F.state_dict_type(model, fsdp_wrap.StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
    other, _ = build(n=2, d=9)
    try:
        with F.state_dict_type(other, fsdp_wrap.StateDictType.SHARDED_STATE_DICT):
            other.load_state_dict(sd)
    except RuntimeError as e:
        return str(e)
    return "loaded"


def test_shape_mismatch_is_named_by_clean_fqn(pool2: Any) -> None:
    for msg in pool2.run(_mismatch):
        assert "size mismatch for blocks.0.fc1.weight" in msg
        assert "the shape in current model is (12, 9)" in msg
        assert "_fsdp_wrapped_module" not in msg
