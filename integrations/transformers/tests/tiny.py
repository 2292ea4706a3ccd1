"""Tiny random-init transformers MoE models built in code (no downloads), for the tests.

Each builder returns a real transformers model or experts module whose
experts run transformers' own eager loop (``experts_implementation="eager"``)
until a test switches them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import (
    GptOssConfig,
    MixtralConfig,
    MixtralForCausalLM,
    NemotronHConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

VOCAB = 64
HIDDEN = 32
EXPERT_WIDTH = 24
EXPERTS = 6
TOP_K = 2


def qwen3_moe_config(**overrides: Any) -> Qwen3MoeConfig:
    """Qwen3-MoE: 2 layers, 6 experts of width 24, top-2, every layer sparse."""
    options: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 48,
        "moe_intermediate_size": EXPERT_WIDTH,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "max_position_embeddings": 64,
        "experts_implementation": "eager",
    }
    return Qwen3MoeConfig(**{**options, **overrides})


def mixtral_config(**overrides: Any) -> MixtralConfig:
    """Mixtral: 2 layers, 6 experts of width 24, top-2 (router weights stay fp32)."""
    options: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": EXPERT_WIDTH,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "max_position_embeddings": 64,
        "experts_implementation": "eager",
    }
    return MixtralConfig(**{**options, **overrides})


CAUSAL_LMS = {
    "qwen3_moe": (qwen3_moe_config, Qwen3MoeForCausalLM),
    "mixtral": (mixtral_config, MixtralForCausalLM),
}


def causal_lm(name: str, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny random-init ``*ForCausalLM`` (transformers' own init), eager experts."""
    make_config, model_class = CAUSAL_LMS[name]
    torch.manual_seed(seed)
    model = model_class(make_config())
    return model.to(dtype)


def moe_block(name: str, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Layer 0's sparse MoE block (router ``gate`` + ``experts``) of a tiny model."""
    block = causal_lm(name, seed, dtype).model.layers[0].mlp
    block.experts.config = copy.deepcopy(block.experts.config)  # its own switch
    return block


def _filled(module: nn.Module, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return module


def _experts_module(config_class: type, experts_class: type, seed: int, **sizes: Any) -> nn.Module:
    """A bare experts module of ``EXPERTS`` experts (top-``TOP_K``), ``sizes`` in the config's names."""
    config = config_class(
        hidden_size=HIDDEN, num_experts_per_tok=TOP_K, experts_implementation="eager", **sizes
    )
    return _filled(experts_class(config), seed)


def gpt_oss_experts(seed: int) -> nn.Module:
    """GPT-OSS experts: transposed ``(E, in, out)`` weights, interleaved gate/up, biases, own gate."""
    sizes = {"intermediate_size": EXPERT_WIDTH, "num_local_experts": EXPERTS}
    return _experts_module(GptOssConfig, GptOssExperts, seed, **sizes)


def nemotron_h_experts(seed: int) -> nn.Module:
    """Nemotron-H experts: no gate (``up_proj``, relu²), ``(E, out, in)`` weights."""
    sizes = {"moe_intermediate_size": EXPERT_WIDTH, "n_routed_experts": EXPERTS}
    return _experts_module(NemotronHConfig, NemotronHExperts, seed, **sizes)


EXPERTS_MODULES = {
    "qwen3_moe": lambda seed: moe_block("qwen3_moe", seed).experts,
    "mixtral": lambda seed: moe_block("mixtral", seed).experts,
    "gpt_oss": gpt_oss_experts,
    "nemotron_h": nemotron_h_experts,
}


def use_implementation(experts: nn.Module, implementation: str) -> nn.Module:
    """Switch one experts module (its own config copy) to ``implementation``."""
    experts.config._experts_implementation = implementation
    return experts


def routing(
    tokens: int, seed: int, *, skip_expert: int | None = 1, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_index, top_k_weights)`` of ``tokens`` tokens: distinct experts per token, one unused.

    Weights are a softmax over the choices (positive, summing to 1 per
    token), drawn fresh from ``seed``; ``skip_expert`` receives no token.
    """
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(EXPERTS) if e != skip_expert])
    scores = torch.rand(tokens, len(allowed), generator=generator)
    index = allowed[scores.topk(TOP_K, dim=-1).indices]
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=generator), dim=-1)
    return index, weights.to(dtype)


def decorated_swiglu_experts(seed: int, **flags: Any) -> nn.Module:
    """Concatenated SwiGLU experts with biases (and optionally a post-expert norm).

    No transformers 5.17–5.24 model combines a SiLU gate with biases and
    ``(E, out, in)`` weights, so this class is declared here, decorated with
    transformers' own ``use_experts_implementation(has_bias=True, **flags)``.
    Its eager ``forward`` is a plain per-(token, choice) loop: the
    independent reference.
    """
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    post_norm = bool(flags.get("has_post_expert_norm", False))

    class BiasedSwiGLUExperts(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.num_experts = EXPERTS
            self.gate_up_proj = nn.Parameter(torch.empty(EXPERTS, 2 * EXPERT_WIDTH, HIDDEN))
            self.gate_up_proj_bias = nn.Parameter(torch.empty(EXPERTS, 2 * EXPERT_WIDTH))
            self.down_proj = nn.Parameter(torch.empty(EXPERTS, HIDDEN, EXPERT_WIDTH))
            self.down_proj_bias = nn.Parameter(torch.empty(EXPERTS, HIDDEN))
            self.act_fn = ACT2FN["silu"]
            if post_norm:
                self.post_expert_norm = nn.LayerNorm(HIDDEN)

        def forward(
            self,
            hidden_states: torch.Tensor,
            top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor,
        ) -> torch.Tensor:
            rows = []
            for t in range(hidden_states.shape[0]):
                total = torch.zeros_like(hidden_states[t])
                for j in range(top_k_index.shape[1]):
                    e = int(top_k_index[t, j])
                    h = self.gate_up_proj[e] @ hidden_states[t] + self.gate_up_proj_bias[e]
                    gate, up = h.chunk(2)
                    y = self.down_proj[e] @ (self.act_fn(gate) * up) + self.down_proj_bias[e]
                    if post_norm:
                        y = self.post_expert_norm(y)
                    total = total + y * top_k_weights[t, j]
                rows.append(total)
            return torch.stack(rows)

    experts_class = use_experts_implementation(has_bias=True, **flags)(BiasedSwiGLUExperts)
    config = qwen3_moe_config()
    return _filled(experts_class(config), seed)


EXPERTS_MODULES["swiglu_bias"] = lambda seed: decorated_swiglu_experts(seed)


def post_norm_supported() -> bool:
    """Whether this transformers' ``use_experts_implementation`` takes ``has_post_expert_norm`` (5.24)."""
    import inspect

    from transformers.integrations.moe import use_experts_implementation

    return "has_post_expert_norm" in inspect.signature(use_experts_implementation).parameters


if post_norm_supported():
    EXPERTS_MODULES["swiglu_bias_post_norm"] = lambda seed: decorated_swiglu_experts(
        seed, has_post_expert_norm=True
    )
