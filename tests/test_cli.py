"""The ``fsdp-wrap`` program: one command line, its help, exit codes, errors and pictures.

Usage errors exit 2 and failures 1, each as one line on stderr (no traceback
unless ``--debug``); every option has help text and says its default one way;
help is plain text; ``python -m fsdp_wrap`` is the same program; ``--plot``
pictures exist and show the plan's own peak.  The subcommands' behaviour is
tested with them (``test_plan.py``, ``test_ckpt_tool.py``, ``test_demo.py``,
``test_install.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import fsdp_wrap as fw
from fsdp_wrap.cli import build_parser, main
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests._plan_common import make_stack
from tests._proc import run_bounded
from tests.models import Block

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parsers(parser: argparse.ArgumentParser, path: str = "fsdp-wrap"
             ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_option_has_help_and_says_its_default_one_way() -> None:
    found = list(_parsers(build_parser()))
    assert {p for p, _ in found} >= {"fsdp-wrap demo", "fsdp-wrap plan", "fsdp-wrap run",
                                     "fsdp-wrap ckpt inspect", "fsdp-wrap ckpt convert",
                                     "fsdp-wrap ckpt consolidate"}
    for path, parser in found:
        text = parser.format_help()
        # plain text: no reStructuredText roles, literals or literal-block markers
        assert not re.search(r"``|:mod:|:func:|::\n", text), (path, text)
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help", "version"):
                continue
            where = f"{path} {'/'.join(action.option_strings)}"
            assert action.help, f"{where} has no help"
            assert not re.search(r"\[[^\]]*\]\s*$", action.help), f"{where}: old '[x]' default"
            shown = parser._get_formatter()._get_help_string(action)  # type: ignore[attr-defined]
            has_default = action.default not in (None, False, argparse.SUPPRESS)
            if has_default:
                assert shown.count("(default:") == 1, f"{where}: {shown!r}"
            else:
                assert "[default" not in shown and "(default " not in shown, where


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own usage errors and --help
        code = int(e.code or 0)
    got = capsys.readouterr()
    return code, got.out, got.err


def test_usage_errors_exit_2_and_failures_exit_1_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    usage = [
        ((), "choose a command"),
        (("ckpt",), "choose what to do: inspect, consolidate, convert"),
        (("run",), "give the command to run"),
        (("plan", "--world-size", "two"), "invalid int value"),
        (("demo", "--steps", "1"), "--steps must be at least 2"),
        (("plan", "--world-size", "2", "--compare", "--plot", "x.png", "tests._plan_common:make_stack"),
         "--plot draws one configuration"),
        (("nope",), "invalid choice"),
    ]
    for argv, text in usage:
        code, _, err = _run(capsys, *argv)
        assert code == 2 and text in err and "Traceback" not in err, (argv, err)
    from fsdp_wrap.frameworks import installer

    missing = str(tmp_path / "missing")
    failures = [
        (("ckpt", "inspect", missing), "missing"),
        (("plan", "--world-size", "2", "tests._plan_common:no_such_factory"), "has no function"),
        # (not exec'd: no such command; without the start-up hook, that is the failure)
        (("run", "--", "no-such-command-anywhere-xyz"),
         "command not found" if installer.startup_hook_path() else "start-up hook"),
    ]
    for argv, text in failures:
        code, _, err = _run(capsys, *argv)
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and text in lines[0], (argv, err)
        assert lines[0].startswith(f"fsdp-wrap {argv[0]}: error: "), lines
    # --debug: the traceback instead of the line (for a bug report)
    with pytest.raises(Exception, match="missing"):
        main(["ckpt", "inspect", "--debug", missing])


def test_python_m_fsdp_wrap_is_the_program_with_its_version() -> None:
    proc = run_bounded([sys.executable, "-m", "fsdp_wrap", "--version"], cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"fsdp-wrap {fw.__version__} (torch {torch.__version__}")
    alias = run_bounded([sys.executable, "-m", "fsdp_wrap.demo", "--help"], cwd=REPO, timeout=120)
    assert alias.returncode == 0 and alias.stdout.startswith("usage: fsdp-wrap demo"), alias


def test_plan_plot_shows_the_plans_peak(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    from fsdp_wrap.planning.plot import plot_plan

    path = str(tmp_path / "plan.png")
    code, out, _ = _run(capsys, "plan", "tests._plan_common:make_stack", "--world-size", "4",
                        "--policy", "transformer:Block", "--plot", path, "--gpu-memory", "0.01")
    assert code == 0 and f"wrote {path}" in out
    assert os.path.getsize(path) > 10_000  # a real PNG, not an empty file
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    for kw in ({}, {"bucket_cap_mb": 0}, {"sharding_strategy": fw.ShardingStrategy.NO_SHARD},
               {"mixed_precision": fw.MixedPrecision(param_dtype=torch.bfloat16)}):
        p = fw.plan(make_stack(), 4, auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)
        m = p.memory
        # the timeline is what the step peak is the largest of, moment by moment
        assert max(b for _, b in m.timeline) == m.step_device, kw
        labels = [label for label, _ in m.timeline]
        assert labels[0] == "forward (root)" and labels[-1] == "optimizer step"
        assert any(label.startswith("backward blocks.") for label in labels)
        assert plot_plan(p, str(tmp_path / "p.svg")) == m.peak_device, kw


def test_without_matplotlib_the_error_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, _, err = _run(capsys, "plan", "tests._plan_common:make_stack", "--world-size", "2",
                        "--plot", str(tmp_path / "x.png"))
    assert code == 1 and "needs matplotlib" in err and "pip install" in err, err
