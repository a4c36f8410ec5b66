"""``quantize_collectives``: what the user asks for, checked before anything runs.

The keyword takes a :class:`CollectiveQuantization` or a string of the same
grammar as ``$FSDP_WRAP_QUANTIZE_COLLECTIVES`` (the keyword wins; the
variable configures code that builds FSDP with torch's arguments only)::

    "grads"                      # gradients' reductions, int8, where they cross nodes
    "weights,grads"              # both (also "both")
    "weights,grads=int4,block=1024,where=all"
    "off"                        # (or "" / unset) nothing quantized: torch's bytes

``ValueError`` for anything else, naming where the value came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fsdp_wrap.comm.quant.codec import Codec

__all__ = ["QUANTIZE_ENV", "CollectiveQuantization", "QuantSpec", "resolve_quantization"]

QUANTIZE_ENV = "FSDP_WRAP_QUANTIZE_COLLECTIVES"
WHERE = ("cross_node", "all")
DEFAULT_BLOCK = 2048
_GRAD_FORMATS = {"int8": 8, "int4": 4}
_WEIGHT_FORMATS = {"int8": 8}


@dataclass(frozen=True)
class CollectiveQuantization:
    """Quantized collectives (fsdp_wrap only; :doc:`/options`).

    ``weights``: the all-gathers of the parameters for forward and backward
    (``"int8"`` or ``None``).  ``grads``: the gradients' reductions
    (``"int8"``, ``"int4"`` or ``None``).  ``block_size``: elements per scale.
    ``where``: ``"cross_node"`` quantizes only the collectives between nodes
    (with a hybrid strategy the replicas' all-reduce; where the strategy's own
    group spans nodes, the step between nodes of a routed gather or
    reduction), ``"all"`` every one of them.  Master weights, optimizer
    state and checkpoints stay exact: only what travels is coded.
    """

    weights: str | None = "int8"
    grads: str | None = "int8"
    block_size: int = DEFAULT_BLOCK
    where: str = "cross_node"


@dataclass(frozen=True)
class QuantSpec:
    """A checked :class:`CollectiveQuantization`: codecs, ``None`` where exact."""

    weights: Codec | None
    grads: Codec | None
    where: str

    def __str__(self) -> str:
        parts = [f"weights={self.weights}" if self.weights else "",
                 f"grads={self.grads}" if self.grads else "", f"where={self.where}"]
        return ",".join(p for p in parts if p)


def resolve_quantization(value: object, rank_tag: str = "") -> QuantSpec | None:
    """The keyword's value (wins), else ``$FSDP_WRAP_QUANTIZE_COLLECTIVES``, else
    ``None`` (nothing quantized)."""
    source = "quantize_collectives"
    if value is None:
        value = os.environ.get(QUANTIZE_ENV, "").strip()
        source = QUANTIZE_ENV
    if isinstance(value, QuantSpec):
        return value
    if isinstance(value, str):
        value = _parse(value, source, rank_tag)
        if value is None:
            return None
    if not isinstance(value, CollectiveQuantization):
        raise TypeError(
            f"{rank_tag}quantize_collectives expects a CollectiveQuantization, a string such "
            f"as 'weights,grads=int4' or None but got {type(value).__name__} {value!r}")
    return _check(value, source, rank_tag)


def _parse(text: str, source: str, rank_tag: str) -> CollectiveQuantization | None:
    text = text.strip()
    if text.lower() in ("", "off", "none", "0", "false"):
        return None
    fields: dict[str, object] = {"weights": None, "grads": None}
    for raw in text.split(","):
        item = raw.strip().lower()
        key, _, val = item.partition("=")
        key = key.strip()
        val = val.strip()
        if key == "both" and not val:
            fields["weights"] = fields["grads"] = "int8"
        elif key in ("weights", "grads"):
            fields[key] = None if val == "off" else (val or "int8")
        elif key in ("block", "block_size") and val:
            try:
                fields["block_size"] = int(val)
            except ValueError:
                _fail(source, rank_tag, f"block={val!r}", "a whole number of elements")
        elif key == "where" and val:
            fields["where"] = val
        else:
            _fail(source, rank_tag, repr(raw.strip()),
                  "items such as 'weights', 'grads=int4', 'block=2048', 'where=all'")
    if fields["weights"] is None and fields["grads"] is None:
        _fail(source, rank_tag, repr(text), "'weights', 'grads' or both among the items")
    return CollectiveQuantization(**fields)  # type: ignore[arg-type]


def _check(q: CollectiveQuantization, source: str, rank_tag: str) -> QuantSpec | None:
    block = q.block_size
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        _fail(source, rank_tag, f"block_size={block!r}", "a whole number of elements >= 1")
    if q.where not in WHERE:
        _fail(source, rank_tag, f"where={q.where!r}", f"one of {list(WHERE)}")
    if q.weights is not None and q.weights not in _WEIGHT_FORMATS:
        hint = ("; int4 is offered for gradients only (a weight's error would be 18x int8's "
                "in every forward), use weights='int8'" if q.weights == "int4" else "")
        _fail(source, rank_tag, f"weights={q.weights!r}", f"'int8' or None{hint}")
    if q.grads is not None and q.grads not in _GRAD_FORMATS:
        _fail(source, rank_tag, f"grads={q.grads!r}", "'int8', 'int4' or None")
    if q.weights is None and q.grads is None:
        return None
    weights = Codec(_WEIGHT_FORMATS[q.weights], block) if q.weights else None
    grads = Codec(_GRAD_FORMATS[q.grads], block) if q.grads else None
    return QuantSpec(weights, grads, q.where)


def _fail(source: str, rank_tag: str, got: str, expected: str) -> None:
    raise ValueError(f"{rank_tag}{source}: expected {expected} but got {got}")
