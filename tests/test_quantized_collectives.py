"""``quantize_collectives``: equal, bit for bit, to a plain model applying the same codes.

Every configuration trains fsdp_wrap and :class:`tests._quant_emulation.Emulation`
(a plain replicated model that quantizes and dequantizes what a rank would
receive, with the same codec functions, and reduces in the same order) in
lockstep on different data per rank, and compares losses and full
parameters after every step with tolerance 0.  Each also checks the coding
moved some value (a comparison coding never touched would prove little).

* 2 ranks, ``where="all"``: FULL_SHARD / SHARD_GRAD_OP / NO_SHARD; int8 and
  int4; gradient buckets and batched gathers on and off (codes restart at
  each unit); bf16 ``param_dtype``; CPU offload; asynchronous gathers;
  ``use_orig_params`` both ways; split (LoRA) units with frozen weights.
* 4 ranks as 2 nodes x 2 (``LOCAL_WORLD_SIZE=2``), ``where="cross_node"``:
  FULL_SHARD and NO_SHARD routed through the nodes (only the step between
  nodes coded), hybrid strategies with only the replicas' all-reduce coded,
  and hybrid ``where="all"``.
* The collectives on their own: a coded reduce-scatter and all-gather are
  within the codec's error bound of the exact ones.
* What it refuses, on every rank alike and before any collective: a
  ``where="cross_node"`` it cannot place (no ``LOCAL_WORLD_SIZE``, a hybrid
  shard group across nodes, a group not made of whole nodes), a
  communication hook with coded gradients; ranks that disagree on the
  setting (a node launched with another ``$FSDP_WRAP_QUANTIZE_COLLECTIVES``),
  at construction, before the sub-groups a routed collective needs, over the
  whole group and across the replicas.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tests._dist import progress
from tests._options_common import cmp, loss_of, rank_tag, run_configs
from tests._quant_emulation import build_pair, full_params, mesh_2x2, model_input, nodes_of
from tests._sweep import Injection

STEPS = 2


def _configs(ws: int) -> list[dict[str, Any]]:
    if ws == 2:
        q8, q84 = "both,block=8,where=all", "weights,grads=int4,block=5,where=all"
        return [
            dict(model="transformer", strategy="FULL_SHARD", uop=False, quant=q8),
            dict(model="transformer", strategy="FULL_SHARD", uop=True, quant=q8, cap=0, batch=0),
            dict(model="transformer", strategy="SHARD_GRAD_OP", uop=False, quant=q84),
            dict(model="transformer", strategy="FULL_SHARD", uop=True, quant=q8,
                 mp=torch.bfloat16),
            dict(model="transformer", strategy="FULL_SHARD", uop=False, quant=q84, offload=True),
            dict(model="transformer", strategy="FULL_SHARD", uop=False, quant=q8, limit=False),
            dict(model="lora", strategy="FULL_SHARD", uop=True, quant=q84),
            dict(model="transformer", strategy="NO_SHARD", uop=False, quant="grads,block=8,where=all"),
        ]
    return [
        dict(model="transformer", strategy="FULL_SHARD", uop=False, quant="both,block=8"),
        dict(model="transformer", strategy="FULL_SHARD", uop=True, quant="both,grads=int4,block=8",
             mp=torch.bfloat16, cap=0),
        dict(model="transformer", strategy="HYBRID_SHARD", uop=False, quant="both,block=8"),
        dict(model="lora", strategy="_HYBRID_SHARD_ZERO2", uop=True, quant="grads=int4,block=6",
             groups="tuple"),
        dict(model="transformer", strategy="HYBRID_SHARD", uop=True, quant="both,block=8,where=all",
             offload=True),
        dict(model="transformer", strategy="NO_SHARD", uop=False, quant="grads,block=8"),
    ]


def _train_vs_emulation(cfg: dict[str, Any]) -> list[str]:
    tag = f"{rank_tag()} {cfg}"
    with nodes_of(2):
        ours, emu, opt = build_pair(cfg)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    cast = cfg["mp"] if isinstance(cfg.get("mp"), torch.dtype) else None
    fails: list[str | None] = []
    for step in range(STEPS):
        x = model_input(cfg["model"], gen)
        loss = loss_of(ours(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = emu.step(x, loss_of, cast_input=cast)
        fails.append(cmp(f"step {step} loss", ref_loss, loss.detach(), 0.0))
        got, want = full_params(ours), dict(emu.master.named_parameters())
        for name, p in want.items():
            fails.append(cmp(f"step {step} param {name}", p, got[name], 0.0))
    # (what the documentation says is coded, not what fsdp_wrap decided)
    if any(u.wire.weights for u in emu.units) and not emu.moved["weights"] > 0:
        fails.append("coding the weights changed no value")
    if any(u.wire.grads or u.wire.replicas for u in emu.units) and not emu.moved["grads"] > 0:
        fails.append("coding the gradients changed no value")
    found = [f for f in fails if f]
    return [f"{tag}: " + "; ".join(found[:4])] if found else []


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_configs(configs, _train_vs_emulation, inject=inject)


def test_equal_to_emulation_2_ranks(pool2: Any) -> None:
    assert pool2.run(_sweep, _configs(2)) == [[], []]


def test_equal_to_emulation_2_nodes_x_2(pool4: Any) -> None:
    assert pool4.run(_sweep, _configs(4)) == [[]] * 4


# ------------------------------------------------ the decision, against the docs


def _coding_cases() -> list[tuple[int, str, str]]:
    """(ranks per node, strategy, setting): 2 nodes x 2 and one node of 4."""
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
    settings = ["weights", "grads=int4,block=64", "both,block=32,where=all", "weights,where=all",
                "off"]
    return ([(2, s, q) for s in strategies for q in settings]
            + [(4, s, q) for s in strategies for q in ("both", "grads,where=all")])


def _coding_of_every_unit() -> list[str]:
    """Each unit's wire (which collectives fsdp_wrap codes, routed or flat)
    against :func:`tests._quant_rules.documented_coding`: the decision itself,
    checked against the documentation (the emulation sweeps above check the
    numbers that follow from it)."""
    import fsdp_wrap
    from tests._quant_rules import documented_coding
    from tests.models import LoraNet, TinyTransformer, lora_policy, transformer_policy

    me, fails, compared = dist.get_rank(), [], 0
    for per_node, strategy, quant in _coding_cases():
        hybrid = "HYBRID" in strategy
        kw: dict[str, Any] = dict(sharding_strategy=fsdp_wrap.ShardingStrategy[strategy],
                                  quantize_collectives=quant)
        shard, replicas = list(range(4)), None
        if hybrid:
            kw["device_mesh"] = mesh_2x2()  # (shard groups {0, 1} and {2, 3})
            shard = [me - me % 2, me - me % 2 + 1]
            replicas = [me % 2, me % 2 + 2]
        models = [(TinyTransformer(), transformer_policy("ours"))]
        if per_node == 2 and quant.startswith("both"):  # (frozen and trainable flat parameters)
            models.append((LoraNet(), lora_policy("ours")))
        for model, policy in models:
            with nodes_of(per_node):
                try:
                    ours = fsdp_wrap.FullyShardedDataParallel(model, auto_wrap_policy=policy, **kw)
                except ValueError as e:
                    fails.append(f"{per_node}/node {strategy} {quant}: refused: {e}")
                    continue
                want = documented_coding(quant, strategy, shard, replicas, per_node)
            units = fsdp_wrap.FullyShardedDataParallel.fsdp_modules(ours)
            for h in (h for unit in units for h in unit._handles):  # type: ignore[union-attr]
                compared += 1
                w = h.wire
                got = (w.weights, w.grads, w.replicas, w.hierarchy is not None)
                if got != (want.weights, want.grads, want.replicas, want.routed):
                    fails.append(f"[rank {me}] {per_node}/node {strategy} {quant!r} "
                                 f"{type(model).__name__} unit {h.unit_fqn!r}: codes "
                                 f"{got} but the docs say {want}")
        progress()
    if compared < len(_coding_cases()) * 3:  # (TinyTransformer: 3 flat parameters)
        fails.append(f"[rank {me}] only {compared} flat parameters compared")
    return fails


def test_each_unit_codes_what_the_docs_say(pool4: Any) -> None:
    assert pool4.run(_coding_of_every_unit) == [[]] * 4


# ------------------------------------------------------- the collectives alone


def _collectives_within_bound() -> list[str]:
    """Coded reduce-scatters, all-gathers and all-reduces (flat and routed
    through 2 nodes) against the exact results: within the codec's bound."""
    from fsdp_wrap.comm.quant import collectives as Q
    from fsdp_wrap.comm.quant.codec import Codec, error_bound
    from fsdp_wrap.comm.quant.topology import Topology, hierarchy

    world, me = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    hier = hierarchy(group, Topology(2), "", "test")
    fails = []
    for codec in (Codec(8, 16), Codec(4, 7)):
        gen = torch.Generator().manual_seed(7)
        xs = [torch.randn(world * 50, generator=gen) * (1 + r) for r in range(world)]
        exact = sum(x.double() for x in xs)
        bound = sum(error_bound(x.view(world, 50)[me], codec) for x in xs)
        for name in ("flat", "routed"):
            out = torch.empty(50)
            if name == "flat":
                Q.reduce_scatter(out, xs[me].clone(), group, codec)
                limit = bound.double()
            else:
                Q.hier_reduce_scatter(out, xs[me].clone(), hier, codec)
                # the routed one sums each node's rows exactly first (float32: a
                # rounding of the node sum) and codes those: its own bound
                node_sums = [xs[i] + xs[i + 1] for i in range(0, world, 2)]
                limit = (sum(error_bound(s.view(world, 50)[me], codec) for s in node_sums)
                         + 4 * 2.0**-24 * exact.view(world, 50)[me].abs())
            err = (out.double() - exact.view(world, 50)[me]).abs()
            if not bool((err <= limit).all()):
                fails.append(f"{name} reduce-scatter {codec}: {float((err - limit).max())} over")
        shard = xs[0].view(world, 50)[me]
        rows = xs[0].view(world, 50)
        for name in ("flat", "routed"):
            out = torch.empty(world * 50)
            if name == "flat":
                Q.all_gather(out, shard, group, codec)
            else:
                Q.hier_all_gather(out, shard, hier, codec)
            for r in range(world):
                err = (out.view(world, 50)[r] - rows[r]).abs()
                if not bool((err <= error_bound(rows[r], codec)).all()):
                    fails.append(f"{name} all-gather {codec}: row {r} out of bound")
        total = Q.all_reduce(xs[me], group, codec)
        same = [torch.empty_like(total) for _ in range(world)]
        dist.all_gather(same, total)
        if not all(torch.equal(s, total) for s in same):
            fails.append(f"all-reduce {codec}: ranks disagree")
        progress()
    return fails


