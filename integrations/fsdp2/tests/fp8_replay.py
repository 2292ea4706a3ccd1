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

On a GPU the replay runs on the ranks' device, so its GEMMs are the same
CUTLASS kernels on the same operands (on the CPU, the reference kernels).

Its weights are quantized at every forward (``is_first_microbatch`` never
passed), so a rank that reused FP8 weights cached before an optimizer step
differs from it. bf16 scenarios run the replay's model in bf16 with
``grad_dtype = float32`` on its parameters: what FSDP2's ``param_dtype`` and
the integration's ``reduce_dtype`` route compute per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def replay(
    cfg: Mapping[str, Any],
    world: int,
    moe_model: Any,
    device: str = "cpu",
    restart_from: Sequence[Mapping[str, Tensor]] | None = None,
) -> dict[str, Any]:
    """Outputs and input grads per (step, rank, micro), reduced grads and weights per step (CPU).

    ``restart_from``: the ranks' weights after each step; step ``s > 0`` then
    starts from the ranks' weights after step ``s - 1`` instead of its own.
    Its FP8 operands are then the ranks' at every step, not only at the first:
    an fp32 update that differs from the ranks' in one ulp (the replay sums
    and steps in fp64) can move a weight across an e4m3 rounding boundary,
    and with it every later step's quantized weight.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (and several times faster on a busy machine)
    try:
        return _replay(cfg, world, moe_model, torch.device(device), restart_from)
    finally:
        torch.set_num_threads(threads)


def _replay(
    cfg: Mapping[str, Any],
    world: int,
    moe_model: Any,
    device: torch.device,
    restart_from: Sequence[Mapping[str, Tensor]] | None,
) -> dict[str, Any]:
    compute = torch.bfloat16 if cfg["bf16"] else torch.float32
    model = moe_model.build(cfg, device)
    master = {n: p.detach().double().cpu().clone() for n, p in model.named_parameters()}
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
        if restart_from is not None and step > 0:
            master = {name: restart_from[step - 1][name].double() for name in master}
        with torch.no_grad():
            for name, param in params.items():  # fp32 master weights, cast as FSDP2 casts them
                param.copy_(master[name].float().to(compute))
        total = {n: torch.zeros_like(v) for n, v in master.items()}
        for rank in range(world):
            for micro in range(cfg["micro_batches"]):
                data = moe_model.batch(cfg, step, micro, rank)
                x = data["x"].to(device).requires_grad_(True)
                out = model(x.to(compute), data["idx"].to(device))
                moe_model.loss_of(out, data["target"]).backward()
                outs[step, rank, micro] = out.detach().cpu().clone()
                dxs[step, rank, micro] = x.grad.detach().cpu().clone()
                for name, param in params.items():
                    if param.grad is not None:
                        total[name] += param.grad.double().cpu()
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
