"""Framework glue: what :func:`fsdp_wrap.install` changes, one module per framework.

* :mod:`fsdp_wrap.frameworks.installer`: ``install()`` / ``uninstall()`` /
  ``installed()`` and the start-up hook (``FSDP_WRAP_INSTALL=1``); applies
  every module's patches in one step that completes or leaves nothing changed.
* :mod:`fsdp_wrap.frameworks.torch_fsdp`: torch's FSDP1 names pointed at
  fsdp_wrap's, and DCP's ``state_dict`` helpers taught to see fsdp_wrap's units.
* :mod:`fsdp_wrap.frameworks.accelerate`: Accelerate's sharded optimizer load.
* :mod:`fsdp_wrap.frameworks._patches`: the undoable patch, the import hook
  and the function wrapper the framework modules share.

Nothing in the library imports this package; ``fsdp_wrap.install`` is
re-exported by ``fsdp_wrap/__init__``, and the start-up hook imports
:mod:`fsdp_wrap.frameworks.installer`.
"""
