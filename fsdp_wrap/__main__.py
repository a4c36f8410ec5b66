"""``python -m fsdp_wrap`` runs the demo (see :mod:`fsdp_wrap.demo`)."""


from fsdp_wrap.demo import entry

if __name__ == "__main__":
    entry()
