"""FP8 layers under FSDP2: their quantized weights never outlive one forward of the unit.

An FP8 groupgrad layer caches its quantized weights when the caller passes
``is_first_microbatch`` (TransformerEngine's convention), and drops the cache
when the parameter's identity, ``data_ptr`` or version changes. Under FSDP2
only the address can change: the unsharded parameter a layer sees is the
same object at every forward, FSDP2 copies the all-gathered weights into it
without moving its version counter, and its storage, freed when the unit
reshards after backward (whatever ``reshard_after_forward`` says), is
allocated again at the next unshard, at an address the allocator picks. When
it picks the old one, a weight quantized before an optimizer step looks
current. So each time FSDP2 unshards a unit for forward, every FP8 layer
of the unit starts with an empty cache: its weights are quantized from the
freshly gathered parameters, whatever ``is_first_microbatch`` says, and
backward reuses the forward's quantization only while the cache's own checks
still hold (else it quantizes the re-gathered weights again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from groupgrad.modules import GroupedLinear

__all__ = ["FreshFp8Weights", "fp8_layers"]


def fp8_layers(members: Sequence[nn.Module]) -> list[GroupedLinear]:
    """The FP8 ``GroupedLinear`` s among ``members`` (a ``GroupedMLP``'s are its ``fc1``/``fc2``)."""
    return [m for m in members if isinstance(m, GroupedLinear) and m.fp8_recipe is not None]


class FreshFp8Weights:
    """Forward pre-hook: the unit's FP8 layers drop any cached quantized weights.

    Registered on each module of an FSDP2 unit that holds FP8 layers, after
    FSDP2's own pre-forward hook (which gathers the weights).

    Args:
        layers: The unit's FP8 layers (:func:`fp8_layers`).
    """

    def __init__(self, layers: Sequence[GroupedLinear]) -> None:
        self.layers = list(layers)

    @torch.compiler.disable  # runs outside a compiled unit's graph (see _shard)
    def __call__(self, module: nn.Module, args: Any) -> None:
        for layer in self.layers:
            layer._fp8_weights.clear()  # the layer's cache (groupgrad.modules._fp8_cache)
