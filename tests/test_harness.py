"""The multi-process harness itself: results, failures, hangs and recovery."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import DistPool, WorkerError, WorkerTimeoutError, progress

# ---------------------------------------------------------------- rank functions


def _all_reduce_rank_plus_one() -> list[float]:
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return t.tolist()


def _rank_info(x: int, *, scale: int = 1) -> tuple[int, int, int]:
    # later ranks finish first, so rank order != completion order
    time.sleep(0.05 * (dist.get_world_size() - dist.get_rank()))
    return dist.get_rank(), dist.get_world_size(), x * scale


def _raise_on(rank: int) -> int:
    print(f"about to fail on rank {dist.get_rank()}")
    if dist.get_rank() == rank:
        raise ValueError(f"boom from rank {rank}")
    return dist.get_rank()


def _raise_everywhere() -> None:
    raise RuntimeError(f"every rank fails ({dist.get_rank()})")


def _rank1_raises_while_rank0_in_collective() -> None:
    if dist.get_rank() == 1:
        raise KeyError("rank 1 gave up before the all_reduce")
    dist.all_reduce(torch.ones(1))  # blocks forever: rank 1 never joins


def _hang() -> None:
    time.sleep(600)


def _beat_for(seconds: float, then_hang: bool) -> int:
    """Call ``progress`` every 0.5 s for ``seconds``, then return or go silent."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.5)
        progress()
    if then_hang:
        time.sleep(600)
    return dist.get_rank()


def _die_on_rank1() -> int:
    if dist.get_rank() == 1:
        sys.stdout.flush()
        os._exit(7)
    return 0


def _async_collective_on_rank0_only() -> int:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # never matched: group out of step
    return dist.get_rank()


def _random_draws() -> list[float]:
    return torch.rand(3).tolist()


def _print_and_return() -> int:
    print(f"hello from rank {dist.get_rank()}")
    return 0


def _environment() -> dict[str, object]:
    return {
        "sys_path": list(sys.path),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "rank_env": os.environ["RANK"],
    }


def _return_tensor(t: torch.Tensor) -> torch.Tensor:
    return t * (dist.get_rank() + 1)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def short_pool():
    """A private pool with a short timeout, for tests that kill/restart it."""
    pool = DistPool(2, timeout=3.0, failure_grace=0.5)
    pool.run(_rank_info, 0)  # started and warm before the timed tests
    yield pool
    pool.close()


# ---------------------------------------------------------------- results


def test_all_reduce_two_ranks(pool2):
    assert pool2.run(_all_reduce_rank_plus_one) == [[3.0, 3.0], [3.0, 3.0]]


def test_all_reduce_three_ranks(pool3):
    assert pool3.run(_all_reduce_rank_plus_one) == [[6.0, 6.0]] * 3


def test_results_in_rank_order_with_args_and_kwargs(pool3):
    assert pool3.run(_rank_info, 7, scale=2) == [(0, 3, 14), (1, 3, 14), (2, 3, 14)]


def test_tensors_round_trip(pool2):
    out = pool2.run(_return_tensor, torch.arange(3.0))
    torch.testing.assert_close(out[0], torch.arange(3.0))
    torch.testing.assert_close(out[1], 2 * torch.arange(3.0))


def test_worker_environment(pool2):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    envs = pool2.run(_environment)
    for rank, env in enumerate(envs):
        assert root in env["sys_path"] and os.path.join(root, "tests") in env["sys_path"]
        assert env["threads"] == 1
        assert env["backend"] == "gloo"
        assert env["rank_env"] == str(rank)


def test_rng_reset_before_every_task(pool2):
    first = pool2.run(_random_draws)
    second = pool2.run(_random_draws)
    torch.manual_seed(0)
    expected = torch.rand(3).tolist()
    assert first == second == [expected, expected]


def test_worker_output_is_forwarded(pool2, capsys):
    pool2.run(_print_and_return)
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out
    assert "[rank 1] hello from rank 1" in out


# ---------------------------------------------------------------- failures


def test_exception_on_one_rank_is_reported(pool2):
    generation = pool2.generation
    with pytest.raises(WorkerError) as info:
        pool2.run(_raise_on, 1)
    msg = str(info.value)
    assert "_raise_on failed on rank(s) [1] of 2" in msg
    assert "[rank 1] Traceback (most recent call last):" in msg
    assert "[rank 1] ValueError: boom from rank 1" in msg
    assert "in _raise_on" in msg
    assert "[rank 0] Traceback" not in msg
    assert "[rank 1] about to fail on rank 1" in msg  # captured output of the failing rank
    assert set(info.value.failures) == {1}
    assert not isinstance(info.value, TimeoutError)
    # no collective was left half-done, so the same processes carry on
    assert pool2.generation == generation
    assert pool2.run(_all_reduce_rank_plus_one) == [[3.0, 3.0], [3.0, 3.0]]