def test_collectives_within_the_error_bound(pool4: Any) -> None:
    assert pool4.run(_collectives_within_bound) == [[]] * 4


# ------------------------------------------------------------------ refusals


def _refusals() -> list[str]:
    """Each case: the error every rank raised (type: first line)."""
    import fsdp_wrap
    from tests.models import TinyTransformer, transformer_policy

    def attempt(per_node: int | None, **kw: Any) -> str:
        try:
            with nodes_of(per_node):
                model = fsdp_wrap.FullyShardedDataParallel(
                    TinyTransformer(), auto_wrap_policy=transformer_policy("ours"), **kw)
        except (ValueError, AssertionError) as e:
            return f"{type(e).__name__}: {e}"
        try:
            model.register_comm_hook(None, lambda state, grad, out=None: None)
        except AssertionError as e:
            return f"AssertionError: {e}"
        return "accepted"

    mesh = mesh_2x2()
    three = dist.new_group([0, 1, 2])
    out = [
        attempt(None, quantize_collectives="grads"),
        attempt(1, quantize_collectives="grads", sharding_strategy=fsdp_wrap.ShardingStrategy.HYBRID_SHARD,
                device_mesh=mesh),
        attempt(3, quantize_collectives="grads"),
        attempt(2, quantize_collectives="grads,where=all"),
        attempt(2, quantize_collectives="weights,where=all"),
    ]
    if dist.get_rank() < 3:
        out.append(attempt(2, quantize_collectives="grads", process_group=three))
    return out


