"""The fused grouped MLP's arguments: its parameter layout and the checks at its boundary.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size;
fc1 weights are ``(2F, H)`` per expert, fc2 weights ``(H, F)``.

Shared by :func:`~groupgrad.modules.grouped_mlp`, :class:`~groupgrad.modules.GroupedMLP`
and :func:`~groupgrad.modules.routed_grouped_mlp`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from groupgrad.modules._group import WeightGroupSpec, check_biases
from groupgrad.protocol import is_distributed_weight

__all__ = [
    "ACTIVATIONS",
    "MLPLayout",
    "check_activation",
    "check_distributed_pairing",
    "check_mlp_inputs",
    "check_mlp_shapes",
    "layer_group",
    "mlp_arguments",
]

ACTIVATIONS = ("swiglu",)


@dataclass(frozen=True)
class MLPLayout:
    """How the flat parameter list of :class:`GroupedMLPFunction` splits into fc1 and fc2.

    ``apply`` receives ``*fc1_weights, *fc1_biases, *fc2_weights, *fc2_biases``;
    fc1 and fc2 have the same layout (per-expert or packed, bias or not).

    Attributes:
        fc1: fc1's weight layout.
        fc2: fc2's weight layout.
        num_weights: Weight parameters per layer (``E``, or 1 when packed).
        num_biases: Bias parameters per layer (0 without bias).
    """

    fc1: WeightGroupSpec
    fc2: WeightGroupSpec
    num_weights: int
    num_biases: int

    def split(
        self, params: Sequence[Tensor]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...], tuple[Tensor, ...], tuple[Tensor, ...]]:
        """``(fc1 weights, fc1 biases, fc2 weights, fc2 biases)``."""
        per_layer = self.num_weights + self.num_biases
        if len(params) != 2 * per_layer:
            raise ValueError(f"got {len(params)} parameters, expected {2 * per_layer}")
        fc1, fc2 = tuple(params[:per_layer]), tuple(params[per_layer:])
        w = self.num_weights
        return fc1[:w], fc1[w:], fc2[:w], fc2[w:]


def check_activation(activation: object, owner: str) -> None:
    """Raise ``ValueError`` unless ``activation`` is one the fused MLP supports."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation is {activation!r}; {owner} supports only "
            f"{', '.join(repr(a) for a in ACTIVATIONS)}"
        )


def check_mlp_inputs(x: object, probs: object, hidden_size: int) -> None:
    """Check ``x`` is ``(T, H)`` and ``probs`` is ``None`` or a floating ``(T,)`` on ``x``'s device.

    Raises:
        ValueError: A shape or device mismatch.
        TypeError: ``probs`` is not a floating-point tensor.
    """
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != hidden_size:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(
            f"x has shape {shape}, expected (tokens, {hidden_size}) for hidden_size={hidden_size}"
        )
    if probs is None:
        return
    if not isinstance(probs, Tensor):
        raise TypeError(f"probs is a {type(probs).__name__}, expected a Tensor or None")
    if tuple(probs.shape) != (x.shape[0],):
        raise ValueError(
            f"probs has shape {tuple(probs.shape)}, expected (T,) = ({x.shape[0]},): one "
            "router probability per row of x"
        )
    if not probs.dtype.is_floating_point:
        raise TypeError(f"probs has dtype {probs.dtype}, expected a floating-point dtype")
    if probs.device != x.device:
        raise ValueError(f"probs is on {probs.device}, expected x's device {x.device}")


def check_distributed_pairing(
    fc1_leader: Tensor,
    fc1_name: str,
    fc2_leader: Tensor,
    fc2_name: str,
    owner: str,
    plain_only: bool = False,
) -> None:
    """Raise ``ValueError`` unless fc1 and fc2 are both distributed or both plain;
    ``TypeError`` for a distributed one where ``owner`` takes ``plain_only`` weights."""
    if plain_only:
        for leader, name in ((fc1_leader, fc1_name), (fc2_leader, fc2_name)):
            if is_distributed_weight(leader):
                raise TypeError(
                    f"{name} is a DistributedWeight; {owner} takes plain weights (grouped_mlp "
                    "takes DistributedWeight groups)"
                )
        return
    fc1_distributed = is_distributed_weight(fc1_leader)
    if fc1_distributed == is_distributed_weight(fc2_leader):
        return
    distributed, plain = (fc1_name, fc2_name) if fc1_distributed else (fc2_name, fc1_name)
    raise ValueError(
        f"{distributed} is a DistributedWeight but {plain} is a plain tensor; {owner} needs fc1 "
        "and fc2 both distributed or both plain"
    )


