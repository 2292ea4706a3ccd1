"""Grouped GEMMs for Mixture-of-Experts layers.

Three kernels with one argument order — :func:`grouped_fprop`,
:func:`grouped_dgrad`, :func:`grouped_wgrad` — run CUTLASS sm_90a grouped GEMMs
on CUDA tensors and a pure-PyTorch reference elsewhere; each has a twin
(``*_ref``) that always runs the reference. Importing this package neither
initializes CUDA nor compiles anything; the CUTLASS backend is built on first
GPU use.

Shapes: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features;
``x`` is ``(T, K)``, each expert's weight ``(N, K)``, ``y``/``dy`` ``(T, N)``;
rows are grouped by expert in order, ``splits[e]`` rows per expert.
"""

from groupgrad.kernels._api import (
    grouped_dgrad,
    grouped_dgrad_ref,
    grouped_fprop,
    grouped_fprop_ref,
    grouped_wgrad,
    grouped_wgrad_ref,
)

__all__ = [
    "grouped_dgrad",
    "grouped_dgrad_ref",
    "grouped_fprop",
    "grouped_fprop_ref",
    "grouped_wgrad",
    "grouped_wgrad_ref",
]
