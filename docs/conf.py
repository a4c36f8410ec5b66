"""Sphinx configuration for fsdp_wrap's documentation site.

Build it from the repository root (the ``docs`` extra installs Sphinx and the
theme)::

    python -m pip install -e ".[docs]"
    python -m sphinx -W --keep-going -b html docs docs/_build/html

``-W`` turns every warning into an error, so a broken cross-reference, a
malformed page or a docstring that does not parse fails the build (``.ci/run``
and ``tox -e docs`` build it that way).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# autodoc imports the package: the checkout's copy, not an installed one.
sys.path.insert(0, ROOT)

import fsdp_wrap  # noqa: E402

project = "fsdp_wrap"
author = "the fsdp_wrap authors"
copyright = "the fsdp_wrap authors"
release = fsdp_wrap.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

# Pages are reStructuredText; build outputs never become pages.
source_suffix = {".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
root_doc = "index"

# Every reference must resolve: a reference to one of fsdp_wrap's own names
# that does not exist is an error.  torch's and Python's own names are linked
# nowhere (no network at build time, so no intersphinx) and are exempt.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|nn|dist|np|numpy|collections|typing|os|enum|contextlib|functools|json|pathlib)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Generator|Sequence|Mapping|Optional|Union)"),
    (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|object|type|None)"),
    (r"py:.*", r"(optional|callable|iterable)"),
    (r"py:class", r"(Tensor|Module|Parameter|Optimizer|ProcessGroup|DeviceMesh|PathLike)"),
]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_typehints_description_target = "documented"
autodoc_default_options: dict[str, object] = {}
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# ``::`` blocks are highlighted as Python where they parse as Python and left
# plain otherwise (shell commands, output), without a warning.
highlight_language = "default"



def _public_alias(app, env, node, contnode):  # type: ignore[no-untyped-def]
    """Resolve ``fsdp_wrap.a._b.Name`` to ``fsdp_wrap.a.Name`` where only that is documented.

    Type hints name a class by the module that defines it (``fsdp_wrap.planning._units``);
    the reference documents it where users import it from (``fsdp_wrap.planning``).
    """
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    parts = target.split(".")
    public = ".".join([p for p in parts[:-1] if not p.startswith("_")] + parts[-1:])
    if public == target or not public.startswith("fsdp_wrap."):
        return None
    return env.get_domain("py").resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], public, node, contnode
    )


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("missing-reference", _public_alias)


html_theme = "furo"
html_title = f"fsdp_wrap {release}"
html_static_path: list[str] = []
