"""Which parameters a unit flattens, in what order, and where each rank's piece lies.

Pure bookkeeping: module walks and integer arithmetic, no tensors allocated and
no process group, so the same rules serve the :class:`FlatParamHandle` that
builds a unit and anything that only needs to know its sizes.

The layout matches torch's FSDP1 so optimizer-visible shapes are identical:

* parameters in ``named_modules`` pre-order of the unit, each once (tied
  parameters are flattened at their first occurrence);
* ``use_orig_params=False``: plain concatenation;
* ``use_orig_params=True``: each parameter starts at a multiple of
  ``16 // itemsize`` elements (of the dtype it is computed in) and the total is
  padded to a multiple of the world size;
* shard ``r`` is ``chunk(world_size)[r]`` right-padded with zeros to
  ``ceil(N / world_size)`` elements.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn


@dataclass(frozen=True)
class ParamInfo:
    """Where one original parameter lives in the flat parameter."""

    fqn: str  # clean name relative to the unit's wrapped module
    module: nn.Module
    name: str
    param: nn.Parameter  # the user's Parameter object
    shape: torch.Size
    offset: int  # start in the unsharded flat parameter
    numel: int
    # A DTensor parameter's mesh and placements (handle/dtensor.py); ``param``
    # and ``shape`` are then its local tensor's.
    spec: Any = None


#: What torch's FSDP1 (and so fsdp_wrap) writes into alignment padding.
PADDING_VALUE = 42.0

#: Set (to ``True``) on an original parameter whose values are not meaningful
#: yet because a checkpoint will overwrite them (``pretrained_init``): the
#: handle then does not copy them into its shard (that copy of uninitialised
#: memory cost as much as the load itself), and deletes the flag.
VALUES_PENDING = "_fsdp_wrap_values_pending"


@dataclass(frozen=True)
class SharedParamInfo:
    """A later reference to a parameter already flattened at ``infos[index]``."""

    fqn: str
    module: nn.Module
    name: str
    index: int


def walk_unit_modules(
    module: nn.Module, stop: Callable[[nn.Module], bool], prefix: str = ""
) -> Iterator[tuple[str, nn.Module]]:
    """Pre-order ``(fqn, module)`` over a unit, not entering modules where ``stop``.

    Like ``named_modules(remove_duplicate=False)``: a shared submodule is
    visited at each place it appears.
    """
    yield prefix.rstrip("."), module
    for name, child in module._modules.items():
        if child is not None and not stop(child):
            yield from walk_unit_modules(child, stop, f"{prefix}{name}.")


def collect_unit_params(
    module: nn.Module, stop: Callable[[nn.Module], bool], ignored: set[nn.Parameter]
) -> tuple[list[tuple[str, nn.Module, str, nn.Parameter]], list[tuple[str, nn.Module, str, int]]]:
    """The unit's parameters in flattening order, and later references to them."""
    unique: list[tuple[str, nn.Module, str, nn.Parameter]] = []
    shared: list[tuple[str, nn.Module, str, int]] = []
    index_of: dict[int, int] = {}
    for mod_fqn, mod in walk_unit_modules(module, stop):
        for name, param in mod._parameters.items():
            if param is None or param in ignored:
                continue
            fqn = f"{mod_fqn}.{name}" if mod_fqn else name
            if id(param) in index_of:
                shared.append((fqn, mod, name, index_of[id(param)]))
            else:
                index_of[id(param)] = len(unique)
                unique.append((fqn, mod, name, param))
    return unique, shared


