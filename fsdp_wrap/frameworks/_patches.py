"""The pieces every framework module's patches are made of.

* :class:`Patch`: one attribute set (or one ``sys.modules`` entry made), which
  knows how to undo itself;
* :class:`MetaPathEntry`: a finder put first on ``sys.meta_path``, undone by
  taking it off;
* :class:`AfterImport`: a finder that runs a callback right after a given
  module has executed (so a framework imported after ``install()`` is patched
  before anything binds its names);
* :class:`FunctionWraps`: wrap functions of one framework module, at once if
  it is imported, else by an :class:`AfterImport` finder; every wrapper
  carries its original (:data:`MARK`) so :func:`unwrap_everywhere` finds each
  module that bound it;
* :func:`importers`: the already-imported module attributes bound to objects
  being replaced.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["MARK", "AfterImport", "FunctionWraps", "MetaPathEntry", "Patch", "importers",
           "original_in", "unwrap_everywhere"]

#: The attribute of a wrapper holding the framework's own function.
MARK = "__fsdp_wrap_original__"


class Patch:
    """One attribute set (or one module created); knows how to undo itself."""

    _MISSING = object()

    def __init__(self, owner: Any, name: str, new: Any) -> None:
        self.owner, self.name, self.new = owner, name, new
        self.old = getattr(owner, name, self._MISSING) if not isinstance(owner, dict) \
            else owner.get(name, self._MISSING)

    def apply(self) -> None:
        if isinstance(self.owner, dict):
            self.owner[self.name] = self.new
        else:
            setattr(self.owner, self.name, self.new)

    def undo(self) -> None:
        missing = self.old is self._MISSING
        if isinstance(self.owner, dict):
            if missing:
                self.owner.pop(self.name, None)
            else:
                self.owner[self.name] = self.old
        elif missing:
            if hasattr(self.owner, self.name):
                delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.old)


class MetaPathEntry:
    """A finder put first on ``sys.meta_path``; undone by taking it off."""

    def __init__(self, finder: Any) -> None:
        self.finder = finder

    def apply(self) -> None:
        sys.meta_path.insert(0, self.finder)

    def undo(self) -> None:
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)


class AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``then(module)`` right after the module ``name`` has been executed."""

    def __init__(self, name: str, then: Callable[[types.ModuleType], None]) -> None:
        self.name, self.then = name, then
        self._inner: importlib.abc.Loader | None = None

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or self._inner is not None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                self._inner = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if self._inner is None:  # (find_spec set it; a spec made elsewhere gets the default)
            return None
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        inner, self._inner = self._inner, None
        if inner is None:
            raise ImportError(f"fsdp_wrap's import hook for {self.name} lost the real loader")
        module.__loader__ = inner  # (source lookups go to the real loader)
        if module.__spec__ is not None:
            module.__spec__.loader = inner
        inner.exec_module(module)
        self.then(module)


def original_in(module: types.ModuleType, name: str) -> Callable[..., Any] | None:
    """``module.name`` if it is a callable not yet wrapped by fsdp_wrap, else ``None``."""
    original = getattr(module, name, None)
    return original if callable(original) and not hasattr(original, MARK) else None


def marked(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper`` with ``original``'s name and docstring, carrying it under :data:`MARK`."""
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, MARK, original)
    return wrapper


class FunctionWraps:
    """Wrap functions of one framework module (``module_name``).

    ``wraps`` maps each function's name to a factory taking the framework's
    function and returning the wrapper (which :func:`marked` marks).  The
    framework's other modules bind these functions by name when they are
    imported; wrapping in the defining module before they run reaches them
    all, and :func:`importers` rebinds those imported earlier.
    """

    def __init__(self, module_name: str,
                 wraps: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]) -> None:
        self.module_name, self.wraps = module_name, wraps

    def _planned(self, module: types.ModuleType, originals: dict[int, Any]) -> list[Patch]:
        out = []
        for name, make in self.wraps.items():
            original = original_in(module, name)
            if original is not None:
                wrapper = make(original)
                originals[id(original)] = wrapper
                out.append(Patch(module, name, wrapper))
        return out

    def plan(self, patches: list[Any], originals: dict[int, Any],
             applied_later: Callable[[Patch], None]) -> None:
        """Append the patches to ``patches`` (and what they replace to
        ``originals``); if the module is not imported yet, append a finder
        whose patches are applied at its import and handed to ``applied_later``."""
        module = sys.modules.get(self.module_name)
        if module is not None:
            patches.extend(self._planned(module, originals))
            return

        def when_imported(mod: types.ModuleType) -> None:
            for p in self._planned(mod, {}):
                p.apply()
                applied_later(p)

        patches.append(MetaPathEntry(AfterImport(self.module_name, when_imported)))


def importers(originals: dict[int, Any], skip: set[str],
              skip_prefixes: tuple[str, ...]) -> Iterator[Patch]:
    """Attributes of already-imported modules bound to an object of ``originals``."""
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name in skip or mod_name.startswith(skip_prefixes):
            continue
        try:
            namespace = vars(mod)
        except TypeError:
            continue
        for attr, value in list(namespace.items()):
            new = originals.get(id(value))
            if new is not None:
                yield Patch(mod, attr, new)


def unwrap_everywhere() -> None:
    """Give every module that binds a wrapper the framework's function back.

    A module that imported the name after the wrapper was set (by a finder)
    holds the wrapper too; :func:`fsdp_wrap.uninstall` leaves none behind.
    """
    for mod in list(sys.modules.values()):
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            original = getattr(value, MARK, None) if callable(value) else None
            if original is not None:
                namespace[attr] = original
