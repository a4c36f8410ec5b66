"""Run torch's own FSDP1 test files on CPU, with torch's FSDP1 or with fsdp_wrap.

The test files are torch's (BSD licence, see README.rst); they are not kept
in this repository.  Put them in a folder and run, from the repository root::

    python -m tests.torch_suite.run --src /tmp/torch_fsdp_tests --impl fsdp_wrap
    python -m tests.torch_suite.run --src /tmp/torch_fsdp_tests --compare   # both, and the diff

Each file is copied to a work folder with two changes: ``import
tests.torch_suite.shim`` first (CPU ranks over gloo, fsdp_wrap installed when
``--impl fsdp_wrap``: see shim.py) and CUDA device literals replaced by CPU
(``torch.device("cuda")``, ``device="cuda"``, ``.cuda()``).  pytest runs the
copies; the outcome of every test is read from its JUnit XML report.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SUBSTITUTIONS = (
    (re.compile(r"""torch\.device\((["'])cuda\1\)"""), 'torch.device("cpu")'),
    (re.compile(r"""device=(["'])cuda\1"""), 'device="cpu"'),
    (re.compile(r"\.cuda\(\)"), ".cpu()"),
    (re.compile(r"""init_device_mesh\(\s*(["'])cuda\1"""), 'init_device_mesh("cpu"'),
    (re.compile(r"\.to\(self\.rank\)"), '.to("cpu")'),
    (re.compile(r"\.cuda\(self\.rank\)"), ".cpu()"),
)


def prepare(src: Path, dst: Path, names: list[str]) -> list[Path]:
    """Copies of the test files, shim first and CPU devices; returns their paths."""
    dst.mkdir(parents=True, exist_ok=True)
    out = []
    for name in names:
        text = (src / name).read_text()
        for pattern, repl in _SUBSTITUTIONS:
            text = pattern.sub(repl, text)
        (dst / name).write_text("import tests.torch_suite.shim  # noqa: F401\n" + text)
        out.append(dst / name)
    return out


def outcomes(xml_path: Path) -> dict[str, str]:
    """``file::Class::test`` -> passed / failed / error / skipped."""
    result: dict[str, str] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        cls = case.get("classname", "")
        module, _, klass = cls.rpartition(".")
        key = f"{module or cls}.py::{klass}::{case.get('name')}" if module else \
            f"{cls}::{case.get('name')}"
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                state = {"failure": "failed"}.get(child.tag, child.tag)
        result[key] = state
    return result


def run(src: Path, impl: str, names: list[str], keyword: str | None, work: Path,
        world: int, timeout: int, cpu_device_id: bool = False) -> dict[str, str]:
    files = prepare(src, work / impl, names)
    xml = work / f"{impl}.xml"
    env = dict(os.environ, TORCH_SUITE_IMPL=impl, TORCH_SUITE_WORLD=str(world),
               TORCH_SUITE_CPU_DEVICE_ID="1" if cpu_device_id else "0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--rootdir", str(work / impl), f"--junitxml={xml}", *map(str, files)]
    if keyword:
        cmd += ["-k", keyword]
    if xml.exists():
        xml.unlink()
    proc = subprocess.run(cmd, cwd=work / impl, env=env, timeout=timeout, check=False)
    if not xml.exists():  # pytest itself died (e.g. a rank's process aborted it)
        return {f"{' '.join(names)} (pytest exit {proc.returncode}, no report)": "error"}
    return outcomes(xml)


def summary(res: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for state in res.values():
        counts[state] = counts.get(state, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, required=True, help="folder holding torch's test files")
    ap.add_argument("--impl", choices=("torch", "fsdp_wrap"), default="fsdp_wrap")
    ap.add_argument("--compare", action="store_true",
                    help="run both and list the tests torch passes and fsdp_wrap does not")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--work", type=Path, default=Path("/tmp/torch_suite_work"))
    ap.add_argument("--world", type=int, default=2, help="ranks of FSDPTest (default: 2)")
    ap.add_argument("--timeout", type=int, default=7200, help="seconds per run (default: 7200)")
    ap.add_argument("--cpu-device-id", action="store_true",
                    help="torch's FSDP1 gets device_id=cpu where a test gives none, and "
                         "DTensorTestBase's nccl runs on gloo (see shim.py)")
    ap.add_argument("files", nargs="*", help="file names in --src (default: every test_*.py)")
    args = ap.parse_args(argv)
    names = args.files or sorted(p.name for p in args.src.glob("test_*.py"))
    impls = ("torch", "fsdp_wrap") if args.compare else (args.impl,)
    results = {i: run(args.src, i, names, args.keyword, args.work, args.world, args.timeout,
                      args.cpu_device_id)
               for i in impls}
    for impl, res in results.items():
        print(f"{impl}: {summary(res)}")
        for key, state in sorted(res.items()):
            if state in ("failed", "error"):
                print(f"  {state}: {key}")
    if args.compare:
        worse = sorted(k for k, s in results["torch"].items()
                       if s == "passed" and results["fsdp_wrap"].get(k) != "passed")
        print(f"torch passes, fsdp_wrap does not: {len(worse)}")
        for key in worse:
            print(f"  {key}: {results['fsdp_wrap'].get(key, 'missing')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