def check_unit_params(
    params: Sequence[tuple[str, nn.Module, str, nn.Parameter]], where: str, use_orig_params: bool
) -> None:
    """Raise what FSDP raises for parameters no flat parameter can hold.

    ``where`` ends each message (e.g. ``"(rank 0, FSDP unit 'blocks.0')"``).
    Mixed dtypes and mixed ``requires_grad`` are not refused: a unit splits
    them into several flat parameters (:func:`split_unit_params`).
    """
    if not params:
        raise ValueError(f"Cannot construct a FlatParamHandle with no parameters {where}")
    devices = {p.device for *_, p in params}
    if len(devices) > 1:
        raise RuntimeError(
            f"FSDP only supports single device modules but got params on {devices} {where}"
        )
    for fqn, _, _, p in params:
        if p.dim() == 0:
            raise ValueError(
                "FSDP doesn't support scalar parameters. Change "
                f"{fqn} to a 1D tensor with numel equal to 1. {where}"
            )
        if not (p.is_floating_point() or p.is_complex()):
            hint = (
                "; 8-bit quantized weights (bitsandbytes load_in_8bit) cannot be flattened "
                "(their scales live on the Parameter object): load the base in 4-bit "
                "(load_in_4bit with bnb_4bit_quant_storage set to the dtype you compute in) or "
                "leave those modules out of FSDP (ignored_states)"
            ) if p.dtype == torch.int8 else ""
            raise ValueError(
                f"Cannot flatten integer dtype tensors: '{fqn}' is {p.dtype} {where}{hint}"
            )


def is_quantized(param: nn.Parameter) -> bool:
    """A bitsandbytes 4-bit weight: packed integers stored in ``param.dtype``
    (``bnb_4bit_quant_storage``), with its quantization state on the object."""
    return bool(getattr(param, "bnb_quantized", False)) or getattr(param, "quant_state", None) is not None


def check_quantized_storage(
    params: Sequence[tuple[str, nn.Module, str, nn.Parameter]], param_dtype: torch.dtype | None,
    where: str,
) -> None:
    """Refuse a compute dtype that would cast packed quantized weights.

    A 4-bit weight's elements are packed integers that only look like
    ``bnb_4bit_quant_storage`` values: casting them (``MixedPrecision.param_dtype``)
    turns the weights into noise without any error, so it is refused here.
    """
    for fqn, _, _, p in params:
        if param_dtype is not None and param_dtype != p.dtype and is_quantized(p):
            raise ValueError(
                f"MixedPrecision(param_dtype={param_dtype}) would cast the quantized weight "
                f"'{fqn}', whose {p.dtype} storage holds packed 4-bit values, and corrupt it "
                f"{where}. Quantize with bnb_4bit_quant_storage={param_dtype} (the dtype you "
                f"compute in), or use param_dtype={p.dtype}"
            )


def keep_quantized_layout(params: Sequence[tuple[str, nn.Module, str, nn.Parameter]]) -> None:
    """Keep each flattened 4-bit weight in the layout it was flattened in.

    bitsandbytes (0.49+) repacks a ``Linear4bit``'s weight for its CPU kernel
    at the first inference forward on a CPU with AVX512-BF16: it replaces
    ``weight.data`` with a tensor of another dtype and shape and rewrites the
    quantization state in place.  Inside a flat parameter that breaks the
    weight's view (the next gather restores the old packing under the
    rewritten state, or the rewrite itself fails on a small layer): the
    repacking is switched off for the weights fsdp_wrap flattens, so a
    wrapped model gives the same results on every CPU (the general kernel).
    """
    for _, module, _, p in params:
        if is_quantized(p) and getattr(module, "support_avx512bf16_for_cpu", False):
            module.__dict__["support_avx512bf16_for_cpu"] = False  # (a plain attribute)


def check_flat_group(
    params: Sequence[tuple[str, nn.Module, str, nn.Parameter]], where: str, use_orig_params: bool
) -> None:
    """Raise torch's error for parameters that cannot share *one* flat parameter.

    A unit never hands a handle such a group (it splits first); this guards
    the handle itself, with torch's sentences.
    """
    first_fqn, *_ = params[0]
    dtype = params[0][3].dtype
    for fqn, _, _, p in params:
        if p.dtype != dtype:
            raise ValueError(
                f"Must flatten tensors with uniform dtype but got {dtype} and {p.dtype} "
                f"('{first_fqn}' vs '{fqn}') {where}"
            )
    if not use_orig_params and len({p.requires_grad for *_, p in params}) > 1:
        frozen = [fqn for fqn, *_, p in params if not p.requires_grad]
        raise ValueError(
            "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False` "
            f"{where}: frozen {frozen} sit with trainable parameters in one flat parameter."
        )