def test_refusals(pool4: Any) -> None:
    results = pool4.run(_refusals)
    for rank, res in enumerate(results):
        tag = f"[rank {rank}] FSDP unit of TinyTransformer: quantize_collectives"
        assert res[0].startswith(f"ValueError: {tag} where='cross_node' needs to know"), res[0]
        assert "LOCAL_WORLD_SIZE" in res[0] and "where='all'" in res[0], res[0]
        nodes = "[0, 1]" if rank < 2 else "[2, 3]"  # (one rank per node)
        assert res[1].startswith(f"ValueError: {tag} where='cross_node' with a hybrid strategy "
                                 "expects each shard group within one node"), res[1]
        assert f"but got a shard group on nodes {nodes}" in res[1], res[1]
        assert "divides the world size 4 but got 3" in res[2], res[2]
        assert res[3].startswith("AssertionError: Communication hook is not supported with "
                                 "quantized gradient reductions"), res[3]
        assert res[4] == "accepted", res[4]  # coded weights, exact gradients: a hook may reduce
        if rank < 3:
            assert "expecting the group's ranks in ascending order with the same number on " \
                "every node but got ranks [0, 1, 2] on nodes [0, 0, 1]" in res[5], res[5]
    # every rank raised the same (but for its rank and its shard group's nodes)
    same = {tuple(s.replace(f"rank {i}", "rank R").replace("[2, 3]", "[0, 1]") for s in res[:5])
            for i, res in enumerate(results)}
    assert len(same) == 1, same


