"""``$FSDP_WRAP_REQUIRE``: a test skipped for a capability that must be there fails the run.

CI, which runs as root with every extra installed, sets
``FSDP_WRAP_REQUIRE=testbed,imports,installed`` (``.ci/run``): a test skipped
for a capability listed there (its skip reason says so, :data:`CAPABILITY_SKIPS`)
makes the run fail (pytest's exit status 1, one line per test on stderr), so a
multi-node test that silently stopped running shows instead of leaving CI
green.  A pytest plugin (tests/conftest.py loads it) that imports no torch, so
tests/test_ci_requirements.py can run it in a pytest of its own, quickly.
"""

from __future__ import annotations

import os
import sys

import pytest

#: What each capability's skip says (its reason contains this).
CAPABILITY_SKIPS = {
    "testbed": "no test-bed cluster",  # root, iproute2, network namespaces
    "imports": "could not import",  # pytest.importorskip: an extra not installed
    "installed": "not pip-installed here",  # the start-up hook of `pip install`
}
REQUIRE_ENV = "FSDP_WRAP_REQUIRE"

_SKIPPED_REQUIRED: list[str] = []


def required_capabilities() -> dict[str, str]:
    names = [n.strip() for n in os.environ.get(REQUIRE_ENV, "").split(",") if n.strip()]
    unknown = [n for n in names if n not in CAPABILITY_SKIPS]
    if unknown:
        raise pytest.UsageError(f"${REQUIRE_ENV}: unknown capability {unknown}; known: "
                                f"{sorted(CAPABILITY_SKIPS)}")
    return {n: CAPABILITY_SKIPS[n] for n in names}


def pytest_configure(config: pytest.Config) -> None:
    required_capabilities()  # (a typo in the variable: a usage error before anything runs)


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _note_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped:
        return
    reason = _skip_reason(report)
    for name, says in required_capabilities().items():
        if says in reason:
            _SKIPPED_REQUIRED.append(f"{report.nodeid}: {reason} (${REQUIRE_ENV} has {name!r})")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_skip(report)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _SKIPPED_REQUIRED:
        print(f"\nerror: {len(_SKIPPED_REQUIRED)} test(s) skipped for a capability "
              f"${REQUIRE_ENV} requires:", file=sys.stderr)
        for line in _SKIPPED_REQUIRED:
            print(f"  {line}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