def split_unit_params(
    params: Sequence[tuple[str, nn.Module, str, nn.Parameter]],
    shared: Sequence[tuple[str, nn.Module, str, int]],
) -> list[tuple[list[tuple[str, nn.Module, str, nn.Parameter]],
                list[tuple[str, nn.Module, str, int]]]]:
    """A unit's parameters as the groups that each make one flat parameter.

    One flat parameter has one dtype and one ``requires_grad``, so a unit
    mixing them (LoRA adapters beside a frozen base, fp32 adapters beside a
    bf16 base) gets one group per ``(requires_grad, dtype)``.  Trainable groups
    come first (the first flat parameter is the one torch's single-flat-param
    API, ``_flat_param``, shows), then frozen ones; groups and the parameters
    inside each keep the walk's order.  Shared references follow the
    parameter they name, with ``index`` into their group.  A uniform unit is
    one group, exactly as before.
    """
    keys: list[tuple[bool, torch.dtype]] = []
    for *_, p in params:
        key = (p.requires_grad, p.dtype)
        if key not in keys:
            keys.append(key)
    keys.sort(key=lambda k: not k[0])  # stable: trainable first, walk order kept
    group_of: dict[int, tuple[int, int]] = {}  # index in params -> (group, index in group)
    groups: list[tuple[list[tuple[str, nn.Module, str, nn.Parameter]],
                       list[tuple[str, nn.Module, str, int]]]] = [([], []) for _ in keys]
    for i, entry in enumerate(params):
        g = keys.index((entry[3].requires_grad, entry[3].dtype))
        group_of[i] = (g, len(groups[g][0]))
        groups[g][0].append(entry)
    for fqn, mod, name, idx in shared:
        g, j = group_of[idx]
        groups[g][1].append((fqn, mod, name, j))
    return groups


def alignment(compute_dtype: torch.dtype, use_orig_params: bool) -> int:
    """Elements each parameter's start is rounded up to (0: none).

    With ``use_orig_params=True`` original parameters start on 16-byte
    boundaries of the dtype they are computed in (torch's rule), so their
    unsharded views stay aligned.
    """
    return 16 // compute_dtype.itemsize if use_orig_params else 0


@dataclass(frozen=True)
class FlatLayout:
    """Offsets, padding and shard sizes of one flat parameter."""

    offsets: tuple[int, ...]  # each parameter's start in the unsharded flat parameter
    numels: tuple[int, ...]
    segments: tuple[int, ...]  # split sizes: parameters and padding, in order
    info_segment: tuple[int, ...]  # the segment holding each parameter
    unpadded_numel: int  # parameters plus alignment padding
    shard_numel: int  # elements every rank stores (right zero-padded)
    padded_numel: int  # shard_numel * world size (sharded), else unpadded_numel
    world_size: int
    sharded: bool

    @classmethod
    def build(
        cls, numels: Sequence[int], *, align: int, world_size: int, sharded: bool
    ) -> FlatLayout:
        offsets: list[int] = []
        segments: list[int] = []
        info_segment: list[int] = []
        total = 0
        for n in numels:
            if align and total % align:
                pad = align - total % align
                segments.append(pad)
                total += pad
            info_segment.append(len(segments))
            segments.append(n)
            offsets.append(total)
            total += n
        if align and total % world_size:
            segments.append(world_size - total % world_size)
        unpadded = sum(segments)
        shard = math.ceil(unpadded / world_size) if sharded else unpadded
        return cls(
            offsets=tuple(offsets),
            numels=tuple(numels),
            segments=tuple(segments),
            info_segment=tuple(info_segment),
            unpadded_numel=unpadded,
            shard_numel=shard,
            padded_numel=shard * (world_size if sharded else 1),
            world_size=world_size,
            sharded=sharded,
        )

    @property
    def has_padding(self) -> bool:
        """Alignment or world-size padding between or after the parameters."""
        return len(self.segments) != len(self.numels)

    def shard_offset(self, rank: int) -> int:
        """Where ``rank``'s shard starts in the unsharded flat parameter."""
        return rank * self.shard_numel if self.sharded else 0

    def shard_valid_numel(self, rank: int) -> int:
        """Elements of ``rank``'s shard that hold data (the rest is right padding)."""
        return max(0, min(self.shard_numel, self.unpadded_numel - self.shard_offset(rank)))

    def shard_slices(self, rank: int) -> list[tuple[int, int] | None]:
        """Per parameter, the ``[start, end)`` of its elements within ``rank``'s shard."""
        lo = self.shard_offset(rank)
        hi = lo + self.shard_valid_numel(rank)
        slices: list[tuple[int, int] | None] = []
        for offset, numel in zip(self.offsets, self.numels):
            start, end = max(lo, offset), min(hi, offset + numel)
            slices.append((start - lo, end - lo) if start < end else None)
        return slices


