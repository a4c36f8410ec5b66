"""Per-rank memory of a plan: what is held between steps and what one step adds.

The model follows the runtime schedule (``fsdp_wrap/runtime/hooks.py``) unit by
unit; everything is in bytes.

Held between steps (exact, given the layout):

* **parameters**: every unit's local shard in the parameters' dtype (on the
  CPU under ``CPUOffload``);
* **gradients**: the sharded gradient of every trainable unit, in the
  parameters' dtype (the compute dtype with ``keep_low_precision_grads``);
* **optimizer state**: ``states`` tensors the size of what the optimizer sees
  (the flat shard, or with ``use_orig_params=True`` each parameter's piece),
  plus a 4-byte CPU ``step`` counter per tensor for Adam-like optimizers.

Added during a step on the compute device (an estimate):

* **unsharded parameters in flight** in the compute dtype: the root unit (kept
  gathered from its forward to its backward), the unit computing, the one
  being prefetched, and under SHARD_GRAD_OP every unit from its forward to its
  backward; plus the cast shard a low-precision gather starts from;
* **gradient transients** of the unit in backward: its parameters' gradients
  and their concatenation into one flat gradient (compute dtype), then the
  copy cast to the reduce dtype and padded to a world-size multiple, and the
  reduce-scatter's output.

Activations are the model's business and not counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from fsdp_wrap.api import BackwardPrefetch
from fsdp_wrap.comm.collectives import GLOO_BROADCAST_MIN_BYTES
from fsdp_wrap.planning._batches import BatchedAhead, batched_ahead
from fsdp_wrap.planning._buckets import BucketModel
from fsdp_wrap.planning._units import FlatPlan, UnitPlan

#: Optimizer kinds: (state tensors per parameter, ``step`` counter per parameter,
#: the dtype the states take: the parameter's (Adam's ``zeros_like(param)``) or the
#: gradient's (SGD clones its first gradient into the momentum buffer)).
OPTIMIZERS: dict[str, tuple[int, bool, str]] = {
    "adam": (2, True, "param"),
    "adamw": (2, True, "param"),
    "sgd": (0, False, "param"),
    "sgd-momentum": (1, False, "grad"),
    "none": (0, False, "param"),
}


FlatName = tuple[str, int]  # a flat parameter: its unit's clean FQN, its index in ``flats``


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The runtime's decisions the plan counts, made with the runtime's rules
    (:mod:`fsdp_wrap.comm.schedule`): each a tuple of flat parameters, in the
    order they happen.

    ``forward_batches`` / ``backward_batches``: the flat parameters each batched
    all-gather takes (none where gathers are asynchronous or the cap is 0);
    ``buckets``: the gradients reduced in one collective (two or more).
    """

    forward_batches: tuple[tuple[FlatName, ...], ...] = ()
    backward_batches: tuple[tuple[FlatName, ...], ...] = ()
    buckets: tuple[tuple[FlatName, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds; ``device`` is the compute device, ``cpu`` the host."""

    rank: int
    params_device: int
    params_cpu: int
    grads_device: int
    grads_cpu: int
    optimizer_device: int
    optimizer_cpu: int
    unsharded_forward: int  # peak of unsharded parameters in forward
    unsharded_backward: int  # peak of unsharded parameters + gradient transients in backward
    step_device: int  # peak a step adds over params and optimizer state: the above plus
    # the sharded gradients of the units already done
    ignored_device: int = 0  # ignored parameters, their gradients and optimizer state (whole)
    quant_state_device: int = 0  # 4-bit weights' quantization states (whole on every rank)
    #: ``(what runs, bytes)`` at each moment of one step: what ``step_device`` is the
    #: largest of (add ``params_device + optimizer_device + ignored_device`` for the
    #: device total).  Forward unit by unit, backward unit by unit, the optimizer step.
    timeline: tuple[tuple[str, int], ...] = dataclasses.field(default=(), compare=False,
                                                              repr=False)
    #: which flat parameters gather together and which gradients share a bucket
    schedule: Schedule = dataclasses.field(default=Schedule(), compare=False, repr=False)

    @property
    def persistent_device(self) -> int:
        return (self.params_device + self.grads_device + self.optimizer_device
                + self.ignored_device + self.quant_state_device)

    @property
    def persistent_cpu(self) -> int:
        return self.params_cpu + self.grads_cpu + self.optimizer_cpu

    @property
    def unsharded_peak(self) -> int:
        return max(self.unsharded_forward, self.unsharded_backward)

    @property
    def peak_device(self) -> int:
        """The most the device holds during a step (activations not included): parameters,
        optimizer state, ignored tensors and quantization states, plus the step's peak
        (``step_device``)."""
        return (self.params_device + self.optimizer_device + self.ignored_device
                + self.quant_state_device + self.step_device)


def _itemsize(flat: FlatPlan, which: str) -> int:
    dtype = {"param": flat.dtype, "compute": flat.compute_dtype, "reduce": flat.reduce_dtype,
             "grad": flat.grad_dtype}[which]
    return dtype.itemsize


def _flat_gathered(f: FlatPlan) -> int:
    lay = f.layout
    if f.sharded:
        return lay.padded_numel * _itemsize(f, "compute")
    needs_copy = f.compute_dtype != f.dtype or f.offload_params
    return lay.unpadded_numel * _itemsize(f, "compute") if needs_copy else 0


def gathered_bytes(unit: UnitPlan) -> int:
    """Device bytes of the unit's unsharded compute copies, every flat parameter
    (0 for one that computes on its shard)."""
    return sum(_flat_gathered(f) for f in unit.flats)


def gather_source_bytes(unit: UnitPlan) -> int:
    """The shard copies a gather starts from: moved to the device and/or cast."""
    return sum(_flat_source(f) for f in unit.flats)


def _flat_source(f: FlatPlan) -> int:
    if not f.sharded:
        return 0
    out = 0
    if f.offload_params:
        out += f.layout.shard_numel * _itemsize(f, "param")
    if f.compute_dtype != f.dtype:
        out += f.layout.shard_numel * _itemsize(f, "compute")
    return out


def dequantized_bytes(unit: UnitPlan) -> int:
    """The largest 4-bit weight of the unit dequantized for its matmul (in forward,
    and again in backward for the input's gradient), in the compute dtype."""
    return max((n * _itemsize(f, "compute") for f in unit.flats for n in f.quantized_numels),
               default=0)


def gradient_stages(unit: UnitPlan) -> tuple[int, int, int]:
    """Extra device bytes of the unit's gradients in their three backward stages,
    over its trainable flat parameters (frozen ones have no gradient).

    1. *compute*: the parameters' gradients, up to the flat size (a tied
       parameter gets one gradient per use before they are summed), while the
       unit's parameters are still gathered;
    2. *concatenate*: those gradients and the flat gradient made of them (a
       sharded unit's gathered parameters are freed just before this);
    3. *reduce* (after the unit is resharded): the flat gradient, its copy in
       the reduce dtype and/or padded to a world-size multiple, the
       reduce-scatter's output and its cast back to the gradient dtype (the
       largest of the unit's flat parameters, which are reduced one by one).
    """
    compute = concat = reduce = 0
    for f in unit.flats:
        if f.trainable:
            c, r = _flat_grad_stages(f)
            compute += c
            concat += 2 * (c - f.shared_numel * _itemsize(f, "compute"))
            reduce = max(reduce, r)
    return compute, concat, reduce


def _flat_grad_stages(f: FlatPlan) -> tuple[int, int]:
    """``(compute, reduce)`` stage bytes of one trainable flat parameter."""
    lay = f.layout
    c, r, gd = (_itemsize(f, k) for k in ("compute", "reduce", "grad"))
    flat = lay.unpadded_numel * c
    reduce = flat
    if f.reduce_dtype != f.compute_dtype:
        reduce += lay.unpadded_numel * r
    if f.sharded:
        if lay.padded_numel != lay.unpadded_numel:
            reduce += lay.padded_numel * r
        reduce += lay.shard_numel * r
        if f.reduce_dtype != f.grad_dtype:
            reduce += lay.shard_numel * gd
    elif f.reduce_dtype != f.grad_dtype and not f.offload_params:
        reduce += lay.unpadded_numel * gd
    return flat + f.shared_numel * c, reduce


@dataclasses.dataclass(frozen=True)
class Backend:
    """What the collective backend adds to the schedule's memory.

    ``async_gathers``: a prefetched all-gather is in flight while the current
    unit computes (its source shard copy lives until it is waited for).
    ``*_staging``: extra bytes a collective holds while it runs, as a multiple
    of its tensor, by element size; ``gather_staging`` only for outputs under
    ``gather_staging_below`` bytes.
    """

    name: str
    async_gathers: bool
    gather_staging: float
    reduce_scatter_staging: dict[int, float]
    all_reduce_staging: dict[int, float]
    gather_staging_below: int = 0


#: NCCL writes into the caller's buffers: no staging.
NCCL = Backend("nccl", True, 0.0, {}, {})


def gloo(limit_all_gathers: bool, shard_size: int) -> Backend:
    """gloo on CPU, as measured inside training steps with torch 2.13 (``docs/plan.rst``).

    fsdp_wrap's gloo forms (``fsdp_wrap/comm/collectives.py``): a reduce-scatter is
    an in-place all-reduce of the gradient, which stages nothing in fp32 and
    0.5x in 16-bit types (not modelled), over two ranks an exchange of halves
    (nothing); over two ranks (``shard_size``) an all-gather is an exchange of
    rows in place, and over more one of ``GLOO_BROADCAST_MIN_BYTES`` (256 KiB)
    or more is broadcasts into the output (neither stages); a smaller
    asynchronous all-gather (``limit_all_gathers=False``) keeps 1x its output
    until it is waited for.
    """
    return Backend("gloo", not limit_all_gathers, 1.0, {}, {},
                   gather_staging_below=0 if shard_size == 2 else GLOO_BROADCAST_MIN_BYTES)


def estimate(
    units: Sequence[UnitPlan],
    ranks: Sequence[int],
    *,
    optimizer: str,
    backward_prefetch: BackwardPrefetch | None,
    forward_prefetch: bool,
    ignored: Sequence[tuple[str, int, torch.dtype, bool]] = (),
    backend: Backend = NCCL,
    bucket_cap_bytes: int = 0,
    replicate_size: int = 1,
    gather_batch_bytes: int = 0,
) -> tuple[RankMemory, ...]:
    """The memory of each of ``ranks``; only the optimizer state differs between them.

    ``bucket_cap_bytes``: the gradient buckets' cap (0: every unit reduced on
    its own); ``replicate_size``: the hybrid strategies' replicas;
    ``gather_batch_bytes``: the batched all-gathers' cap where gathers are
    synchronous (0: none, as with asynchronous gathers).
    """
    states, counters, state_dtype = OPTIMIZERS[optimizer]
    ignored_bytes = sum(
        n * dt.itemsize * (1 + (1 + states if trainable else 0)) for _, n, dt, trainable in ignored
    )
    same = dict(params_device=0, params_cpu=0, grads_device=0, grads_cpu=0,
                quant_state_device=0)
    for f in (f for u in units for f in u.flats):
        where = "cpu" if f.offload_params else "device"
        same[f"params_{where}"] += f.layout.shard_numel * _itemsize(f, "param")
        if f.trainable:
            same[f"grads_{where}"] += f.layout.shard_numel * _itemsize(f, "grad")
        same["quant_state_device"] += f.quant_state_bytes
    buckets = BucketModel(bucket_cap_bytes, replicate_size,
                          staging=lambda u, nbytes: _staging_of(u, nbytes, backend),
                          alone=lambda u: _alone_bytes(u, backend), done_bytes=_done_bytes)
    fwd, bwd, step, batches = _unsharded_peaks(units, backward_prefetch, forward_prefetch,
                                               backend, buckets, gather_batch_bytes)
    names = [(u.fqn, j) for u in units for j in range(len(u.flats))]
    name_of = {id(f): (u.fqn, j) for u in units for j, f in enumerate(u.flats)}
    fwd_formed, bwd_formed = (tuple(tuple(names[f] for f in b) for b in side.batches)
                              for side in batches)
    schedule = Schedule(fwd_formed, bwd_formed,
                        tuple(tuple(name_of[id(f)] for f in b) for b in buckets.issued))
    out = []
    for rank in ranks:
        optim = {"optimizer_device": 0, "optimizer_cpu": 0}
        for f in (f for u in units for f in u.flats):
            numel, tensors = f.optimizer_numel(rank)
            where = "cpu" if f.offload_params else "device"
            optim[f"optimizer_{where}"] += states * numel * _itemsize(f, state_dtype)
            if counters:
                optim["optimizer_cpu"] += 4 * tensors
        out.append(RankMemory(rank=rank, unsharded_forward=fwd, unsharded_backward=bwd,
                              step_device=step, ignored_device=ignored_bytes,
                              timeline=tuple(buckets.timeline), schedule=schedule,
                              **same, **optim))
    return tuple(out)


def _unsharded_peaks(
    units: Sequence[UnitPlan],
    backward_prefetch: BackwardPrefetch | None,
    forward_prefetch: bool,
    backend: Backend,
    buckets: BucketModel,
    gather_batch_bytes: int = 0,
) -> tuple[int, int, int, tuple[BatchedAhead, BatchedAhead]]:
    """Walk one step's schedule; return three device peaks in bytes (and the
    batched gathers of forward and backward).

    ``(forward, backward, step)``: unsharded parameters in flight in forward;
    in flight plus gradient transients (and what gradient buckets hold) in
    backward; and that plus the sharded gradients the units already finished
    hold (gradients start from ``None``, as after
    ``zero_grad(set_to_none=True)``).  Units run in the order given (root
    first); backward visits them in reverse.
    """
    g = [gathered_bytes(u) for u in units]
    src = [gather_source_bytes(u) for u in units]
    # A unit being gathered holds its output and source (and staging if async).
    gathering = [
        g[i] + src[i] + (int(backend.gather_staging * g[i])
                         if backend.async_gathers and g[i] < backend.gather_staging_below else 0)
        for i in range(len(units))
    ]
    # A prefetched unit while the current one computes: still in flight if async.
    ahead_of = [gathering[i] if backend.async_gathers else g[i] for i in range(len(units))]
    kept = [u.sharded and (i == 0 or not u.reshard_after_forward) for i, u in enumerate(units)]
    dq = [dequantized_bytes(u) for u in units]
    fwd_batches, bwd_batches = _gather_batches(units, kept, gather_batch_bytes, forward_prefetch,
                                               backward_prefetch is not None)
    fwd = held = 0
    for i in range(len(units)):
        ahead = ahead_of[i + 1] if forward_prefetch and i + 1 < len(units) else 0
        # While the prefetch gathers, its source (a cast shard) lives too.
        prefetching = gathering[i + 1] if ahead else 0
        # Batched gathers: the next units of a batch wait gathered for their turn.
        ahead = max(ahead, fwd_batches.after_prefetch[i])
        here = max(held + gathering[i], held + g[i] + prefetching, held + g[i] + ahead + dq[i],
                   held + fwd_batches.batch_copy[i])
        buckets.timeline.append((f"forward {units[i].fqn or '(root)'}", here))
        fwd = max(fwd, here)
        if kept[i]:
            held += g[i]
    walk = _BackwardWalk(units, g, gathering, ahead_of, kept, dq, held, backward_prefetch,
                         backend, buckets, bwd_batches)
    bwd, step, done = walk.run()
    buckets.timeline.append(("optimizer step", done))
    return fwd, bwd, max(step, fwd, done), (fwd_batches, bwd_batches)


def _gather_batches(units: Sequence[UnitPlan], kept: Sequence[bool], cap_bytes: int,
                    forward_prefetch: bool, backward_prefetch: bool,
                    ) -> tuple[BatchedAhead, BatchedAhead]:
    """The batched gathers of forward and backward, flat parameter by flat
    parameter as the runtime chains them (positions: units, in each walk's order)."""
    flats = [f for u in units for f in u.flats]
    ids, i = [], 0  # per unit, its flat parameters' indices in ``flats``
    for u in units:
        ids.append(list(range(i, i + len(u.flats))))
        i += len(u.flats)
    g = [_flat_gathered(f) for f in flats]
    src = [_flat_source(f) for f in flats]
    keys = [f.compute_dtype for f in flats]
    needs = [f.sharded and g[j] > 0 for j, f in enumerate(flats)]
    fwd = batched_ahead(ids, g, needs, keys, cap_bytes, True, src,
                        prefetch_alone=forward_prefetch)
    # (backward: units last to first, a unit's flat parameters last to first; a
    # unit kept gathered since forward gathers nothing)
    for u_ids, keep in zip(ids, kept):
        for j in u_ids:
            needs[j] = needs[j] and not keep
    bwd = batched_ahead([x[::-1] for x in ids[::-1]], g, needs, keys, cap_bytes,
                        backward_prefetch, src, each_at_its_turn=True)
    return fwd, bwd


@dataclasses.dataclass
class _BackwardWalk:
    """The backward half of :func:`_unsharded_peaks` (its per-unit lists as fields)."""

    units: Sequence[UnitPlan]
    g: list[int]
    gathering: list[int]
    ahead_of: list[int]
    kept: list[bool]
    dq: list[int]  # a dequantized 4-bit weight while the unit computes
    held: int  # unsharded parameters kept from forward
    backward_prefetch: BackwardPrefetch | None
    backend: Backend
    buckets: BucketModel
    batches: BatchedAhead  # batched gathers, by position in backward order

    def run(self) -> tuple[int, int, int]:
        """``(backward peak, step peak, sharded gradients held at the end)``."""
        units, g, buckets = self.units, self.g, self.buckets
        # The root's parameters used after the nested units in forward (an output
        # head, a final norm, a tied embedding's later use: ``late_numel``) get
        # their gradients first in backward, and those wait until the root's
        # own backward ends; one early gradient of its size per parameter.
        root = units[0] if units and units[0].fqn == "" and units[0].trainable else None
        root_early = sum(f.late_numel * _itemsize(f, "compute")
                         for f in root.flats if f.trainable) if root else 0
        order = list(range(len(units)))[::-1]
        # A unit's frozen flat parameters are freed once the gradient of its
        # input is computed; that gradient is the next unit's output gradient,
        # whose pre-backward hook (gather, prefetch) runs first: for that
        # moment the previous unit's frozen copies are still held.
        frozen_prev = 0
        for k, i in enumerate(order):
            u = units[i]
            if self.kept[i]:
                self.held -= g[i]  # counted as this unit's own from here on
                regather = 0
            else:
                regather = self.gathering[i]
            nxt = order[k + 1] if k + 1 < len(order) else None
            ahead = self.ahead_of[nxt] if nxt is not None and not self.kept[nxt] else 0
            pre = ahead if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE else 0
            # While the prefetch gathers, its source (a cast shard) lives too.
            prefetching = (self.gathering[nxt] if pre and nxt is not None else 0)
            post = ahead if self.backward_prefetch is not None else 0
            # Batched gathers: the units a batch (or the prefetch's batch) gathered
            # wait for their turn; BACKWARD_PRE prefetches before this unit computes.
            pre = max(pre, self.batches.after_prefetch[k]
                      if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE
                      else self.batches.before_prefetch[k])
            post = max(post, self.batches.after_prefetch[k])
            regather = max(regather, self.batches.batch_copy[k])
            compute, concat, _ = gradient_stages(u)
            # Sharded units free their parameters once all their gradients exist;
            # NO_SHARD copies go at the reshard before the reduction.
            during_concat = concat + (0 if u.sharded else g[i])
            held = self.held + (0 if i == 0 else root_early)
            buckets.label = f"backward {u.fqn or '(root)'}"
            buckets.base = held  # earlier units' gradients in buckets come on top
            buckets.note(max(regather + frozen_prev, g[i] + prefetching + frozen_prev,
                             g[i] + pre + compute + self.dq[i], pre + during_concat))
            frozen_prev = sum(_flat_gathered(f) for f in u.flats
                              if not f.requires_grad and f.sharded)
            buckets.base = held + post
            # Each trainable flat parameter's gradient is handed over on its own
            # (last first): into a bucket, or reduced alone.
            for f in reversed([f for f in u.flats if f.trainable]):
                buckets.reduce(f, f.layout.unpadded_numel * _itemsize(f, "compute"))
        buckets.base = 0
        buckets.label = "end of backward"
        buckets.finish()  # the end-of-backward callback
        return buckets.peak, buckets.peak_with_grads, buckets.released


def _done_bytes(u: FlatPlan) -> int:
    """The sharded gradient a flat parameter keeps on the device once reduced."""
    if not u.trainable or u.offload_params:
        return 0
    return u.layout.shard_numel * _itemsize(u, "grad")


def _alone_bytes(u: FlatPlan, backend: Backend) -> int:
    """Bytes of ``u``'s reduction on its own: its flat gradient, casts, output, staging."""
    return _flat_grad_stages(u)[1] + _collective_staging(u, backend)


def _staging_of(u: FlatPlan, nbytes: int, backend: Backend) -> int:
    """A bucket's collective staging: ``nbytes`` of ``u``'s reduce dtype and kind."""
    table = backend.reduce_scatter_staging if u.sharded else backend.all_reduce_staging
    return int(table.get(_itemsize(u, "reduce"), 0.0) * nbytes)


def _collective_staging(u: FlatPlan, backend: Backend) -> int:
    if not u.trainable:
        return 0
    r = _itemsize(u, "reduce")
    if u.sharded:
        return int(backend.reduce_scatter_staging.get(r, 0.0) * u.layout.padded_numel * r)
    if u.layout.world_size > 1:
        return int(backend.all_reduce_staging.get(r, 0.0) * u.layout.unpadded_numel * r)
    return 0
