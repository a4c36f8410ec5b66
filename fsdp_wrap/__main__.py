"""``python -m fsdp_wrap`` is the ``fsdp-wrap`` program (see :mod:`fsdp_wrap.cli`)."""

from fsdp_wrap.cli import entry

if __name__ == "__main__":
    entry()