def _no_effect_warnings() -> list[list[str]]:
    """The warnings each construction gave (auto-wrapped: once per tree, not per unit)."""
    import warnings

    import fsdp_wrap
    from tests.models import TinyTransformer, transformer_policy

    S = fsdp_wrap.ShardingStrategy
    out = []
    for per_node, quant, kw in _NO_EFFECT:
        if "sharding_strategy" in kw:
            kw = dict(kw, sharding_strategy=S[kw["sharding_strategy"]])
        if kw.get("sharding_strategy") in (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2):
            kw["device_mesh"] = mesh_2x2()
        with nodes_of(per_node), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fsdp_wrap.FullyShardedDataParallel(
                TinyTransformer(), auto_wrap_policy=transformer_policy("ours"),
                quantize_collectives=quant, **kw)
        out.append([str(w.message) for w in seen if "quantize_collectives" in str(w.message)])
    return out


# (ranks per node, setting, keywords; what the warnings must say, "" for none)
_NO_EFFECT: list[tuple[int, str, dict[str, Any]]] = [
    (4, "grads", {}),  # one node: nothing crosses
    (4, "both", {"sharding_strategy": "HYBRID_SHARD"}),
    (2, "both", {"sharding_strategy": "HYBRID_SHARD"}),  # weights stay within a node
    (2, "both,where=all", {"sharding_strategy": "NO_SHARD"}),
    # neighbours: each setting codes what it says
    (2, "both", {}),
    (2, "grads", {"sharding_strategy": "_HYBRID_SHARD_ZERO2"}),
    (4, "both,where=all", {}),
    (4, "both,where=all", {"sharding_strategy": "HYBRID_SHARD"}),
]
_NO_EFFECT_SAYS = [
    ["'grads' codes nothing: every rank of the unit's group is on one node "
     "(LOCAL_WORLD_SIZE=4) and where='cross_node' codes only what crosses nodes"],
    ["'weights' codes nothing: with a hybrid strategy where='cross_node' codes only the "
     "replicas' all-reduce", "'grads' codes nothing: the replicas share a node (LOCAL_WORLD_SIZE=4)"],
    ["'weights' codes nothing: with a hybrid strategy where='cross_node' codes only the "
     "replicas' all-reduce"],
    ["'weights' codes nothing: NO_SHARD all-gathers no parameters"],
    [], [], [], [],
]


