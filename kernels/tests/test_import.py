"""Importing ``groupgrad.kernels`` is cheap and inert; the package is laid out as promised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import groupgrad.kernels

PACKAGE_DIR = Path(groupgrad.kernels.__file__).parent

PROBE = """
import json, sys
import torch
libraries_before = set(torch.ops.loaded_libraries)
modules_before = set(sys.modules)
import groupgrad.kernels
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


def test_import_neither_initializes_cuda_nor_loads_an_extension():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["cuda_initialized"] is False
    assert report["new_libraries"] == []
    assert report["extensions"] == []
    assert "groupgrad.kernels" in report["new_modules"]  # the probe did import it
    assert "groupgrad.kernels._cutlass" not in report["new_modules"]
    assert "groupgrad.kernels.build" not in report["new_modules"]
    assert "groupgrad.kernels._swiglu_triton" not in report["new_modules"]
    assert "triton" not in report["new_modules"]
    assert "torch.utils.cpp_extension" not in report["new_modules"]


def test_groupgrad_is_a_namespace_package():
    import groupgrad

    assert getattr(groupgrad, "__file__", None) is None
    assert not (PACKAGE_DIR.parent / "__init__.py").exists()
    assert (PACKAGE_DIR / "py.typed").is_file()


def test_public_names_are_documented():
    assert sorted(groupgrad.kernels.__all__) == [
        "grouped_dgrad",
        "grouped_dgrad_ref",
        "grouped_fprop",
        "grouped_fprop_ref",
        "grouped_wgrad",
        "grouped_wgrad_ref",
        "swiglu_probs",
        "swiglu_probs_backward",
        "swiglu_probs_backward_ref",
        "swiglu_probs_ref",
    ]
    for name in groupgrad.kernels.__all__:
        doc = getattr(groupgrad.kernels, name).__doc__ or ""
        assert "Args:" in doc, name
        assert "Returns:" in doc, name
