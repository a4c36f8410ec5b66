"""CI proves what it claims: a test skipped for a capability CI has fails the run.

``$FSDP_WRAP_REQUIRE`` (tests/_require.py; ``.ci/run`` sets
``testbed,imports,installed``) turns a skip whose reason says that capability
is missing (no test-bed cluster, an extra that does not import, fsdp_wrap not
pip-installed) into a failed run naming the test.  Checked here on a
throw-away test file run by a pytest of its own, with the plugin, with and
without the variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = '''
import pytest

def test_needs_the_testbed():
    pytest.skip("no test-bed cluster: not root")

@pytest.mark.skipif(True, reason="needs CUDA")
def test_needs_a_gpu():
    pass

def test_runs():
    pass
'''


def _pytest(tmp_path: Any, require: str | None) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "test_skips.py"
    path.write_text(CASES)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FSDP_WRAP_REQUIRE", None)
    if require is not None:
        env["FSDP_WRAP_REQUIRE"] = require
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests._require",
         "--rootdir", str(tmp_path), "--confcutdir", str(tmp_path), str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_required_capability_skipped_fails_the_run(tmp_path: Any) -> None:
    free = _pytest(tmp_path, None)
    assert free.returncode == 0, free.stdout + free.stderr
    required = _pytest(tmp_path, "testbed")
    assert required.returncode == 1, required.stdout + required.stderr
    assert "1 test(s) skipped for a capability $FSDP_WRAP_REQUIRE requires" in required.stderr
    assert "test_skips.py::test_needs_the_testbed: Skipped: no test-bed cluster: not root" \
        in required.stderr, required.stderr
    assert "test_needs_a_gpu" not in required.stderr  # (a GPU is not required)
    other = _pytest(tmp_path, "imports")  # required, but not what skipped
    assert other.returncode == 0, other.stdout + other.stderr
    unknown = _pytest(tmp_path, "testbed,gpus")
    assert unknown.returncode != 0 and "unknown capability ['gpus']" in unknown.stderr
