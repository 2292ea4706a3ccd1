"""Grouped GEMMs and the fused MLP's elementwise kernels for Mixture-of-Experts layers.

Three GEMMs with one argument order — :func:`grouped_fprop`,
:func:`grouped_dgrad`, :func:`grouped_wgrad` — run CUTLASS sm_90a grouped GEMMs
on CUDA tensors and a pure-PyTorch reference elsewhere. The fused MLP's
elementwise step, SwiGLU × router probabilities (:func:`swiglu_probs`,
:func:`swiglu_probs_backward`, and their FP8 forms), runs fused Triton
kernels on CUDA and the reference elsewhere. FP8 blockwise quantization for
Hopper's FP8 GEMMs, :func:`quantize_fp8` into :class:`Fp8Blocks`, runs
Triton on CUDA and the reference elsewhere. On sm_90 the activations' FP8
quantizer and the FP8 SwiGLU backward run hand-written CUDA kernels of the
CUTLASS backend instead, where it builds. Each kernel has a twin (``*_ref``) with the same
signature and semantics that always runs the reference. Importing this
package neither initializes CUDA nor compiles nor imports Triton; the
CUTLASS backend is built on first GPU use. Kernel plans, variants, builds
and per-call host stages for benchmarks: :mod:`groupgrad.kernels.tuning`.

Shapes: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features,
``F`` ffn_hidden_size; ``x`` is ``(T, K)``, each expert's weight ``(N, K)``,
``y``/``dy`` ``(T, N)``; rows are grouped by expert in order, ``splits[e]``
rows per expert.
"""

__version__ = "0.1.0"

from groupgrad.kernels._api import (
    PreparedWgrad,
    grouped_dgrad,
    grouped_dgrad_ref,
    grouped_fprop,
    grouped_fprop_ref,
    grouped_wgrad,
    grouped_wgrad_ref,
    prepare_wgrad,
)
from groupgrad.kernels._fp8 import Fp8Blocks, quantize_fp8, quantize_fp8_ref
from groupgrad.kernels._swiglu import (
    swiglu_probs,
    swiglu_probs_backward,
    swiglu_probs_backward_ref,
    swiglu_probs_ref,
)
from groupgrad.kernels._swiglu_fp8 import (
    swiglu_probs_backward_fp8,
    swiglu_probs_backward_fp8_ref,
    swiglu_probs_fp8,
    swiglu_probs_fp8_ref,
)

__all__ = [
    "Fp8Blocks",
    "PreparedWgrad",
    "grouped_dgrad",
    "grouped_dgrad_ref",
    "grouped_fprop",
    "grouped_fprop_ref",
    "grouped_wgrad",
    "grouped_wgrad_ref",
    "prepare_wgrad",
    "quantize_fp8",
    "quantize_fp8_ref",
    "swiglu_probs",
    "swiglu_probs_backward",
    "swiglu_probs_backward_fp8",
    "swiglu_probs_backward_fp8_ref",
    "swiglu_probs_backward_ref",
    "swiglu_probs_fp8",
    "swiglu_probs_fp8_ref",
    "swiglu_probs_ref",
]
