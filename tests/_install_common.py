"""What the install tests share: a fresh interpreter per scenario (installing
changes process-wide module state)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests._proc import run_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python(code: str, env: dict[str, str] | None = None, timeout: int = 180,
            prelude: str = "") -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONWARNINGS="ignore")
    full_env.pop("FSDP_WRAP_INSTALL", None)
    full_env.update(env or {})
    source = textwrap.dedent(prelude) + textwrap.dedent(code)
    return run_bounded([sys.executable, "-c", source], cwd=ROOT, env=full_env,
                          timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout
