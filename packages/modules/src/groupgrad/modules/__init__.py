"""groupgrad.modules: grouped-linear layers for Mixture-of-Experts, with the main_grad contract.

* :func:`grouped_linear` — the functional op (one autograd Function).
* :class:`GroupedLinear` — ``E`` experts' ``nn.Linear`` as grouped GEMMs, with
  per-expert or packed parameters, ``main_grad`` writing, delayed wgrad and
  ``DistributedWeight`` support.
* :func:`grouped_mlp` — the fused MLP as a functional op, for frameworks that
  own their parameters.
* :class:`GroupedMLP` — ``E`` experts' SwiGLU MLPs (fc1 → SwiGLU × router
  probabilities → fc2) as one fused op with one backward; both layers' weight
  gradients follow the same contract.
* :func:`routed_grouped_mlp` — token-choice experts in one op: gather each
  token's rows, the fused MLP, the router-weighted combine, at a lower peak
  memory than the three apart.

Weight gradients go where :mod:`groupgrad.protocol` says: into ``main_grad``
through the GEMM's epilogue (accumulate or overwrite), into a distributed
implementer's buffers, or back to autograd.
"""

__version__ = "0.1.0"

from groupgrad.modules._linear import GroupedLinear
from groupgrad.modules._linear_fn import grouped_linear
from groupgrad.modules._mlp import GroupedMLP
from groupgrad.modules._mlp_fn import grouped_mlp
from groupgrad.modules._routed import routed_grouped_mlp

__all__ = ["GroupedLinear", "GroupedMLP", "grouped_linear", "grouped_mlp", "routed_grouped_mlp"]
