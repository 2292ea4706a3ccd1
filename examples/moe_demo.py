"""Train a small Mixture-of-Experts layer with groupgrad experts (``nox -s demo``).

A router picks the top-2 of ``E`` experts for every token; the experts are
groupgrad ``GroupedLinear`` layers (or one fused ``GroupedMLP`` with
``--experts mlp``) run in bf16 whose weight gradients go straight into fp32
``main_grad`` buffers, as in Megatron-style mixed-precision training: two
micro-batches accumulate into ``main_grad``, then Adam updates fp32 master
weights from it. The task is synthetic: match a fixed random teacher MoE.

At the end the demo says where every expert's gradient went and measures why
it matters: the same expert gradients reduced across 8 simulated data-parallel
ranks in fp32 and in bf16, against an fp64 reduction; ``--plot`` (default
``moe_demo.png``) draws the loss curve and the two errors.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from groupgrad.modules import GroupedLinear, GroupedMLP


class MoELayer(nn.Module):
    """Router + top-k + grouped experts (SwiGLU MLPs) on token rows grouped by expert."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        experts: int,
        top_k: int,
        *,
        fused: bool,
        dtype,
        device,
        fp8_recipe: str | None = None,
    ) -> None:
        super().__init__()
        self.experts, self.top_k, self.ffn = experts, top_k, ffn
        self.router = nn.Linear(hidden, experts, bias=False, device=device)
        if fused:
            self.mlp = GroupedMLP(
                experts,
                hidden,
                ffn,
                dtype=dtype,
                device=device,
                accumulate_into_main_grad=True,
                fp8_recipe=fp8_recipe,
            )
        else:
            self.mlp = None
            common = {
                "bias": False,
                "dtype": dtype,
                "device": device,
                "accumulate_into_main_grad": True,
                "fp8_recipe": fp8_recipe,
            }
            self.fc1 = GroupedLinear(experts, hidden, 2 * ffn, **common)
            self.fc2 = GroupedLinear(experts, ffn, hidden, **common)

    def expert_weights(self) -> list[nn.Parameter]:
        """The grouped experts' weight parameters (those with an fp32 ``main_grad``)."""
        owners = [self.mlp.fc1, self.mlp.fc2] if self.mlp is not None else [self.fc1, self.fc2]
        return [getattr(owner, name) for owner in owners for name in owner.weight_names]

    def forward(self, x: Tensor, is_first_microbatch: bool | None = None) -> Tensor:
        tokens, hidden = x.shape
        probs, chosen = F.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # group routed copies by expert
        splits = torch.bincount(flat, minlength=self.experts)
        rows = x.repeat_interleave(self.top_k, dim=0)[order].to(self.fc_dtype)
        row_probs = probs.reshape(-1)[order]
        if self.mlp is not None:
            out = self.mlp(rows, splits, row_probs.to(self.fc_dtype), is_first_microbatch)
        else:
            h = self.fc1(rows, splits, is_first_microbatch)
            act = F.silu(h[:, : self.ffn]) * h[:, self.ffn :] * row_probs[:, None].to(h.dtype)
            out = self.fc2(act, splits, is_first_microbatch)
        combined = torch.zeros(tokens * self.top_k, hidden, dtype=torch.float32, device=x.device)
        combined[order] = out.float()
        return combined.view(tokens, self.top_k, hidden).sum(1)

    @property
    def fc_dtype(self) -> torch.dtype:
        return self.expert_weights()[0].dtype


def _attach_main_grads(weights: list[nn.Parameter]) -> list[Tensor]:
    """Give each expert weight an fp32 ``main_grad`` and an fp32 master copy (Megatron style)."""
    masters = []
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        w.grad_added_to_main_grad = False
        masters.append(w.detach().float().clone().requires_grad_())
    return masters


