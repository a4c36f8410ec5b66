"""Weights in and out of a sharded model, for people coming from Hugging Face.

* :func:`load_pretrained` -- a ``save_pretrained`` checkpoint straight into the
  shards of a model built on the meta device and wrapped with fsdp_wrap (with
  :func:`pretrained_init` as its ``param_init_fn``): each rank reads only the
  bytes of its own shards, converting dtype as it reads
  (:mod:`fsdp_wrap.checkpoint.weights.load`).
* :func:`iter_full_weights` -- the FULL state dict as a stream, one unit
  unsharded at a time, e.g. to push weights to another process
  (:mod:`fsdp_wrap.checkpoint.weights.export`).

Above the façade, beside :mod:`fsdp_wrap.checkpoint` (whose safetensors
reader it uses); nothing in the library below imports it.
"""

from fsdp_wrap.checkpoint.weights._materialize import pretrained_init
from fsdp_wrap.checkpoint.weights.export import iter_full_weights
from fsdp_wrap.checkpoint.weights.load import PretrainedLoad, load_pretrained

__all__ = ["PretrainedLoad", "iter_full_weights", "load_pretrained", "pretrained_init"]
