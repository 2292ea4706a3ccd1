"""Train a tiny Megatron-Core GPT-MoE with groupgrad experts, beside Megatron's own SequentialMLP.

Each backend named by ``--experts`` trains the same GPT-MoE (Megatron-Core's
``GPTModel`` on its local modules; only the experts differ) from the same
initial weights — the ``sequential`` model's, copied — on the same synthetic
data, for ``--steps`` steps of ``--micro-batches`` micro-batches, through
Megatron's own machinery: ``get_forward_backward_func()``, its
``DistributedDataParallel`` (fp32 gradient buffers) and its optimizer.
Experts are spread over the ranks (``--ep``). Backends:

* ``sequential``: Megatron's ``SequentialMLP`` (one MLP per expert);
* ``groupgrad-fused``: :class:`~groupgrad.integrations.megatron_core.GroupgradFusedExperts`;
* ``groupgrad``: Megatron's ``TEGroupedMLP`` with groupgrad grouped linears.

Rank 0 prints every step's loss per backend (and with ``--out``, writes them
as JSON); with fp32 the losses agree to float rounding.

CPU (2 processes, gloo; megatron-core needs the test-only CUDA shim of
``integrations/megatron_core/tests/cpu_shim.py``, which this script loads on a
machine without CUDA)::

    torchrun --nproc-per-node 2 examples/train_megatron_core_moe.py

2 GPUs (NCCL), bf16, Megatron's delayed-wgrad schedule (expert-parallel
communication overlapped with computation, weight gradients at
``backward_dw()``)::

    torchrun --nproc-per-node 2 examples/train_megatron_core_moe.py --dtype bf16 \\
        --dispatcher alltoall --overlap-ep-comm --delay-wgrad

Megatron's ``gradient_accumulation_fusion`` stays off here: it also makes
Megatron's own attention linears demand APEX's fused wgrad kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

BACKENDS = ("sequential", "groupgrad-fused", "groupgrad")
SHIM = (
    Path(__file__).resolve().parents[1] / "integrations" / "megatron_core" / "tests" / "cpu_shim.py"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default=",".join(BACKENDS), help="backends, comma-separated")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2, help="expert_model_parallel_size")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--dispatcher", choices=("allgather", "alltoall"), default="allgather")
    parser.add_argument(
        "--overlap-ep-comm", action="store_true", help="overlap_moe_expert_parallel_comm"
    )
    parser.add_argument("--delay-wgrad", action="store_true", help="delay_wgrad_compute")
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seq-length", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=None, help="rank 0 writes the losses here")
    args = parser.parse_args(argv)
    unknown = set(args.experts.split(",")) - set(BACKENDS)
    if unknown:
        parser.error(f"--experts has {sorted(unknown)}, expected some of {list(BACKENDS)}")
    return args


def setup_distributed(args: argparse.Namespace) -> torch.device:
    """Process group (NCCL on GPUs, gloo + the CPU shim otherwise) and Megatron's parallel state."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        runpy.run_path(str(SHIM))["install"]()  # the test-only shim, loaded by its path
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(expert_model_parallel_size=args.ep)
    model_parallel_cuda_manual_seed(args.seed)
    return device


def make_config(args: argparse.Namespace, device: torch.device) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = args.dtype == "bf16"
    return TransformerConfig(
        num_layers=2,
        hidden_size=args.hidden,
        ffn_hidden_size=2 * args.hidden,
        num_attention_heads=4,
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.hidden,
        moe_router_topk=2,
        moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type=args.dispatcher,
        expert_model_parallel_size=args.ep,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=device.type == "cpu",
        gradient_accumulation_fusion=False,
        overlap_moe_expert_parallel_comm=args.overlap_ep_comm,
        delay_wgrad_compute=args.delay_wgrad,
    )


def build_model(backend: str, config: Any, args: argparse.Namespace, device: torch.device) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from groupgrad.integrations.megatron_core import get_gpt_layer_groupgrad_spec

    if backend == "sequential":
        spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    else:
        spec = get_gpt_layer_groupgrad_spec(args.num_experts, fused=backend == "groupgrad-fused")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope",
    )
    # every parameter and buffer in the compute dtype, as Megatron's Float16Module casts them
    return model.to(device=device, dtype=config.params_dtype)


