"""Which of a unit's collectives ``quantize_collectives`` codes, from the documentation alone.

The references of the quantized collectives (tests/_quant_emulation.py, used by
tests/test_quantized_collectives.py and tests/test_accumulation.py) code what
this module says, never what fsdp_wrap decided: a change that makes fsdp_wrap
code another collective, or none, then shows as a difference.  Its rules are
those of docs/options.rst, "Quantized collectives":

* the grammar: comma-separated ``weights`` / ``grads`` (int8), ``both``,
  ``weights=int8``, ``grads=int4``, ``block=N`` (default 2048),
  ``where=cross_node|all`` (default ``cross_node``); ``"off"`` or empty: nothing;
* the table: with ``where="all"`` every gather (``weights``) and reduction
  (``grads``) of the unit, the hybrid replicas' all-reduce included; with
  ``"cross_node"`` a hybrid strategy codes only the replicas' all-reduce, a
  strategy whose group spans nodes is *routed* (exact within each node, coded
  between them), a group within one node codes nothing;
* nodes: rank ``g`` runs on node ``g // LOCAL_WORLD_SIZE``;
* "What stays exact": non-floating data and 4-bit packed bases; NO_SHARD
  gathers nothing, so ``weights`` codes nothing there.

The one production piece used is :class:`fsdp_wrap.comm.quant.codec.Codec`, a
value type (bits and block size) whose pure functions tests/test_quant_codec.py
pins against the documented error bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_wrap.comm.quant.codec import Codec

__all__ = ["Coding", "EXACT_CODING", "documented_coding", "parse_setting"]

DEFAULT_BLOCK = 2048  # docs/options.rst: "(default 2048; ...)"
BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class Coding:
    """``weights``: the shard group's all-gathers; ``grads``: its reductions;
    ``replicas``: the hybrid replicas' all-reduce; ``routed``: the shard group
    spans nodes and only its step between nodes is coded."""

    weights: Codec | None = None
    grads: Codec | None = None
    replicas: Codec | None = None
    routed: bool = False

    @property
    def is_exact(self) -> bool:
        return self.weights is None and self.grads is None and self.replicas is None

    def sum_dtype(self, reduce_dtype: torch.dtype) -> torch.dtype:
        """Coded sums are float32 ("coded sums are float32"), exact ones ``reduce_dtype``."""
        return torch.float32 if self.grads is not None else reduce_dtype


EXACT_CODING = Coding()


@dataclass(frozen=True)
class Setting:
    weights: Codec | None
    grads: Codec | None
    where: str


def parse_setting(text: str | None) -> Setting | None:
    """The documented grammar; ``None`` for off.  Malformed text is the test's bug."""
    text = (text or "").strip().lower()
    if text in ("", "off"):
        return None
    weights = grads = None
    block, where = DEFAULT_BLOCK, "cross_node"
    for item in (i.strip() for i in text.split(",")):
        key, _, val = item.partition("=")
        if key == "both":
            weights = grads = "int8"
        elif key == "weights":
            weights = val or "int8"
        elif key == "grads":
            grads = val or "int8"
        elif key == "block":
            block = int(val)
        elif key == "where":
            where = val
        else:
            raise ValueError(f"not in the documented grammar: {item!r}")
    return Setting(Codec(BITS[weights], block) if weights else None,
                   Codec(BITS[grads], block) if grads else None, where)


def documented_coding(setting: str | None, strategy: str, shard_group: list[int],
                      replicate_group: list[int] | None, per_node: int | None,
                      floating: bool = True) -> Coding:
    """What docs/options.rst says a unit codes: ``setting`` the keyword's string,
    ``strategy`` a ``ShardingStrategy`` name, the unit's groups as global ranks,
    ``per_node`` the ``LOCAL_WORLD_SIZE`` (``None``: unset), ``floating``
    whether the flat parameter holds floating-point values (not packed bytes)."""
    spec = parse_setting(setting)
    if spec is None or not floating:
        return EXACT_CODING
    hybrid = "HYBRID" in strategy
    gathers = strategy != "NO_SHARD"  # NO_SHARD gathers nothing
    moves = len(shard_group) > 1  # (a group of one rank moves nothing)
    replicas = spec.grads if replicate_group is not None and len(replicate_group) > 1 else None

    def nodes(group: list[int]) -> set[int]:
        return {g // per_node for g in group} if per_node else set()

    if spec.where == "all":
        return Coding(spec.weights if gathers and moves else None,
                      spec.grads if moves else None, replicas)
    if hybrid:  # cross_node: the replicas' all-reduce, where it crosses nodes
        if replicate_group is not None and per_node and len(nodes(replicate_group)) == 1:
            replicas = None
        return Coding(None, None, replicas)
    if moves and not per_node:
        raise ValueError("documented refusal: where='cross_node' without LOCAL_WORLD_SIZE")
    if not moves or len(nodes(shard_group)) < 2:  # within one node: nothing crosses
        return EXACT_CODING
    return Coding(spec.weights if gathers else None, spec.grads, None, routed=True)
