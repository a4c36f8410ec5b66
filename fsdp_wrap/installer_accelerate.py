"""``fsdp_wrap.installer_accelerate``: where the Accelerate glue always was.

It lives in :mod:`fsdp_wrap.frameworks.accelerate` now; this module keeps its
public names importable from here.
"""

from __future__ import annotations

from fsdp_wrap.frameworks._patches import unwrap_everywhere
from fsdp_wrap.frameworks.accelerate import FUNCTION, MODULE, original_in, wrap

__all__ = ["FUNCTION", "MODULE", "original_in", "unwrap_everywhere", "wrap"]
