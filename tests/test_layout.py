"""Cross-package rules of the monorepo: namespace layout and dependency direction."""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable, Iterator
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


@pytest.mark.parametrize("package", _existing_packages(), ids=lambda p: p.name)
def test_package_says_its_version(package: Path) -> None:
    """``__version__`` of the top package equals the distribution's version in pyproject.toml.

    Read from the source (megatron-core's package is not importable in every test environment).
    """
    init = min((package / "src").glob("groupgrad/**/__init__.py"), key=lambda p: len(p.parts))
    found = [
        node.value.value
        for node in ast.parse(init.read_text()).body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
    ]
    version = tomllib.loads((package / "pyproject.toml").read_text())["project"]["version"]
    assert found == [version], f"{init}: __version__ {found}, expected {version!r}"


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


# --- dependencies as declared, private modules, file size ---------------------------------

MAX_SOURCE_LINES = 450
SOURCE_SUFFIXES = {".py", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"}
_SKIPPED_DIRS = {"build", "dist", "_build", "__pycache__", "node_modules", "site-packages"}


def _import_names() -> dict[str, tuple[Path, str, set[str]]]:
    """Import package -> (folder, distribution, the groupgrad distributions it declares).

    Read from each package's ``pyproject.toml``: ``[project] name`` and
    ``dependencies``, and the import package from ``[tool.setuptools.packages.find]
    include`` (``"groupgrad.kernels*"``).
    """
    table = {}
    for package in _existing_packages():
        meta = tomllib.loads((package / "pyproject.toml").read_text())
        (include,) = meta["tool"]["setuptools"]["packages"]["find"]["include"]
        declared = {
            re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower()
            for requirement in meta["project"]["dependencies"]
        }
        groupgrad = {name for name in declared if name.startswith("groupgrad-")}
        table[include.rstrip("*")] = (package, meta["project"]["name"], groupgrad)
    return table


def _package_of(module: str, import_names: Iterable[str]) -> str | None:
    """The import package ``module`` belongs to (longest match), or ``None``."""
    owners = [name for name in import_names if module == name or module.startswith(name + ".")]
    return max(owners, key=len, default=None)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _imported(tree: ast.AST) -> Iterator[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every absolute import (``names`` empty for ``import m``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [alias.name for alias in node.names]


def _private_reaches(tree: ast.AST, owner: str | None, import_names: Iterable[str]) -> list[str]:
    """What ``tree`` takes from another package's private modules or names, as ``line: what``.

    Catches ``import groupgrad.x._m``, ``from groupgrad.x._m import n``,
    ``from groupgrad.x import _m`` (a private module or name) and, through an
    imported package bound to a name, ``pkg._m`` attribute access.
    """
    names = list(import_names)
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> groupgrad module it stands for
    for line, module, imported in _imported(tree):
        target = _package_of(module, names)
        if target is None or target == owner:
            continue
        inner = module[len(target) :].split(".")
        if any(_is_private(part) for part in inner):
            found.append(f"{line}: {module}")
        for name in imported:
            if _is_private(name):
                found.append(f"{line}: {module}.{name}")
    for node in ast.walk(
        tree
    ):  # `import groupgrad.kernels as gk` / `from groupgrad import kernels`
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = bound.get(node.value.id)
            if module is None or not _is_private(node.attr):
                continue
            target = _package_of(module, names)
            if target is not None and target != owner:
                found.append(f"{node.lineno}: {module}.{node.attr}")
    return sorted(found, key=lambda reach: int(reach.split(":")[0]))


def _python_files() -> Iterator[Path]:
    """Every Python file of the repository: packages (src and tests), tests/, benchmarks, examples…"""
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts[:-1]
        if any(part.startswith(".") or part in _SKIPPED_DIRS for part in parts):
            continue
        yield path


def test_private_import_rule_catches_each_form() -> None:
    names = ["groupgrad.kernels", "groupgrad.modules", "groupgrad.integrations.fsdp2"]
    code = (
        "import groupgrad.kernels._ops\n"
        "from groupgrad.kernels._swiglu import swiglu_probs\n"
        "from groupgrad.kernels import _cutlass, grouped_fprop\n"
        "from groupgrad.modules import _private_name\n"
        "import groupgrad.integrations.fsdp2 as fsdp\n"
        "fsdp._patch()\n"
        "from groupgrad import kernels\n"
        "kernels._dispatch\n"
        "from groupgrad.kernels import tuning, __all__\n"
        "from groupgrad.modules._mlp import GroupedMLP\n"
    )
    found = _private_reaches(ast.parse(code), owner="groupgrad.modules", import_names=names)
    assert found == [
        "1: groupgrad.kernels._ops",
        "2: groupgrad.kernels._swiglu",
        "3: groupgrad.kernels._cutlass",
        "6: groupgrad.integrations.fsdp2._patch",
        "8: groupgrad.kernels._dispatch",
    ]
    outside = _private_reaches(ast.parse(code), owner=None, import_names=names)
    assert [reach for reach in outside if reach not in found] == [
        "4: groupgrad.modules._private_name",
        "10: groupgrad.modules._mlp",
    ]


def test_no_package_reaches_into_another_packages_private_modules() -> None:
    """Only a package's own code (its src and tests) imports its ``_``-prefixed modules and names.

    Everything else — other packages' src and tests, ``tests/``, benchmarks,
    examples, docs — uses public names only.
    """
    import_names = _import_names()
    folders = {name: folder for name, (folder, _, _) in import_names.items()}
    problems = []
    for path in _python_files():
        owner = next((n for n, f in folders.items() if f in path.parents), None)
        tree = ast.parse(path.read_text(), filename=str(path))
        for reach in _private_reaches(tree, owner, import_names):
            problems.append(f"{path.relative_to(ROOT)}:{reach}")
    assert problems == [], "private modules of another package imported:\n" + "\n".join(problems)


@pytest.mark.parametrize("package", _existing_packages(), ids=lambda p: p.name)
def test_src_imports_only_declared_groupgrad_dependencies(package: Path) -> None:
    """A package's src imports a sibling only if its pyproject declares it (DESIGN's table).

    With :func:`test_imports_point_down_the_layers` this keeps the table of
    DESIGN.md: e.g. kernels depends on no sibling, integrations on protocol
    and modules (not kernels), and nothing imports an integration.
    """
    import_names = _import_names()
    own = next(name for name, (folder, _, _) in import_names.items() if folder == package)
    declared = import_names[own][2]
    for source in (package / "src").rglob("*.py"):
        tree = ast.parse(source.read_text(), filename=str(source))
        for line, module, _ in _imported(tree):
            target = _package_of(module, import_names)
            if target is None or target == own:
                continue
            where = f"{source.relative_to(ROOT)}:{line} imports {module}"
            assert not target.startswith("groupgrad.integrations."), (
                f"{where}: nothing imports an integration"
            )
            assert import_names[target][1] in declared, (
                f"{where}, but {package.name}/pyproject.toml does not declare "
                f"{import_names[target][1]}"
            )


@pytest.mark.parametrize("package", _existing_packages(), ids=lambda p: p.name)
def test_source_files_stay_small(package: Path) -> None:
    """No source file under ``src/`` passes 450 lines: one concern per file (STYLE.md).

    Generated kernel instantiations (a ``Generated … do not edit`` header) are
    the exception; tests and benchmarks are not counted.
    """
    too_long = []
    for source in sorted((package / "src").rglob("*")):
        if source.suffix not in SOURCE_SUFFIXES or not source.is_file():
            continue
        lines = source.read_text().splitlines()
        header = "\n".join(lines[:5]).lower()
        if "generated" in header and "do not edit" in header:
            continue
        if len(lines) > MAX_SOURCE_LINES:
            too_long.append(f"{source.relative_to(ROOT)}: {len(lines)} lines")
    assert too_long == [], f"over {MAX_SOURCE_LINES} lines: {too_long}"


KERNELS_SRC = ROOT / "kernels" / "src" / "groupgrad" / "kernels"
# 30 before the FP8 GEMMs; they added 11: their operand rules (_rules_fp8), their
# kernels and custom ops (_fp8_gemm), and the validator's split into calls and rules.
# The fused FP8 SwiGLU (_swiglu_fp8, _swiglu_fp8_triton) added 5; the FP8 operand rules
# moving into _validate and the kernel plan into _support (build's table of compiled
# dtypes moving into build, so build imports no sibling) took 4 away; the FP8 SwiGLU
# checking its kept h with the validator's FP8 operand rule added 1; the FP8 quantizers
# and SwiGLU calling their kernels directly in plain eager code (_fp8_ops -> _ops) added 1;
# the bf16 SwiGLU's Triton kernels taking their launch device's context from _fp8_triton's
# on_device (entered only when needed) instead of a copy of their own added 1; the weight
# quantizer checking a listed group with _group's one-pass listed_facts (_fp8 -> _group)
# instead of 128 members one by one added 1; the FP8 quantizers checking splits with the
# GEMMs' one rule (_fp8 -> _rules) instead of a rule of their own added 1.
MAX_KERNELS_EDGES = 47


def _module_graph(folder: Path, package: str) -> dict[str, set[str]]:
    """``module -> the sibling modules it imports`` for the ``.py`` files of one package folder.

    Every import counts, at any depth of the file (a function's lazy import
    too): ``import p.m``, ``from p.m import x`` and ``from p import m``.
    """
    modules = {path.stem for path in folder.glob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for path in folder.glob("*.py"):
        for _, module, names in _imported(ast.parse(path.read_text())):
            if module.startswith(package + "."):
                graph[path.stem].add(module[len(package) + 1 :].split(".")[0])
            elif module == package:
                graph[path.stem].update(name for name in names if name in modules)
    for name in graph:
        graph[name] &= modules - {name}
    return graph


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The imports that close a loop (``a -> b`` where ``b`` reaches ``a``): each runs back up."""

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
        return False

    return sorted(f"{a} -> {b}" for a in graph for b in graph[a] if reaches(b, a))


def test_the_graph_reader_finds_each_import_form_and_each_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert _upward_imports(graph) == []
    graph["c"].add("a")
    assert _upward_imports(graph) == ["a -> b", "b -> c", "c -> a"]


def test_kernels_private_import_graph_stays_small_and_points_down() -> None:
    """The kernels' modules: at most MAX_KERNELS_EDGES imports between them, none back up a floor."""
    graph = _module_graph(KERNELS_SRC, "groupgrad.kernels")
    assert {"_group", "_validate", "_api"} <= set(graph), "the reader lost the kernels' modules"
    assert "_group" in graph["_validate"], "the reader misses `from groupgrad.kernels._x import`"
    edges = sum(len(targets) for targets in graph.values())
    assert edges <= MAX_KERNELS_EDGES, f"{edges} imports between the kernels' modules: {graph}"
    assert _upward_imports(graph) == []


# The GEMMs' host path proper: the modules issue 24 counts (less __init__ and the FP8,
# quantization and SwiGLU rooms, which the FP8 issues added beside it).
HOST_PATH_EXCLUDED = ("__init__", "_swiglu", "_fp8", "_quant")
MAX_HOST_PATH_MODULES, MAX_HOST_PATH_EDGES = 8, 30


def test_the_gemms_host_path_is_eight_modules_and_thirty_imports_at_most() -> None:
    graph = _module_graph(KERNELS_SRC, "groupgrad.kernels")
    host = {
        module: {t for t in targets if not t.startswith(HOST_PATH_EXCLUDED)}
        for module, targets in graph.items()
        if not module.startswith(HOST_PATH_EXCLUDED)
    }
    private = sorted(m for m in host if m.startswith("_"))
    assert len(private) <= MAX_HOST_PATH_MODULES, private
    assert {"_api", "_validate", "_group"} <= set(private), "the reader lost the host path"
    edges = sum(len(targets) for targets in host.values())
    assert edges <= MAX_HOST_PATH_EDGES, f"{edges} imports on the host path: {host}"
