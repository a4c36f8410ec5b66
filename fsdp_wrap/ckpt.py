"""``python -m fsdp_wrap.ckpt inspect|consolidate|convert ...``: see :mod:`fsdp_wrap.checkpoint.cli`."""

import sys

from fsdp_wrap.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
