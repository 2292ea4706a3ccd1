"""The main job (`nox -s demo`) end to end: router, top-k, groupgrad experts, fp32 main_grad."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "moe_demo.py"


def _run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(DEMO), "--device", "cpu", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize(("experts", "steps"), [("linear", 30), ("mlp", 4)])
def test_demo_trains_and_reports_where_gradients_went(experts: str, steps: int) -> None:
    out = _run("--experts", experts, "--steps", str(steps), "--print-every", "10")
    fell = re.search(r"loss went from ([0-9.]+) to ([0-9.]+) in (\d+) steps", out)
    assert fell is not None, out
    first, last = float(fell.group(1)), float(fell.group(2))
    assert last < first, out
    assert "16/16 had grad_added_to_main_grad set" in out
    assert "16/16 gave autograd a zero dummy" in out
    assert "torch.float32 main_grad" in out
    errors = re.search(r"fp32 ([0-9.e+-]+), bf16 ([0-9.e+-]+)", out)
    assert errors is not None, out
    assert float(errors.group(1)) < 1e-5 < float(errors.group(2))