def test_settings_with_no_effect_warn_on_every_rank(pool4: Any) -> None:
    for rank, res in enumerate(pool4.run(_no_effect_warnings)):
        for case, says, got in zip(_NO_EFFECT, _NO_EFFECT_SAYS, res):
            assert len(got) == len(says), (case, got)  # one per tree, not per unit
            for want, message in zip(says, got):
                assert message.startswith(f"[rank {rank}] FSDP unit of TinyTransformer: "
                                          "quantize_collectives (or "
                                          "$FSDP_WRAP_QUANTIZE_COLLECTIVES)"), message
                assert want in message, (want, message)


def _one_replica_warning() -> list[str]:
    """HYBRID_SHARD on one node of 2 ranks (the default groups: a shard group of
    2, replicate groups of 1), gradients coded between nodes: nothing crosses."""
    import warnings

    import fsdp_wrap
    from tests.models import TinyTransformer, transformer_policy

    with nodes_of(2), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fsdp_wrap.FullyShardedDataParallel(
            TinyTransformer(), auto_wrap_policy=transformer_policy("ours"),
            sharding_strategy=fsdp_wrap.ShardingStrategy.HYBRID_SHARD,
            quantize_collectives="grads")
    return [str(w.message) for w in seen if "quantize_collectives" in str(w.message)]


def test_one_replica_warns_that_nothing_crosses(pool2: Any) -> None:
    """(Found by mutation testing: the case of one replica had no test.)"""
    for rank, got in enumerate(pool2.run(_one_replica_warning)):
        assert len(got) == 1 and got[0].startswith(f"[rank {rank}] "), got
        assert "'grads' codes nothing: the hybrid strategy has one replica (one node)" \
            in got[0], got


def _disagreements() -> list[str]:
    """Ranks 2 and 3 (node 1) quantize, ranks 0 and 1 do not: the error each
    rank raised (FULL_SHARD over every rank, coded between nodes, where node 1
    alone would create the sub-groups of a routed reduction: a hang before
    the check; FULL_SHARD coding every collective; HYBRID_SHARD, where each
    shard group agrees and only the replicas differ).  Node 1's setting comes
    from its environment, as a node launched differently."""
    import fsdp_wrap
    from tests.models import TinyTransformer, transformer_policy

    env = "grads" if dist.get_rank() >= 2 else "off"
    out = []
    for quant, kw in ((None, dict()), ("grads,where=all", dict()),
                      ("grads,where=all", dict(
                          sharding_strategy=fsdp_wrap.ShardingStrategy.HYBRID_SHARD,
                          device_mesh=mesh_2x2()))):
        with nodes_of(2):
            torch.manual_seed(0)
            os.environ["FSDP_WRAP_QUANTIZE_COLLECTIVES"] = env
            try:
                model = fsdp_wrap.FullyShardedDataParallel(
                    TinyTransformer(), auto_wrap_policy=transformer_policy("ours"),
                    quantize_collectives=quant if dist.get_rank() >= 2 else None, **kw)
                model(model_input("transformer", torch.Generator().manual_seed(0))).sum().backward()
                out.append("accepted")
            except RuntimeError as e:
                out.append(str(e))
            finally:
                os.environ.pop("FSDP_WRAP_QUANTIZE_COLLECTIVES", None)
    return out


def test_ranks_disagreeing_are_refused(pool4: Any) -> None:
    results = pool4.run(_disagreements)
    setting = "quantize_collectives (or $FSDP_WRAP_QUANTIZE_COLLECTIVES) is off on rank(s) "
    for rank, res in enumerate(results):
        # over every rank; hybrid: over this rank's replicas (compared first)
        for got, ranks, coded in zip(res, ([0, 1, 2, 3], [0, 1, 2, 3], [rank % 2, rank % 2 + 2]),
                                     ("grads=int8/2048,where=cross_node",
                                      "grads=int8/2048,where=all", "grads=int8/2048,where=all")):
            assert got.startswith(f"[rank {rank}] FSDP was constructed with settings that "
                                  f"differ between ranks {ranks}"), got
            mine = [r for r in ranks if r < 2]
            theirs = [r for r in ranks if r >= 2]
            assert f"{setting}{mine} and {coded} on rank(s) {theirs}" in got, got
