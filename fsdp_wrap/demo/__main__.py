"""``python -m fsdp_wrap.demo`` runs the demo (see :mod:`fsdp_wrap.demo`)."""

from fsdp_wrap.demo.launch import entry

if __name__ == "__main__":
    entry()
