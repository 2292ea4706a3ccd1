"""One forward and backward of a Hugging Face-style experts module, every result by name.

An experts module is called as ``experts(hidden_states, top_k_index,
top_k_weights)`` (transformers' experts interface); the tests compare what one
implementation gives with what another gives on the same inputs::

    out, results = run_experts(experts, hidden, index, weights, dy)
    results["d_hidden"], results["d_gate_up_proj"], ...
"""

from __future__ import annotations

from torch import Tensor, nn


def run_experts(
    experts: nn.Module, hidden: Tensor, index: Tensor, weights: Tensor, dy: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """Run ``experts`` forward on fresh leaf copies of ``hidden`` and ``weights``, then backward ``dy``.

    Every parameter's ``.grad`` is cleared first, so the gradients are this
    step's alone.

    Returns:
        The output (still attached to its autograd graph) and the results by
        name: ``"out"`` (the output, detached), ``"d_hidden"``, ``"d_weights"``
        and ``"d_<parameter name>"`` for each parameter of ``experts``.
    """
    hidden = hidden.detach().clone().requires_grad_(True)
    weights = weights.detach().clone().requires_grad_(True)
    for param in experts.parameters():
        param.grad = None
    out = experts(hidden, index, weights)
    out.backward(dy.to(out.dtype))
    results = {"out": out.detach(), "d_hidden": hidden.grad, "d_weights": weights.grad}
    for name, param in experts.named_parameters():
        results[f"d_{name}"] = param.grad
    return out, results  # type: ignore[return-value]
