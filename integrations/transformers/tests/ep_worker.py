"""One rank of a transformers expert-parallel run with groupgrad experts (2 gloo ranks).

A ``groupgrad_testsupport`` worker script; ``test_expert_parallel.py``
imports it too, for :func:`initial_model` and :func:`token_ids`.

Each scenario builds the tiny random-init model of ``tiny.py`` (the same seed
on every rank), saves it, and loads it back with transformers' own expert
parallelism: ``DistributedConfig(tp_size=2, ep_size=2, ep_implementation=...)``
(transformers 5.24 needs ``ep_size`` to divide ``fsdp_size * tp_size``, so EP
without FSDP shares the batch over a TP group of the same two ranks). The
experts are ``Shard(0)`` ``DTensor``s, 3 per rank; ``"groupgrad"`` runs them.

* ``train``: one forward + backward of the causal-LM loss; returns the loss,
  every parameter's gradient gathered whole (fp32), and for the expert
  weights the share of gradient elements exactly representable in bf16.
  ``bf16`` scenarios load bf16 weights whose expert ``DTensor``s ask for fp32
  gradients (``grad_dtype``); ``compile`` ones run the model under
  ``torch.compile`` (default backend), ``checkpointing`` ones with
  transformers' gradient checkpointing (the experts run again in backward).
* ``generate``: greedy ``generate()`` of 4 tokens with groupgrad experts and
  with transformers' eager ones, both expert-parallel.
* ``save``: ``save_pretrained`` of the expert-parallel model (rank 0 writes
  the gathered weights), and a ``torch.distributed.checkpoint`` round trip of
  its sharded state dict into a zeroed second copy.
* ``refuse``: EP beside FSDP (``fsdp_size=2, ep_size=2``): the forward's error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig

import groupgrad.integrations.transformers as ggt
from groupgrad_testsupport import Rank, load_sibling, run_worker

tiny = load_sibling(__file__, "tiny")

SEED = 3
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def initial_model(model: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The scenario's model before any sharding: the same weights on every rank and in the test."""
    config_of, model_class = tiny.CAUSAL_LMS[model]
    torch.manual_seed(SEED)
    return model_class(config_of(num_experts=6) if model == "qwen3_moe" else config_of()).to(dtype)


def token_ids() -> Tensor:
    """``(2, 12)`` token ids, the same on every rank (the TP group shares its batch)."""
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, tiny.VOCAB, (2, 12), generator=gen)


def _whole(t: Tensor) -> Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()


def _load(scenario: dict[str, Any], rank: Rank, implementation: str) -> nn.Module:
    dtype = torch.bfloat16 if scenario.get("bf16") else torch.float32
    folder = rank.workdir / f"{scenario['name']}-{implementation}-initial"
    if rank.rank == 0:  # under a process group transformers saves from rank 0 only
        initial_model(scenario["model"], dtype).save_pretrained(folder)
    dist.barrier()
    sizes = {"fsdp_size": 2} if scenario["kind"] == "refuse" else {"tp_size": 2}
    distributed = DistributedConfig(
        **sizes, ep_size=2, ep_implementation=scenario.get("ep_implementation", "auto")
    )
    model_class = tiny.CAUSAL_LMS[scenario["model"]][1]
    model = model_class.from_pretrained(folder, distributed_config=distributed, dtype=dtype)
    model.set_experts_implementation(implementation)
    return model


def _train(scenario: dict[str, Any], rank: Rank) -> dict[str, Any]:
    model = _load(scenario, rank, "groupgrad")
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert all(getattr(m, "_is_expert_parallel", False) for m in experts), "EP was not applied"
    if scenario.get("bf16"):
        for module in experts:
            for name in EXPERT_WEIGHTS:
                getattr(module, name).grad_dtype = torch.float32
    if scenario.get("checkpointing"):
        model.gradient_checkpointing_enable()
    model.train()
    ids = token_ids()
    run = torch.compile(model) if scenario.get("compile") else model
    loss = run(ids, labels=ids).loss
    loss.backward()
    grads = {name: _whole(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    exact, dtypes = {}, {}
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS and p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dtypes[name] = str(local.dtype)
            exact[name] = float((local.bfloat16().float() == local.float()).float().mean())
    return {
        "loss": float(loss),
        "grads": grads,
        "expert_grad_dtypes": dtypes,
        "bf16_exact_share": exact,
        "local_experts": [int(m.num_experts) for m in experts],
    }


def _generate(scenario: dict[str, Any], rank: Rank) -> dict[str, Any]:
    ids = token_ids()[:1, :6]
    out = {}
    for implementation in ("groupgrad", "eager"):
        model = _load(scenario, rank, implementation).eval()
        with torch.no_grad():
            out[implementation] = model.generate(ids, max_new_tokens=4, do_sample=False).tolist()
            out[f"{implementation}_logits"] = model(ids).logits.float()
    return out


def _save(scenario: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """``save_pretrained``, and a DCP round trip of the sharded state into a zeroed copy."""
    model = _load(scenario, rank, "groupgrad")
    folder = rank.workdir / f"{scenario['name']}-saved"
    model.save_pretrained(folder)
    dist.barrier()
    dcp_folder = rank.workdir / f"{scenario['name']}-dcp"
    dcp.save(model.state_dict(), checkpoint_id=str(dcp_folder))
    other = _load({**scenario, "name": f"{scenario['name']}-other"}, rank, "groupgrad")
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    state = other.state_dict()
    dcp.load(state, checkpoint_id=str(dcp_folder))
    other.load_state_dict(state)
    mismatched = [
        name
        for (name, a), (_, b) in zip(
            model.state_dict().items(), other.state_dict().items(), strict=True
        )
        if not torch.equal(_whole(a), _whole(b))
    ]
    experts = [n for n, t in other.state_dict().items() if isinstance(t, DTensor)]
    return {"folder": str(folder), "dcp_mismatched": mismatched, "dtensor_entries": experts}


def _refuse(scenario: dict[str, Any], rank: Rank) -> dict[str, Any]:
    model = _load(scenario, rank, "groupgrad")
    ids = token_ids()
    try:
        model(ids, labels=ids)
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None}


def run_scenario(scenario: dict[str, Any], rank: Rank) -> dict[str, Any]:
    ggt.register()
    kind = scenario["kind"]
    if kind == "refuse":
        return _refuse(scenario, rank)
    if kind == "train":
        return _train(scenario, rank)
    if kind == "generate":
        return _generate(scenario, rank)
    return _save(scenario, rank)


if __name__ == "__main__":
    run_worker(run_scenario)
