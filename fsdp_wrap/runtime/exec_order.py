"""The order in which units run forward, which prefetching follows (owned by the root)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import fsdp_wrap.comm.collectives as C
from fsdp_wrap.comm.collectives import global_rank

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from fsdp_wrap.handle.flat_param import FlatParamHandle


class ExecOrder:
    """Unit order the prefetches follow; owned by the root.

    Forward prefetch uses the pre-forward order of the first iteration;
    backward prefetch uses this iteration's post-forward order reversed.
    """

    def __init__(self) -> None:
        self.forward_order: list[FlatParamHandle] = []
        self.forward_index: dict[FlatParamHandle, int] = {}
        self.forward_frozen = False
        self.post_forward_order: list[FlatParamHandle] = []
        self.post_forward_index: dict[FlatParamHandle, int] = {}
        # Set by the root at lazy init under TORCH_DISTRIBUTED_DEBUG=DETAIL only.
        self.order_check: ForwardOrderCheck | None = None

    def record_pre_forward(self, handle: FlatParamHandle) -> None:
        if not self.forward_frozen and handle not in self.forward_index:
            self.forward_index[handle] = len(self.forward_order)
            self.forward_order.append(handle)

    def record_post_forward(self, handle: FlatParamHandle) -> None:
        if handle not in self.post_forward_index:
            self.post_forward_index[handle] = len(self.post_forward_order)
            self.post_forward_order.append(handle)

    def next_in_forward(self, handle: FlatParamHandle) -> FlatParamHandle | None:
        i = self.forward_index.get(handle)
        if not self.forward_frozen or i is None or i + 1 >= len(self.forward_order):
            return None
        return self.forward_order[i + 1]

    def next_in_backward(self, handle: FlatParamHandle) -> FlatParamHandle | None:
        i = self.post_forward_index.get(handle)
        if i is None or i == 0:
            return None
        return self.post_forward_order[i - 1]

    def next_iteration(self) -> None:
        if self.forward_order:
            self.forward_frozen = True
        self.post_forward_order.clear()
        self.post_forward_index.clear()


class ForwardOrderCheck:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL``: every rank runs the units in one order.

    Created by the root at lazy init only under DETAIL (otherwise nothing is
    checked and nothing costs).  Training forwards only, as in torch: an eval
    forward has no backward to end its iteration.

    * Every training iteration: each unit's pre-forward all-gathers its
      index (one int; every rank makes this collective at the same point
      while the orders agree), and every rank raises ``RuntimeError`` naming
      both ranks' units as soon as two ranks are about to gather different
      units, i.e. before the mismatched all-gather that would mix different
      units' shards or hang.  torch checks across ranks in the first
      iteration only and afterwards lets diverging ranks pair one unit's
      collectives with another's (wrong gradients, or a hang); here, where
      batched gathers and buckets make such pairings hang, the check goes on
      (it costs one int per unit, under DETAIL only).
    * Later iterations: the local order is also compared with the first one;
      each deviation of the first deviating iteration gives a
      ``UserWarning`` (the prefetches follow the first iteration's order);
      later iterations are not compared with the first.
    """

    def __init__(
        self,
        handles: list[FlatParamHandle],
        group: ProcessGroup,
        rank: int,
        world_size: int,
    ) -> None:
        self.handles = handles
        self.index = {h: i for i, h in enumerate(handles)}
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.first_iteration = True
        self.iteration = 0  # training iterations (backwards) completed
        self.first_order: list[FlatParamHandle] = []
        self.position = 0
        self.warned = False  # a deviation was reported (stop checking after this iteration)
        self.stop = False

    def describe(self, handle: FlatParamHandle | None) -> str:
        if handle is None:
            return "no unit (a unit added since construction?)"
        unit = handle.unit_fqn
        names = [f"{unit}.{i.fqn}" if unit else i.fqn for i in handle.infos]
        return f"unit '{unit or '<root>'}' (parameters {names})"

    def names(self, handle: FlatParamHandle | None) -> list[list[str]]:
        """torch's naming of a unit in these messages: its parameters' FQNs, one list."""
        if handle is None:
            return []
        unit = handle.unit_fqn
        return [[f"{unit}.{i.fqn}" if unit else i.fqn for i in handle.infos]]

    def check(self, handle: FlatParamHandle) -> None:
        if self.first_iteration:
            self.first_order.append(handle)
        elif not self.stop:
            self._check_against_first(handle)
        self._check_across_ranks(handle)

    def _check_across_ranks(self, handle: FlatParamHandle) -> None:
        local = torch.tensor([self.index.get(handle, -1)], dtype=torch.int64, device=handle.device)
        gathered = torch.empty(self.world_size, dtype=torch.int64, device=handle.device)
        C.all_gather_into(gathered, local, self.group)
        indices = gathered.tolist()
        if len(set(indices)) == 1:
            return
        # torch's sentence names the first pair of group ranks that differ
        r1 = next(r for r in range(len(indices)) if any(i != indices[r] for i in indices))
        r2 = next(r for r in range(r1 + 1, len(indices)) if indices[r] != indices[r1])
        mine = indices[self.rank]
        other = next(r for r, i in enumerate(indices) if i != mine)
        raise RuntimeError(
            f"Forward order differs across ranks: rank {r1} is all-gathering parameters for "
            f"{self.names(self._handle_at(indices[r1]))} while rank {r2} is all-gathering "
            f"parameters for {self.names(self._handle_at(indices[r2]))}. [rank {global_rank()}] "
            f"In training iteration {self.iteration + 1}, this rank is all-gathering parameters "
            f"for {self.describe(self._handle_at(mine))} "
            f"while rank {dist.get_global_rank(self.group, other)} is all-gathering parameters "
            f"for {self.describe(self._handle_at(indices[other]))} (all ranks' unit indices in "
            f"order of construction: {indices}). Every rank must run the FSDP units in the "
            "same order in forward (same control flow on every rank); otherwise the units' "
            "all-gathers mix different parameters or hang."
        )

    def _handle_at(self, index: int) -> FlatParamHandle | None:
        return self.handles[index] if 0 <= index < len(self.handles) else None

    def _check_against_first(self, handle: FlatParamHandle) -> None:
        if self.position >= len(self.first_order):
            prefix = "Expected to not all-gather any more parameters in the forward but trying "
        elif self.first_order[self.position] is not handle:
            expected = self.names(self.first_order[self.position])
            prefix = f"Expected to all-gather for {expected} but trying "
        else:
            prefix = ""
        self.position += 1
        if prefix:  # every deviation of the first deviating iteration, as torch
            self.warned = True
            got = self.names(handle) or "a newly-added parameter since construction time"
            warnings.warn(
                "Forward order differs from that of the first iteration "
                f"on rank {self.rank}. Collectives are unchecked and may give incorrect results "
                f"or hang.\n{prefix}to all-gather parameters for {got}. [rank {global_rank()}] "
                f"This rank all-gathers {self.describe(handle)}. "
                "Keep the units' forward order the same every iteration (forward_prefetch "
                "follows the first iteration's order).",
                stacklevel=2,
            )

    def end_of_iteration(self) -> None:
        """The end of a backward: the first iteration's order is fixed from now on."""
        self.first_iteration = False
        self.iteration += 1
        self.position = 0
        if self.warned:
            self.stop = True
