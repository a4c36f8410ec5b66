"""``TORCH_DISTRIBUTED_DEBUG=DETAIL``: forward-order validation, torch's FSDP1 as the oracle.

* First iteration, ranks running the units in different orders: torch raises
  ``RuntimeError`` "Forward order differs across ranks"; so do we, on every
  rank, before the mismatched all-gather, naming both ranks and the units by
  clean FQN.
* A later iteration whose order differs from the first: a ``UserWarning``
  "Forward order differs from that of the first iteration" per deviating
  unit, in the first deviating iteration only, as torch.
* A later iteration in which the ranks diverge (rank 1 changes its order,
  rank 0 does not): deliberate difference from torch, which warns on rank 1
  and then pairs one unit's collectives with the other's (a wrong gradient for
  same-shaped units, a hang otherwise); ours keeps checking across ranks under
  DETAIL and raises torch's "Forward order differs across ranks" on every
  rank, before the mismatched all-gather, within seconds.
* Debug level not DETAIL: nothing is checked (no extra collective).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import fsdp_cls, fsdp_kwargs, wrap_api

ACROSS = "Forward order differs across ranks"
LATER = "Forward order differs from that of the first iteration"


class TwoBlocks(nn.Module):
    """Two same-shaped units whose order the caller picks."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, flip: bool = False) -> torch.Tensor:
        if flip:
            return self.first(self.second(x))
        return self.second(self.first(x))


def _build(impl: str) -> nn.Module:
    torch.manual_seed(0)
    return fsdp_cls(impl)(
        TwoBlocks(), auto_wrap_policy=wrap_api(impl).ModuleWrapPolicy({nn.Linear}),
        **fsdp_kwargs(impl),
    )


def _with_debug(level: Any, fn: Any) -> Any:
    previous = dist.get_debug_level()
    dist.set_debug_level(level)
    try:
        return fn()
    finally:
        dist.set_debug_level(previous)


def _ranks_disagree(impl: str) -> tuple[str, str] | None:
    def run() -> tuple[str, str] | None:
        model = _build(impl)
        try:
            model(torch.randn(2, 4), flip=dist.get_rank() == 1).sum().backward()
        except Exception as e:  # noqa: BLE001
            return type(e).__name__, str(e)
        return None

    return _with_debug(dist.DebugLevel.DETAIL, run)


def _ranks_disagree_both() -> dict[str, Any]:
    return {impl: _ranks_disagree(impl) for impl in ("torch", "ours")}


def test_first_iteration_order_differs_across_ranks(pool2: Any) -> None:
    for rank, out in enumerate(pool2.run(_ranks_disagree_both)):
        torch_out, ours = out["torch"], out["ours"]
        assert torch_out is not None and ACROSS in torch_out[1], torch_out
        assert ours is not None, f"rank {rank}: fsdp_wrap did not raise (torch: {torch_out})"
        assert ours[0] == torch_out[0] == "RuntimeError", (ours, torch_out)
        msg = ours[1]
        # torch's whole sentence first, filled as torch fills it (its tests match the start)
        assert msg.startswith(torch_out[1]), (msg, torch_out[1])
        other = 1 - rank
        assert f"[rank {rank}]" in msg and f"rank {other} is all-gathering" in msg, msg
        mine, theirs = ("first", "second") if rank == 0 else ("second", "first")
        assert (f"In training iteration 1, this rank is all-gathering parameters for unit "
                f"'{mine}' "
                f"(parameters ['{mine}.weight', '{mine}.bias'])") in msg, msg
        assert f"is all-gathering parameters for unit '{theirs}'" in msg, msg
        assert "_fsdp_wrapped_module" not in msg and "same order" in msg, msg


def _later_iterations(impl: str) -> list[list[str]]:
    def run() -> list[list[str]]:
        model = _build(impl)
        per_iteration = []
        for flip in (False, True, True, False):
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                model(torch.randn(2, 4), flip=flip).sum().backward()
            per_iteration.append([str(w.message) for w in rec if LATER in str(w.message)])
        return per_iteration

    return _with_debug(dist.DebugLevel.DETAIL, run)


def _later_iterations_both() -> dict[str, Any]:
    return {impl: _later_iterations(impl) for impl in ("torch", "ours")}


