"""One rank of the FP8 scenarios: the fused experts under Megatron's schedule and optimizer.

Run by ``groupgrad_testsupport.launch``: on the CPU (gloo, the test-only
``cpu_shim``; Megatron's ``DistributedOptimizer`` and its no-pipelining
schedule allocate a few scalars with ``device="cuda"`` and check
``param.type()`` for ``torch.cuda.*Tensor``, which :func:`_optimizer_on_cpu`
maps to the CPU in this process only) or on a GPU (NCCL, nothing patched:
the experts run the CUTLASS FP8 GEMMs and the Triton quantizers). Kinds:

* ``step`` — an MoE layer (``get_moe_module_groupgrad_spec``, bf16,
  ``fp8="e4m3"``, ``fp8_recipe="blockwise"``) under Megatron's DDP and
  ``DistributedOptimizer``, two optimizer steps of two micro-batches each
  through ``forward_backward_no_pipelining``: the ``is_first_microbatch``
  each experts forward passed, and each forward's output beside the same
  experts run on the same rows with weights quantized afresh
  (``is_first_microbatch=None``) and with the weights of before the step.
* ``bf16_layers`` — three MoE layers told their numbers (1, 2, 3) under
  ``first_last_layers_bf16``: each one's output beside a bf16 and an FP8
  ``GroupedMLP`` holding the same weights.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn import functional as F

SEED = 4321
HIDDEN, FFN, EXPERTS, TOKENS = 128, 128, 2, 8


def _optimizer_on_cpu() -> None:
    """``device="cuda"`` factories on the CPU; a CPU tensor's ``type()`` named as a CUDA one."""

    def on_cpu(factory: Any) -> Any:
        @functools.wraps(factory)
        def made(*args: Any, **kwargs: Any) -> Any:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return made

    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    tensor_type = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        named = tensor_type(self, *args, **kwargs)
        if not args and not kwargs and not named.startswith("torch.cuda."):
            return named.replace("torch.", "torch.cuda.", 1)
        return named

    torch.Tensor.type = cuda_type  # type: ignore[assignment,method-assign]


def _config(num_layers: int = 1, **fp8: Any) -> Any:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=2,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=FFN,
        moe_router_topk=2,
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        gradient_accumulation_fusion=True,
    )
    # Megatron's own FP8 checks need Transformer Engine: the FP8 fields are set after them
    for name, value in {"fp8": "e4m3", "fp8_recipe": "blockwise", **fp8}.items():
        setattr(config, name, value)
    return config


def _layer(config: Any, layer_number: int, device: torch.device) -> Any:
    from mcore_worker import build_from_spec  # a sibling: the worker's folder is sys.path[0]

    from groupgrad.integrations.megatron_core import get_moe_module_groupgrad_spec

    layer = build_from_spec(get_moe_module_groupgrad_spec(EXPERTS, layer_numbers=True), config)
    layer.set_layer_number(layer_number)  # what Megatron's TransformerLayer does
    return layer.to(device)


class _Recorder:
    """Each experts forward: its flag, inputs and output (a wrapper of ``grouped_mlp.forward``)."""

    def __init__(self, experts: Any) -> None:
        self.calls: list[dict[str, Any]] = []
        mlp = experts.grouped_mlp
        forward = mlp.forward

        def recorded(
            x: Any, splits: Any, probs: Any = None, is_first_microbatch: Any = None
        ) -> Any:
            y = forward(x, splits, probs, is_first_microbatch)
            self.calls.append(
                {
                    "flag": is_first_microbatch,
                    "x": x.detach().clone(),
                    "splits": [int(s) for s in splits],
                    "probs": probs.detach().clone(),
                    "y": y.detach().clone(),
                    "weights": [w.detach().clone() for w in experts._weights()],
                    "versions": [w._version for w in experts._weights()],
                }
            )
            return y

        mlp.forward = recorded
        self.stop = lambda: setattr(mlp, "forward", forward)


