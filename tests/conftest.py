"""Shared fixtures for the fsdp_wrap test-suite.

Distributed tests run on real gloo process groups (CPU) through the worker
pools of :mod:`tests._dist`; each world size is started once per session::

    def _check(x):                 # module level, runs on every rank
        ...

    def test_something(pool2):
        assert pool2.run(_check, 3) == [..., ...]

GPU-only tests: ``@requires_cuda`` (``from tests.conftest import requires_cuda``)
or ``@pytest.mark.gpu``; both skip when CUDA is unavailable.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import TORCH_NOISE_MODULE, DistPool, close_all_pools, get_pool

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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
