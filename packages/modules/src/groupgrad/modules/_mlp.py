"""``GroupedMLP``: every expert's SwiGLU MLP, fc1 → SwiGLU × router probs → fc2, fused.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from groupgrad.modules._group import WeightGroupSpec, WgradQueue
from groupgrad.modules._linear import GroupedLinear
from groupgrad.modules._mlp_fn import GroupedMLPFunction, MLPLayout
from groupgrad.protocol import is_distributed_weight

__all__ = ["GroupedMLP"]

ACTIVATIONS = ("swiglu",)


class GroupedMLP(nn.Module):
    """``E`` SwiGLU MLPs applied to consecutive row groups of one input, as one fused op.

    Expert ``e`` computes, on its ``splits[e]`` rows::

        h = x_e @ fc1_e.T (+ b1_e)                       (T_e, 2F)
        y_e = (silu(h[:, :F]) * h[:, F:] * probs_e[:, None]) @ fc2_e.T (+ b2_e)

    as one autograd Function with one backward (see ``_mlp_fn`` for the exact
    steps). The parameters live in the submodules :attr:`fc1` (a
    :class:`GroupedLinear` ``H → 2F``: ``fc1.weight0 …`` of shape ``(2F, H)``,
    or packed ``fc1.weight`` ``(E, 2F, H)``) and :attr:`fc2` (``F → H``:
    ``(H, F)`` per expert or ``(E, H, F)``); with ``bias=True`` also
    ``fc1.bias0 …`` / ``fc2.bias0 …`` (or packed ``(E, 2F)`` / ``(E, H)``).
    They are looked up by name at every forward, so a framework may replace
    them (e.g. with ``DistributedWeight`` leaders — for fc1 and fc2 both, or
    neither). Initialization: each expert like ``nn.Linear``.

    Activation memory: forward saves ``x`` ``(T, H)``, ``h`` ``(T, 2F)`` and
    ``probs`` ``(T,)`` when given — ``2·(H + 2F)`` bytes per token in bf16
    (plus 4 for fp32 ``probs``); the SwiGLU output ``(T, F)`` is always
    recomputed by backward's fused SwiGLU pass (no extra read: that pass reads
    ``h`` anyway), saving ``2·F`` bytes per token. Weights are never saved.

    Weight gradients follow the ``main_grad`` contract of
    :mod:`groupgrad.protocol` for fc1 and fc2 alike: with
    ``accumulate_into_main_grad=True`` each wgrad GEMM writes straight into
    ``main_grad`` — adding, or overwriting where ``overwrite_main_grad`` is
    set when the GEMM runs.

    Args:
        num_groups: ``E``, the number of experts.
        hidden_size: ``H``, the model width (input and output features).
        ffn_hidden_size: ``F``, each expert's intermediate width.
        activation: Only ``"swiglu"``: ``silu(gate) * up`` with the gate in
            the first ``F`` columns of fc1's output.
        bias: Whether fc1 and fc2 have per-expert biases.
        dtype: Parameter dtype (default: PyTorch's default dtype).
        device: Parameter device.
        single_grouped_weight: Hold each layer's experts in one packed
            parameter (``fc1.weight``, ``fc2.weight``).
        accumulate_into_main_grad: Write fc1's and fc2's weight gradients into
            each weight parameter's ``main_grad`` through the GEMM's epilogue
            (accumulating or overwriting, per ``overwrite_main_grad``);
            autograd receives a zero dummy (``grad_added_to_main_grad``) or
            ``None``.
        delay_wgrad_compute: Backward computes only the input, ``probs`` and
            bias gradients; both weight-gradient GEMMs run at
            :meth:`backward_dw`.

    Raises:
        ValueError: A size is not a positive int, or ``activation`` is not
            ``"swiglu"``.
    """

    def __init__(
        self,
        num_groups: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        single_grouped_weight: bool = False,
        accumulate_into_main_grad: bool = False,
        delay_wgrad_compute: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_groups", num_groups),
            ("hidden_size", hidden_size),
            ("ffn_hidden_size", ffn_hidden_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} is {value!r}, expected a positive int")
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation is {activation!r}; GroupedMLP supports only "
                f"{', '.join(repr(a) for a in ACTIVATIONS)}"
            )
        self.num_groups = num_groups
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.use_bias = bias
        self.single_grouped_weight = single_grouped_weight
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.delay_wgrad_compute = delay_wgrad_compute
        self._wgrad_queue = WgradQueue()

        def layer(in_features: int, out_features: int) -> GroupedLinear:
            return GroupedLinear(
                num_groups,
                in_features,
                out_features,
                bias=bias,
                dtype=dtype,
                device=device,
                single_grouped_weight=single_grouped_weight,
                accumulate_into_main_grad=accumulate_into_main_grad,
                delay_wgrad_compute=delay_wgrad_compute,
            )

        self.fc1 = layer(hidden_size, 2 * ffn_hidden_size)
        self.fc2 = layer(ffn_hidden_size, hidden_size)

    def reset_parameters(self) -> None:
        """Re-initialize every expert of fc1 and fc2 like ``nn.Linear``."""
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def _layer_spec(self, prefix: str, layer: GroupedLinear) -> WeightGroupSpec:
        return WeightGroupSpec(
            tuple(f"{prefix}.{name}" for name in layer.weight_names),
            self.single_grouped_weight,
            self.accumulate_into_main_grad,
        )

    def _check_inputs(self, x: Tensor, probs: Tensor | None) -> None:
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != self.hidden_size:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"x has shape {shape}, expected (tokens, {self.hidden_size}) for hidden_size="
                f"{self.hidden_size}"
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

    def _check_distributed_pairing(self, fc1_leader: Tensor, fc2_leader: Tensor) -> None:
        fc1_distributed = is_distributed_weight(fc1_leader)
        if fc1_distributed == is_distributed_weight(fc2_leader):
            return
        names = (f"fc1.{self.fc1.weight_names[0]}", f"fc2.{self.fc2.weight_names[0]}")
        distributed, plain = names if fc1_distributed else names[::-1]
        raise ValueError(
            f"{distributed} is a DistributedWeight but {plain} is a plain tensor; GroupedMLP "
            "needs fc1 and fc2 both distributed or both plain"
        )

    def forward(
        self, x: Tensor, splits: Sequence[int] | Tensor, probs: Tensor | None = None
    ) -> Tensor:
        """Apply every expert's MLP to its rows, scaled per token by ``probs``.

        Args:
            x: ``(T, H)`` input, rows grouped by expert in order, in the
                parameters' dtype.
            splits: ``E`` token counts summing to ``T`` (sequence, CPU tensor
                or device tensor; the GPU path never reads a device tensor on
                the host).
            probs: ``(T,)`` router probability of each row (any floating
                dtype; it receives a gradient in its dtype), or ``None`` for
                ones.

        Returns:
            ``(T, H)`` output in ``x``'s dtype.

        Raises:
            ValueError: ``x`` is not ``(T, H)``; ``probs`` is not ``(T,)`` or
                on another device; fc1 and fc2 are not both distributed or
                both plain (the kernels check ``splits``, dtypes and devices).
            TypeError: ``probs`` is not a floating-point tensor.
        """
        self._check_inputs(x, probs)
        fc1_weights = [getattr(self.fc1, name) for name in self.fc1.weight_names]
        fc2_weights = [getattr(self.fc2, name) for name in self.fc2.weight_names]
        self._check_distributed_pairing(fc1_weights[0], fc2_weights[0])
        fc1_biases = [getattr(self.fc1, name) for name in self.fc1.bias_names]
        fc2_biases = [getattr(self.fc2, name) for name in self.fc2.bias_names]
        layout = MLPLayout(
            fc1=self._layer_spec("fc1", self.fc1),
            fc2=self._layer_spec("fc2", self.fc2),
            num_weights=len(fc1_weights),
            num_biases=len(fc1_biases),
        )
        queue = self._wgrad_queue if self.delay_wgrad_compute else None
        return GroupedMLPFunction.apply(
            x,
            splits,
            probs,
            layout,
            queue,
            *fc1_weights,
            *fc1_biases,
            *fc2_weights,
            *fc2_biases,
        )

    def backward_dw(self) -> None:
        """Run the fc2 and fc1 weight-gradient GEMMs one backward deferred (oldest first).

        Only with ``delay_wgrad_compute=True``; a no-op otherwise. With
        ``main_grad`` each GEMM writes it now (the flag and dummy went to
        autograd at backward); without, the gradient is added into ``.grad``
        as autograd would have; distributed groups are finalized now, right
        after their gradient exists.

        Raises:
            RuntimeError: No backward has queued a weight gradient.
        """
        if self.delay_wgrad_compute:
            self._wgrad_queue.pop_and_run(type(self).__name__)

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation!r}, "
            f"bias={self.use_bias}, single_grouped_weight={self.single_grouped_weight}, "
            f"accumulate_into_main_grad={self.accumulate_into_main_grad}, "
            f"delay_wgrad_compute={self.delay_wgrad_compute}"
        )
