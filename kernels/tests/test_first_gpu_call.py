"""What a user meets at the first GPU call of groupgrad.kernels, checked on a CPU.

* Without the ``[cuda]`` extra's build tools, a call that suits CUTLASS raises a
  ``RuntimeError`` naming ``pip install 'groupgrad-kernels[cuda]'`` (a CPU
  install of groupgrad-kernels pulls none of them).
* Before the first call compiles the kernels, one WARNING says what is built,
  about how long it takes and how to prebuild; with no logging configured it
  still reaches the terminal (Python's last-resort handler). A cached build
  compiles nothing and says nothing.

The compiler itself is replaced by a stand-in here; the GPU suite builds for real.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from groupgrad.kernels import _cutlass
from groupgrad.kernels.build import VARIANT_SETS, VARIANTS, build_spec

A_DEFAULT_VARIANT = VARIANTS[0].name


@pytest.fixture
def fresh_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> list[list[str]]:
    """No extension loaded, an empty cache under ``tmp_path``, and a build that compiles nothing.

    Returns, per run of the stand-in build, the messages logged before it began.
    """
    monkeypatch.setenv("GROUPGRAD_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(_cutlass, "_modules", {})
    monkeypatch.setattr(_cutlass, "_toolchain_reason_cache", [])
    caplog.set_level(logging.DEBUG, logger="groupgrad.kernels")
    seen_at_build: list[list[str]] = []

    def stand_in_build(*args: object, **kwargs: object) -> None:
        seen_at_build.append([record.getMessage() for record in caplog.records])
        _cutlass._modules["default"] = SimpleNamespace(variants=lambda: [A_DEFAULT_VARIANT])

    monkeypatch.setattr(_cutlass, "build", stand_in_build)
    return seen_at_build


def test_missing_build_tools_raise_naming_the_cuda_extra(
    monkeypatch: pytest.MonkeyPatch, fresh_backend: list[list[str]]
) -> None:
    monkeypatch.setattr(_cutlass, "BUILD_TOOLS", {"groupgrad_absent_module": "nvidia-cutlass"})
    with pytest.raises(
        RuntimeError,
        match=r"needs nvidia-cutlass to compile .* pip install 'groupgrad-kernels\[cuda\]'",
    ):
        _cutlass._toolchain_reason()


def test_present_build_tools_raise_nothing(
    monkeypatch: pytest.MonkeyPatch, fresh_backend: list[list[str]]
) -> None:
    monkeypatch.setattr(_cutlass, "BUILD_TOOLS", {"torch": "torch"})
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", None)
    assert _cutlass._toolchain_reason() == (
        "nvcc was not found (CUDA_HOME is unset or has no bin/nvcc)"
    )


def test_a_loaded_extension_needs_no_build_tools(
    monkeypatch: pytest.MonkeyPatch, fresh_backend: list[list[str]]
) -> None:
    monkeypatch.setattr(_cutlass, "BUILD_TOOLS", {"groupgrad_absent_module": "nvidia-cutlass"})
    _cutlass._modules["default"] = SimpleNamespace(variants=list)
    assert _cutlass._toolchain_reason() is None


def test_first_call_says_it_compiles_before_it_compiles(
    fresh_backend: list[list[str]], caplog: pytest.LogCaptureFixture, tmp_path
) -> None:
    _cutlass._extension(A_DEFAULT_VARIANT)
    _cutlass._extension(A_DEFAULT_VARIANT)  # loaded now: nothing more is said or built
    assert len(fresh_backend) == 1, "the stand-in build ran more than once"
    (said_before_build,) = fresh_backend
    assert len(said_before_build) == 1, said_before_build
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    message = said_before_build[0]
    assert f"compiling {len(VARIANT_SETS['default'])} CUTLASS kernel variants" in message
    assert str(tmp_path) in message
    assert "about 2 minutes on a 16-core host" in message
    assert "python -m groupgrad.kernels.build" in message


def test_a_cached_build_is_loaded_without_a_word(
    fresh_backend: list[list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    spec = build_spec(None, VARIANT_SETS["default"])
    (spec.directory / "build").mkdir(parents=True)
    (spec.directory / "build" / f"{spec.name}.so").write_bytes(b"")
    (spec.directory / "complete").write_text("\n")
    _cutlass.compiled_variants()
    assert fresh_backend == [[]]
    assert caplog.records == []


_NO_LOGGING_CONFIGURED = f"""
from types import SimpleNamespace
from groupgrad.kernels import _cutlass

def stand_in_build(*args, **kwargs):
    print("build starts")
    _cutlass._modules["default"] = SimpleNamespace(variants=lambda: [])

_cutlass.build = stand_in_build
_cutlass._extension({A_DEFAULT_VARIANT!r})
"""


def test_the_notice_reaches_stderr_with_no_logging_configured(tmp_path) -> None:
    env = {**os.environ, "GROUPGRAD_KERNELS_CACHE": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", _NO_LOGGING_CONFIGURED],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "build starts"
    lines = [line for line in done.stderr.splitlines() if "groupgrad.kernels" in line]
    assert len(lines) == 1, done.stderr
    assert "Prebuild them with: python -m groupgrad.kernels.build" in lines[0]
