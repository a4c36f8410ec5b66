"""``python -m fsdp_wrap.demo`` is ``fsdp-wrap demo`` (see :mod:`fsdp_wrap.cli.demo`)."""

from fsdp_wrap.cli import demo_entry

if __name__ == "__main__":
    demo_entry()
