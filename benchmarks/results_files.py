"""Where a benchmark's results land: ``<out>/<stem>.json`` and its PNG plot beside it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def gpu_stem(prefix: str, gpu: str) -> str:
    """``prefix`` plus the GPU's name as a file-name part (``"NVIDIA H200"`` → ``"h200"``)."""
    return prefix + gpu.lower().replace("nvidia ", "").replace(" ", "_")


def write_results(out: Path, stem: str, result: dict, plot: Callable[[dict, Path], None]) -> bool:
    """Write ``result`` to ``out/<stem>.json`` and ``plot(result, out/<stem>.png)``, saying each.

    Returns:
        Whether the PNG was written: ``False`` where matplotlib (imported only
        by the plot) is missing, which is said on stdout.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / f'{stem}.json'}")
    try:
        plot(result, out / f"{stem}.png")
    except ImportError as error:
        print(f"!! PNG not written: {error} (pip install matplotlib)")
        return False
    print(f"wrote {out / f'{stem}.png'}")
    return True
