"""Loss scaling for sharded and data-parallel training: ``ShardedGradScaler``.

A drop-in for FSDP1's ``ShardedGradScaler``: ``from fsdp_wrap.sharded_grad_scaler
import ShardedGradScaler``.  It is a :class:`torch.amp.GradScaler` that knows two
things a single-process scaler does not:

* **Every rank must make the same skip decision.**  With sharded parameters each
  rank only checks the gradients it owns, so an inf/NaN may exist on one rank
  only.  :meth:`ShardedGradScaler.unscale_` reduces the inf flags over the process
  group; if any rank saw a non-finite gradient, every rank skips
  ``optimizer.step()`` and backs the scale off in :meth:`update`, so parameters
  and scales stay identical across ranks.
* **Gradients may live anywhere and be low precision.**  Grads are grouped by
  (device, dtype) and fp16 grads are allowed (mixed precision keeps them so);
  CPU gradients of a GPU scaler (CPU offload) are checked on the CPU and their
  flag is reduced on the scaler's device; a ``device="cpu"`` scaler works on a
  CPU-only host with gloo.

A rank may own no gradient at all (with ``use_orig_params=True`` a small
parameter can lie entirely in another rank's shard); it still contributes a
zero flag so that every rank issues the same collective.

[Note: one flag, one collective]
The local check yields one flag per gradient device.  Instead of one
all-reduce per device (what torch does, which needs every rank to have grads on
the same set of devices or the collectives mismatch), the flags are combined
into one tensor, reduced once with ``MAX`` and the global 0/1 result is written
back into every per-device flag.  ``MAX`` keeps the flag at exactly 0.0 or 1.0:
fused optimizers (``Adam(fused=True)``) skip their update only when the flag
equals 1, which a ``SUM`` over ranks would break.
"""

from __future__ import annotations

from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler, OptState
from torch.distributed import ProcessGroup

import fsdp_wrap.comm.collectives as _collectives

__all__ = ["ShardedGradScaler"]


def _fresh_optimizer_state() -> dict[str, Any]:
    # Module level so that GradScaler's defaultdict of these stays picklable.
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _supported_device_types() -> tuple[str, ...]:
    return ("cuda", "xla", "cpu", "hpu", "mtia", "xpu", torch._C._get_privateuse1_backend_name())


def _check_supported(tensor: torch.Tensor, what: str) -> None:
    if tensor.device.type not in _supported_device_types():
        # AssertionError, as torch's scaler raises, so callers catching it keep working.
        raise AssertionError(
            f"ShardedGradScaler.{what}: expected a tensor on one of "
            f"{_supported_device_types()}, got one on {tensor.device}"
        )


def _reduction_device(scale_device: torch.device, scaler_device: str) -> torch.device:
    """Where the inf flag is all-reduced.

    The scale's own device, except that a CPU scale of a non-CPU scaler (the
    loss came from CPU, e.g. with CPU offload) is reduced on the scaler's
    accelerator, as the process group's backend (NCCL) may not take CPU tensors.
    """
    if scale_device.type == "cpu" and scaler_device != "cpu":
        return torch.device(scaler_device)
    return scale_device


