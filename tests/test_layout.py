"""Cross-package rules of the monorepo: namespace layout and dependency direction."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layer order: a package may import only from packages before it in this list.
LAYERS = ["protocol", "kernels", "modules", "integrations"]
# The one list of packages (noxfile.py reads it too), in dependency order.
PACKAGES = [
    ROOT / folder
    for folder in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["groupgrad"][
        "packages"
    ]
]
LICENSE = (ROOT / "LICENSE").read_text()
PYTHONS = ("3.11", "3.12")


def _existing_packages() -> list[Path]:
    return PACKAGES


def _meta(package: Path) -> dict:
    return tomllib.loads((package / "pyproject.toml").read_text())["project"]


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "groupgrad":
        return None
    return parts[1] if parts[1] in LAYERS else None


def test_the_package_list_names_every_package_on_disk() -> None:
    on_disk = {
        p.parent
        for pattern in (
            "packages/*/pyproject.toml",
            "kernels/pyproject.toml",
            "integrations/*/pyproject.toml",
        )
        for p in ROOT.glob(pattern)
    }
    listed = set(PACKAGES)
    assert on_disk == listed, (
        f"folders with a pyproject.toml but not in [tool.groupgrad] packages: "
        f"{sorted(str(p.relative_to(ROOT)) for p in on_disk - listed)}; listed but missing: "
        f"{sorted(str(p.relative_to(ROOT)) for p in listed - on_disk)}"
    )
    assert PACKAGES[0] == ROOT / "packages" / "protocol"


def test_the_package_list_is_in_dependency_order() -> None:
    """nox installs the folders in list order; a package's siblings come before it."""
    names = [_meta(p)["name"] for p in PACKAGES]
    for i, package in enumerate(PACKAGES):
        for requirement in _meta(package)["dependencies"]:
            sibling = requirement.split("==")[0].strip()
            if sibling.startswith("groupgrad-"):
                assert sibling in names[:i], (
                    f"{names[i]} depends on {sibling}, which the list puts after it (or omits)"
                )


def test_every_package_carries_the_license_and_complete_metadata() -> None:
    """One version, Apache-2.0 with its text, the project as author, URLs, classifiers."""
    versions = {_meta(p)["version"] for p in PACKAGES}
    assert len(versions) == 1, f"one version scheme across packages, found {sorted(versions)}"
    (version,) = versions
    assert LICENSE.lstrip().startswith("Apache License")
    for package in PACKAGES:
        meta, where = _meta(package), package.relative_to(ROOT)
        assert meta["license"] == "Apache-2.0", where
        assert meta["license-files"] == ["LICENSE"], where
        assert (package / "LICENSE").read_text() == LICENSE, f"{where}/LICENSE differs from LICENSE"
        assert meta["authors"] == [{"name": "the groupgrad developers"}], where
        assert {"Homepage", "Source", "Issues", "Documentation"} <= set(meta["urls"]), where
        classifiers = meta["classifiers"]
        for python in PYTHONS:
            assert f"Programming Language :: Python :: {python}" in classifiers, (where, python)
        assert any(c.startswith("Development Status :: ") for c in classifiers), where
        assert meta["requires-python"] == f">={PYTHONS[0]}", where
        for requirement in meta["dependencies"]:
            if requirement.startswith("groupgrad-"):
                assert requirement.endswith(f"=={version}"), (
                    f"{where}: {requirement!r}, expected the lockstep pin =={version}"
                )


def test_kernels_installs_light_and_its_cuda_extra_holds_the_build_tools() -> None:
    meta = _meta(ROOT / "kernels")
    names = [r.split(">")[0].split("=")[0].strip() for r in meta["dependencies"]]
    assert names == ["torch"], f"groupgrad-kernels depends on {names}, expected torch only"
    cuda = [r.split(">")[0].split("=")[0].strip() for r in meta["optional-dependencies"]["cuda"]]
    assert sorted(cuda) == ["ninja", "nvidia-cutlass", "pybind11"]


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