def _reduction_error(
    layer: MoELayer, teacher: MoELayer, hidden: int, device, ranks: int = 8
) -> tuple[float, float]:
    """Reduce one step's expert gradients over simulated ranks in fp32 and bf16 vs fp64."""
    per_rank = []
    for rank in range(ranks):
        gen = torch.Generator(device="cpu").manual_seed(10_000 + rank)
        x = torch.randn(256, hidden, generator=gen).to(device)
        for w in layer.expert_weights():
            w.main_grad.zero_()
        F.mse_loss(layer(x), teacher(x).detach()).backward()
        per_rank.append(torch.cat([w.main_grad.flatten() for w in layer.expert_weights()]).clone())
    stacked = torch.stack(per_rank)
    exact = stacked.double().sum(0)
    fp32 = stacked.sum(0)
    bf16 = torch.zeros_like(stacked[0], dtype=torch.bfloat16)
    for grad in stacked:  # ring-style reduction in bf16: round after every add
        bf16 = (bf16.float() + grad.bfloat16().float()).bfloat16()
    rel = lambda r: float((r.double() - exact).norm() / exact.norm())  # noqa: E731
    return rel(fp32), rel(bf16)


def accumulate_step(
    layer: MoELayer, teacher: MoELayer, batches: list[Tensor]
) -> tuple[float, list[Tensor]]:
    """Forward and backward of one optimizer step's micro-batches; the wgrads land in ``main_grad``.

    Each micro-batch's loss is divided by their number, so ``main_grad`` holds
    the gradient of the mean loss. Returns that mean loss and the expert
    weights' ``main_grad`` buffers (fp32), which the optimizer then reads.
    """
    loss_value = 0.0
    for index, x in enumerate(batches):  # FP8 weights: quantized at the first, then reused
        loss = F.mse_loss(layer(x, is_first_microbatch=index == 0), teacher(x).detach())
        (loss / len(batches)).backward()
        loss_value += loss.item() / len(batches)
    return loss_value, [w.main_grad for w in layer.expert_weights()]