# ---------------------------------------------------------------- filling


def flatten_params(infos: Sequence[ParamInfo], unpadded_numel: int, has_padding: bool,
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The unsharded flat tensor (no right padding) copied from ``infos``'
    parameters, alignment padding ``PADDING_VALUE``; a parameter flagged
    :data:`VALUES_PENDING` (a checkpoint will fill it) is not copied, as in
    :func:`shard_from_params`."""
    flat = torch.empty(unpadded_numel, dtype=dtype, device=device)
    if has_padding:
        flat.fill_(PADDING_VALUE)
    for info in infos:
        if getattr(info.param, VALUES_PENDING, False):
            continue
        flat[info.offset : info.offset + info.numel].copy_(info.param.detach().reshape(-1))
    return flat


def shard_from_params(infos: Sequence[ParamInfo], slices: Sequence[tuple[int, int] | None],
                      shard_offset: int, shard_numel: int, valid_numel: int,
                      has_padding: bool, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """One rank's shard copied from the original parameters' elements it holds:
    what :func:`flatten_params` then slicing would give (alignment padding
    ``PADDING_VALUE``, right padding zeros) at a shard's cost.

    ``slices[i]``: parameter ``i``'s elements in the shard (shard offsets), or
    ``None``.  Each element is written once (no zero-fill first); a parameter
    flagged :data:`VALUES_PENDING` (a checkpoint will fill it) is not copied."""
    shard = torch.empty(shard_numel, dtype=dtype, device=device)
    shard[valid_numel:].zero_()
    pos = 0
    fill = PADDING_VALUE if has_padding else 0.0
    held = sorted(((i, sl) for i, sl in zip(infos, slices) if sl is not None),
                  key=lambda pair: pair[1][0])
    for info, sl in held:
        if sl[0] > pos:
            shard[pos : sl[0]].fill_(fill)  # alignment padding between parameters
        pos = max(pos, sl[1])
        if getattr(info.param, VALUES_PENDING, False):
            continue
        start = sl[0] + shard_offset - info.offset
        src = info.param.detach().reshape(-1)[start : start + sl[1] - sl[0]]
        shard[sl[0] : sl[1]].copy_(src)
    if valid_numel > pos:
        shard[pos:valid_numel].fill_(fill)
    return shard


def alignment_padding_mask(shard_numel: int, valid_numel: int,
                           slices: Sequence[tuple[int, int] | None],
                           device: torch.device) -> torch.Tensor | None:
    """Which elements of a local shard are alignment padding (between the
    parameters' ``slices`` within its ``valid_numel`` first elements); ``None``
    where it has none."""
    mask = torch.zeros(shard_numel, dtype=torch.bool)
    mask[:valid_numel] = True
    for sl in slices:
        if sl is not None:
            mask[sl[0] : sl[1]] = False
    return mask.to(device) if bool(mask.any()) else None