def _rerun(experts: Any, call: dict[str, Any], weights: list[torch.Tensor]) -> torch.Tensor:
    """The experts' output on a recorded call's rows, weights quantized afresh from ``weights``."""
    params = experts._weights()
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)
        y = experts.grouped_mlp(call["x"], call["splits"], call["probs"], None)
        for p, w in zip(params, saved, strict=True):
            p.copy_(w)
    return y


def run_step(sc: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Two optimizer steps of two micro-batches under Megatron's schedule (see the module docstring)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = _config()
    layer = _layer(config, 1, device)
    experts = layer.experts
    recorder = _Recorder(experts)
    from megatron.core.enums import ModelType

    layer.model_type = ModelType.encoder_or_decoder  # what the schedule asks of a model
    layer.set_input_tensor = lambda tensors: None
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True
    )
    model = DistributedDataParallel(config, ddp_config, layer)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=0.05,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
            clip_grad=0.0,
        ),
        [model],
    )
    config.no_sync_func = model.no_sync
    generator = torch.Generator().manual_seed(SEED)

    def forward_step(data: Any, model: Any) -> Any:
        x = torch.randn(TOKENS // 2, 2, HIDDEN, generator=generator).bfloat16()
        y, _ = model(x.to(device))
        return y, lambda out: (out.float().square().mean(), {})

    schedule = get_forward_backward_func()
    steps_ok = []
    for _ in range(2):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        schedule(
            forward_step_func=forward_step,
            data_iterator=None,
            model=[model],
            num_microbatches=2,
            seq_length=TOKENS // 2,
            micro_batch_size=2,
        )
        model.finish_grad_sync()
        steps_ok.append(bool(optimizer.step()[0]))
    recorder.stop()  # the reruns below are not recorded
    calls = recorder.calls
    fresh = [_rerun(experts, call, call["weights"]) for call in calls]
    before_step = _rerun(experts, calls[2], calls[1]["weights"])
    return {
        "steps_ok": steps_ok,
        "flags": [call["flag"] for call in calls],
        "y": [call["y"] for call in calls],
        "fresh": fresh,
        "step2_with_step1_weights": before_step,
        "weights_moved": bool(
            any(
                (a != b).any()
                for a, b in zip(calls[1]["weights"], calls[2]["weights"], strict=True)
            )
        ),
        "versions_moved": calls[1]["versions"] != calls[2]["versions"],
    }


def run_bf16_layers(sc: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Three layers under ``first_last_layers_bf16`` (see the module docstring)."""
    from groupgrad.modules import GroupedMLP

    config = _config(num_layers=3, first_last_layers_bf16=True)
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(TOKENS, HIDDEN, generator=generator).bfloat16().to(device)
    probs = torch.rand(TOKENS, generator=generator).to(device)
    splits = [TOKENS // 2, TOKENS // 2]
    out: dict[str, Any] = {}
    for number in (1, 2, 3):
        experts = _layer(config, number, device).experts
        y, _ = experts(x, splits, probs)
        for recipe in (None, "blockwise"):
            twin = GroupedMLP(
                EXPERTS, HIDDEN, FFN, dtype=torch.bfloat16, device=device, fp8_recipe=recipe
            )
            twin.load_state_dict(experts.grouped_mlp.state_dict())
            with torch.no_grad():
                out[f"layer{number}-{recipe}"] = twin(x, splits, probs)
        out[f"layer{number}"] = y.detach()
    return out


RUNNERS = {"step": run_step, "bf16_layers": run_bf16_layers}


def run_scenario(scenario: dict[str, Any], rank: Any) -> dict[str, Any]:
    """One scenario on this rank."""
    return RUNNERS[scenario["kind"]](scenario, rank.device)


def setup(rank: Any) -> None:
    """On CPU launches: the CPU shim and the optimizer's CUDA scalars on the CPU (this process only)."""
    if rank.device.type == "cpu":
        import cpu_shim  # a sibling: the worker's folder is sys.path[0]

        cpu_shim.install()
        _optimizer_on_cpu()


if __name__ == "__main__":
    from groupgrad_testsupport import run_worker

    run_worker(run_scenario, setup=setup)
