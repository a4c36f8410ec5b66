"""``fsdp_wrap.install()`` and Accelerate (``fsdp_wrap/frameworks/accelerate.py``):
``load_fsdp_optimizer`` wrapped in every module that binds it, and back.

What the wrapper does in a real run: ``tests/test_frameworks.py`` (Accelerate
and the Trainer resuming SHARDED checkpoints) and ``tests/test_optim_template.py``.
"""

from __future__ import annotations

import pytest

from tests._install_common import ok as _ok
from tests._install_common import python as _python

ACCELERATE_CHECK = """
import inspect, sys
import fsdp_wrap
from fsdp_wrap.frameworks import _patches
def wrapped(f):
    return hasattr(f, _patches.MARK)
def holders():
    import accelerate.accelerator, accelerate.utils, accelerate.utils.fsdp_utils, transformers.trainer
    return [accelerate.utils.fsdp_utils, accelerate.utils, accelerate.accelerator, transformers.trainer]
"""


def test_install_wraps_accelerates_sharded_optimizer_load() -> None:
    """Accelerate's ``load_fsdp_optimizer`` is wrapped in every module that
    binds it, whether Accelerate was imported after install() (then by the
    import finder, the moment its module has run) or before; uninstall() undoes
    both.  One fresh interpreter (each costs seconds of imports): first
    install() with Accelerate not yet imported, uninstall(), then install()
    again with it imported, uninstall().  (What the wrapper does:
    test_frameworks.py, test_optim_template.py.)"""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    out = _ok(_python(prelude=ACCELERATE_CHECK, code="""
    for when in ("after", "before"):
        if when == "before":
            mods = holders()
            # (in a list: install() rebinds every module-level name bound to the
            # function, this script's own globals included, as for torch's names)
            box = [mods[0].load_fsdp_optimizer]
            assert not wrapped(box[0]), box
            fsdp_wrap.install(verbose=False)
            original = box[0]
            finders = [f for f in sys.meta_path if isinstance(f, _patches.AfterImport)]
            assert not finders, finders
        else:
            fsdp_wrap.install(verbose=False)
            assert "accelerate" not in sys.modules
            assert any(isinstance(f, _patches.AfterImport) for f in sys.meta_path)
            mods = holders()
            original = getattr(mods[0].load_fsdp_optimizer, _patches.MARK)
        fns = [m.load_fsdp_optimizer for m in mods]
        assert all(wrapped(f) and f is fns[0] for f in fns), (when, fns)
        assert getattr(fns[0], _patches.MARK) is original, when
        assert "def load_fsdp_optimizer" in inspect.getsource(mods[0])  # (the real loader answers)
        fsdp_wrap.uninstall()
        assert all(m.load_fsdp_optimizer is original for m in mods), (when, [m.__name__ for m in mods])
        assert not any(isinstance(f, _patches.AfterImport) for f in sys.meta_path), when
        print("OK", when)
    """))
    assert [ln for ln in out.splitlines() if ln.startswith("OK")] == ["OK after", "OK before"], out