_EXPERT = re.compile(r"(.*\.experts\.)(?:grouped_mlp\.(fc[12])|linear_(fc[12]))\.weight(\d+)$")


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Give ``dst`` the weights of ``src`` (``SequentialMLP`` experts), expert names mapped."""
    source = dict(src.named_parameters())
    with torch.no_grad():
        for name, param in dst.named_parameters():
            match = _EXPERT.match(name)
            if match is not None:
                prefix, fc_fused, fc_linear, expert = match.groups()
                name = f"{prefix}local_experts.{expert}.linear_{fc_fused or fc_linear}.weight"
            param.copy_(source[name])


VOCAB = 64


def batches(args: argparse.Namespace, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Synthetic next-token data of this data-parallel rank: ``t[i+1] = (5 t[i] + 3) mod V``."""
    from megatron.core import parallel_state

    rank = parallel_state.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)
    b, s = args.micro_batch_size, args.seq_length
    while True:
        start = torch.randint(0, VOCAB, (b, 1), generator=gen)
        seq = [start]
        for _ in range(s):
            seq.append((5 * seq[-1] + 3) % VOCAB)
        tokens = torch.cat(seq, dim=1)
        yield {
            "tokens": tokens[:, :-1].to(device),
            "labels": tokens[:, 1:].to(device),
            "position_ids": torch.arange(s).expand(b, s).to(device),
            "attention_mask": torch.ones(1, 1, s, s, dtype=torch.bool).triu(1).to(device),
        }


def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach()}


def forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: Any, return_schedule_plan: bool = False
) -> tuple[Any, Any]:
    """Megatron's forward-step contract (a schedule plan under the overlapped EP schedule)."""
    batch = next(data_iterator)
    inputs = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    if return_schedule_plan:
        return model.build_schedule_plan(*inputs, labels=batch["labels"]), loss_func
    return model(*inputs, labels=batch["labels"]), loss_func


class MainGradAdam:
    """Adam on fp32 parameters from Megatron DDP's ``main_grad`` (what Megatron's FP32Optimizer does).

    Used on the CPU, where Megatron's optimizer cannot run (it allocates its
    loss scale with ``device="cuda"``).
    """

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.adam = torch.optim.Adam(self.params, lr=lr)

    def zero_grad(self) -> None:
        self.adam.zero_grad(set_to_none=True)

    def step(self) -> None:
        for param in self.params:
            param.grad = param.main_grad
        self.adam.step()


class CheckedOptimizer:
    """Megatron's optimizer, refusing a skipped step (non-finite gradients) instead of hiding it."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        update_ok, _, _ = self.optimizer.step()
        if not update_ok:
            raise RuntimeError("the optimizer skipped a step (non-finite gradients)")


def make_optimizer(ddp: Any, config: Any, args: argparse.Namespace, device: torch.device) -> Any:
    """Megatron's optimizer on GPUs (fp32 master weights under bf16), :class:`MainGradAdam` on CPU."""
    if device.type == "cpu":
        if args.dtype != "fp32":
            raise SystemExit("on the CPU this example trains in fp32 only (--dtype fp32)")
        return MainGradAdam(ddp, args.lr)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            weight_decay=0.0,
            bf16=args.dtype == "bf16",
            params_dtype=config.params_dtype,
            clip_grad=0.0,
        ),
        [ddp],
    )
    return CheckedOptimizer(optimizer)


def cpu_forward_backward(ddp: Any, data: Iterator[Any], num_microbatches: int) -> list[dict]:
    """What Megatron's no-pipelining schedule does, for the CPU (the schedule allocates on "cuda").

    Every micro-batch's loss (and the MoE auxiliary loss) scaled by
    ``1 / num_microbatches``; gradients reduced once, after the last micro-batch.
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / num_microbatches)
    reports = []
    for micro in range(num_microbatches):
        with ddp.no_sync() if micro < num_microbatches - 1 else contextlib.nullcontext():
            output, loss_fn = forward_step(data, ddp)
            loss, report = loss_fn(output)
            (loss / num_microbatches).backward()
        reports.append(report)
    ddp.finish_grad_sync()
    return reports


def train(
    backend: str, reference: Any, args: argparse.Namespace, device: torch.device
) -> list[float]:
    """Train one backend from ``reference``'s weights; its losses (mean over micro-batches, ranks)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = make_config(args, device)
    model = build_model(backend, config, args, device)
    copy_weights(reference, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, delay_wgrad_compute=args.delay_wgrad
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    optimizer = make_optimizer(ddp, config, args, device)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    data = batches(args, device)
    losses = []
    for _ in range(args.steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        if device.type == "cuda":
            reports = forward_backward(
                forward_step_func=forward_step,
                data_iterator=data,
                model=[ddp],
                num_microbatches=args.micro_batches,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
            )
        else:
            reports = cpu_forward_backward(ddp, data, args.micro_batches)
        optimizer.step()
        loss = torch.stack([r["lm loss"] for r in reports]).mean().reshape(1)
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        losses.append(loss.item() / parallel_state.get_data_parallel_world_size())
    return losses


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = setup_distributed(args)
    # every backend starts from the weights of one freshly seeded SequentialMLP model
    torch.manual_seed(args.seed)
    reference = build_model("sequential", make_config(args, device), args, device)
    results = {
        backend: train(backend, reference, args, device) for backend in args.experts.split(",")
    }
    if dist.get_rank() == 0:
        for backend, losses in results.items():
            print(f"{backend:16s} " + " ".join(f"{x:.7f}" for x in losses), flush=True)
        if args.out is not None:
            args.out.write_text(
                json.dumps({"args": {**vars(args), "out": str(args.out)}, "losses": results})
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
