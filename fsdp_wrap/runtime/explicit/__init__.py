"""FSDP2's explicit controls on fsdp_wrap's units.

FSDP2 (``torch.distributed.fsdp.fully_shard``) lets a user steer the schedule
by hand where FSDP1 only has its constructor flags (``forward_prefetch``,
``backward_prefetch``, ``limit_all_gathers``).  fsdp_wrap offers the same
methods, with FSDP2's names, signatures and meanings, on every
``FullyShardedDataParallel`` unit (:doc:`/options`, "FSDP2's explicit
controls", says what each one changes in FSDP1's schedule):

* :mod:`~fsdp_wrap.runtime.explicit.controls`: what a unit holds
  (:class:`ExplicitControls`, ``unit._explicit``; the hooks read it) and the
  check that every rank set the same schedule;
* :mod:`~fsdp_wrap.runtime.explicit.api`: what each control does on a
  unit's state (the façade's methods of the same names,
  ``fsdp_wrap.fully_sharded_data_parallel.explicit_methods``, call it),
  ``UnshardHandle`` and ``register_fsdp_forward_method``.

Imports nothing: the modules are imported by their full paths.
"""
