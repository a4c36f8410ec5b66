"""Numbers the documentation quotes, checked against the code they come from.

Each entry: a page (or source file), a pattern that must match there at
least once, and the value every match must equal, computed from the
constant it quotes (not typed again).  A page reworded so that the pattern no
longer matches fails too: the entry is then updated with the new wording,
so a number cannot drift away from its source unseen.  Measured numbers
(benchmarks) are not here: they come from runs, not constants.
"""

from __future__ import annotations

import os
import re
from typing import Callable

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _codec_ratio() -> int:
    from fsdp_wrap.comm.quant.codec import QMAX

    return round(QMAX[8] / QMAX[4])  # int4's half step over int8's, at the same absmax


def _block() -> int:
    from fsdp_wrap.comm.quant.config import DEFAULT_BLOCK

    return DEFAULT_BLOCK


def _scale_overhead_pct() -> float:
    from fsdp_wrap.comm.quant.config import DEFAULT_BLOCK

    return round(100 * 4 / DEFAULT_BLOCK, 1)  # one float32 scale per block of 1-byte codes


def _bucket_mb() -> float:
    from fsdp_wrap.comm.bucket import DEFAULT_BUCKET_CAP_MB

    return DEFAULT_BUCKET_CAP_MB


def _batch_mb() -> float:
    from fsdp_wrap.comm.gather_batch import DEFAULT_ALL_GATHER_BATCH_MB

    return DEFAULT_ALL_GATHER_BATCH_MB


def _window_mib() -> int:
    from fsdp_wrap.checkpoint.full import DEFAULT_WINDOW_BYTES

    return DEFAULT_WINDOW_BYTES // 2**20


def _broadcast_kib() -> int:
    from fsdp_wrap.comm.collectives import GLOO_BROADCAST_MIN_BYTES

    return GLOO_BROADCAST_MIN_BYTES // 2**10


def _qmax(bits: int) -> Callable[[], int]:
    def f() -> int:
        from fsdp_wrap.comm.quant.codec import QMAX

        return QMAX[bits]
    return f


def _first_host() -> str:
    from fsdp_wrap.cli.testbed import network

    return f"{network.SUBNET}.({network._FIRST_HOST} + i)"


# (file, pattern with one group, the source's value, how to read the group)
QUOTES: list[tuple[str, str, Callable[[], object], Callable[[str], object]]] = [
    ("docs/options.rst", r"the error would be (\d+) times\s+int8's", _codec_ratio, int),
    ("docs/performance/fewer_bytes.rst", r"int4's error bound is (\d+) times int8's", _codec_ratio, int),
    ("fsdp_wrap/comm/quant/config.py", r"error would be (\d+)x int8's", _codec_ratio, int),
    ("docs/options.rst", r"\(default (\d+); blocks restart", _block, int),
    ("docs/options.rst", r"``absmax / (\d+)`` \(int8\)", _qmax(8), int),
    ("docs/options.rst", r"``absmax / (\d+)`` \(int4", _qmax(4), int),
    ("docs/options.rst", r"([\d.]+)% over int8 at \d+", _scale_overhead_pct, float),
    ("docs/options.rst", r"FSDP\(model, \.\.\., bucket_cap_mb=([\d.]+)\)\s+# the default",
     _bucket_mb, float),
    ("docs/options.rst", r"``all_gather_batch_mb`` \(fsdp_wrap only, default ([\d.]+) MiB\)",
     _batch_mb, float),
    ("docs/options.rst", r"all_gather_batch_mb=([\d.]+)\)\s+# the default", _batch_mb, float),
    ("docs/options.rst", r"for gathers under (\d+) KiB", _broadcast_kib, int),
    ("docs/checkpointing.rst", r"\((\d+) MiB by default\)", _window_mib, int),
    ("docs/nodes.rst", r"at address ``([\d.]+\(\d+ \+ i\))``", _first_host, str),
]


@pytest.mark.parametrize("where,pattern,source,read", QUOTES,
                         ids=[f"{q[0]}:{q[1][:30]}" for q in QUOTES])
def test_quoted_number_matches_its_source(where: str, pattern: str,
                                          source: Callable[[], object],
                                          read: Callable[[str], object]) -> None:
    with open(os.path.join(ROOT, where), encoding="utf-8") as f:
        text = f.read()
    found = [read(m.group(1)) for m in re.finditer(pattern, text)]
    assert found, f"{where} no longer says {pattern!r}: update the entry with the new wording"
    want = source()
    assert all(v == want for v in found), f"{where} quotes {found} where the source has {want}"
