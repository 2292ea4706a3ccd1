"""Importing the protocol package must not touch CUDA."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_import_does_not_initialise_cuda() -> None:
    probe = textwrap.dedent(
        """
        import torch
        touched = []
        def spy(name):
            def call(*args, **kwargs):
                touched.append(name)
                raise RuntimeError(name + " called during import")
            return call
        for name in ("_lazy_init", "init", "is_available", "device_count", "current_device"):
            setattr(torch.cuda, name, spy(name))
        import groupgrad.protocol
        import groupgrad.protocol.testing
        assert not torch.cuda.is_initialized()
        print("touched:", touched)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "touched: []"