def _at_least_one(text: str) -> int:
    """argparse type: an int >= 1 (the error names the value and the expectation)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; invalid values end in a one-line error and exit code 2."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--steps",
        type=_at_least_one,
        default=400,
        help="optimizer steps to train (each of 2 micro-batches; with --fp8 on the CPU, whose "
        "FP8 reference kernels are slow, 40 unless given)",
    )
    parser.add_argument(
        "--experts",
        choices=["linear", "mlp"],
        default="linear",
        help="expert layers: two GroupedLinear with SwiGLU between them, or one fused GroupedMLP",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="run the experts' GEMMs in blockwise FP8 (fp8_recipe='blockwise'; CUTLASS on an "
        "H100/H200, the kernels' reference on the CPU) with hidden and ffn sizes of 128",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to train: cpu (reference kernels) or cuda (CUTLASS kernels on an H100/H200); "
        "the default is cuda when PyTorch sees a CUDA device",
    )
    parser.add_argument(
        "--print-every", type=_at_least_one, default=50, help="print the loss every this many steps"
    )
    parser.add_argument(
        "--plot",
        default="moe_demo.png",
        help="write the loss curve and the fp32-vs-bf16 reduction error as a PNG to this path "
        "(needs matplotlib; an empty string writes none)",
    )
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.steps_given = any(a == "--steps" or a.startswith("--steps=") for a in given)
    try:
        args.device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"argument --device: expected cpu or cuda, got {args.device!r}")
    if args.device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: expected cpu or cuda, got {str(args.device)!r}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        why = (
            "this PyTorch has no CUDA support"
            if torch.version.cuda is None
            else "PyTorch sees no CUDA device"
        )
        parser.error(
            f"argument --device: cuda was asked for, but {why} (torch {torch.__version__}); "
            "use --device cpu"
        )
    if args.device.type == "cuda" and (args.device.index or 0) >= torch.cuda.device_count():
        parser.error(
            f"argument --device: {args.device} was asked for, but PyTorch sees "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device
    hidden, ffn, experts, top_k, tokens = 64, 96, 8, 2, 128
    recipe = "blockwise" if args.fp8 else None
    if args.fp8:  # FP8 blocks: sizes multiples of 128
        hidden, ffn = 128, 128
    torch.manual_seed(0)
    fused = args.experts == "mlp"
    teacher = MoELayer(
        hidden, ffn, experts, top_k, fused=fused, dtype=torch.bfloat16, device=device
    )
    for w in teacher.expert_weights():
        w.requires_grad_(False)
    layer = MoELayer(
        hidden,
        ffn,
        experts,
        top_k,
        fused=fused,
        dtype=torch.bfloat16,
        device=device,
        fp8_recipe=recipe,
    )
    layer.router.load_state_dict(teacher.router.state_dict())
    layer.router.requires_grad_(False)  # same routing as the teacher: the experts learn
    weights = layer.expert_weights()
    masters = _attach_main_grads(weights)
    optimizer = torch.optim.Adam(masters, lr=1e-2)

    print(
        f"groupgrad MoE demo on {device}: {experts} experts ({args.experts}), top-{top_k}, "
        f"hidden {hidden}, ffn {ffn}; bf16 experts, fp32 main_grad, 2 micro-batches per step"
    )
    if args.fp8 and device.type == "cpu" and not args.steps_given:
        args.steps = 40
    if args.fp8:
        where = (
            "CUTLASS FP8 GEMMs"
            if device.type == "cuda"
            else "the kernels' reference on the CPU (dequantize, multiply in fp32): FP8's "
            "numerics, not its speed"
        )
        print(
            f"FP8: blockwise recipe (e4m3, 1x128 / 128x128 / 128-token blocks) on {where}; "
            f"{args.steps} steps"
        )
    gen = torch.Generator(device="cpu").manual_seed(1)
    start, losses = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        batches = [torch.randn(tokens, hidden, generator=gen).to(device) for _ in range(2)]
        loss_value, main_grads = accumulate_step(layer, teacher, batches)
        losses.append(loss_value)
        flagged = sum(bool(w.grad_added_to_main_grad) for w in weights)
        dummies = sum(w.grad is not None and not w.grad.any() for w in weights)
        for master, main_grad in zip(masters, main_grads, strict=True):
            master.grad = main_grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for master, w in zip(masters, weights, strict=True):
                w.copy_(master)
                w.main_grad.zero_()
                w.grad = None
                w.grad_added_to_main_grad = False
        if step % args.print_every == 0 or step == 1:
            print(f"step {step:4d}  loss {loss_value:.5f}  ({time.perf_counter() - start:5.1f} s)")

    first_loss, loss_value = losses[0], losses[-1]  # --steps is at least 1
    change = 100.0 * (loss_value - first_loss) / first_loss
    print(
        f"\nloss went from {first_loss:.5f} to {loss_value:.5f} in {args.steps} steps ({change:+.0f}%)"
    )
    w0 = weights[0]
    print(
        f"where the expert gradients went: {len(weights)} {w0.dtype} weights, each wgrad written "
        f"by the GEMM straight into its {w0.main_grad.dtype} main_grad (2 micro-batches "
        f"accumulated per step); in the last step {flagged}/{len(weights)} had "
        f"grad_added_to_main_grad set and {dummies}/{len(weights)} gave autograd a zero dummy"
    )
    fp32_err, bf16_err = _reduction_error(layer, teacher, hidden, device)
    print(
        "gradient reduction over 8 simulated ranks, relative error vs fp64: "
        f"fp32 {fp32_err:.2e}, bf16 {bf16_err:.2e} ({bf16_err / max(fp32_err, 1e-30):.0f}x larger)"
    )
    if args.plot:
        _plot(args.plot, losses, fp32_err, bf16_err, f"{args.experts} experts on {device}")


def _plot(path: str, losses: list[float], fp32_err: float, bf16_err: float, title: str) -> None:
    """The loss curve and the two reduction errors, side by side, as a PNG at ``path``."""
    try:
        import matplotlib
    except ImportError:
        print(
            f"no picture: matplotlib is not installed (pip install matplotlib), {path} not written"
        )
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.plot(range(1, len(losses) + 1), losses)
    left.set(yscale="log", xlabel="step", ylabel="loss (log)", title=f"training: {title}")
    right.bar(["fp32", "bf16"], [fp32_err, bf16_err], color=["tab:green", "tab:red"])
    right.set(yscale="log", ylabel="relative error vs fp64", title="wgrad reduction, 8 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}: the loss curve and the two reduction errors")


if __name__ == "__main__":
    main()
