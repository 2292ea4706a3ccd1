"""groupgrad experts under transformers' own expert parallelism, on 2 gloo ranks.

``ep_worker.py`` loads tiny Qwen3-MoE and Mixtral models with
``DistributedConfig(tp_size=2, ep_size=2, ep_implementation=...)`` and
``experts_implementation="groupgrad"``; the test replays the same step in one
process in fp64 with transformers' eager experts (the oracle):

* ``all_to_all`` (training: local ids, top-1, unit weights, the 1-row dummy
  of a rank that receives nothing) and ``all_reduce`` (sentinel ids for
  other ranks' experts): loss and every gradient, gathered whole, within
  fp32 rounding of fp64;
* bf16 weights whose expert ``DTensor``s ask for fp32 gradients, eager,
  under ``torch.compile`` and with gradient checkpointing: the gradients arrive in fp32, under 1 % of their
  elements exactly bf16 (a bf16-rounded gradient is 100 %), and close to fp64;
* ``generate()`` (``auto``: all-reduce at inference) gives eager's tokens;
* ``save_pretrained`` of the sharded model writes the initial weights, and a
  DCP save/load of its ``DTensor`` state restores it exactly;
* EP beside FSDP (``fsdp_size=2``) raises, naming the combination.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from packaging.version import Version

from groupgrad.integrations.transformers._version import (
    EXPERT_PARALLEL_SINCE,
    check_expert_parallel_support,
)
from groupgrad_testsupport import Launches, load_sibling

transformers = pytest.importorskip("transformers")
worker = load_sibling(__file__, "ep_worker")

WORKER = Path(__file__).with_name("ep_worker.py")
TRAIN = [
    {"name": f"{model}-{impl}", "kind": "train", "model": model, "ep_implementation": impl}
    for model in ("qwen3_moe", "mixtral")
    for impl in ("all_to_all", "all_reduce")
]
SCENARIOS = [
    *TRAIN,
    {"name": "qwen3_moe-bf16", "kind": "train", "model": "qwen3_moe",
     "ep_implementation": "all_to_all", "bf16": True},
    {"name": "qwen3_moe-bf16-compiled", "kind": "train", "model": "qwen3_moe",
     "ep_implementation": "all_to_all", "bf16": True, "compile": True},
    {"name": "qwen3_moe-bf16-checkpointed", "kind": "train", "model": "qwen3_moe",
     "ep_implementation": "all_to_all", "bf16": True, "checkpointing": True},
    {"name": "generate", "kind": "generate", "model": "qwen3_moe"},
    {"name": "save", "kind": "save", "model": "mixtral"},
    {"name": "refuse", "kind": "refuse", "model": "qwen3_moe"},
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory, WORKER, {2: SCENARIOS}, timeout_s=600.0)


def _oracle(model: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one process in fp64 with transformers' eager experts."""
    reference = worker.initial_model(model, torch.float64)
    reference.set_experts_implementation("eager")
    ids = worker.token_ids()
    loss = reference(ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


@pytest.mark.parametrize("scenario", [s["name"] for s in TRAIN])
def test_loss_and_gradients_match_one_fp64_process(runs: Launches, scenario: str) -> None:
    model = scenario.split("-")[0]
    want_loss, want = _oracle(model)
    for rank, got in enumerate(runs(2)[scenario]):
        assert got["local_experts"] == [3, 3], f"rank {rank} does not hold 3 local experts"
        assert got["loss"] == pytest.approx(want_loss, rel=1e-5)
        assert got["grads"].keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(
                got["grads"][name].double(), grad, rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}"
            )


@pytest.mark.parametrize(
    "scenario", ["qwen3_moe-bf16", "qwen3_moe-bf16-compiled", "qwen3_moe-bf16-checkpointed"]
)
def test_bf16_weights_keep_their_fp32_gradients(runs: Launches, scenario: str) -> None:
    want_loss, want = _oracle("qwen3_moe")
    for got in runs(2)[scenario]:
        assert got["loss"] == pytest.approx(want_loss, rel=2e-2)
        assert set(got["expert_grad_dtypes"].values()) == {"torch.float32"}
        for name, share in got["bf16_exact_share"].items():
            assert share < 0.01, f"{name}: {share:.1%} of its fp32 gradient is exactly bf16"
            ref = want[name]
            err = (got["grads"][name].double() - ref).norm() / ref.norm()
            assert err < 2e-2, f"{name}: relative error {err:.2e} against fp64"


def test_generate_matches_eager_experts(runs: Launches) -> None:
    for got in runs(2)["generate"]:
        assert got["groupgrad"] == got["eager"]
        assert len(got["groupgrad"][0]) == 10
        torch.testing.assert_close(
            got["groupgrad_logits"], got["eager_logits"], rtol=1e-4, atol=1e-5
        )


def test_save_pretrained_writes_the_whole_experts(runs: Launches) -> None:
    folder = runs(2)["save"][0]["folder"]
    initial = worker.initial_model("mixtral")
    saved = type(initial).from_pretrained(folder, dtype=torch.float32)
    for (name, want), (_, got) in zip(
        initial.state_dict().items(), saved.state_dict().items(), strict=True
    ):
        assert torch.equal(got, want), name


def test_expert_parallelism_needs_a_recent_transformers() -> None:
    older = f"{EXPERT_PARALLEL_SINCE.major}.{EXPERT_PARALLEL_SINCE.minor - 1}.0"
    with pytest.raises(RuntimeError, match=r"transformers >= 5\.23, but transformers 5\.22\.0"):
        check_expert_parallel_support(older)
    check_expert_parallel_support(str(EXPERT_PARALLEL_SINCE))
    assert Version(transformers.__version__) >= EXPERT_PARALLEL_SINCE


def test_expert_parallelism_beside_fsdp_is_refused_by_name(runs: Launches) -> None:
    for got in runs(2)["refuse"]:
        assert got["error"] is not None, "EP with fsdp_size=2 ran instead of raising"
        assert "ep_size=2) with fsdp_size=2, dp_replicate_size=1" in got["error"]


def test_dcp_round_trip_of_the_sharded_experts(runs: Launches) -> None:
    for got in runs(2)["save"]:
        assert any("experts" in name for name in got["dtensor_entries"]), "no DTensor experts"
        assert got["dcp_mismatched"] == []
