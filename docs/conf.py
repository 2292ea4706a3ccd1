"""Sphinx configuration for the groupgrad docs (``nox -s docs``): strict and offline.

Every cross-reference must resolve (``nitpicky``; ``-W`` turns each miss into
an error), against the project's own pages or the Python and PyTorch
inventories written by ``inventories.py`` (no network at build time). Every
name of every public module's ``__all__`` is documented: on its package's page
under ``api/``, or, until someone sorts it there, on the generated page
``api/generated/unsorted`` (``api_index.py``); a check below fails the build
for any name documented nowhere.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS))

from api_index import exported, public_modules, write_unsorted_page  # noqa: E402
from inventories import intersphinx_mapping as _write_inventories  # noqa: E402

project = "groupgrad"
author = "the groupgrad developers"
copyright = "2026, the groupgrad developers"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]

nitpicky = True
# Megatron-Core's classes (bases of the megatron_core integration's modules) have no
# inventory the offline build can use; they are not groupgrad's names.
# GroupgradMoELayer inherits MoELayer's __init__, whose annotations name Megatron's
# classes bare (and "optional", from its docstring's types).
nitpick_ignore_regex = [
    ("py:class", r"megatron\.core\..*"),
    ("py:class", r"TransformerConfig|MoESubmodules|ProcessGroupCollection|optional"),
]
# Bare `::` blocks are plain text; Python examples are `code-block:: python`, which
# tests/test_readme_blocks.py runs.
highlight_language = "none"

autosummary_generate = True
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Annotations as the signatures should read them: a public alias instead of its
# expansion; a private TypeVar (it only ties `out` to the return value of
# grouped_wgrad's overloads) as the type it stands for, spelled as its module does.
autodoc_type_aliases = {
    "WeightGroup": "groupgrad.protocol.WeightGroup",
    "OutList": "Sequence[Tensor]",
}

# The inventories are written locally (the build machine may have no network);
# the links point at docs.python.org and docs.pytorch.org.
intersphinx_mapping = _write_inventories(DOCS / "_build" / "inventories")

# Exported names that no page under api/ lists get a page of their own (api_index.py), and a
# warning (an error under -W): every name belongs on its package's page.
UNSORTED = write_unsorted_page(DOCS, ROOT)

html_theme = "furo"
html_title = "groupgrad"
templates_path = ["_templates"]
exclude_patterns = ["_build"]

# Instance attributes that autodoc cannot see (submodules set in __init__), shown on
# their class's page by _templates/autosummary/class.rst: (name, type, description).
autosummary_context = {
    "instance_attributes": {
        "groupgrad.modules.GroupedMLP": [
            (
                "fc1",
                "groupgrad.modules.GroupedLinear",
                "The first layer, ``H → 2F`` per expert (the gate in the first ``F`` "
                "output rows): ``fc1.weight0 …`` ``(2F, H)``, or packed ``fc1.weight`` "
                "``(E, 2F, H)``.",
            ),
            (
                "fc2",
                "groupgrad.modules.GroupedLinear",
                "The second layer, ``F → H`` per expert: ``fc2.weight0 …`` ``(H, F)``, or "
                "packed ``fc2.weight`` ``(E, H, F)``.",
            ),
        ]
    }
}

# Public members left out of the API pages, as (package, qualified name), each with the reason.
_INTERNAL_MEMBERS = {
    # How GroupedMLP reads its submodules' weight layout; returns a private type.
    ("groupgrad.modules", "GroupedLinear.group_spec"),
}

# How the sources spell some names (`from torch import Tensor`, `import torch.distributed
# as dist`), where autodoc renders an annotation it could not evaluate as written.
_SOURCE_SPELLINGS = {"Tensor": "torch.Tensor", "dist.": "torch.distributed.", "nn.": "torch.nn."}


def _skip_internal(app: Any, what: str, name: str, obj: Any, skip: bool, options: Any) -> Any:
    module = getattr(obj, "__module__", None) or ""
    qualname = getattr(obj, "__qualname__", None)
    for package, internal in _INTERNAL_MEMBERS:
        if qualname == internal and module.startswith(package + "."):
            return True
    return None  # autodoc decides


def _no_docstring_of_the_type(
    app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """A data object documents itself, not its type (a dict constant would show ``dict``'s help)."""
    if what in ("data", "attribute") and type(obj).__doc__ and not isinstance(obj, type):
        own = [line.strip() for line in lines if line.strip()]
        theirs = [line.strip() for line in type(obj).__doc__.splitlines() if line.strip()]
        if own and own == theirs[: len(own)]:
            lines.clear()


def _respell(app: Any, env: Any, node: Any, contnode: Any) -> None:
    """Point an annotation spelled as in the sources at its full name; intersphinx resolves it."""
    target = node.get("reftarget", "")
    for short, full in _SOURCE_SPELLINGS.items():
        if target == short or (short.endswith(".") and target.startswith(short)):
            node["reftarget"] = full + target[len(short) :]
            return


def _property_type_from_annotation(
    app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """A property's type comes from its return annotation, not from its docstring's first line.

    Napoleon reads a first line "X: Y" of an attribute's docstring as type X;
    for a property whose summary merely contains a colon ("One member's shard:
    ...") that would make "One member's shard" a type. Undo that split.
    """
    if what != "property" or ":type:" not in "\n".join(lines):
        return
    annotations = getattr(getattr(obj, "fget", None), "__annotations__", {})
    if "return" not in annotations:
        return
    for i, line in enumerate(lines):
        if line.startswith(":type: "):
            written = line[len(":type: ") :]
            first = next(j for j, text in enumerate(lines) if text.strip())
            lines[first] = f"{written}: {lines[first]}"
            del lines[i]
            while lines and not lines[-1].strip():
                lines.pop()
            return


def _check_all_documented(app: Any, env: Any) -> None:
    """Warn (an error under -W) for every name of a public ``__all__`` without documentation."""
    from sphinx.util import logging

    logger = logging.getLogger("groupgrad.docs")
    for name in UNSORTED:
        logger.warning(
            f"{name} is exported but no page under docs/api/ lists it (it landed on the "
            "'not yet sorted' page); add it to its package's page"
        )
    documented = set(env.get_domain("py").objects)
    for name in exported(public_modules(ROOT)):
        if name not in documented:
            module = name.rsplit(".", 1)[0]
            logger.warning(
                f"{name} is in {module}.__all__ but documented nowhere; "
                f"add it to the API page of {module} (docs/api/)"
            )


def _public_bases(app: Any, name: str, obj: Any, options: Any, bases: list[Any]) -> None:
    """Show a private base class (e.g. ``_base.GroupedModule``) as its first public ancestor."""
    for index, base in enumerate(bases):
        if any(part.startswith("_") for part in base.__module__.split(".")[1:]):
            public = next(
                b
                for b in base.__mro__[1:]
                if not any(part.startswith("_") for part in b.__module__.split(".")[1:])
            )
            bases[index] = public


def setup(app: Any) -> None:
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("autodoc-skip-member", _skip_internal)
    app.connect("autodoc-process-docstring", _no_docstring_of_the_type, priority=400)
    app.connect("autodoc-process-docstring", _property_type_from_annotation, priority=600)
    app.connect("missing-reference", _respell, priority=400)
    app.connect("env-check-consistency", _check_all_documented)
