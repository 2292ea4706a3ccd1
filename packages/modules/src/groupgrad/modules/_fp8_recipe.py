"""``fp8_recipe``: the one rule for its values, and the blockwise recipe's quantizations.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features, ``C`` any
activation's channels.

``"blockwise"`` (Hopper's FP8 recipe, DESIGN "Kernels"): e4m3 data with fp32
scales, ``(1, 128)`` blocks of ``x`` and ``dy`` for fprop and dgrad,
``(128, 128)`` weight tiles, ``(128, 1)`` token blocks inside each expert's
segment for the wgrad. Each FP8 form is quantized from the bf16 (fp16, fp32)
tensor, never from another FP8 form: ``x`` once at forward into both of its
forms, ``dy`` once at backward into both of its forms. The weights are
quantized from the materialized (and autocast-cast) weights at forward,
unless a :class:`~groupgrad.modules._fp8_cache.Fp8WeightCache` serves them
(``is_first_microbatch``). A layer's forward keeps its quantized plain
weights for its backward's dgrad (TransformerEngine's way: one quantization
per step, holding both orientations, 2 bytes per parameter, until backward);
backward quantizes them again where keeping them would undo a memory saving
the caller chose: weights that are gathered per use (``DistributedWeight``,
Megatron-FSDP, a module under FSDP2's ``fully_shard``), saved-tensor hooks
(activation checkpointing, offloading), the functional ops (which cannot see
FSDP2), and ``torch.compile``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from groupgrad.kernels import Fp8Blocks, quantize_fp8
from groupgrad.modules._fp8_cache import Fp8WeightCache
from groupgrad.modules._group import Splits, checks_weight_versions, fsdp_managed
from groupgrad.modules._operands import Operand
from groupgrad.protocol import is_distributed_weight, is_fsdp_param

__all__ = [
    "FP8_RECIPES",
    "Fp8Blockwise",
    "check_fp8_recipe",
    "check_fp8_sizes",
    "fp8_for_forward",
    "keeps_weights_for_backward",
    "weight_cache",
]

FP8_RECIPES = ("blockwise",)
"""The values ``fp8_recipe`` takes besides ``None``."""

ROWS, WEIGHTS, TOKENS = (1, 128), (128, 128), (128, 1)


def check_fp8_recipe(fp8_recipe: object) -> str | None:
    """``fp8_recipe`` itself when it is ``None`` or a supported recipe.

    Raises:
        ValueError: Any other value, naming it and the supported ones.
    """
    if fp8_recipe is None or (isinstance(fp8_recipe, str) and fp8_recipe in FP8_RECIPES):
        return fp8_recipe
    supported = ", ".join(repr(r) for r in FP8_RECIPES)
    raise ValueError(f"fp8_recipe is {fp8_recipe!r}, expected None or one of: {supported}")


def check_fp8_sizes(**sizes: int) -> None:
    """Raise ``ValueError`` naming the first size that is not a multiple of 128 (the FP8 blocks)."""
    for name, value in sizes.items():
        if value % 128:
            raise ValueError(
                f"{name} is {value}, expected a multiple of 128 for fp8_recipe='blockwise' "
                "(its FP8 blocks are 128 wide)"
            )


_MEMBER = re.compile(r"\bt\[(\d+)\]")  # the kernels' name of a listed member
_WHOLE = re.compile(r"(?<![\w.'])t(?![\w\[])")  # ... and of the whole argument


def _quantized(
    t: Tensor | Sequence[Tensor], what: str, names: Sequence[str] = (), **how: Any
) -> Any:
    """``quantize_fp8(t, **how)``, its argument errors naming ``what`` and, where the kernels
    say ``t`` or ``t[i]``, the argument (``names``: the weights' parameter names, leader
    first; else ``what``)."""
    try:
        return quantize_fp8(t, **how)
    except (TypeError, ValueError) as error:
        message = _MEMBER.sub(lambda m: names[int(m[1])] if names else m[0], str(error))
        message = _WHOLE.sub(names[0] if names else what, message)
        raise type(error)(f"fp8_recipe='blockwise' quantizes {what}: {message}") from error


@dataclass(frozen=True)
class Fp8Blockwise:
    """The blockwise recipe as one forward of one layer (and its backward) runs it.

    Attributes:
        cache: The layer's weight cache when the caller passed
            ``is_first_microbatch``, else ``None`` (quantize at every forward).
        refresh: ``is_first_microbatch=True``: the forward quantizes anew and
            caches; ``False``: the forward reuses a cached weight that still
            matches (else quantizes and caches).
        held: Without a cache, where the forward keeps the plain weights it
            quantized (by the leader's ``id``, each in a one-entry cache whose
            guard sees an in-place edit before backward) for backward's dgrad,
            which takes them out; ``None``: backward quantizes again.
    """

    cache: Fp8WeightCache | None = None
    refresh: bool = False
    held: dict[int, Fp8WeightCache] | None = None

    def quantize_input(
        self, x_TK: Tensor, splits: Splits, *, tokens: bool
    ) -> tuple[Fp8Blocks, Operand]:
        """``x``'s ``(1, 128)`` form (fprop) and, where a wgrad will read it (``tokens``), its
        ``(128, 1)`` form, each from ``x``; else ``x`` itself, as the bf16 path keeps it."""
        if not tokens:
            return self.quantize_rows(x_TK, "x"), x_TK
        both = _quantized(x_TK, "x", block=(ROWS, TOKENS), splits=splits)
        return cast(tuple[Fp8Blocks, Fp8Blocks], both)

    def quantize_grad(
        self, dy_TN: Tensor, splits: Splits, *, rows: bool, tokens: bool, what: str = "dy"
    ) -> tuple[Fp8Blocks | None, Fp8Blocks | None]:
        """``dy``'s ``(1, 128)`` form (dgrad) and ``(128, 1)`` form (wgrad), those asked for.

        ``what`` names the gradient in argument errors.
        """
        if rows and tokens:
            both = _quantized(dy_TN, what, block=(ROWS, TOKENS), splits=splits)
            return cast(tuple[Fp8Blocks, Fp8Blocks], both)
        if rows:
            return self.quantize_rows(dy_TN, what), None
        if tokens:
            return None, self.quantize_tokens(dy_TN, splits, what)
        return None, None

    def quantize_rows(self, t_TC: Tensor, what: str) -> Fp8Blocks:
        """``t``'s ``(1, 128)`` form: an fprop/dgrad operand, or an activation kept for backward."""
        return cast(Fp8Blocks, _quantized(t_TC, what, block=ROWS))

    def quantize_tokens(self, t_TC: Tensor, splits: Splits, what: str) -> Fp8Blocks:
        """``t``'s ``(128, 1)`` form, 128-token blocks inside each expert's rows (a wgrad operand)."""
        return cast(Fp8Blocks, _quantized(t_TC, what, block=TOKENS, splits=splits))

    def weights(
        self,
        params: Sequence[Tensor],
        gemm_weights: Callable[[], Tensor | list[Tensor]],
        dtype: torch.dtype,
        *,
        forward: bool,
        names: Sequence[str] = (),
    ) -> Fp8Blocks:
        """The ``(128, 128)`` weights for one GEMM: cached, or quantized now.

        Args:
            params: The layer's weight parameters, leader first (the cache's key).
            gemm_weights: Returns the materialized weights in the GEMM's dtype
                (called only when they are quantized now).
            dtype: That dtype (the cache's key too).
            forward: The forward's fprop (may fill the cache, or hold the
                weights for backward) or backward's dgrad (uses a matching
                cached or held weight, else quantizes and keeps nothing).
            names: The parameters' names, leader first, for error messages.

        A ``DistributedWeight`` group is never cached nor held: each GEMM
        quantizes the weights its leader materialized for it. Nor are
        Megatron-FSDP parameters (``__fsdp_param__``): it re-gathers them for
        every forward, and under ZeRO-1 writes the updated weights into the
        same storage without moving a version counter, where a cached entry
        looks current. (A layer FSDP manages gets no cache at all:
        :func:`weight_cache`.)
        """
        cache, held = self.cache, self.held
        if is_distributed_weight(params[0]) or is_fsdp_param(params[0]):
            cache = held = None
        if cache is not None and not (forward and self.refresh):
            cached = cache.get(params, dtype)
            if cached is not None:
                return cached
        if held is not None and not forward:
            kept = held.pop(id(params[0]), None)
            blocks = None if kept is None else kept.get(params, dtype)
            if blocks is not None:
                return blocks
        blocks = cast(Fp8Blocks, _quantized(gemm_weights(), "the weights", names, block=WEIGHTS))
        if forward and cache is not None:
            cache.put(params, dtype, blocks)
        elif forward and held is not None:
            held[id(params[0])] = for_dgrad = Fp8WeightCache()
            for_dgrad.put(params, dtype, blocks)
        return blocks


