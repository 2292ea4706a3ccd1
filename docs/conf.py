"""Sphinx configuration for the groupgrad API docs (``nox -s docs``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from torch_inventory import write_torch_inventory

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

autosummary_generate = True
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# PyTorch's inventory is written locally from a curated list of names (the build
# machine may have no network); the links point at PyTorch's online docs.
_torch_inv = write_torch_inventory(Path(__file__).parent / "_build" / "torch-objects.inv")
intersphinx_mapping = {"torch": ("https://docs.pytorch.org/docs/stable/", str(_torch_inv))}

html_theme = "furo"
html_title = "groupgrad"
templates_path = ["_templates"]
exclude_patterns = ["_build"]
