"""The scenarios the multi-rank suites launch (``mcore_worker.py`` runs them), by test module.

Layer scenarios compare Megatron's ``MoELayer`` with groupgrad experts to the
same layer with ``SequentialMLP`` (fp32), and to its fp64 run (bf16), over
expert parallelism, ``delay_wgrad_compute`` and ``gradient_accumulation_fusion``.
"""

from __future__ import annotations

from typing import Any

BACKENDS = ("fused", "unfused")
PROBS_ON_INPUT = {
    "moe_apply_probs_on_input": True,
    "moe_router_topk": 1,
    "moe_router_pre_softmax": True,
}


def layer(name: str, **options: Any) -> dict[str, Any]:
    """A ``layer`` scenario (see ``mcore_worker.run_layer``)."""
    return {"name": name, "kind": "layer", **options}


def layer_name(ep: int, backend: str, delay: bool, fusion: bool, dtype: str = "fp32") -> str:
    """``fp32-ep2-fused-delay-fusion``, ``bf16-ep1-unfused-autograd`` …"""
    return f"{dtype}-ep{ep}-{backend}-{'delay' if delay else 'nodelay'}-{'fusion' if fusion else 'autograd'}"


FP32_LAYERS = [
    layer(
        layer_name(ep, backend, delay, fusion), ep=ep, backend=backend, delay=delay, fusion=fusion
    )
    for ep in (1, 2)
    for backend in BACKENDS
    for delay in (False, True)
    for fusion in (False, True)
]
FP32_LAYERS += [
    layer("fp32-ep2-unfused-bias", ep=2, backend="unfused", bias=True, fusion=True),
    layer("fp32-ep2-fused-probs-on-input", ep=2, backend="fused", config=PROBS_ON_INPUT),
]
# Two experts over two expert-parallel ranks: one local expert per rank (as Mixtral's 8 on 8)
FP32_LAYERS += [
    layer(
        f"fp32-ep2-{backend}-{'fusion' if fusion else 'autograd'}-one-local-expert",
        ep=2,
        backend=backend,
        fusion=fusion,
        # top-1 (top-2 of 2 experts: a router gradient of about 0, all cancellation)
        config={"num_moe_experts": 2, "moe_router_topk": 1, "moe_router_pre_softmax": True},
    )
    for backend in BACKENDS
    for fusion in (False, True)
]
# Every expert weight frozen (a fine-tune of the router only), delayed wgrad: backward_dw()
# after each backward has nothing to run
FP32_LAYERS += [
    layer(
        f"fp32-ep2-{backend}-delay-fusion-experts-frozen",
        ep=2,
        backend=backend,
        delay=True,
        fusion=True,
        frozen_experts=True,
    )
    for backend in BACKENDS
]
BF16_LAYERS = [
    layer(layer_name(1, backend, False, False, "bf16"), ep=1, backend=backend, dtype="bfloat16")
    for backend in BACKENDS
] + [
    layer(
        layer_name(2, backend, True, True, "bf16"),
        ep=2,
        backend=backend,
        dtype="bfloat16",
        delay=True,
        fusion=True,
    )
    for backend in BACKENDS
]
CHECKPOINTS = [
    {"name": "checkpoint-ep1", "kind": "checkpoint", "ep": 1},
    {"name": "checkpoint-ep2", "kind": "checkpoint", "ep": 2},
    {
        "name": "checkpoint-ep2-bias",
        "kind": "checkpoint",
        "ep": 2,
        "bias": True,
        "backends": ["sequential", "unfused"],
    },
]
LAYOUTS = [{"name": f"layout-ep{ep}", "kind": "layout", "ep": ep} for ep in (1, 2)]
INITS = [
    {"name": "init-ep2-delay", "kind": "init", "ep": 2, "delay": True},
    {"name": "init-ep1", "kind": "init", "ep": 1, "delay": False},
]
ERRORS = [{"name": "errors", "kind": "errors", "ep": 2}]
ATOMICS = [
    {"name": f"atomics-{dtype}", "kind": "atomics", "ep": 2, "dtype": dtype}
    for dtype in ("float32", "bfloat16")
]

# On 2 GPUs: NCCL, Megatron's alltoall dispatcher, expert parallelism 2.
GPU_LAYERS = [
    layer(
        f"gpu-{layer_name(2, backend, delay, True, dtype)}",
        ep=2,
        backend=backend,
        delay=delay,
        fusion=True,
        dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
        dispatcher="alltoall",
    )
    for backend in BACKENDS
    for delay in (False, True)
    for dtype in ("fp32", "bf16")
]
PARAM_GATHER = [
    {"name": f"param-gather-{backend}-{where}", "kind": "param_gather", "ep": 1,
     "backend": backend, "expert_buffers": where == "expert-buffers",
     "bucket_size": 64 if where == "small-buckets" else None}
    for backend in ("fused", "unfused")
    for where in ("expert-buffers", "small-buckets")
]  # fmt: skip