def test_exception_on_every_rank(pool3):
    with pytest.raises(WorkerError) as info:
        pool3.run(_raise_everywhere)
    assert set(info.value.failures) == {0, 1, 2}
    for r in range(3):
        assert f"[rank {r}] RuntimeError: every rank fails ({r})" in str(info.value)
    assert pool3.run(_all_reduce_rank_plus_one) == [[6.0, 6.0]] * 3


def test_rank_raises_while_other_blocked_in_collective(short_pool):
    generation = short_pool.generation
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        short_pool.run(_rank1_raises_while_rank0_in_collective)
    assert time.monotonic() - t0 < 2.5  # failure_grace (0.5 s), not the 3 s timeout
    err = info.value
    msg = str(err)
    assert isinstance(err, WorkerTimeoutError) and isinstance(err, TimeoutError)
    assert "_rank1_raises_while_rank0_in_collective did not finish on rank(s) [0]" in msg
    assert "[rank 1] KeyError: 'rank 1 gave up before the all_reduce'" in msg
    assert "all_reduce" in msg.split("captured output of rank 0")[1]  # rank 0's stack
    assert set(err.failures) == {1}
    assert short_pool.generation == generation + 1
    assert short_pool.run(_all_reduce_rank_plus_one) == [[3.0, 3.0], [3.0, 3.0]]


def test_timeout_kills_and_restarts(short_pool):
    generation = short_pool.generation
    with pytest.raises(
        TimeoutError, match=r"test_harness\._hang did not finish on rank\(s\) \[0, 1\]"
    ):
        short_pool.run(_hang)
    assert short_pool.generation == generation + 1
    assert short_pool.run(_all_reduce_rank_plus_one) == [[3.0, 3.0], [3.0, 3.0]]


def test_progress_extends_the_timeout(short_pool):
    # 4.5 s of work with progress reports fits a 3 s no-progress timeout ...
    assert short_pool.run(_beat_for, 4.5, False) == [0, 1]
    # ... and once the reports stop, the hang is reported 3 s later, not at the end of time.
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"no progress for timeout=3s"):
        short_pool.run(_beat_for, 1.0, True)
    assert time.monotonic() - t0 < 1.0 + 3.0 + 3.0
    assert short_pool.run(_all_reduce_rank_plus_one) == [[3.0, 3.0], [3.0, 3.0]]


def test_dead_worker_is_reported_and_replaced(short_pool):
    with pytest.raises(WorkerError, match=r"\[rank 1\] worker process died \(exit code 7\)"):
        short_pool.run(_die_on_rank1)
    assert short_pool.run(_all_reduce_rank_plus_one) == [[3.0, 3.0], [3.0, 3.0]]


def test_out_of_step_group_is_restarted(short_pool, capsys):
    generation = short_pool.generation
    assert short_pool.run(_async_collective_on_rank0_only) == [0, 1]
    assert "restarted the pool for a clean group" in capsys.readouterr().err
    assert short_pool.generation == generation + 1
    assert short_pool.run(_all_reduce_rank_plus_one) == [[3.0, 3.0], [3.0, 3.0]]


def test_bad_tasks_are_rejected_in_the_parent(pool2):
    with pytest.raises(TypeError, match="module-level function"):
        pool2.run(lambda: 0)
    with pytest.raises((TypeError, pickle.PicklingError)):
        pool2.run(_rank_info, threading.Lock())
    assert pool2.run(_rank_info, 1) == [(0, 2, 1), (1, 2, 1)]


def test_a_hanging_test_fails_at_the_limit_with_stacks():
    """conftest's per-test limit: the test fails (not the run) and its stack is printed."""
    from tests._proc import run_bounded

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, FSDP_WRAP_TEST_LIMIT="2")
    t0 = time.monotonic()
    proc = run_bounded(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/_limit_probe.py"],
        timeout=60, cwd=root, env=env,
    )
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed" in proc.stdout and "TimeLimitExceeded" in proc.stdout, proc.stdout
    assert "in test_hangs" in proc.stdout + proc.stderr  # the stack of the hanging test


def test_a_hanging_command_fails_with_the_stacks_of_its_processes():
    from tests._proc import run_bounded

    code = "import faulthandler, time\ndef waiting_here():\n    time.sleep(60)\nwaiting_here()"
    with pytest.raises(AssertionError, match="did not finish within 2s") as info:
        run_bounded([sys.executable, "-c", code], timeout=2)
    assert "in waiting_here" in str(info.value)
