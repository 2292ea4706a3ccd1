"""Cross-package rules of the monorepo: namespace layout and dependency direction."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layer order: a package may import only from packages before it in this list.
LAYERS = ["protocol", "kernels", "modules", "integrations"]
PACKAGE_DIRS = {
    "protocol": ROOT / "packages" / "protocol",
    "kernels": ROOT / "kernels",
    "modules": ROOT / "packages" / "modules",
}


def _existing_packages() -> list[Path]:
    found = [p for p in PACKAGE_DIRS.values() if (p / "pyproject.toml").exists()]
    found += sorted(p for p in (ROOT / "integrations").glob("*") if (p / "pyproject.toml").exists())
    return found


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "groupgrad":
        return None
    return parts[1] if parts[1] in LAYERS else None


def test_protocol_package_exists() -> None:
    assert (PACKAGE_DIRS["protocol"] / "pyproject.toml").exists()


@pytest.mark.parametrize("package", _existing_packages(), ids=lambda p: p.name)
def test_package_follows_the_namespace_layout(package: Path) -> None:
    meta = tomllib.loads((package / "pyproject.toml").read_text())
    assert meta["project"]["name"].startswith("groupgrad-")
    assert "dependencies" in meta["project"]
    assert (package / "README.md").exists()
    assert (package / "tests").is_dir()
    src = package / "src" / "groupgrad"
    assert src.is_dir()
    assert not (src / "__init__.py").exists(), "groupgrad is a PEP 420 namespace"
    typed = list(src.rglob("py.typed"))
    assert typed, f"{package} ships no py.typed"


@pytest.mark.parametrize("package", _existing_packages(), ids=lambda p: p.name)
def test_imports_point_down_the_layers(package: Path) -> None:
    for source in (package / "src").rglob("*.py"):
        own = _layer_of(".".join(source.relative_to(package / "src").with_suffix("").parts))
        assert own is not None, source
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                layer = _layer_of(name)
                if layer is None or layer == own:
                    continue
                assert LAYERS.index(layer) < LAYERS.index(own), (
                    f"{source.relative_to(ROOT)} imports {name}: {own} may not depend on {layer}"
                )
