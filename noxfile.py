"""Development sessions for the groupgrad monorepo (`nox --list` shows the menu).

CPU sessions build their own virtual environments and pin the CPU build of
PyTorch. GPU sessions (`tests-gpu`, `bench`, and `demo` where a GPU is
present) run with the CUDA build of PyTorch of the Python that runs nox: their
environment sees that Python's packages and installs the project without
dependencies or build isolation, so they also work on a machine with no
network (set ``PIP_NO_INDEX=1`` and ``PIP_FIND_LINKS`` to a folder of wheels
for anything missing there, such as ``nvidia-cutlass``).
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import nox

nox.options.sessions = ["tests"]

PYTHON_VERSIONS = None  # the interpreter nox runs under
TORCH_CPU = "torch==2.13.0"

# Installed in dependency order: protocol <- kernels <- modules <- integrations.
PACKAGES = [
    "./packages/protocol",
    "./kernels",
    "./packages/modules",
    "./integrations/torch_distributed",
    "./integrations/megatron_fsdp",
]
TEST_PATHS = [
    "packages/protocol/tests",
    "kernels/tests",
    "packages/modules/tests",
    "integrations/torch_distributed/tests",
    "integrations/megatron_fsdp/tests",
    "tests",
]
SOURCE_PATHS = [
    "packages/protocol/src",
    "kernels/src",
    "packages/modules/src",
    "integrations/torch_distributed/src",
    "integrations/megatron_fsdp/src",
]
# What the GPU sessions need beside the machine's own torch, pytest, pybind11, ninja and einops.
GPU_EXTRAS = ["nvidia-cutlass>=4.2", "megatron-fsdp>=0.6.1,<0.7"]


def _install_project_cpu(session: nox.Session, *extra: str) -> None:
    session.install(TORCH_CPU, *extra)
    session.install(*PACKAGES)


@nox.session(python=PYTHON_VERSIONS)
def tests(session: nox.Session) -> None:
    """CPU test suite of every package plus tests/ (what CI runs)."""
    _install_project_cpu(session, "pytest>=8", "pytest-timeout")
    session.run(
        "python",
        "-m",
        "pytest",
        "-m",
        "not gpu",
        "--timeout=900",
        *TEST_PATHS,
        *session.posargs,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )


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
    purelib = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    Path(str(purelib).strip(), "_groupgrad_host_site.pth").write_text("\n".join(host) + "\n")


def _install_project_gpu(session: nox.Session) -> None:
    _see_host_packages(session)
    # --no-deps: their needs are the machine's (torch, einops) or unused (nvidia-cutlass only
    # lends its C++ headers; its Python tooling and cuda-python are not needed)
    session.install("--no-deps", *GPU_EXTRAS)
    session.install("--no-deps", "--no-build-isolation", *PACKAGES)


@nox.session(name="tests-gpu", python=PYTHON_VERSIONS)
def tests_gpu(session: nox.Session) -> None:
    """GPU test suite (CUTLASS kernels, modules on CUDA); skipped without a CUDA device."""
    reason = _host_cuda_reason()
    if reason is not None:
        session.skip(f"tests-gpu needs a CUDA device: {reason}")
    _install_project_gpu(session)
    session.run("python", "-m", "pytest", "-m", "gpu", *TEST_PATHS, *session.posargs)


@nox.session(python=PYTHON_VERSIONS)
def demo(session: nox.Session) -> None:
    """The main job: train a small MoE layer with groupgrad experts (GPU if present, else CPU)."""
    if _host_cuda_reason() is None:
        _install_project_gpu(session)
    else:
        _install_project_cpu(session)
    session.run("python", "examples/moe_demo.py", *session.posargs)


@nox.session(python=PYTHON_VERSIONS)
def bench(session: nox.Session) -> None:
    """GPU benchmarks (kernels, mlp): JSON and PNG under benchmarks/results/; skipped without CUDA."""
    reason = _host_cuda_reason()
    if reason is not None:
        session.skip(f"bench needs a CUDA device: {reason}")
    _install_project_gpu(session)
    # `nox -s bench -- kernels --reps 30` runs one benchmark with its own options.
    scripts = {"kernels": "benchmarks/bench_kernels.py", "mlp": "benchmarks/bench_mlp.py"}
    chosen, options = list(scripts), list(session.posargs)
    if options and options[0] in scripts:
        chosen, options = [options[0]], options[1:]
    for name in chosen:
        session.run("python", scripts[name], "--out", "benchmarks/results", *options)


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
