"""Development sessions for the groupgrad monorepo (`nox --list` shows the menu).

Every session runs in a virtual environment of its own, made by the standard
library's ``venv``. The packages are listed once, in ``pyproject.toml``
(``[tool.groupgrad] packages``); the sessions derive installs, test paths,
mypy paths and distributions from that list.

CPU sessions (``tests``, ``lint``, ``docs``, and ``demo`` without a GPU) share
one installation of PyTorch: ``torch==2.13.0`` is installed once into
``.nox/_torch-2.13.0-py3XX`` (pip's progress shows) and each CPU session sees
it through a ``.pth`` file; later sessions and later runs reuse it. On plain
PyPI that wheel is the CUDA build of PyTorch (about 3 GB with its libraries; it
runs on a CPU as well). For the CPU wheel (about 200 MB), add PyTorch's CPU
index: ``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu nox -s tests``.

GPU sessions (`tests-gpu`, `bench`, and `demo` where a GPU is present) run
with the CUDA build of PyTorch of the Python that runs nox: their environment
sees that Python's packages and installs the project without dependencies or
build isolation, so they also work on a machine with no network (set
``PIP_NO_INDEX=1`` and ``PIP_FIND_LINKS`` to a folder of wheels for anything
missing there, such as ``nvidia-cutlass``).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import site
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import ModuleType

import nox
import nox.command
import nox.virtualenv
from packaging.version import Version

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"
# The backend is the standard library's venv, so nox need not look for uv (it would print
# "uv binary not found." in every session); these are the values nox itself reads.
nox.virtualenv.HAS_UV, nox.virtualenv.UV, nox.virtualenv.UV_VERSION = False, "uv", Version("0")

ROOT = Path(__file__).resolve().parent
PYTHON_VERSIONS = None  # the interpreter nox runs under
TORCH_VERSION = "2.13.0"
TORCH_CPU = f"torch=={TORCH_VERSION}"

# One list of packages (folders, dependency order: protocol <- kernels <- modules <- integrations).
FOLDERS: list[str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["groupgrad"][
    "packages"
]
PACKAGES = [f"./{folder}" for folder in FOLDERS]
TEST_PATHS = [*(f"{folder}/tests" for folder in FOLDERS), "tests"]
# Packages whose CPU tests need an environment of their own: megatron-fsdp 0.6 takes
# megatron.core's DistributedDataParallelConfig whenever megatron-core is importable, and the
# newest megatron-core for Python 3.11 (0.16.x) lacks fields megatron-fsdp 0.6 passes it.
OWN_TEST_ENVIRONMENT = {
    "integrations/megatron_core": ["./packages/protocol", "./kernels", "./packages/modules"]
}
SOURCE_PATHS = [f"{folder}/src" for folder in FOLDERS]
# What the GPU sessions need beside the machine's own torch, pytest, pybind11, ninja and einops.
GPU_EXTRAS = ["nvidia-cutlass>=4.2", "megatron-fsdp>=0.6.1,<0.7", "megatron-core>=0.19,<0.20"]
DIST_DIR = ROOT / "dist"
# Never part of a CPU install of any distribution (the CUDA tooling of groupgrad-kernels[cuda]).
CUDA_TOOLING = ("nvidia-cutlass", "cuda-python", "cuda-bindings")


# --------------------------------------------------------------------------- PyTorch, once


def _ask(python: str | Path, code: str) -> str:
    """What ``python -c code`` prints (a quiet query, kept out of the session's log)."""
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _torch_layer(session: nox.Session) -> Path:
    """The folder holding ``torch==2.13.0`` and its dependencies, installed on first use."""
    tag = _ask(Path(session.bin) / "python", "import sys; print('py%d%d' % sys.version_info[:2])")
    layer = ROOT / ".nox" / f"_torch-{TORCH_VERSION}-{tag}"
    complete = layer / ".complete"
    if complete.is_file():
        session.log(f"reusing {TORCH_CPU} from {layer.relative_to(ROOT)}")
        return layer
    shutil.rmtree(layer, ignore_errors=True)
    session.log(
        f"installing {TORCH_CPU} once into {layer.relative_to(ROOT)} (shared by CPU sessions)"
    )
    session.install("--target", str(layer), TORCH_CPU, silent=False)
    complete.write_text(f"{TORCH_CPU}\n")
    return layer


def _purelib(python: str | Path) -> Path:
    return Path(_ask(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))


def _see_torch_layer(
    session: nox.Session, layer: Path, python: str | Path, bin_dir: str | Path
) -> Path:
    """Let the environment of ``python`` import the shared PyTorch and run its commands (torchrun).

    Returns the environment's own site-packages folder.
    """
    purelib = _purelib(python)
    (purelib / "_groupgrad_torch.pth").write_text(f"{layer}\n")
    _bind_torch_commands(python, bin_dir)
    return purelib


_TORCH_COMMANDS = """
import json
from importlib import metadata
print(json.dumps([[e.name, e.value] for e in metadata.distribution("torch").entry_points
                  if e.group == "console_scripts"]))
"""


def _bind_torch_commands(python: str | Path, bin_dir: str | Path) -> None:
    """Write PyTorch's console scripts (``torchrun`` ...) into ``bin_dir``, run by ``python``.

    PyTorch seen through a ``.pth`` file brings no commands of its own, and the
    host's ``torchrun`` would start its workers with the host's Python, which
    lacks this environment's packages.
    """
    import json

    for name, target in json.loads(_ask(python, _TORCH_COMMANDS)):
        module, _, function = target.partition(":")
        launcher = Path(bin_dir) / name
        launcher.write_text(
            f"#!{python}\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n"
        )
        launcher.chmod(0o755)


def _install_project_cpu(
    session: nox.Session, *extra: str, packages: list[str] | None = None
) -> None:
    _see_torch_layer(session, _torch_layer(session), Path(session.bin) / "python", session.bin)
    if extra:
        session.install(*extra, silent=False)
    session.install(*(PACKAGES if packages is None else packages), silent=False)


def _run_cpu_tests(session: nox.Session, *paths: str) -> None:
    """pytest's CPU tests (not marked ``gpu``) of ``paths``, no CUDA device visible; posargs reach it."""
    session.run(
        "python",
        "-m",
        "pytest",
        "-m",
        "not gpu",
        "--timeout=900",
        *paths,
        *session.posargs,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )


# --------------------------------------------------------------------------- sessions


@nox.session(python=PYTHON_VERSIONS)
def tests(session: nox.Session) -> None:
    """CPU tests of every package, README/docs examples, then each distribution installed alone."""
    shared = [p for p in PACKAGES if p.removeprefix("./") not in OWN_TEST_ENVIRONMENT]
    # matplotlib: the demo's picture, which the demo's test checks; accelerate: transformers
    # needs it to load a model expert-parallel (the transformers integration's EP tests)
    _install_project_cpu(
        session,
        "pytest>=8",
        "pytest-timeout",
        "build",
        "matplotlib",
        "accelerate>=1.0",
        packages=shared,
    )
    own = {f"{folder}/tests" for folder in OWN_TEST_ENVIRONMENT}
    failures: list[str] = []
    try:  # a failing test does not stop the distribution checks: every failure is reported
        _run_cpu_tests(session, *(path for path in TEST_PATHS if path not in own))
    except nox.command.CommandFailed:
        failures.append("pytest failed (its summary is above)")
    _build_dists(session)
    failures += _check_dists(session)
    for folder in OWN_TEST_ENVIRONMENT:
        session.notify(f"tests-{Path(folder).name.replace('_', '-')}")
    if failures:
        session.error("failed:\n  " + "\n  ".join(failures))


@nox.session(name="tests-megatron-core", python=PYTHON_VERSIONS)
def tests_megatron_core(session: nox.Session) -> None:
    """CPU tests of groupgrad-megatron-core in an environment without megatron-fsdp (run by tests)."""
    folder = "integrations/megatron_core"
    packages = [*OWN_TEST_ENVIRONMENT[folder], f"./{folder}"]
    _install_project_cpu(session, "pytest>=8", "pytest-timeout", packages=packages)
    _run_cpu_tests(session, f"{folder}/tests")


@nox.session(python=PYTHON_VERSIONS)
def build(session: nox.Session) -> None:
    """Build every distribution (wheel and sdist) into dist/."""
    session.install("build", *_build_requirements(), silent=False)
    _build_dists(session)


_CUDA_PROBE = """
import importlib.util, sys
if importlib.util.find_spec("torch") is None:
    print("no PyTorch in the Python that runs nox"); sys.exit()
import torch
if not torch.cuda.is_available():
    print(f"no CUDA device visible to torch {torch.__version__}"); sys.exit()
print("ok")
"""


def _host_cuda_reason() -> str | None:
    """Why the Python running nox cannot drive a GPU, or None when it can (CUDA torch + device)."""
    probe = subprocess.run(
        [sys.executable, "-c", _CUDA_PROBE], capture_output=True, text=True, check=False
    )
    lines = probe.stdout.strip().splitlines() or [f"the CUDA probe failed: {probe.stderr[-300:]}"]
    return None if lines[-1] == "ok" else lines[-1]


def _see_host_packages(session: nox.Session) -> None:
    """Let the session's environment import what the Python running nox has (its CUDA torch).

    PyTorch's commands (``torchrun``) are bound to the session's Python, so their
    workers see the project installed here.

    A ``.pth`` file appends the host's site-packages to the environment's path,
    after the environment's own packages; this works even when the host Python
    is itself a virtual environment (where ``--system-site-packages`` would
    reach only the base interpreter).
    """
    host = [
        path
        for path in (*site.getsitepackages(), site.getusersitepackages())
        if os.path.isdir(path)
    ]
    purelib = _purelib(Path(session.bin) / "python")
    (purelib / "_groupgrad_host_site.pth").write_text("\n".join(host) + "\n")
    _bind_torch_commands(Path(session.bin) / "python", session.bin)


def _install_project_gpu(session: nox.Session) -> None:
    _see_host_packages(session)
    # --no-deps: their needs are the machine's (torch, einops) or unused (nvidia-cutlass only
    # lends its C++ headers; its Python tooling and cuda-python are not needed)
    session.install("--no-deps", *GPU_EXTRAS, silent=False)
    # --no-build-isolation builds with this environment's setuptools: PEP 639 metadata needs 77+
    session.install("--no-deps", "setuptools>=77", silent=False)
    session.install("--no-deps", "--no-build-isolation", *PACKAGES, silent=False)


@nox.session(name="tests-gpu", python=PYTHON_VERSIONS)
def tests_gpu(session: nox.Session) -> None:
    """GPU test suite (CUTLASS kernels, modules on CUDA, GPU examples); skipped without CUDA."""
    reason = _host_cuda_reason()
    if reason is not None:
        session.skip(f"tests-gpu needs a CUDA device: {reason}")
    _install_project_gpu(session)
    session.run("python", "-m", "pytest", "-m", "gpu", *TEST_PATHS, *session.posargs)


# What examples/moe_demo.py imports: nothing else is installed for it.
DEMO_PACKAGES = ["./packages/protocol", "./kernels", "./packages/modules"]


@nox.session(python=PYTHON_VERSIONS, reuse_venv=True)
def demo(session: nox.Session) -> None:
    """The main job: train a small MoE layer with groupgrad experts (GPU if present, else CPU)."""
    if _host_cuda_reason() is None:
        _install_project_gpu(session)
    elif _installed_already(session, DEMO_PACKAGES, ["matplotlib"]):
        session.log("reusing the demo environment (its packages' sources are unchanged)")
    else:
        _install_project_cpu(session, "matplotlib", packages=DEMO_PACKAGES)
        _installed_already(session, DEMO_PACKAGES, ["matplotlib"], record=True)
    session.run("python", "examples/moe_demo.py", *session.posargs)


def _installed_already(
    session: nox.Session, packages: list[str], extras: list[str], record: bool = False
) -> bool:
    """Whether this environment holds exactly these packages' current sources (or note that it does).

    A fingerprint of every file of the packages (paths, sizes, modification
    times) and of the extra requirements is kept in the environment; the
    install is skipped while it matches.
    """
    import hashlib

    digest = hashlib.sha256(" ".join([TORCH_CPU, *extras]).encode())
    for package in packages:
        for path in sorted((ROOT / package).rglob("*")):
            if (
                path.is_file()
                and not {"__pycache__", "build"} & set(path.parts)
                and ".egg-info" not in str(path)
            ):
                info = path.stat()
                digest.update(
                    f"{path.relative_to(ROOT)} {info.st_size} {info.st_mtime_ns}".encode()
                )
    stamp = Path(session.virtualenv.location) / ".groupgrad-installed"
    if record:
        stamp.write_text(digest.hexdigest())
        return True
    return stamp.is_file() and stamp.read_text() == digest.hexdigest()


@nox.session(python=PYTHON_VERSIONS)
def bench(session: nox.Session) -> None:
    """GPU benchmarks (kernels, fp8_gemm, mlp, fp8_mlp, profile_fp8_step, fidelity_fp8, megatron_moe, hf_moe, hf_moe_fsdp): JSON + PNG in benchmarks/results/."""
    reason = _host_cuda_reason()
    if reason is not None:
        session.skip(f"bench needs a CUDA device: {reason}")
    _install_project_gpu(session)
    # `nox -s bench -- kernels --reps 30` runs one benchmark with its own options.
    scripts = {
        "kernels": "benchmarks/bench_kernels.py",
        "fp8_gemm": "benchmarks/bench_fp8_gemm.py",
        "mlp": "benchmarks/bench_mlp.py",
        "fp8_mlp": "benchmarks/bench_fp8_mlp.py",
        "profile_fp8_step": "benchmarks/profile_fp8_step.py",
        "fidelity_fp8": "benchmarks/fidelity_fp8.py",
        "megatron_moe": "benchmarks/bench_megatron_moe.py",
        "hf_moe": "benchmarks/bench_hf_moe.py",
    }
    # FSDP2 across the machine's GPUs: one process per GPU
    multi_gpu = {"hf_moe_fsdp": ("benchmarks/bench_hf_moe.py", "--fsdp")}
    chosen, options = [*scripts, *multi_gpu], list(session.posargs)
    if options and options[0] in (*scripts, *multi_gpu):
        chosen, options = [options[0]], options[1:]
    for name in chosen:
        if name in scripts:
            session.run("python", scripts[name], "--out", "benchmarks/results", *options)
            continue
        script, *flags = multi_gpu[name]
        gpus = int(
            _ask(Path(session.bin) / "python", "import torch; print(torch.cuda.device_count())")
        )
        if gpus < 2:
            session.log(f"{name} skipped: needs 2 GPUs, found {gpus}")
            continue
        launch = [
            "python",
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={gpus}",
        ]
        session.run(*launch, script, *flags, "--out", "benchmarks/results", *options)


@nox.session(python=PYTHON_VERSIONS)
def mutants(session: nox.Session) -> None:
    """Deliberate breaks (tests/mutants/catalog.py), each on a copy of the tree: every one must fail a test."""
    _install_project_cpu(session, "pytest>=8", "pytest-timeout")
    session.run("python", "tests/mutants/run.py", *session.posargs)


@nox.session(python=PYTHON_VERSIONS)
def lint(session: nox.Session) -> None:
    """ruff (format check and lint rules) and mypy on every package's src/."""
    _install_project_cpu(session, "ruff>=0.6", "mypy>=1.11", "pytest>=8")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
    session.run("mypy", *SOURCE_PATHS, env={"MYPYPATH": os.pathsep.join(SOURCE_PATHS)})


@nox.session(python=PYTHON_VERSIONS)
def docs(session: nox.Session) -> None:
    """Sphinx docs (install, quickstart, API; nitpicky, warnings are errors) into docs/_build/html."""
    _install_project_cpu(session, "sphinx>=7.3", "furo", "numpy")
    for stale in ("docs/_build", "docs/api/generated"):  # autosummary stubs are regenerated
        shutil.rmtree(stale, ignore_errors=True)
    session.run(
        "sphinx-build",
        "-W",
        "--keep-going",
        "-b",
        "html",
        "docs",
        "docs/_build/html",
        *session.posargs,
    )


# --------------------------------------------------------------------------- distributions


def _project(folder: str) -> dict:
    return tomllib.loads((ROOT / folder / "pyproject.toml").read_text())


def _build_requirements() -> list[str]:
    """The union of every package's ``[build-system] requires``."""
    return sorted({r for f in FOLDERS for r in _project(f)["build-system"]["requires"]})


def _build_dists(session: nox.Session) -> None:
    """Build a wheel and an sdist (the wheel from the sdist) of every package into dist/."""
    session.install(*_build_requirements(), silent=False)
    DIST_DIR.mkdir(exist_ok=True)
    for old in DIST_DIR.glob("groupgrad[-_]*"):
        old.unlink()
    for folder in FOLDERS:
        session.run(
            "python", "-m", "build", "-q", "--no-isolation", "--outdir", str(DIST_DIR), folder
        )
    session.log("dist/: " + ", ".join(sorted(p.name for p in DIST_DIR.glob("groupgrad[-_]*"))))


def _top_package(folder: str) -> str:
    """The import name a package's folder provides, e.g. ``groupgrad.integrations.fsdp2``."""
    src = ROOT / folder / "src"
    inits = sorted(src.glob("groupgrad/**/__init__.py"), key=lambda p: len(p.parts))
    return ".".join(inits[0].parent.relative_to(src).parts)


def _sibling_closure(folder: str) -> set[str]:
    """Distributions of the monorepo that ``folder`` imports, directly or through each other.

    Read from the ``import`` statements of the sources, independently of the
    dependencies each ``pyproject.toml`` declares (which is what pip follows).
    """
    owner = {_top_package(f): f for f in FOLDERS}
    needed, todo = {folder}, [folder]
    while todo:
        current = todo.pop()
        for source in (ROOT / current / "src").rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    for package, other in owner.items():
                        if (name == package or name.startswith(package + ".")) and (
                            other not in needed
                        ):
                            needed.add(other)
                            todo.append(other)
    return {_project(f)["project"]["name"] for f in needed}


_DIST_PROBE = """
import importlib, json, pkgutil, sys
from importlib import metadata
site_dir, top = sys.argv[1], sys.argv[2]
own = sorted(d.metadata["Name"] for d in metadata.distributions(path=[site_dir]))
package = importlib.import_module(top)
modules = [top] + [
    m.name for m in pkgutil.walk_packages(package.__path__, top + ".")
    if not any(part.startswith("_") for part in m.name.split("."))
]
for name in modules:
    importlib.import_module(name)
import torch
print(json.dumps({"installed": own, "imported": modules, "torch": torch.__version__}))
"""


def _check_dists(session: nox.Session) -> list[str]:
    """Install each distribution alone from dist/ into a fresh environment, import it, run its README.

    The environment sees the shared ``torch==2.13.0`` (a ``.pth`` file) and
    gets everything else from ``pip install --find-links dist <name>``: the
    monorepo siblings from dist/, third-party packages from the index. A
    failure: the install pulls a sibling that the sources do not import,
    misses one they do, pulls CUDA tooling, a public module does not import,
    or a CPU example of the package's README (its advertised paths, e.g.
    checkpoints) fails there — a runtime need the package does not declare.

    Returns:
        What failed, one line each (every distribution is checked).
    """
    import json

    blocks = _readme_blocks_module()
    failures: list[str] = []

    work = Path(session.create_tmp()).resolve() / "dist-check"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    probe_script = work / "probe.py"
    probe_script.write_text(_DIST_PROBE)
    layer, timings = _torch_layer(session), []
    for folder in FOLDERS:
        name = _project(folder)["project"]["name"]
        start = time.perf_counter()
        env = work / name
        session.run("python", "-m", "venv", str(env))
        python = env / "bin" / "python"
        site_dir = _see_torch_layer(session, layer, python, env / "bin")
        session.run(
            str(python), "-m", "pip", "install", "--find-links", str(DIST_DIR), name, external=True
        )
        probe = session.run(
            str(python),
            str(probe_script),
            str(site_dir),
            _top_package(folder),
            silent=True,
            external=True,
            env={"CUDA_VISIBLE_DEVICES": ""},
        )
        report = json.loads(str(probe).strip().splitlines()[-1])
        installed = set(report["installed"])
        siblings = {d for d in installed if d.startswith("groupgrad-")}
        expected = _sibling_closure(folder)
        if siblings != expected:
            failures.append(
                f"pip install --find-links dist {name} installed the groupgrad distributions "
                f"{sorted(siblings)}, expected {sorted(expected)} (what its sources import)"
            )
        tooling = sorted(d for d in installed if d.lower() in CUDA_TOOLING)
        if tooling:
            failures.append(f"pip install --find-links dist {name} pulled CUDA tooling {tooling}")
        examples = [
            b for b in blocks.parse(ROOT / folder / "README.md")[0]
            if b.language in blocks.PYTHON and not b.gpu
        ]  # fmt: skip
        for block in examples:
            folder_for_block = work / f"{name}-example-{block.line}"
            folder_for_block.mkdir()
            done = blocks.run_block(block, folder_for_block, 600, bin_dir=env / "bin")
            if done.returncode != 0:
                session.log(f"{block.id} failed with {name} alone:\n{done.stderr[-3000:]}")
                failures.append(f"{block.id} exited {done.returncode} with {name} installed alone")
        seconds = time.perf_counter() - start
        timings.append(f"{name} {seconds:.0f} s")
        session.log(
            f"{name}: installed alone with {sorted(siblings - {name}) or 'no siblings'}, "
            f"imported {len(report['imported'])} public modules (torch {report['torch']}), "
            f"ran {len(examples)} README examples, in {seconds:.0f} s"
        )
    session.log("every distribution installed alone from dist/: " + ", ".join(timings))
    return failures


def _readme_blocks_module() -> ModuleType:
    """``tests/groupgrad_testsupport/readme_blocks.py`` (standard library only), loaded by path."""
    path = ROOT / "tests" / "groupgrad_testsupport" / "readme_blocks.py"
    spec = importlib.util.spec_from_file_location("groupgrad_readme_blocks", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
