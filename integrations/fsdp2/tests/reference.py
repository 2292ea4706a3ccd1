"""Single-process replays of an FSDP2 training run: the fp64 oracle and PyTorch's own bf16.

:func:`replay` recomputes, in one process and with ``torch.nn.functional``
only (:func:`moe_model.reference_forward`), everything the ranks did: each
rank's micro-batches, the reduced gradient (mean over ranks of the sum over
micro-batches, as FSDP2 reduces), and SGD (with momentum) on master weights.

* ``compute=torch.float64``: fp64 master weights and compute — the oracle.
* ``compute=torch.bfloat16``: fp32 master weights, bf16 compute with bf16
  parameters (autograd's wgrads are bf16), gradients reduced in fp32 — what
  PyTorch itself computes for the same thing in bf16 (the bf16 rule's yardstick).

:func:`replays` gives both for a scenario, from the model it builds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def replays(
    cfg: Mapping[str, Any], world: int, moe_model: Any
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The fp64 and (bf16 scenarios only) PyTorch-bf16 replays, on one thread like the ranks.

    Small ops on two threads of a busy two-core machine run several times
    slower than on one.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        init = {n: p.detach() for n, p in moe_model.build(cfg).named_parameters()}
        fp64 = replay(cfg, init, world, torch.float64, moe_model)
        bf16 = replay(cfg, init, world, torch.bfloat16, moe_model) if cfg["bf16"] else None
    finally:
        torch.set_num_threads(threads)
    return fp64, bf16


def replay(
    cfg: Mapping[str, Any],
    init: Mapping[str, Tensor],
    world: int,
    compute: torch.dtype,
    moe_model: Any,
) -> dict[str, Any]:
    """Outputs and input grads per (step, rank, micro), reduced grads and weights per step."""
    master_dtype = torch.float64 if compute == torch.float64 else torch.float32
    master = {name: value.to(master_dtype).clone() for name, value in init.items()}
    momentum: dict[str, Tensor] = {}
    outs: dict[tuple[int, int, int], Tensor] = {}
    dxs: dict[tuple[int, int, int], Tensor] = {}
    grads: list[dict[str, Tensor]] = []
    weights: list[dict[str, Tensor]] = []
    for step in range(cfg["steps"]):
        total = {
            name: torch.zeros_like(value, dtype=torch.float64) for name, value in master.items()
        }
        for rank in range(world):
            for micro in range(cfg["micro_batches"]):
                data = moe_model.batch(cfg, step, micro, rank)
                params = {
                    n: v.to(compute, copy=True).requires_grad_(True) for n, v in master.items()
                }
                x = data["x"].to(master_dtype).requires_grad_(True)
                out = moe_model.reference_forward(params, cfg, x.to(compute), data["idx"])
                moe_model.loss_of(out, data["target"]).backward()
                outs[step, rank, micro] = out.detach()
                dxs[step, rank, micro] = x.grad.detach()
                for name, param in params.items():
                    if param.grad is not None:  # None: an expert this micro-batch did not use
                        total[name] += param.grad.double()
        reduced = {name: (value / world).to(master_dtype) for name, value in total.items()}
        grads.append(reduced)
        for name, grad in reduced.items():
            buffer = momentum.get(name)
            buffer = grad.clone() if buffer is None else buffer * cfg["momentum"] + grad
            momentum[name] = buffer
            master[name] = master[name] - cfg["lr"] * buffer
        weights.append({name: value.clone() for name, value in master.items()})
    return {"outs": outs, "dxs": dxs, "grads": grads, "weights": weights}
