"""Which Megatron ``TransformerConfig`` settings groupgrad experts support, checked at construction.

Every check raises ``ValueError`` naming the setting, its value and what is
expected, so an unsupported setup fails when the model is built, not at the
first step.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

__all__ = [
    "SPEC_NUM_EXPERTS",
    "check_expert_config",
    "check_expert_groups",
    "check_fused_config",
    "check_offloading",
    "check_spec_experts",
    "check_unfused_recompute",
    "process_groups",
]

SPEC_NUM_EXPERTS = "spec_num_experts"
"""Class attribute of an experts class bound to a spec's ``num_experts`` (``_specs``)."""


def process_groups(pg_collection: Any) -> Any:
    """``pg_collection``, or Megatron's default MoE process groups when it is ``None``."""
    if pg_collection is not None:
        return pg_collection
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()


def check_expert_config(config: Any, owner: str) -> None:
    """Check the settings every groupgrad expert layer needs (before any process group is read).

    Raises:
        ValueError: Expert tensor parallelism (``expert_tensor_parallel_size``
            larger than 1), or FP4 training. FP8 is each backend's own check
            (``_fp8``).
    """
    etp = config.expert_tensor_parallel_size
    if etp is not None and etp > 1:
        raise ValueError(
            f"{owner}: expert_tensor_parallel_size is {etp}; groupgrad experts do not implement "
            "expert tensor parallelism, expected 1 (use expert_model_parallel_size to spread "
            "experts over ranks)"
        )
    fp4 = getattr(config, "fp4", None)
    if fp4:
        raise ValueError(
            f"{owner}: fp4 is {fp4!r}; groupgrad experts compute in the parameters' dtype "
            "(bf16, fp16 or fp32) or in FP8 (the fused experts), expected fp4=None"
        )


def check_expert_groups(pg_collection: Any, owner: str) -> None:
    """Check the process groups: no expert tensor parallelism.

    Raises:
        ValueError: The expert tensor-parallel group (``pg_collection.expt_tp``)
            has more than one rank.
    """
    group_size = pg_collection.expt_tp.size()
    if group_size > 1:
        raise ValueError(
            f"{owner}: the expert tensor-parallel group (pg_collection.expt_tp) has {group_size} "
            "ranks; groupgrad experts do not implement expert tensor parallelism, expected 1"
        )


def check_fused_config(config: Any, owner: str) -> None:
    """Check the settings the fused SwiGLU experts need (on top of :func:`check_expert_config`).

    The fused op computes ``fc2(silu(h[:, :F]) * h[:, F:] * probs)`` with
    ``h = fc1(x)`` and no biases: Megatron's SwiGLU with the router
    probability applied after the activation.

    Raises:
        ValueError: Another activation (``gated_linear_unit`` off, an
            ``activation_func`` other than ``F.silu``, a clamp value, a GLU
            linear offset, interleaved GLU weights), biases
            (``add_bias_linear``: Megatron scales fc2's bias by the router
            probability, the fused op does not), or an MoE latent projection.
    """
    expected = [
        ("gated_linear_unit", config.gated_linear_unit, True),
        ("activation_func", config.activation_func, F.silu),
        ("add_bias_linear", config.add_bias_linear, False),
        ("activation_func_clamp_value", getattr(config, "activation_func_clamp_value", None), None),
        ("glu_linear_offset", getattr(config, "glu_linear_offset", 0.0), 0.0),
        # 0.19 only (absent, i.e. None, on 0.16)
        ("moe_mlp_glu_interleave_size", getattr(config, "moe_mlp_glu_interleave_size", None), None),
        ("moe_latent_size", getattr(config, "moe_latent_size", None), None),
    ]
    for name, value, wanted in expected:
        if value is not wanted and value != wanted:
            shown = getattr(value, "__name__", repr(value))
            wanted_shown = getattr(wanted, "__name__", repr(wanted))
            raise ValueError(
                f"{owner}: {name} is {shown}, expected {wanted_shown}: the fused experts compute "
                "SwiGLU (silu(gate) * up) times the router probability, without biases; use the "
                "unfused groupgrad experts (fused=False) for other activations, biases or a "
                "latent projection"
            )


