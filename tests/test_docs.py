"""The code the README and the documentation site say runs, runs.

The convention, for ``README.rst`` and every page under ``docs/``: a Python
block written as ``.. code-block:: python`` (or ``py``, ``python3``,
``pycon``) says with its ``:class:`` option what it claims::

    .. code-block:: python
       :class: runs

       import fsdp_wrap
       ...

``runs``
    A complete program.  The test writes it to a file and runs it in a fresh
    Python process (working directory a new temporary directory, the checkout
    first on ``PYTHONPATH``, no ``torchrun`` variables); it must exit with
    status 0.  A block whose first line starts with ``>>>`` is a doctest
    session instead (``python -m doctest``): its printed output must match.
``runs-2-ranks``
    A complete program meant for ``torchrun --nproc-per-node 2``.  It runs on
    the two gloo ranks of the suite's pool (``tests/_dist.py``, no new
    processes), in one shared temporary directory, with
    ``dist.init_process_group`` and ``dist.destroy_process_group`` made no-ops
    for the run because the pool already holds the process group; no rank may
    raise.
``not-run``
    Shown, never run: a fragment, a placeholder such as ``MyModel``, or code
    that needs a GPU or a launcher.  Say so in the surrounding text.

Every such Python block carries exactly one of these classes (the first test
checks it), so that each new block is a decision and none is left unchecked
by accident.  ``::`` literal blocks (shell commands, output, fragments inside
prose) make no claim and are not run.  The class is invisible on the rendered
page and on GitHub.

The README is not part of the Sphinx build (``.ci/run`` builds the site with
warnings as errors); :func:`test_readme_is_valid_restructuredtext` checks it
with docutils where docutils is installed (the ``docs`` extra brings it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import io
import os
import re
import sys
from typing import Any

import pytest
import torch.distributed as dist

from tests._proc import run_bounded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(REPO, "README.rst")] + sorted(
    glob.glob(os.path.join(REPO, "docs", "**", "*.rst"), recursive=True)
)
MARKERS = ("runs", "runs-2-ranks", "not-run")
PYTHON = ("python", "py", "python3", "pycon")

_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. code-block::[ \t]*(?P<lang>\S*)[ \t]*$")
_OPTION = re.compile(r"^[ \t]+:(?P<name>[\w-]+):[ \t]*(?P<value>.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the directive
    language: str
    classes: tuple[str, ...]
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def extract(path: str) -> list[Block]:
    """Every ``.. code-block::`` of one page: its language, classes and code, dedented."""
    lines = open(path, encoding="utf-8").read().splitlines()
    page = os.path.relpath(path, REPO)
    blocks = []
    i = 0
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, base = i, len(m.group("indent"))
        classes: list[str] = []
        i += 1
        while i < len(lines) and _OPTION.match(lines[i]) and _indent(lines[i]) > base:
            opt = _OPTION.match(lines[i])
            assert opt is not None
            if opt.group("name") == "class":
                classes += opt.group("value").split()
            i += 1
        body: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        content = [ln for ln in body if ln.strip()]
        cut = min((_indent(ln) for ln in content), default=0)
        code = "\n".join(ln[cut:] for ln in body).strip("\n") + "\n"
        blocks.append(Block(page, start + 1, m.group("lang"), tuple(classes), code))
    return blocks


BLOCKS = [b for p in PAGES for b in extract(p) if b.language in PYTHON]


def _marked(marker: str) -> list[Any]:
    return [pytest.param(b, id=b.name) for b in BLOCKS if marker in b.classes]


# ------------------------------------------------------------ the convention


def test_the_extraction_finds_the_readme_example() -> None:
    """A guard: if the parser stopped finding blocks, every test below would pass empty."""
    readme = [b for b in BLOCKS if b.page == "README.rst"]
    assert any("runs-2-ranks" in b.classes and "FullyShardedDataParallel(" in b.code
               for b in readme), readme
    assert len(_marked("runs")) >= 2 and len(_marked("runs-2-ranks")) >= 2


def test_extract_reads_options_indentation_and_nesting(tmp_path: Any) -> None:
    page = tmp_path / "page.rst"
    page.write_text(
        "Intro::\n\n    not a code-block\n\n"
        "* item\n\n  .. code-block:: python\n     :class: runs\n     :caption: x\n\n"
        "     a = 1\n\n     if a:\n         b = 2\n\n  after the block\n\n"
        ".. code-block:: console\n\n   $ ls\n"
    )
    blocks = extract(str(page))
    assert [(b.language, b.classes) for b in blocks] == [("python", ("runs",)), ("console", ())]
    assert blocks[0].code == "a = 1\n\nif a:\n    b = 2\n"
    assert blocks[0].line == 7


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in BLOCKS])
def test_every_python_block_says_whether_it_runs(block: Block) -> None:
    said = [c for c in block.classes if c in MARKERS]
    assert len(said) == 1, (
        f"{block.name}: a Python code-block needs exactly one of :class: {' / '.join(MARKERS)} "
        f"(see tests/test_docs.py), has {list(block.classes)}"
    )


# ------------------------------------------------------------------ running


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "FSDP_WRAP_INSTALL"):
        env.pop(var, None)
    return env


@pytest.mark.parametrize("block", _marked("runs"))
def test_block_runs(block: Block, tmp_path: Any) -> None:
    if block.code.lstrip().startswith(">>>"):
        path = tmp_path / "block.txt"
        cmd = [sys.executable, "-m", "doctest", str(path)]
    else:
        path = tmp_path / "block.py"
        cmd = [sys.executable, str(path)]
    path.write_text(block.code, encoding="utf-8")
    proc = run_bounded(cmd, cwd=str(tmp_path), env=_env(), timeout=180)
    assert proc.returncode == 0, (
        f"{block.name} exited with {proc.returncode}:\n{block.code}\n--- stdout ---\n"
        f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _exec_on_rank(code: str, name: str, workdir: str) -> str:
    """Run a ``runs-2-ranks`` block on this pool rank; return what it printed."""
    saved = (dist.init_process_group, dist.destroy_process_group)
    dist.init_process_group, dist.destroy_process_group = _noop, _noop  # type: ignore[assignment]
    here = os.getcwd()
    out = io.StringIO()
    try:
        os.chdir(workdir)
        with contextlib.redirect_stdout(out):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
    finally:
        dist.init_process_group, dist.destroy_process_group = saved
        os.chdir(here)
    return out.getvalue()


@pytest.mark.parametrize("block", _marked("runs-2-ranks"))
def test_block_runs_on_2_ranks(block: Block, pool2: Any, tmp_path: Any) -> None:
    outputs = pool2.run(_exec_on_rank, block.code, block.name, str(tmp_path))
    assert len(outputs) == 2


# ------------------------------------------------------------------- README


def test_readme_is_valid_restructuredtext() -> None:
    """No docutils warning in the README (GitHub and the package index render it)."""
    core = pytest.importorskip("docutils.core")
    stream = io.StringIO()
    with open(os.path.join(REPO, "README.rst"), encoding="utf-8") as f:
        core.publish_doctree(
            f.read(), source_path="README.rst",
            settings_overrides={"warning_stream": stream, "report_level": 2, "halt_level": 5},
        )
    assert stream.getvalue() == ""


def test_readme_quickstart_is_the_two_commands() -> None:
    """The first command installs and runs the demo, the second is the test command."""
    text = open(os.path.join(REPO, "README.rst"), encoding="utf-8").read()
    quick = text[text.index("Quickstart\n==========") :]
    literal = quick.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    commands = [ln.strip() for ln in literal.splitlines()]
    assert commands == [
        'python -m pip install torch==2.13.0 -e ".[test,frameworks]" && python -m fsdp_wrap.demo',
        "python -m pytest",
    ]


# ------------------------------------------------------------ API reference


_AUTO = re.compile(r"^\.\. (?:auto(?:class|function|method|property|data)|(?:current)?module)::\s+(\S+)")


def _documented() -> set[str]:
    """Full names of what ``docs/api/*.rst`` documents with autodoc directives."""
    names: set[str] = set()
    for path in sorted(glob.glob(os.path.join(REPO, "docs", "api", "*.rst"))):
        module = ""
        for line in open(path, encoding="utf-8"):
            m = _AUTO.match(line)
            if m is None:
                continue
            if "module::" in line:
                module = m.group(1)
            else:
                names.add(f"{module}.{m.group(1)}" if module else m.group(1))
    return names


def _fsdp_public_attrs() -> dict[str, object]:
    """The public attributes FullyShardedDataParallel defines: its own and its
    parts' (the classes of ``fsdp_wrap/fully_sharded_data_parallel/`` it
    inherits), not nn.Module's."""
    import fsdp_wrap

    FSDP = fsdp_wrap.FullyShardedDataParallel
    parts = [c for c in reversed(FSDP.__mro__)
             if c.__module__.startswith("fsdp_wrap.fully_sharded_data_parallel")]
    assert len(parts) >= 4, parts  # the class, torch's attributes, optimizer state, accumulation
    own: dict[str, object] = {}
    for cls in parts:
        own.update(vars(cls))
    return {n: v for n, v in own.items() if not n.startswith("_")}


def test_api_reference_documents_every_public_name() -> None:
    import fsdp_wrap
    import fsdp_wrap.checkpoint
    import fsdp_wrap.wrap

    methods = [n for n, v in _fsdp_public_attrs().items()
               if callable(v) or isinstance(v, (staticmethod, property))]
    wanted = (
        [f"fsdp_wrap.{n}" for n in fsdp_wrap.__all__]
        + [f"fsdp_wrap.wrap.{n}" for n in fsdp_wrap.wrap.__all__]
        + [f"fsdp_wrap.checkpoint.{n}" for n in fsdp_wrap.checkpoint.__all__]
        + ["fsdp_wrap.sharded_grad_scaler.ShardedGradScaler"]
        + [f"fsdp_wrap.FullyShardedDataParallel.{n}" for n in methods]
    )
    missing = sorted(set(wanted) - _documented())
    assert not missing, f"not in the API reference (docs/api/): {missing}"
    assert len(methods) >= 23, methods


def test_every_public_fsdp_method_has_a_docstring() -> None:
    bare = [n for n, v in _fsdp_public_attrs().items()
            if not (getattr(v, "__func__", v).__doc__ or "").strip()]
    assert not bare, f"public FullyShardedDataParallel methods without a docstring: {bare}"