def check_mlp_shapes(fc1: Tensor, fc1_name: str, fc2: Tensor, fc2_name: str) -> int:
    """Check fc1 is ``(·, 2F, H)`` and fc2 ``(·, H, F)`` with one ``E``; return ``H``."""
    (*e1, two_f, hidden), (*e2, out, ffn) = fc1.shape, fc2.shape
    if two_f != 2 * ffn or out != hidden or e1 != e2:
        raise ValueError(
            f"{fc1_name} has shape {tuple(fc1.shape)} and {fc2_name} has shape "
            f"{tuple(fc2.shape)}; expected fc1 (·, 2F, H) and fc2 (·, H, F) with one E, F and H"
        )
    return int(hidden)


def layer_group(
    name: str, weights: object, bias: Tensor | Sequence[Tensor] | None
) -> tuple[WeightGroupSpec, list[Tensor], list[Tensor]]:
    """One layer's weights and biases as a spec and parameter lists (functional form)."""
    if isinstance(weights, Tensor):
        if weights.dim() != 3 and not is_distributed_weight(weights):
            raise ValueError(
                f"{name}_weights has shape {tuple(weights.shape)}, expected (E, ·, ·) or a "
                "sequence of E 2-D tensors"
            )
        members: list[Tensor] = [weights]
        names: tuple[str, ...] = (f"{name}_weights",)
    elif isinstance(weights, Sequence) and not isinstance(weights, str | bytes) and weights:
        members = list(weights)
        for index, w in enumerate(members):
            if not isinstance(w, Tensor):
                raise TypeError(
                    f"{name}_weights[{index}] is a {type(w).__name__}, expected a Tensor"
                )
        names = tuple(f"{name}_weights[{i}]" for i in range(len(members)))
    else:
        raise TypeError(
            f"{name}_weights is {type(weights).__name__}, expected an (E, ·, ·) tensor or a "
            "non-empty sequence of E 2-D tensors"
        )
    packed = isinstance(weights, Tensor)
    biases: list[Tensor] = []
    if bias is not None:
        if packed != isinstance(bias, Tensor):
            raise ValueError(
                f"{name}_bias is a {type(bias).__name__}; expected a packed (E, ·) tensor with "
                f"packed {name}_weights, or a sequence of E 1-D tensors with per-expert weights"
            )
        biases = [bias] if isinstance(bias, Tensor) else list(bias)
        if len(biases) != len(members):
            raise ValueError(
                f"{name}_bias has {len(biases)} entries, expected {len(members)} (one per "
                f"{name} weight)"
            )
        if not is_distributed_weight(members[0]):
            check_biases(biases, members, packed, f"{name}_bias", f"{name}_weights")
    return WeightGroupSpec(names, packed, False), members, biases


def mlp_arguments(
    fc1_weights: Tensor | Sequence[Tensor],
    fc2_weights: Tensor | Sequence[Tensor],
    fc1_bias: Tensor | Sequence[Tensor] | None,
    fc2_bias: Tensor | Sequence[Tensor] | None,
    accumulate_into_main_grad: bool,
    owner: str,
    plain_only: bool = False,
) -> tuple[MLPLayout, list[Tensor], int | None]:
    """A functional fused MLP's weights and biases as a layout and its parameter list
    (``plain_only``: ``owner`` takes no ``DistributedWeight`` group).

    Returns:
        The layout, the parameters (``*fc1 weights, *fc1 biases, *fc2 weights,
        *fc2 biases``) and ``H`` (``None`` for a ``DistributedWeight`` group,
        whose shapes are its implementer's).

    Raises:
        ValueError: A shape or layout mismatch between fc1 and fc2 or their biases.
        TypeError: A weight that is not a tensor, or a ``DistributedWeight`` group
            where ``plain_only``.
    """
    if (fc1_bias is None) != (fc2_bias is None):
        raise ValueError(
            "fc1_bias and fc2_bias must be given both or neither, got "
            f"fc1_bias={'None' if fc1_bias is None else 'a bias'} and "
            f"fc2_bias={'None' if fc2_bias is None else 'a bias'}"
        )
    fc1, w1, b1 = layer_group("fc1", fc1_weights, fc1_bias)
    fc2, w2, b2 = layer_group("fc2", fc2_weights, fc2_bias)
    if fc1.packed != fc2.packed or len(w1) != len(w2):
        raise ValueError(
            f"fc1_weights and fc2_weights differ in layout ({len(w1)} "
            f"{'packed' if fc1.packed else 'per-expert'} vs {len(w2)} "
            f"{'packed' if fc2.packed else 'per-expert'}); expected the same"
        )
    check_distributed_pairing(w1[0], fc1.names[0], w2[0], fc2.names[0], owner, plain_only)
    hidden = None
    if not is_distributed_weight(w1[0]):
        hidden = check_mlp_shapes(w1[0], fc1.names[0], w2[0], fc2.names[0])
    layout = MLPLayout(
        fc1=WeightGroupSpec(fc1.names, fc1.packed, accumulate_into_main_grad),
        fc2=WeightGroupSpec(fc2.names, fc2.packed, accumulate_into_main_grad),
        num_weights=len(w1),
        num_biases=len(b1),
    )
    return layout, [*w1, *b1, *w2, *b2], hidden
