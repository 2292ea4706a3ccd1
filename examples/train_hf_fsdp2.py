"""Train a tiny Qwen3-MoE with groupgrad experts under FSDP2 (2 processes, gloo on CPU, NCCL on GPUs).

    torchrun --nproc-per-node 2 examples/train_hf_fsdp2.py

A random-init Hugging Face ``Qwen3MoeForCausalLM`` (built from a config in
code, nothing downloaded) runs its experts on groupgrad
(``experts_implementation="groupgrad"``) and is sharded per decoder layer,
then at the root, with ``groupgrad.integrations.fsdp2.fully_shard`` and
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 master
weights, bf16 compute, and the experts' weight gradients written in fp32 by the
grouped GEMMs straight into FSDP2's fp32 reduce-scatter. Each step
accumulates two micro-batches (the first without gradient sync). The task is
synthetic and learnable: every sequence follows ``next = (a·token + b) mod V``
with a per-sequence ``b``.

At the end it measures what the integration changes on one batch: the
reduced expert gradients with groupgrad's fp32 route and with plain FSDP2 on
the same weights and data (plain FSDP2 computes each expert wgrad in bf16 and
upcasts it for its fp32 reduce-scatter); their relative difference is the
rounding plain FSDP2 adds to every expert gradient.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as plain_fully_shard
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import groupgrad.integrations.transformers  # noqa: F401  (registers "groupgrad")
from groupgrad.integrations.fsdp2 import fully_shard

POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build_model(args: argparse.Namespace, device: torch.device) -> Qwen3MoeForCausalLM:
    """The same random-init tiny Qwen3-MoE on every rank (fp32 master weights)."""
    config = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.expert_width,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        experts_implementation="groupgrad",
    )
    torch.manual_seed(args.seed)
    return Qwen3MoeForCausalLM(config).to(device)


def shard(model: nn.Module, shard_fn) -> nn.Module:  # type: ignore[no-untyped-def]
    """torchtitan's recipe: one FSDP2 unit per decoder layer, then the root."""
    for layer in model.model.layers:
        shard_fn(layer, mp_policy=POLICY)
    shard_fn(model, mp_policy=POLICY)
    return model


def batch(args: argparse.Namespace, generator: torch.Generator, device: torch.device) -> Tensor:
    """``(batch, seq)`` token ids of ``next = (3·token + b) mod V`` sequences, ``b`` random per row."""
    starts = torch.randint(0, args.vocab, (args.batch, 1), generator=generator)
    offsets = torch.randint(0, 4, (args.batch, 1), generator=generator)
    ids = [starts]
    for _ in range(args.seq - 1):
        ids.append((3 * ids[-1] + offsets) % args.vocab)
    return torch.cat(ids, dim=1).to(device)


def expert_grads(model: nn.Module) -> Tensor:
    """Every layer's reduced expert weight gradients, gathered whole and flattened (collective)."""
    found = []
    for name, param in model.named_parameters():
        if ".experts." in name:
            grad = param.grad
            full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            found.append(full.double().flatten())
    return torch.cat(found)


def compare_gradients(model: nn.Module, args: argparse.Namespace, device: torch.device) -> None:
    """One batch's reduced expert gradients: groupgrad's fp32 route vs plain FSDP2's bf16 wgrads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(10_000 + rank)
    ids = batch(args, generator, device)
    plain = build_model(args, device)  # same config; weights copied from the trained model
    plain.load_state_dict(
        {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
            for k, v in model.state_dict().items()
        }
    )
    shard(plain, plain_fully_shard)
    for candidate in (model, plain):
        candidate.zero_grad(set_to_none=True)
        candidate(input_ids=ids, labels=ids).loss.backward()
    fp32, bf16 = expert_grads(model), expert_grads(plain)
    if rank == 0:
        difference = (fp32 - bf16).norm() / fp32.norm()
        print(
            f"\nreduced expert gradients of one batch ({fp32.numel()} values, {world} ranks):\n"
            f"  fp32 vs bf16 wgrad route, relative difference (norm): {float(difference):.2e}\n"
            "  (plain FSDP2 rounds every expert wgrad to bf16 before its fp32 reduce-scatter; "
            "groupgrad's GEMM writes it in fp32, so the reduce-scatter sums unrounded values)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=8, help="sequences per micro-batch and rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--expert-width", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-every", type=int, default=10)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if use_cuda
        else torch.device("cpu")
    )
    if use_cuda:
        torch.cuda.set_device(device)

    model = shard(build_model(args, device), fully_shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if rank == 0:
        print(
            f"Qwen3-MoE ({args.layers} layers, {args.experts} experts of width {args.expert_width}, "
            f"top-{args.top_k}, hidden {args.hidden}) on {world} {device.type} ranks: groupgrad "
            "experts, FSDP2 bf16 compute / fp32 reduce, 2 micro-batches per step"
        )
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    start, first = time.perf_counter(), None
    for step in range(1, args.steps + 1):
        total = torch.zeros((), device=device)
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)  # reduce-scatter once, after the last
            ids = batch(args, generator, device)
            loss = model(input_ids=ids, labels=ids).loss / 2
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        value = float(total) / world
        first = value if first is None else first
        if rank == 0 and (step == 1 or step % args.print_every == 0 or step == args.steps):
            print(f"step {step:4d}  loss {value:.4f}  ({time.perf_counter() - start:5.1f} s)")
    if rank == 0:
        print(f"\nloss went from {first:.4f} to {value:.4f} in {args.steps} steps")

    compare_gradients(model, args, device)
    dist.barrier()  # no rank tears its connections down while a peer still talks to it
    dist.destroy_process_group()


def exit_without_teardown() -> None:
    """Leave the process without Python's interpreter teardown (every rank is done by now).

    ``destroy_process_group()`` joins gloo's threads only when nothing else
    references the group, and PyTorch itself may: ``torch.distributed.nn``,
    imported lazily through ``torch._dynamo`` (which transformers pulls in),
    keeps ``group.WORLD`` in default arguments. A gloo thread still alive
    during interpreter finalization can then abort the process (SIGABRT)
    after all the work was done. ``os._exit`` ends it before finalization.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_without_teardown()
