"""Shared fixtures for the fsdp_wrap test-suite.

Distributed tests run on real gloo process groups (CPU) through the worker
pools of :mod:`tests._dist`; each world size is started once per session::

    def _check(x):                 # module level, runs on every rank
        ...

    def test_something(pool2):
        assert pool2.run(_check, 3) == [..., ...]

GPU-only tests: ``@requires_cuda`` (``from tests.conftest import requires_cuda``)
or ``@pytest.mark.gpu``; both skip when CUDA is unavailable.

Every test is bounded in time: a pool task fails a minute after its last
progress (tests/_dist.py), a command started with ``tests._proc.run_bounded``
at its own timeout, and any test at :data:`TEST_LIMIT_S` seconds (slow ones
:data:`SLOW_TEST_LIMIT_S`; ``$FSDP_WRAP_TEST_LIMIT`` overrides both), after
dumping the stacks of the test process.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Iterator

import pytest
import torch

from tests._dist import TORCH_NOISE_MODULE, DistPool, close_all_pools, get_pool

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# $FSDP_WRAP_REQUIRE: a skip for a capability CI has fails the run (tests/_require.py)
pytest_plugins = ["tests._require"]


def pytest_configure(config: pytest.Config) -> None:
    # FutureWarnings that torch raises about its own internals are noise; ones
    # attributed to our code (or the tests) stay visible.
    config.addinivalue_line("filterwarnings", f"ignore::FutureWarning:{TORCH_NOISE_MODULE}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


TEST_LIMIT_S = 300
SLOW_TEST_LIMIT_S = 1200  # the framework runs launch torchrun with a 900 s timeout


class TimeLimitExceeded(Exception):
    """A test ran past its time limit (see the module docstring)."""


def _alarm(signum: int, frame: object) -> None:
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    raise TimeLimitExceeded("test ran past its time limit; stacks of every thread are on stderr")


@pytest.fixture(autouse=True)
def _time_limit(request: pytest.FixtureRequest) -> Iterator[None]:
    if not hasattr(signal, "SIGALRM"):
        yield
        return
    limit = int(os.environ.get("FSDP_WRAP_TEST_LIMIT", "0")) or (
        SLOW_TEST_LIMIT_S if request.node.get_closest_marker("slow") else TEST_LIMIT_S
    )
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    close_all_pools()


@pytest.fixture(scope="session")
def pool2() -> DistPool:
    return get_pool(2)


@pytest.fixture(scope="session")
def pool3() -> DistPool:
    return get_pool(3)


@pytest.fixture(scope="session")
def pool4() -> DistPool:
    return get_pool(4)
