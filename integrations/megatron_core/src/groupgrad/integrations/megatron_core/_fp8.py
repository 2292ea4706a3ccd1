"""Megatron's FP8 settings, read for groupgrad experts: what runs ``fp8_recipe="blockwise"``, what is refused.

Megatron's ``TransformerConfig`` (0.16 and 0.19 alike) says FP8 with
``fp8`` (``None``, ``"e4m3"`` or ``"hybrid"``; ``--fp8-format``),
``fp8_recipe`` (``"delayed"`` by default, ``"tensorwise"``, ``"mxfp8"``,
``"blockwise"``, ``"custom"``; a ``str`` enum), ``fp8_param``
(``--fp8-param-gather``: FP8 parameters), ``fp8_wgrad`` (``False``: wgrads
in high precision) and ``first_last_layers_bf16`` with
``num_layers_at_start_in_bf16`` / ``num_layers_at_end_in_bf16``. 0.19 adds
``quant_recipe`` (a per-module precision file for Transformer Engine).

groupgrad's FP8 route is the fused experts: ``fp8="e4m3"`` with
``fp8_recipe="blockwise"`` runs their ``GroupedMLP`` with
``fp8_recipe="blockwise"``; everything else FP8 is a ``ValueError`` at
construction naming the setting, its value and what is supported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FUSED_FP8", "fused_experts_fp8_recipe", "refuse_unfused_fp8", "runs_in_bf16"]

FUSED_FP8 = "fp8='e4m3' with fp8_recipe='blockwise'"
"""The one FP8 configuration groupgrad experts run, as its error messages name it."""


def _shown(value: Any) -> str:
    return repr(getattr(value, "value", value))  # Megatron's Fp8Recipe is a str enum


def fused_experts_fp8_recipe(config: Any, owner: str) -> str | None:
    """The ``fp8_recipe`` of the fused experts' ``GroupedMLP`` for this config.

    Returns:
        ``"blockwise"`` for ``fp8="e4m3"`` with ``fp8_recipe="blockwise"``;
        ``None`` (the parameters' dtype) without ``fp8``.

    Raises:
        ValueError: ``fp8="hybrid"``, another ``fp8_recipe``, ``fp8_param``,
            ``fp8_wgrad=False`` or a ``quant_recipe`` (0.19), or FP8 with a
            ``hidden_size`` or ``moe_ffn_hidden_size`` not a multiple of 128,
            named with the value; FP8 with a recompute Megatron runs only
            through Transformer Engine, which is not installed
            (:func:`_refuse_recompute_without_te`).
    """
    fp8 = config.fp8
    expected = f"groupgrad's fused experts support {FUSED_FP8} (or fp8=None)"
    if getattr(config, "fp8_param", False):
        raise ValueError(
            f"{owner}: fp8_param is True (--fp8-param-gather); {expected} with fp8_param=False: "
            "the expert weights stay bf16/fp32 parameters and are quantized at the forward"
        )
    if fp8 is None:
        return None
    if getattr(fp8, "value", fp8) != "e4m3":
        raise ValueError(f"{owner}: fp8 is {_shown(fp8)}; {expected}")
    recipe = config.fp8_recipe
    if getattr(recipe, "value", recipe) != "blockwise":
        raise ValueError(
            f"{owner}: fp8_recipe is {_shown(recipe)} with fp8='e4m3'; {expected} (1x128 "
            "activation and 128x128 weight blocks, fp32 scales)"
        )
    if not getattr(config, "fp8_wgrad", True):
        raise ValueError(
            f"{owner}: fp8_wgrad is False; {expected}, whose weight gradients are FP8 GEMMs "
            "into fp32, expected fp8_wgrad=True"
        )
    if getattr(config, "quant_recipe", None) is not None:
        raise ValueError(
            f"{owner}: quant_recipe is {config.quant_recipe!r}; {expected}, expected "
            "quant_recipe=None"
        )
    for setting in ("hidden_size", "moe_ffn_hidden_size"):  # named as Megatron names them
        if getattr(config, setting) % 128:
            raise ValueError(
                f"{owner}: {setting} is {getattr(config, setting)} with {FUSED_FP8}, expected a "
                "multiple of 128 (the FP8 GEMMs' 128-wide blocks)"
            )
    _refuse_recompute_without_te(config, owner)
    return "blockwise"


def _te_installed() -> bool:
    """Whether Megatron's MoE layer imported Transformer Engine's checkpoint (0.16 leaves the
    name undefined where the import failed, 0.19 sets it to ``None``)."""
    from megatron.core.transformer.moe import moe_layer

    return getattr(moe_layer, "te_checkpoint", None) is not None


def _refuse_recompute_without_te(config: Any, owner: str) -> None:
    """Refuse a recompute of an FP8 config that Megatron cannot run without Transformer Engine.

    With ``config.fp8`` set, Megatron recomputes through Transformer Engine's
    ``te_checkpoint``: ``recompute_granularity="full"`` (``TransformerBlock``),
    the selective ``"moe"`` and, where there is a shared expert not overlapped
    with the token dispatch, ``"shared_experts"`` (``MoELayer``). Without
    Transformer Engine the first forward fails (``NameError: te_checkpoint``,
    ``'NoneType' object is not callable``; megatron-core 0.16 and 0.19).
    """
    granularity = getattr(config, "recompute_granularity", None)
    shared = getattr(config, "moe_shared_expert_intermediate_size", None) is not None
    shared = shared and not getattr(config, "moe_shared_expert_overlap", False)
    through_te = ("moe", "shared_experts") if shared else ("moe",)
    modules = [m for m in getattr(config, "recompute_modules", None) or () if m in through_te]
    if granularity == "full":
        what = "recompute_granularity is 'full'"
    elif granularity == "selective" and modules:
        what = f"recompute_modules holds {modules} (recompute_granularity='selective')"
    else:
        return
    if _te_installed():
        return
    raise ValueError(
        f"{owner}: {what} under {FUSED_FP8}: Megatron recomputes an FP8 layer only through "
        "Transformer Engine's te_checkpoint, and Transformer Engine is not installed (the "
        "first forward would stop with NameError: te_checkpoint). Install Transformer Engine, "
        "or leave that recompute off (for 'moe': the fused experts recompute their SwiGLU in "
        "backward anyway)"
    )


def refuse_unfused_fp8(config: Any, owner: str) -> None:
    """Refuse FP8 for the grouped-linear experts (Megatron's ``TEGroupedMLP`` with groupgrad linears).

    Megatron's own ``TEGroupedMLP`` runs FP8 only through Transformer
    Engine; groupgrad's FP8 route is the fused experts.

    Raises:
        ValueError: ``config.fp8`` is set.
    """
    if config.fp8 is not None:
        raise ValueError(
            f"{owner}: fp8 is {_shown(config.fp8)}; the grouped-linear experts (fused=False, "
            "Megatron's TEGroupedMLP layer, which runs FP8 only through Transformer Engine) "
            f"compute in the parameters' dtype. groupgrad's FP8 route is the fused experts: "
            f"build the spec with fused=True (GroupgradFusedExperts) and {FUSED_FP8}"
        )


def runs_in_bf16(config: Any, layer_number: int) -> bool:
    """Whether Megatron keeps this layer out of FP8 (``first_last_layers_bf16``).

    Args:
        layer_number: The transformer layer's global number, 1-based, as
            Megatron's ``TransformerLayer.layer_number``.

    Megatron's rule (``fp8_utils.is_first_last_bf16_layer``): the first
    ``num_layers_at_start_in_bf16`` and the last ``num_layers_at_end_in_bf16``
    of ``num_layers`` layers.
    """
    if not config.first_last_layers_bf16:
        return False
    index = layer_number - 1
    return (
        index < config.num_layers_at_start_in_bf16
        or index >= config.num_layers - config.num_layers_at_end_in_bf16
    )
