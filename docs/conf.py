"""Sphinx configuration for the groupgrad docs (``nox -s docs``): strict and offline.

Every cross-reference must resolve (``nitpicky``; ``-W`` turns each miss into
an error), against the project's own pages or the Python and PyTorch
inventories written by ``inventories.py`` (no network at build time). Every
name of every public module's ``__all__`` must be documented (checked below).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import tomllib
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS))

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


def _public_modules() -> list[str]:
    """Every public module (no ``_`` in its name) of every package in the package list."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["groupgrad"]["packages"]
    modules = []
    for folder in folders:
        src = ROOT / folder / "src"
        init = min(src.glob("groupgrad/**/__init__.py"), key=lambda p: len(p.parts))
        top = ".".join(init.parent.relative_to(src).parts)
        package = importlib.import_module(top)
        modules.append(top)
        modules += [
            info.name
            for info in pkgutil.walk_packages(package.__path__, top + ".")
            if not any(part.startswith("_") for part in info.name.split("."))
        ]
    return modules


def _check_all_documented(app: Any, env: Any) -> None:
    """Warn (an error under -W) for every name of a public ``__all__`` without documentation."""
    from sphinx.util import logging

    logger = logging.getLogger("groupgrad.docs")
    documented = set(env.get_domain("py").objects)
    for module in _public_modules():
        for name in getattr(importlib.import_module(module), "__all__", ()):
            if f"{module}.{name}" not in documented:
                logger.warning(
                    f"{module}.{name} is in {module}.__all__ but documented nowhere; "
                    f"add it to the API page of {module} (docs/api/)"
                )


def setup(app: Any) -> None:
    app.connect("autodoc-skip-member", _skip_internal)
    app.connect("autodoc-process-docstring", _property_type_from_annotation, priority=600)
    app.connect("missing-reference", _respell, priority=400)
    app.connect("env-check-consistency", _check_all_documented)
