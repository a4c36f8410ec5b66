"""``python -m fsdp_wrap`` runs the demo (see :mod:`fsdp_wrap.demo`)."""

import sys

from fsdp_wrap.demo import main

if __name__ == "__main__":
    sys.exit(main())
