"""Importing ``groupgrad.kernels`` is cheap and inert; the package is laid out as promised."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import groupgrad.kernels
from groupgrad.kernels import tuning
from groupgrad_testsupport.gemms import public_kernel_names

PACKAGE_DIR = Path(groupgrad.kernels.__file__).parent

PROBE = """
import json, sys
import torch
libraries_before = set(torch.ops.loaded_libraries)
modules_before = set(sys.modules)
import {module}
new_modules = sorted(set(sys.modules) - modules_before)
print(json.dumps({
    "cuda_initialized": torch.cuda.is_initialized(),
    "new_libraries": sorted(set(torch.ops.loaded_libraries) - libraries_before),
    "new_modules": new_modules,
    "extensions": [
        name for name in new_modules
        if str(getattr(sys.modules[name], "__file__", "") or "").endswith((".so", ".pyd"))
    ],
}))
"""


def _probe(module: str) -> dict:
    """What importing ``module`` in a fresh interpreter did."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = PROBE.replace("{module}", module)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_neither_initializes_cuda_nor_loads_an_extension():
    report = _probe("groupgrad.kernels")
    assert report["cuda_initialized"] is False
    assert report["new_libraries"] == []
    assert report["extensions"] == []
    assert "groupgrad.kernels" in report["new_modules"]  # the probe did import it
    assert "groupgrad.kernels._cutlass" not in report["new_modules"]
    assert "groupgrad.kernels.build" not in report["new_modules"]
    assert "groupgrad.kernels._swiglu_triton" not in report["new_modules"]
    assert "triton" not in report["new_modules"]
    assert "torch.utils.cpp_extension" not in report["new_modules"]


def test_importing_tuning_neither_initializes_cuda_nor_compiles():
    report = _probe("groupgrad.kernels.tuning")
    assert report["cuda_initialized"] is False
    assert report["new_libraries"] == []
    assert report["extensions"] == []
    assert "groupgrad.kernels.tuning" in report["new_modules"]
    assert "torch.utils.cpp_extension" not in report["new_modules"]  # what a build imports
    assert "triton" not in report["new_modules"]


def test_groupgrad_is_a_namespace_package():
    import groupgrad

    assert getattr(groupgrad, "__file__", None) is None
    assert not (PACKAGE_DIR.parent / "__init__.py").exists()
    assert (PACKAGE_DIR / "py.typed").is_file()


def test_public_names_are_documented():
    assert sorted(groupgrad.kernels.__all__) == public_kernel_names()  # each with its twin
    for name in groupgrad.kernels.__all__:
        obj = getattr(groupgrad.kernels, name)
        doc = obj.__doc__ or ""
        if inspect.isclass(obj):  # a type: what it holds, or what builds it
            assert "Attributes:" in doc or "Args:" in doc, name
            continue
        assert "Args:" in doc, name
        assert "Returns:" in doc, name


@pytest.mark.parametrize("name", tuning.__all__)
def test_tuning_names_are_documented(name: str) -> None:
    obj = getattr(tuning, name)
    assert f"{name}`" in (tuning.__doc__ or ""), f"the module docstring does not present {name}"
    if inspect.isfunction(obj):
        doc = obj.__doc__ or ""
        if inspect.signature(obj).parameters:
            assert "Args:" in doc, name
        assert "Returns:" in doc, name
    elif inspect.isclass(obj):
        assert "Attributes:" in (obj.__doc__ or ""), name
