"""The main job (`nox -s demo`): its expert gradients against fp64, its run end to end, its CLI.

The gradient test runs the demo's own step (``accumulate_step``: router, top-2,
groupgrad experts in bf16, two micro-batches into fp32 ``main_grad``) and
compares every expert's ``main_grad`` with an independent per-expert loop in
float64 from the same inputs, within twice the error of PyTorch's own bf16
computation of the same loop. A loss that falls under Adam cannot show a
wrongly scaled gradient (Adam is scale-invariant); this comparison does.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import Tensor
from torch.nn import functional as F

from groupgrad_testsupport import run_command

DEMO = Path(__file__).resolve().parents[1] / "examples" / "moe_demo.py"


def _load_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("groupgrad_moe_demo", DEMO)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = run_command([sys.executable, str(DEMO), *args], timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-2000:]
    return result


def reference_expert_grads(
    router_weight: Tensor,
    expert_weights: list[Tensor],
    batches: list[Tensor],
    targets: list[Tensor],
    *,
    ffn: int,
    top_k: int,
    dtype: torch.dtype,
) -> list[Tensor]:
    """Gradient of the mean micro-batch MSE w.r.t. each expert weight, one expert at a time.

    ``expert_weights`` are the fc1 weights ``(2F, H)`` of experts ``0 … E-1``
    followed by their fc2 weights ``(H, F)``. Routing (a plain fp32 softmax
    and top-k) is not under test; the experts run in ``dtype``.
    """
    experts = len(expert_weights) // 2
    leaves = [w.detach().to(dtype).requires_grad_() for w in expert_weights]
    fc1, fc2 = leaves[:experts], leaves[experts:]
    for x, target in zip(batches, targets, strict=True):
        probs, chosen = F.softmax(x @ router_weight.T, dim=-1).topk(top_k, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        out = torch.zeros(x.shape, dtype=dtype)
        for e in range(experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            h = x[token].to(dtype) @ fc1[e].T
            act = F.silu(h[:, :ffn]) * h[:, ffn:] * probs[token, slot][:, None].to(dtype)
            out = out.index_add(0, token, act @ fc2[e].T)
        (F.mse_loss(out, target.to(dtype)) / len(batches)).backward()
    grads = [leaf.grad for leaf in leaves]
    assert all(g is not None for g in grads)
    return [g.double() for g in grads if g is not None]


@pytest.mark.parametrize("experts", ["linear", "mlp"])
def test_demo_expert_gradients_match_an_fp64_per_expert_reference(experts: str) -> None:
    demo = _load_demo()
    hidden, ffn, num_experts, top_k, tokens = 64, 96, 8, 2, 128
    torch.manual_seed(0)
    common = {"fused": experts == "mlp", "dtype": torch.bfloat16, "device": torch.device("cpu")}
    teacher = demo.MoELayer(hidden, ffn, num_experts, top_k, **common)
    for w in teacher.expert_weights():
        w.requires_grad_(False)
    layer = demo.MoELayer(hidden, ffn, num_experts, top_k, **common)
    layer.router.load_state_dict(teacher.router.state_dict())
    layer.router.requires_grad_(False)
    weights = layer.expert_weights()
    demo._attach_main_grads(weights)
    for w in weights:  # an earlier step left NaN nowhere: the demo zeroes main_grad per step
        assert not w.main_grad.any()

    gen = torch.Generator().manual_seed(7)
    batches = [torch.randn(tokens, hidden, generator=gen) for _ in range(2)]
    targets = [teacher(x).detach() for x in batches]
    _, main_grads = demo.accumulate_step(layer, teacher, batches)

    router = layer.router.weight.detach()
    args = {"ffn": ffn, "top_k": top_k}
    exact = reference_expert_grads(router, weights, batches, targets, dtype=torch.float64, **args)
    torch_bf16 = reference_expert_grads(
        router, weights, batches, targets, dtype=torch.bfloat16, **args
    )
    assert len(main_grads) == len(exact) == 2 * num_experts
    for i, (ours, want, theirs) in enumerate(zip(main_grads, exact, torch_bf16, strict=True)):
        name = f"{'fc1' if i < num_experts else 'fc2'} expert {i % num_experts}"
        assert ours.dtype == torch.float32, name
        assert want.abs().max() > 0, f"{name}: no tokens reached it; the test would be vacuous"
        error = (ours.double() - want).abs().max().item()
        yardstick = (theirs - want).abs().max().item()
        allowed = 2 * yardstick + 1e-5 * want.abs().max().item()
        assert error <= allowed, (
            f"{name}: main_grad errs {error:.3g} from the fp64 reference (max |grad| "
            f"{want.abs().max().item():.3g}); PyTorch's own bf16 errs {yardstick:.3g}"
        )


@pytest.mark.parametrize(("experts", "steps"), [("linear", 30), ("mlp", 4)])
def test_demo_trains_and_reports_where_gradients_went(
    experts: str, steps: int, tmp_path: Path
) -> None:
    picture = tmp_path / "demo.png"
    out = _run(
        "--device", "cpu", "--experts", experts, "--steps", str(steps), "--print-every", "10",
        "--plot", str(picture),
    )  # fmt: skip
    out = out.stdout
    assert f"wrote {picture}" in out, out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fell = re.search(r"loss went from ([0-9.]+) to ([0-9.]+) in (\d+) steps", out)
    assert fell is not None, out
    first, last = float(fell.group(1)), float(fell.group(2))
    assert last < first, out
    assert "16/16 had grad_added_to_main_grad set" in out
    assert "16/16 gave autograd a zero dummy" in out
    assert "torch.float32 main_grad" in out
    errors = re.search(r"fp32 ([0-9.e+-]+), bf16 ([0-9.e+-]+)", out)
    assert errors is not None, out
    assert float(errors.group(1)) < 1e-5 < float(errors.group(2))


@pytest.mark.parametrize("experts", ["linear", "mlp"])
def test_fp8_demo_trains_on_the_reference_and_says_so(experts: str) -> None:
    out = _run(
        "--device", "cpu", "--experts", experts, "--fp8", "--steps", "3", "--print-every", "1",
        "--plot", "",
    ).stdout  # fmt: skip
    assert "FP8: blockwise recipe" in out, out
    assert "the kernels' reference on the CPU" in out, out
    fell = re.search(r"loss went from ([0-9.]+) to ([0-9.]+) in 3 steps", out)
    assert fell is not None, out
    assert float(fell.group(2)) < float(fell.group(1)), out
    assert "16/16 had grad_added_to_main_grad set" in out, out


def test_help_describes_every_option_with_its_default() -> None:
    help_text = " ".join(_run("--help").stdout.split())
    for option, default in [
        ("--steps", "400"),
        ("--experts", "linear"),
        ("--device", "cpu"),
        ("--print-every", "50"),
        ("--plot", "moe_demo.png"),
    ]:
        described = re.search(rf"{option} \S+ (.+?)\(default: {default}\)", help_text)
        assert described is not None, f"{option}: no description with its default in\n{help_text}"
        assert len(described.group(1).split()) >= 3, f"{option}: {described.group(1)!r}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
        (["--steps", "many"], "argument --steps: expected an integer >= 1, got 'many'"),
        (["--print-every", "0"], "argument --print-every: expected an integer >= 1, got 0"),
        (["--experts", "moe"], "argument --experts: invalid choice: 'moe'"),
        (["--device", "tpu"], "argument --device: expected cpu or cuda, got 'tpu'"),
        (["--device", "cuda"], "argument --device: cuda was asked for, but "),
    ],
)
def test_invalid_options_end_in_one_line_error_and_exit_code_2(
    args: list[str], message: str
) -> None:
    if args == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("CUDA is available here, so --device cuda is valid")
    result = _run(*args, check=False)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("usage: "), result.stderr
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, result.stderr
    assert lines[-1] == errors[0], "the error is the last line"
    assert message in errors[0], result.stderr
    if args == ["--device", "cuda"]:
        assert "use --device cpu" in errors[0]