def test_later_iteration_order_change_warns_in_first_deviating_iteration(pool2: Any) -> None:
    for rank, out in enumerate(pool2.run(_later_iterations_both)):
        torch_out, ours = out["torch"], out["ours"]
        assert [len(w) for w in torch_out] == [0, 2, 0, 0], torch_out  # both units deviate
        assert [len(w) for w in ours] == [len(w) for w in torch_out], (ours, torch_out)
        for mine, theirs in zip(ours[1], torch_out[1]):
            # torch's warning first, filled as torch fills it; then rank and unit names
            assert mine.startswith(theirs), (mine, theirs)
        msg = ours[1][0]
        assert f"on rank {rank}" in msg and f"[rank {rank}]" in msg, msg
        assert ("Expected to all-gather for [['first.weight', 'first.bias']] but trying to "
                "all-gather parameters for [['second.weight', 'second.bias']]") in msg, msg
        assert "This rank all-gathers unit 'second'" in msg, msg


def _later_divergence() -> list[tuple[int, str, str]]:
    """Iterations 1-2 agree; in iteration 3 rank 1 flips: what each iteration raised."""

    def run() -> list[tuple[int, str, str]]:
        model = _build("ours")
        raised = []
        for i, flip in enumerate((False, False, dist.get_rank() == 1)):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model(torch.randn(2, 4), flip=flip).sum().backward()
            except RuntimeError as e:
                raised.append((i + 1, type(e).__name__, str(e)))
                break
        return raised

    return _with_debug(dist.DebugLevel.DETAIL, run)


def test_later_iteration_divergence_across_ranks_raises_on_every_rank(pool2: Any) -> None:
    for rank, raised in enumerate(pool2.run(_later_divergence)):
        assert len(raised) == 1, (rank, raised)
        iteration, kind, msg = raised[0]
        assert iteration == 3 and kind == "RuntimeError", raised
        assert msg.startswith(f"{ACROSS}: rank 0 is all-gathering parameters for "
                              "[['first.weight', 'first.bias']] while rank 1 is all-gathering "
                              "parameters for [['second.weight', 'second.bias']]."), msg
        assert f"[rank {rank}] In training iteration 3, this rank" in msg, msg


def _not_detail() -> tuple[Any, list[str]]:
    calls: list[str] = []
    model = _build("ours")
    import fsdp_wrap.comm.collectives as C

    real = C.all_gather_into

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append("all_gather")
        return real(*args, **kwargs)

    C.all_gather_into = counting  # type: ignore[assignment]
    try:
        # Debug level INFO (not DETAIL): the different order goes unchecked, as in torch.
        _with_debug(dist.DebugLevel.INFO, lambda: model(torch.randn(2, 4), flip=dist.get_rank() == 1))
    finally:
        C.all_gather_into = real  # type: ignore[assignment]
    return model._exec_order.order_check, calls


def test_not_checked_unless_detail(pool2: Any) -> None:
    for check, calls in pool2.run(_not_detail):
        assert check is None
        assert len(calls) == 2, calls  # one unshard per unit, no order-check gathers


class Reused(TwoBlocks):
    """``first`` runs twice in every forward (a shared block)."""

    def forward(self, x: torch.Tensor, flip: bool = False) -> torch.Tensor:
        return self.first(self.second(self.first(x)))


def _reused(impl: str) -> list[int]:
    def run() -> list[int]:
        torch.manual_seed(0)
        model = fsdp_cls(impl)(
            Reused(), auto_wrap_policy=wrap_api(impl).ModuleWrapPolicy({nn.Linear}),
            **fsdp_kwargs(impl),
        )
        counts = []
        for _ in range(3):
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                model(torch.randn(2, 4)).sum().backward()
            counts.append(sum(LATER in str(w.message) for w in rec))
        return counts

    return _with_debug(dist.DebugLevel.DETAIL, run)


def _reused_both() -> dict[str, list[int]]:
    return {impl: _reused(impl) for impl in ("torch", "ours")}


def test_unit_run_twice_per_forward_is_not_a_change_of_order(pool2: Any) -> None:
    # Deliberate difference (docs/features.rst): torch records a unit's first run only, so
    # the second run of a reused unit warns from the second iteration on,
    # although nothing changed; ours records every run of the first iteration.
    for out in pool2.run(_reused_both):
        assert out["torch"] == [0, 1, 0], out
        assert out["ours"] == [0, 0, 0], out
