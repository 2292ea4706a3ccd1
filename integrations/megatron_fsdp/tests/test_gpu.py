"""The Megatron-FSDP training scenarios on GPUs with NCCL (no shim), against the fp64 reference.

One launch over ``min(2, torch.cuda.device_count())`` ranks runs ZeRO-3 and
ZeRO-1 (fixed); with one GPU the data-parallel group has size 1, so every
gradient buffer is unsharded and the wgrads must accumulate.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from groupgrad_testsupport import launch, load_sibling

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).with_name("mfsdp_worker.py")


SHAPE = {"experts": 3, "hidden": 8, "ffn_hidden": 6, "tokens": 12}
COMMON = {"packed": False, "fixed": True, "steps": 2, "micro_batches": 2, "lr": 0.5, **SHAPE}
SCENARIOS = [
    {"name": "gpu-zero3", "strategy": "optim_grads_params", "seed": 11, **COMMON},
    {"name": "gpu-zero1-packed", "strategy": "optim", "seed": 12, **COMMON, "packed": True},
]


def test_training_on_gpus_matches_fp64_reference(tmp_path: Path) -> None:
    ref = load_sibling(__file__, "reference")
    world = min(2, torch.cuda.device_count())
    results = launch(WORKER, SCENARIOS, world_size=world, workdir=tmp_path, device="cuda")
    for cfg in SCENARIOS:
        ranks = results[cfg["name"]]
        ref.check_weights(ranks, ref.expected_weights(ranks))
        sharded = cfg["strategy"] == "optim_grads_params" and world > 1
        ref.check_main_grad_calls(ranks, overwrite=sharded)
        for result in ranks:
            assert all(c["dtype"] == "torch.float32" for c in result["collectives"])
