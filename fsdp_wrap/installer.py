"""``fsdp_wrap.installer``: where :func:`fsdp_wrap.install` always was.

The install step now lives in :mod:`fsdp_wrap.frameworks` (one module per
framework, :mod:`fsdp_wrap.frameworks.installer` for ``install()`` itself);
this module keeps its public names importable from here, for the start-up
hook (``fsdp_wrap-install.pth`` imports ``fsdp_wrap.installer``) and for
code that imported them.
"""

from __future__ import annotations

from fsdp_wrap.frameworks.installer import (
    ENV_VAR,
    PTH_NAME,
    install,
    install_from_env,
    installed,
    logger,
    startup_hook_path,
    uninstall,
)

__all__ = ["ENV_VAR", "PTH_NAME", "install", "install_from_env", "installed", "logger",
           "startup_hook_path", "uninstall"]