def check_spec_experts(cls: type, config: Any, owner: str) -> None:
    """Check a spec's ``num_experts`` against the config the layer is built with.

    The spec helpers that take ``num_experts`` bind it to the experts class
    they put in the spec (:data:`SPEC_NUM_EXPERTS`); Megatron builds the
    layer from ``config.num_moe_experts``.

    Raises:
        ValueError: The two differ.
    """
    expected = getattr(cls, SPEC_NUM_EXPERTS, None)
    if expected is not None and config.num_moe_experts != expected:
        raise ValueError(
            f"{owner}: the spec was made for num_experts={expected} but config.num_moe_experts is "
            f"{config.num_moe_experts}; expected the same number (pass the config's "
            "num_moe_experts to the spec helper)"
        )


def check_unfused_recompute(config: Any, owner: str) -> None:
    """Refuse ``moe_act`` recompute in Megatron's ``TEGroupedMLP`` where it cannot run.

    ``TEGroupedMLP`` recomputes the activation through
    ``tensor_parallel.CheckpointWithoutOutput()``, whose default ``fp8=False``
    counts as FP8 (``fp8 is not None``) and so reads Transformer Engine's FP8
    state: without Transformer Engine the first forward fails with
    ``NameError: FP8GlobalStateManager`` (megatron-core 0.16 and 0.19).

    Raises:
        ValueError: ``"moe_act"`` in ``recompute_modules`` with
            ``recompute_granularity="selective"``, and that class would read
            Transformer Engine's state without Transformer Engine installed.
    """
    modules = getattr(config, "recompute_modules", None) or ()
    if getattr(config, "recompute_granularity", None) != "selective" or "moe_act" not in modules:
        return
    from megatron.core.tensor_parallel import random as tp_random

    if getattr(tp_random, "HAVE_TE", False) or not tp_random.CheckpointWithoutOutput().fp8:
        return
    raise ValueError(
        f"{owner}: recompute_modules holds 'moe_act' (recompute_granularity='selective'), "
        "which Megatron's TEGroupedMLP runs through tensor_parallel.CheckpointWithoutOutput; "
        "without Transformer Engine installed that fails at the first forward (NameError: "
        "FP8GlobalStateManager). Use the fused groupgrad experts (fused=True: they keep fc1's "
        "output and recompute the activation in backward anyway), or drop 'moe_act'"
    )


def check_offloading(config: Any, owner: str, *, fused: bool) -> None:
    """Refuse fine-grained activation offloading of expert activations the experts keep.

    Megatron's ``TEGroupedMLP`` offloads fc1's input (``"expert_fc1"``) by
    switching its Transformer Engine linears to save their original input
    (``set_save_original_input``, which raises a message about Transformer
    Engine's version for any other linear); the fused experts save fc1's
    output and the activation inside one op, which offloads neither
    (``"expert_fc1"``, ``"moe_act"``) nor the whole MLP (0.19's
    ``"fused_group_mlp"``).

    Raises:
        ValueError: ``fine_grained_activation_offloading`` with such a module
            in ``offload_modules``.
    """
    if not getattr(config, "fine_grained_activation_offloading", False):
        return
    kept = {"expert_fc1", "moe_act", "fused_group_mlp"} if fused else {"expert_fc1"}
    found = sorted(kept & set(getattr(config, "offload_modules", None) or ()))
    if not found:
        return
    if fused:
        how = (
            "the fused groupgrad experts save fc1's output and the activation inside one op "
            "and offload neither; drop them from offload_modules, or use the unfused groupgrad "
            "experts (fused=False), which offload 'moe_act'"
        )
    else:
        how = (
            "Megatron offloads fc1's input by switching Transformer Engine linears to save "
            "their original input, a switch groupgrad's grouped linears do not have; drop it "
            "from offload_modules ('moe_act' offloads)"
        )
    raise ValueError(
        f"{owner}: fine_grained_activation_offloading is on and offload_modules holds "
        f"{found}, expected none of {sorted(kept)}: {how}"
    )
