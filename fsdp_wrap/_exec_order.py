"""The order in which units run forward, which prefetching follows (owned by the root)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._flat_param import FlatParamHandle


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
