"""Import a helper module that sits beside a test file.

Tests run with ``--import-mode=importlib``, which puts no test folder on
``sys.path``, so ``import reference`` from a test does not work. Instead::

    ref = load_sibling(__file__, "reference")  # <this test's folder>/reference.py
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType


def load_sibling(test_file: str | Path, name: str) -> ModuleType:
    """The module ``<folder of test_file>/<name>.py``, imported once under a name unique to its path."""
    path = Path(test_file).resolve().with_name(f"{name}.py")
    module_name = "_groupgrad_tests_" + re.sub(r"\W", "_", str(path.with_suffix("")))
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