def keeps_weights_for_backward(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward may keep its quantized weights for backward's dgrad.

    Not without grad, not under ``torch.compile``, not in a module FSDP2's
    ``fully_shard`` manages (it frees the gathered weights after forward),
    and not under saved-tensor hooks (activation checkpointing and
    offloading, which drop what forward saves). The weights' own kind
    (distributed, Megatron-FSDP) is checked per GEMM.
    """
    return (
        checks_weight_versions(module)
        and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    )


def weight_cache(module: torch.nn.Module, cache: Fp8WeightCache) -> Fp8WeightCache | None:
    """``module``'s weight cache for ``is_first_microbatch``, or ``None`` where FSDP manages
    ``module``: its weights are gathered at every forward and freed after it, so they are never
    cached across forwards (DESIGN), and a cached FP8 copy of the gathered weights would stay
    alive through backward and the optimizer step, each layer's whole unsharded weight."""
    return None if fsdp_managed(module) else cache


def fp8_for_forward(
    fp8_recipe: str | None,
    cache: Fp8WeightCache | None,
    is_first_microbatch: bool | None,
    *,
    keep_weights: bool = False,
) -> Fp8Blockwise | None:
    """The recipe one forward runs (``None``: the bf16 path), its cache use resolved.

    Args:
        fp8_recipe: The layer's recipe, checked again here: a layer's ``fp8_recipe``
            attribute may be set after construction.
        cache: The layer's weight cache (``None`` for the functional op).
        is_first_microbatch: ``None`` never caches; ``True`` quantizes and
            caches; ``False`` reuses the cache.
        keep_weights: Without a cache, keep the forward's quantized weights
            for backward's dgrad (:func:`keeps_weights_for_backward`).

    Raises:
        ValueError: ``fp8_recipe`` is not ``None`` or a supported recipe.
        TypeError: ``is_first_microbatch`` is not ``None`` or a bool.
        RuntimeError: ``is_first_microbatch`` is given with the FP8 recipe under
            ``torch.compile``, where the cache's checks cannot run.
    """
    if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
        raise TypeError(
            f"is_first_microbatch is {is_first_microbatch!r}, expected None, True or False"
        )
    if check_fp8_recipe(fp8_recipe) is None:
        return None
    if is_first_microbatch is None or cache is None:
        return Fp8Blockwise(held={} if keep_weights else None)
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"is_first_microbatch={is_first_microbatch} with fp8_recipe='blockwise' under "
            "torch.compile: the FP8 weight cache is Python state whose checks (data_ptr, "
            "version) a compiled graph cannot run; pass is_first_microbatch=None (the weights "
            "are quantized at every forward) or run this layer eagerly"
        )
    return Fp8Blockwise(cache, refresh=is_first_microbatch)
