"""Root pytest configuration for every package's tests.

Puts ``tests/`` on ``sys.path`` so any test imports the shared test support
(``groupgrad_testsupport``), also when one package's tests run alone, and
applies the ``gpu`` marker: a test that needs more CUDA devices than are
visible is skipped with a reason (see ``groupgrad_testsupport.gpu``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_SUPPORT = str(Path(__file__).resolve().parent / "tests")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)

from groupgrad_testsupport.gpu import mark_unavailable  # noqa: E402


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: only selected tests are looked at
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_unavailable(items)
