"""Development sessions for the groupgrad monorepo (`nox --list` shows the menu).

CPU sessions build their own virtual environments and pin the CPU build of
PyTorch. GPU sessions (`tests-gpu`) run on a CUDA machine whose Python
already has a CUDA build of PyTorch: their environment sees the system's
site-packages and installs the project without dependencies or build
isolation, so they also work on a machine with no network (set
``PIP_NO_INDEX=1`` and ``PIP_FIND_LINKS`` to a folder of wheels for anything
missing there, such as ``nvidia-cutlass``).
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]

PYTHON_VERSIONS = None  # the interpreter nox runs under
TORCH_CPU = "torch==2.13.0"

# Installed in dependency order: protocol <- kernels <- modules <- integrations.
PACKAGES = ["./packages/protocol", "./kernels", "./packages/modules"]
TEST_PATHS = ["packages/protocol/tests", "kernels/tests", "packages/modules/tests", "tests"]
SOURCE_PATHS = ["packages/protocol/src", "kernels/src", "packages/modules/src"]
# What the GPU sessions need beside the machine's own torch, pytest, pybind11 and ninja.
GPU_EXTRAS = ["nvidia-cutlass>=4.2"]


def _install_project_cpu(session: nox.Session, *extra: str) -> None:
    session.install(TORCH_CPU, *extra)
    session.install(*PACKAGES)


@nox.session(python=PYTHON_VERSIONS)
def tests(session: nox.Session) -> None:
    """CPU test suite of every package plus tests/ (what CI runs)."""
    _install_project_cpu(session, "pytest>=8", "pytest-timeout")
    session.run(
        "pytest",
        "-m",
        "not gpu",
        "--timeout=900",
        *TEST_PATHS,
        *session.posargs,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )


def _cuda_report(session: nox.Session) -> str | None:
    """Return a reason to skip GPU work, or None when a CUDA device is usable."""
    probe = (
        "import importlib.util, sys\n"
        "if importlib.util.find_spec('torch') is None:\n"
        "    print('no PyTorch in the system site-packages'); sys.exit()\n"
        "import torch\n"
        "if not torch.cuda.is_available():\n"
        "    print(f'no CUDA device visible to torch {torch.__version__}'); sys.exit()\n"
        "print('ok')\n"
    )
    answer = str(session.run("python", "-c", probe, silent=True)).strip().splitlines()[-1]
    return None if answer == "ok" else answer


def _install_project_gpu(session: nox.Session) -> None:
    session.install(*GPU_EXTRAS)
    session.install("--no-deps", "--no-build-isolation", *PACKAGES)


@nox.session(name="tests-gpu", python=PYTHON_VERSIONS, venv_params=["--system-site-packages"])
def tests_gpu(session: nox.Session) -> None:
    """GPU test suite (CUTLASS kernels, modules on CUDA); skipped without a CUDA device."""
    reason = _cuda_report(session)
    if reason is not None:
        session.skip(f"tests-gpu needs a CUDA device: {reason}")
    _install_project_gpu(session)
    session.run("pytest", "-m", "gpu", *TEST_PATHS, *session.posargs)


@nox.session(python=PYTHON_VERSIONS, venv_params=["--system-site-packages"])
def demo(session: nox.Session) -> None:
    """The main job: train a small MoE layer with groupgrad experts (GPU if present, else CPU)."""
    if _cuda_report(session) is None:
        _install_project_gpu(session)
    else:
        _install_project_cpu(session)
    session.run("python", "examples/moe_demo.py", *session.posargs)


@nox.session(python=PYTHON_VERSIONS, venv_params=["--system-site-packages"])
def bench(session: nox.Session) -> None:
    """GPU benchmarks: JSON and PNG plots under benchmarks/results/; skipped without CUDA."""
    reason = _cuda_report(session)
    if reason is not None:
        session.skip(f"bench needs a CUDA device: {reason}")
    _install_project_gpu(session)
    session.run(
        "python", "benchmarks/bench_kernels.py", "--out", "benchmarks/results", *session.posargs
    )


@nox.session(python=PYTHON_VERSIONS)
def lint(session: nox.Session) -> None:
    """ruff (format check and lint rules) and mypy on every package's src/."""
    _install_project_cpu(session, "ruff>=0.6", "mypy>=1.11", "pytest>=8")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
    session.run("mypy", *SOURCE_PATHS)


@nox.session(python=PYTHON_VERSIONS)
def docs(session: nox.Session) -> None:
    """Sphinx API docs (autodoc + napoleon, -W) into docs/_build/html; no GPU needed."""
    _install_project_cpu(session, "sphinx>=7.3", "furo", "numpy")
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
