"""The FP8 FSDP2 scenarios and their checks, shared by the gloo (CPU) and NCCL (GPU) runs.

``SHAPE``: a one-block model, hidden and expert width 128 (the FP8 blocks'
size). :func:`fp8_scenarios` lists ``GroupedMLP`` and two ``GroupedLinear``,
per-expert and packed, fp32 and bf16 compute, resharding on and off, a DCP
round trip, and the ``"stale"`` caching habit (``fsdp2_worker.first_microbatch``);
``GroupedMLP`` once without the cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from groupgrad_testsupport import load_sibling

moe_model = load_sibling(__file__, "moe_model")
reference = load_sibling(__file__, "reference")
scenarios = load_sibling(__file__, "scenarios")

SHAPE = {**moe_model.SHAPE, "hidden": 128, "ffn": 128, "tokens": 64, "blocks": 1, "fp8": True}


def fp8_scenarios(prefix: str = "", seed: int = 70) -> list[dict[str, Any]]:
    """The five FP8 scenarios, named ``prefix + name``.

    The last one keeps the gathered weights from forward to backward
    (``reshard=False``) and caches nothing, so a layer that kept its FP8
    weights would serve them to dgrad unchanged: the one scenario where the
    first backward's quantization count shows whether it kept them.
    """
    stale = {"fp8_cache": "stale"}
    return [
        scenarios.scenario(
            f"{prefix}fp8_mlp_per_expert_fp32_stale", SHAPE, seed, bf16=False, **stale
        ),
        scenarios.scenario(
            f"{prefix}fp8_mlp_packed_bf16_stale",
            SHAPE,
            seed + 1,
            packed=True,
            reshard=False,
            empty_expert=False,
            **stale,
        ),
        scenarios.scenario(f"{prefix}fp8_linear_per_expert_bf16", SHAPE, seed + 2, module="linear"),
        scenarios.scenario(
            f"{prefix}fp8_linear_packed_fp32_dcp_stale",
            SHAPE,
            seed + 3,
            module="linear",
            packed=True,
            bf16=False,
            reshard=False,
            dcp=True,
            steps=3,
            momentum=0.9,
            **stale,
        ),
        scenarios.scenario(
            f"{prefix}fp8_mlp_packed_fp32_no_reshard",
            SHAPE,
            seed + 4,
            packed=True,
            bf16=False,
            reshard=False,
        ),
    ]


def check_matches_replay(
    cfg: Mapping[str, Any], ranks: Sequence[Mapping[str, Any]], expected: Mapping[str, Any]
) -> None:
    """Outputs, input grads, reduced grads and weights within 1e-5 of the replay's maxima."""
    name = cfg["name"]
    for step in range(cfg["steps"]):
        for param, grad in ranks[0]["grads"][step].items():
            for other in ranks[1:]:
                assert torch.equal(other["grads"][step][param], grad), (param, step)
    for rank, result in enumerate(ranks):
        for i, (out, dx) in enumerate(zip(result["outs"], result["dxs"], strict=True)):
            step, micro = divmod(i, cfg["micro_batches"])
            key = (step, rank, micro)
            scenarios.close(out, expected["outs"][key], f"{name} output {key}")
            scenarios.close(dx, expected["dxs"][key], f"{name} input grad {key}")
    for step in range(cfg["steps"]):
        for param, grad in ranks[0]["grads"][step].items():
            scenarios.close(grad, expected["grads"][step][param], f"{name} grad {param} {step}")
        for param, weight in ranks[0]["weights"][step].items():
            want = expected["weights"][step][param]
            scenarios.close(weight, want, f"{name} weight {param} after step {step}")


def check_ran_in_fp8(cfg: Mapping[str, Any], ranks: Sequence[Mapping[str, Any]]) -> None:
    """The expert gradients differ from an unquantized fp64 replay's by FP8's error, not 1e-5.

    And no sharded layer keeps its quantized weights from forward to backward,
    with or without ``is_first_microbatch`` (FSDP2 frees the gathered weights
    after forward; FSDP weights are never cached: the dgrad quantizes the
    re-gathered ones): the first backward quantizes as many weights as the
    first forward did.
    """
    for result in ranks:
        forward, backward = result["weight_quantizations"]
        assert forward > 0, result["weight_quantizations"]
        assert backward == forward, result["weight_quantizations"]
    init = {n: p.detach() for n, p in moe_model.build(cfg).named_parameters()}
    unquantized = reference.replay(cfg, init, len(ranks), torch.float64, moe_model)
    checked = 0
    for param, grad in ranks[0]["grads"][0].items():
        if scenarios.is_expert(param) and ".weight" in param:
            want = unquantized["grads"][0][param]
            error = float((grad.double() - want).abs().max() / want.abs().max())
            assert 1e-3 < error < 0.2, (param, error)
            checked += 1
    assert checked, list(ranks[0]["grads"][0])
