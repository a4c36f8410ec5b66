"""Quantized collectives: a codec beside the collectives it wraps.

:mod:`~fsdp_wrap.comm.quant.codec` (blockwise integer codes, pure functions),
:mod:`~fsdp_wrap.comm.quant.collectives` (encode, move bytes, decode),
:mod:`~fsdp_wrap.comm.quant.topology` (which ranks share a node),
:mod:`~fsdp_wrap.comm.quant.config` (the ``quantize_collectives`` setting) and
:mod:`~fsdp_wrap.comm.quant.wire` (the one seam the gather and reduce paths
call).  Imports nothing: the modules are imported by their full paths.
"""