class _PerDevice:
    """Copies of one tensor, made on first request per device and then reused."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self.copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        copy = self.copies.get(device)
        if copy is None:
            copy = self.master.to(device=device, non_blocking=True, copy=True)
            self.copies[device] = copy
        return copy


class ShardedGradScaler(GradScaler):
    """Gradient scaler whose inf/NaN check is agreed by all ranks of ``process_group``.

    Use it exactly like :class:`torch.amp.GradScaler`::

        scaler = ShardedGradScaler()
        for inputs, target in data:
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), target)
            scaler.scale(loss).backward()   # scaled gradients
            scaler.step(optimizer)          # unscale, agree on inf/NaN, maybe step
            scaler.update()                 # back off on inf, grow after successes

    Args:
        device: where the scale lives by default (``"cuda"``; use ``"cpu"`` on a
            CPU-only host: a ``"cuda"`` scaler without CUDA disables itself
            with a warning, as :class:`torch.amp.GradScaler` does).
        init_scale: initial scale factor.
        backoff_factor: the scale is multiplied by this (< 1) in :meth:`update`
            when any rank found an inf/NaN gradient.  Note the positional order
            (backoff before growth) differs from ``GradScaler``'s, as in torch.
        growth_factor: the scale is multiplied by this (> 1) after
            ``growth_interval`` consecutive steps without inf/NaN.
        growth_interval: number of consecutive finite steps before growing.
        enabled: ``False`` turns the scaler into a pass-through.
        process_group: group over which inf flags are reduced; ``None`` (the
            default) means the default group at the time of the reduction, so
            the scaler may be built before ``init_process_group``.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            backoff_factor=backoff_factor,
            growth_factor=growth_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    # ------------------------------------------------------------------
    # Scaling outputs
    # ------------------------------------------------------------------

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(
        self, outputs: torch.Tensor | Iterable[torch.Tensor]
    ) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply ``outputs`` (a tensor or a nested list/tuple/iterable of them) by the scale.

        Unlike :class:`torch.amp.GradScaler`, the result keeps each output's
        dtype: an fp16/bf16 loss from a mixed-precision model stays fp16/bf16
        (a 0-dim fp16 loss times the fp32 scale would otherwise promote to fp32).
        A list or tuple gives the same type back; another iterable gives a lazy
        iterator.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            _check_supported(outputs, "scale")
            return (outputs * self._scale_on(outputs.device)).type(outputs.dtype)
        copies: list[_PerDevice] = []

        def apply(val: torch.Tensor | Iterable[torch.Tensor]) -> Any:
            if isinstance(val, torch.Tensor):
                _check_supported(val, "scale")
                if not copies:
                    copies.append(_PerDevice(self._ensure_scale(val.device)))
                return (val * copies[0].get(val.device)).type(val.dtype)
            if isinstance(val, abc.Iterable):
                mapped = map(apply, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(mapped)
                return mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)  # type: ignore[no-any-return]

    def _ensure_scale(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(device)
        scale, _ = self._check_scale_growth_tracker("scale")
        return scale

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        return self._ensure_scale(device).to(device=device, non_blocking=True)

    # ------------------------------------------------------------------
    # Unscaling and the shared inf check
    # ------------------------------------------------------------------

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale this rank's grads in place; return one local inf flag per grad device.

        Grads are grouped by (device, dtype) so each group is one fused kernel
        call.  A rank without grads still gets a zero flag on the scale's device.
        """
        inv_scales = _PerDevice(inv_scale)
        flags = _PerDevice(found_inf)
        groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for param_group in optimizer.param_groups:
                for param in param_group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if grad.is_sparse:
                        # Duplicate indices are summed by coalesce(), which may
                        # overflow, so the coalesced values are what we check.
                        # fp16 cannot be coalesced directly: go through fp32.
                        if grad.dtype is torch.float16:
                            param.grad = grad.float().coalesce().half()
                            grad = param.grad
                        values = grad._values()
                    else:
                        values = grad
                    groups[values.device][values.dtype].append(values)
            for device, by_dtype in groups.items():
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        grads, flags.get(device), inv_scales.get(device)
                    )
        if not flags.copies:
            scale, _ = self._check_scale_growth_tracker("unscale_")
            flags.get(scale.device)
        return flags.copies

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s grads by the scale and agree with all ranks on inf/NaN.

        Afterwards every per-device flag of ``optimizer`` holds 1.0 on every
        rank if any rank found a non-finite grad, else 0.0.  One collective per
        call, on every rank (including ranks without grads).
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        group = self._group_for("unscale_")
        # The reciprocal in fp64: fp32 division can be inexact under some compile options.
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.full((1,), 0.0, dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        state["stage"] = OptState.UNSCALED
        self._agree_on_found_inf(state["found_inf_per_device"], scale.device, group)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The check ``step()`` runs for optimizers that unscale themselves (fused ones).

        torch's scaler leaves this check local; here it is agreed across ranks
        too, so a fused optimizer skips on every rank or on none.
        """
        group = self._group_for("step")
        flags = super()._check_inf_per_device(optimizer)
        scale, _ = self._check_scale_growth_tracker("step")
        self._agree_on_found_inf(flags, scale.device, group)
        return flags

    def _group_for(self, what: str) -> ProcessGroup:
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError(
                f"ShardedGradScaler.{what}: no process group to agree on inf/NaN: "
                "torch.distributed is not initialized and no process_group was given. "
                "Call torch.distributed.init_process_group() first."
            )
        return group

    def _agree_on_found_inf(
        self,
        flags: dict[Any, torch.Tensor],
        scale_device: torch.device,
        group: ProcessGroup,
    ) -> None:
        """Replace every local flag in ``flags`` by the 0/1 maximum over ranks and devices."""
        device = _reduction_device(scale_device, self._device)
        combined = torch.zeros((1,), dtype=torch.float32, device=device)
        for flag in flags.values():
            torch.maximum(combined, flag.to(device).reshape(1), out=combined)
        _collectives.all_reduce(combined, group, dist.ReduceOp.MAX)
        for flag in flags.values():
            flag.copy_(combined.reshape(flag.shape))

    # ------------------------------------------------------------------
    # Scale update
    # ------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back the scale off if any step this iteration was skipped, else count towards growth.

        ``new_scale`` (a float or a 1-element tensor on the scaler's device
        type, not requiring grad) sets the scale directly instead.  Call once
        per iteration, after ``step`` for every optimizer.
        """
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, float):
                scale.fill_(new_scale)
            else:
                reason = (
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if (
                    new_scale.device.type != self._device
                    or new_scale.numel() != 1
                    or new_scale.requires_grad is not False
                ):
                    raise AssertionError(reason)
                # reshape: torch's scaler rejects a shape-(1,) tensor its message invites.
                scale.copy_(new_scale.reshape(scale.shape))
        else:
            found_infs = [
                flag.to(device=scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for flag in state["found_inf_per_device"].values()
            ]
            if not found_infs:
                raise AssertionError("No inf checks were recorded prior to update.")
            combined = found_infs[0].clone()
            for flag in found_infs[1:]:
                combined += flag
            if scale.device.type == "cpu":
                self._update_scale_cpu(scale, tracker, combined)
            else:
                torch._amp_update_scale_(
                    scale,
                    tracker,
                    combined,
                    self._growth_factor,
                    self._backoff_factor,
                    self._growth_interval,
                )
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    def _update_scale_cpu(
        self, scale: torch.Tensor, tracker: torch.Tensor, found_inf: torch.Tensor
    ) -> None:
        """CPU scale update, with the semantics of torch's ``_amp_update_scale_cpu_``.

        Any inf: ``scale *= backoff_factor`` and the success count restarts.
        Otherwise the count grows; on reaching ``growth_interval`` the scale is
        multiplied by ``growth_factor`` and the count restarts.
        """
        if found_inf.item() >= 1.0:
            scale.mul_(self._backoff_factor)
            tracker.fill_(0)
            return
        successful = int(tracker.item()) + 1
        if successful == self._growth_interval:
            scale.mul_(self._growth_factor)
            tracker.fill_(0)
        else:
            tracker.fill_(successful)
