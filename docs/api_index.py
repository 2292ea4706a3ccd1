"""Which exported names the API pages cover, and a page for the ones they do not (yet).

The pages under ``docs/api/`` sort each package's names into sections by
hand. A name that a package exports (``__all__`` of a public module) but no
page lists is not left out: :func:`write_unsorted_page` puts it on
``api/generated/unsorted.rst``, documented from its docstring like the
others, until someone sorts it into its package's page. So the strict build
documents every exported name, also right after a package adds one.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import tomllib
from pathlib import Path

_CURRENT = re.compile(r"^\.\.\s+(?:currentmodule|automodule|module|py:module)::\s*(\S+)")
_MODULE_TARGET = re.compile(r"^\.\.\s+(?:automodule|module|py:module)::\s*(\S+)")
_AUTOSUMMARY = re.compile(r"^\.\.\s+autosummary::")
_DIRECTIVE = re.compile(
    r"^\s*\.\.\s+(?:py:(?:data|function|class|attribute|module)|auto(?:data|function|class))::"
    r"\s*(\S+)"
)


def public_modules(root: Path) -> list[str]:
    """Every public module (no ``_`` in its name) of every package in the package list."""
    folders = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["groupgrad"]["packages"]
    modules = []
    for folder in folders:
        src = root / folder / "src"
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


def exported(modules: list[str]) -> list[str]:
    """``module.name`` for every name of every module's ``__all__``, in order."""
    names = []
    for module in modules:
        names += [
            f"{module}.{name}" for name in getattr(importlib.import_module(module), "__all__", ())
        ]
    return names


def listed(pages: list[Path]) -> set[str]:
    """Full names the hand-written pages list (autosummary entries, ``py:`` directives, modules)."""
    found: set[str] = set()
    for page in pages:
        current, in_autosummary = "", False
        for line in page.read_text().splitlines():
            if match := _MODULE_TARGET.match(line):
                found.add(match.group(1))
            if match := _CURRENT.match(line):
                current, in_autosummary = match.group(1), False
            elif _AUTOSUMMARY.match(line):
                in_autosummary = True
            elif match := _DIRECTIVE.match(line):
                name = match.group(1)
                found.add(name if "." in name else f"{current}.{name}")
            elif in_autosummary and line.startswith("   ") and not line.strip().startswith(":"):
                found.add(f"{current}.{line.strip()}")
            elif line.strip() and not line.startswith(" "):
                in_autosummary = False
    return found


def write_unsorted_page(docs: Path, root: Path) -> list[str]:
    """Write ``api/generated/unsorted.rst`` for the exported names no page lists; return them."""
    pages = sorted((docs / "api").glob("*.rst"))
    on_pages = listed(pages)
    names = [name for name in exported(public_modules(root)) if name not in on_pages]
    # orphan: in no toctree (a passing build has nothing here: an unsorted name fails it)
    lines = [":orphan:", "", "Not yet sorted into the API pages", "=" * 33, ""]
    if not names:
        lines.append("Every exported name is on its package's page.")
    else:
        lines += [
            "Exported names that no API page lists yet; each is documented from its",
            "docstring. Sort them into their package's page under ``docs/api/``.",
            "",
        ]
        modules = sorted({name.rsplit(".", 1)[0] for name in names})
        for module in modules:
            lines += [module, "-" * len(module), ""]
            if module in on_pages:  # its page documents the module itself
                lines += [f".. currentmodule:: {module}", ""]
            else:
                lines += [f".. automodule:: {module}", "   :no-members:", ""]
            lines += [".. autosummary::", "   :toctree: .", "   :nosignatures:", ""]
            lines += [f"   {n.rsplit('.', 1)[1]}" for n in names if n.rsplit(".", 1)[0] == module]
            lines.append("")
    out = docs / "api" / "generated" / "unsorted.rst"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return names
