"""The Megatron-FSDP training scenarios on GPUs with NCCL (no shim), against the fp64 reference.

One launch over ``min(2, torch.cuda.device_count())`` ranks runs ZeRO-3 and
ZeRO-1 (fixed); with one GPU the data-parallel group has size 1, so every
gradient buffer is unsharded and the wgrads must accumulate.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)"),
]


def _load_helper(name: str) -> Any:
    module_name = f"_groupgrad_megatron_fsdp_tests_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(
        module_name, Path(__file__).with_name(f"{name}.py")
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


SHAPE = {"experts": 3, "hidden": 8, "ffn_hidden": 6, "tokens": 12}
COMMON = {"packed": False, "fixed": True, "steps": 2, "micro_batches": 2, "lr": 0.5, **SHAPE}
SCENARIOS = [
    {"name": "gpu-zero3", "strategy": "optim_grads_params", "seed": 11, **COMMON},
    {"name": "gpu-zero1-packed", "strategy": "optim", "seed": 12, **COMMON, "packed": True},
]


def test_training_on_gpus_matches_fp64_reference(tmp_path: Path) -> None:
    ref = _load_helper("reference")
    world = min(2, torch.cuda.device_count())
    results = ref.launch(tmp_path, world, SCENARIOS, backend="nccl", device="cuda")
    for cfg in SCENARIOS:
        ranks = results[cfg["name"]]
        ref.check_weights(ranks, ref.expected_weights(ranks))
        sharded = cfg["strategy"] == "optim_grads_params" and world > 1
        ref.check_main_grad_calls(ranks, overwrite=sharded)
        for result in ranks:
            assert all(c["dtype"] == "torch.float32" for c in result["collectives"])
