"""The single-process replay of an FP8 FSDP2 run: the same FP8 model, unsharded, one process.

Why this oracle and not an fp64 chain of dequantized operands: the blockwise
quantization is a deterministic function of the tensor it reads, and an
unsharded model in one process reads exactly the tensors each rank reads
(FSDP2's all-gather restores the full weights bit for bit, ``param_dtype``
casts them as :meth:`torch.Tensor.to` does). So every GEMM of the replay
multiplies the same FP8 operands as the ranks', and only the reduction over
ranks differs (fp64 here, FSDP2's fp32 reduce-scatter there). The FP8 GEMMs
themselves are checked against an fp64 chain of the dequantized operands in
the modules' tests; what this replay adds is the sharding, the reduction, the
optimizer steps and a fresh quantization of the weights at every forward.

Its weights are quantized at every forward (``is_first_microbatch`` never
passed), so a rank that reused FP8 weights cached before an optimizer step
differs from it. bf16 scenarios run the replay's model in bf16 with
``grad_dtype = float32`` on its parameters: what FSDP2's ``param_dtype`` and
the integration's ``reduce_dtype`` route compute per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def replay(cfg: Mapping[str, Any], world: int, moe_model: Any) -> dict[str, Any]:
    """Outputs and input grads per (step, rank, micro), reduced grads and weights per step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (and several times faster on a busy machine)
    try:
        return _replay(cfg, world, moe_model)
    finally:
        torch.set_num_threads(threads)


def _replay(cfg: Mapping[str, Any], world: int, moe_model: Any) -> dict[str, Any]:
    compute = torch.bfloat16 if cfg["bf16"] else torch.float32
    model = moe_model.build(cfg)
    master = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    model.to(compute)
    params = dict(model.named_parameters())
    for param in params.values():
        param.grad_dtype = torch.float32
    momentum: dict[str, Tensor] = {}
    outs: dict[tuple[int, int, int], Tensor] = {}
    dxs: dict[tuple[int, int, int], Tensor] = {}
    grads: list[dict[str, Tensor]] = []
    weights: list[dict[str, Tensor]] = []
    for step in range(cfg["steps"]):
        with torch.no_grad():
            for name, param in params.items():  # fp32 master weights, cast as FSDP2 casts them
                param.copy_(master[name].float().to(compute))
        total = {n: torch.zeros_like(v) for n, v in master.items()}
        for rank in range(world):
            for micro in range(cfg["micro_batches"]):
                data = moe_model.batch(cfg, step, micro, rank)
                x = data["x"].requires_grad_(True)
                out = model(x.to(compute), data["idx"])
                moe_model.loss_of(out, data["target"]).backward()
                outs[step, rank, micro] = out.detach().clone()
                dxs[step, rank, micro] = x.grad.detach().clone()
                for name, param in params.items():
                    if param.grad is not None:
                        total[name] += param.grad.double()
                    param.grad = None
        reduced = {name: value / world for name, value in total.items()}
        grads.append(reduced)
        for name, grad in reduced.items():
            buffer = momentum.get(name)
            buffer = grad.clone() if buffer is None else buffer * cfg["momentum"] + grad
            momentum[name] = buffer
            master[name] = (master[name] - cfg["lr"] * buffer).float().double()
        weights.append({name: value.clone() for name, value in master.items()})
    return {"outs": outs, "dxs": dxs, "grads": grads, "weights": weights}
