"""A training loop around sharded experts, in real processes: nothing corrupted or lost.

What a user does around ``shard_expert_weights``, run by gloo ranks
(``loop_worker.py``; NCCL on 2 GPUs in the ``gpu`` test) and checked against
independent single-process references (``loop_reference.py``):

* ``DistributedDataParallel`` for the router: DDP around the sharded module
  itself, or around a parent after ``ddp_ignore_sharded``, trains like fp64
  autograd on the full weights (router gradients averaged by DDP, experts
  reduce-scattered by their shard groups and never touched by DDP: not
  broadcast, not in its buckets); DDP around a parent *without* it raises a
  clear error at the first forward; DDP around a ``GroupedLinear`` itself (its
  weights at DDP's root, which DDP names two ways) reduces only the biases.
* Checkpoints saved on 2 ranks (DCP, ``full_state_dict`` + ``torch.save``,
  per-rank ``torch.save``) load on 2 and on 4 ranks bit for bit, with
  ``main_grad`` shards of the new size; another rank's per-rank file is a
  clear error; the full file and the DCP folder load into unsharded models.
* ``MasterWeights``: bf16 shards, fp32 masters, ``torch.optim.AdamW`` stepping
  them from ``main_grad`` and copied back, equals ``torch.optim.AdamW`` on
  full fp32 masters fed the exact gradient.
* Frozen members of a sharded group are never written (their ``main_grad``
  sentinel and flag stay, ``.grad`` stays ``None``), need no ``main_grad``,
  and the trainable members still receive the exact reduced gradient.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from groupgrad.modules import GroupedLinear, GroupedMLP
from groupgrad_testsupport import Launches, assert_close, load_sibling

ref = load_sibling(__file__, "loop_reference")
WORKER = Path(__file__).with_name("loop_worker.py")
Results = dict[str, list[dict[str, Any]]]

MOE = {"experts": 4, "hidden": 8, "ffn": 6, "tokens": 16, "steps": 3, "lr": 0.5}
DDP = [{"name": f"ddp-{wrap}", "kind": "ddp", "wrap": wrap, "seed": 1, **MOE}
       for wrap in ("whole", "parent", "forgotten")]  # fmt: skip
ROOT_LAYER = {"name": "ddp-root-layer", "kind": "ddp_root_layer", "seed": 2, "splits": [3, 0, 7]}
MASTERS = [
    {"name": f"masters-{layout}", "kind": "masters", "seed": 3, "packed": layout == "packed",
     "experts": 3, "in_features": 8, "out_features": 12, "tokens": 12, "splits": [5, 0, 7],
     "steps": 3, "micro_batches": 2, "lr": 1e-3, "weight_decay": 0.1}
    for layout in ("per_expert", "packed")
]  # fmt: skip
FROZEN = [
    {"name": "frozen-leader-and-follower", "kind": "frozen", "seed": 4, "packed": False,
     "frozen": ["weight0", "weight2"], "without_main_grad": "weight0", "overwrite": False,
     "delay": False},
    {"name": "frozen-follower-overwrite-delay", "kind": "frozen", "seed": 5, "packed": False,
     "frozen": ["weight1"], "without_main_grad": None, "overwrite": True, "delay": True},
    {"name": "frozen-packed", "kind": "frozen", "seed": 6, "packed": True, "frozen": ["weight"],
     "without_main_grad": None, "overwrite": False, "delay": False},
]  # fmt: skip
for _frozen in FROZEN:
    _frozen["splits"] = [3, 0, 7]


def _checkpoints(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    save = {"name": "checkpoint-save", "kind": "checkpoint_save", "seed": 7, "folder": str(folder)}
    load = {"name": "checkpoint-load", "kind": "checkpoint_load", "seed": 7,
            "folder": str(folder), "saved_on": 2}  # fmt: skip
    return save, load


def _masters_resume(folder: Path) -> dict[str, Any]:
    return {"name": "masters-resume", "kind": "masters_resume", "seed": 8, "experts": 3,
            "in_features": 8, "out_features": 12, "tokens": 12, "splits": [5, 0, 7], "lr": 1e-3,
            "folder": str(folder)}  # fmt: skip


CLIP = {"name": "clip", "kind": "clip", "seed": 8, "max_norm": 1.0}


def _two_rank_scenarios(folder: Path) -> list[dict[str, Any]]:
    scenarios = [*DDP, ROOT_LAYER, *MASTERS, *FROZEN, *_checkpoints(folder)]
    return [*scenarios, _masters_resume(folder), CLIP]


@pytest.fixture(scope="module")
def checkpoint_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoint")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, checkpoint_folder: Path) -> Launches:
    """One 2-rank launch (everything, saving the checkpoint) and one 4-rank one (loading it)."""
    scenarios = {
        2: _two_rank_scenarios(checkpoint_folder),
        4: [_checkpoints(checkpoint_folder)[1]],
    }
    return Launches(tmp_path_factory, WORKER, scenarios, timeout_s=300)


# --- DDP --------------------------------------------------------------------------------------


def check_ddp_trains_like_reference(found: Results, wrap: str) -> None:
    ranks = found[f"ddp-{wrap}"]
    reference = ref.moe_steps(ranks, MOE)
    for rank, result in enumerate(ranks):
        where = f"ddp-{wrap} rank {rank}"
        assert result["untouched_by_wrap"], f"{where}: DDP's broadcast changed the expert shards"
        assert result["reduced_by_ddp"] == ["router.bias", "router.weight"], where
        for step, got in enumerate(result["steps"]):
            assert got["expert_grads_zero"], f"{where} step {step}: an expert .grad is not zero"
            expected = reference[step]
            assert got["experts"].keys() | got["router"].keys() == expected.keys(), where
            for name, value in {**got["router"], **got["experts"]}.items():
                what = f"{where} step {step} {name}"
                assert_close(value, expected[name], rtol=1e-5, atol=1e-6, what=what)


def check_forgotten_ddp_ignore_raises(found: Results) -> None:
    ranks = found["ddp-forgotten"]
    assert not ranks[1]["untouched_by_wrap"], "DDP left rank 1's shards alone: nothing to detect"
    for rank, result in enumerate(ranks):
        error = result["error"]
        assert error is not None, f"rank {rank}: the overwritten shards went unnoticed"
        assert "'fc1.weight0' are identical on all 2 ranks" in error, error
        assert "ddp_ignore_sharded(model) before DistributedDataParallel(model)" in error, error


def check_ddp_around_the_layer_itself(found: Results) -> None:
    ranks = found["ddp-root-layer"]
    splits, world = ROOT_LAYER["splits"], len(ranks)
    bias_grads = [sum(r["dy"].double().split(splits)[e].sum(0) for r in ranks) / world
                  for e in range(3)]  # fmt: skip
    wgrad_ENK = ref.mean_wgrads(ranks, splits)
    for rank, result in enumerate(ranks):
        where = f"ddp-root-layer rank {rank}"
        assert result["untouched_by_wrap"], f"{where}: DDP's broadcast changed the shards"
        assert result["reduced_by_ddp"] == ["bias0", "bias1", "bias2"], where
        for e in range(3):
            got = result["bias_grads"][f"bias{e}"]
            assert_close(got, bias_grads[e], rtol=1e-5, atol=1e-6, what=f"{where} bias{e}.grad")
            expected = ref.rows(wgrad_ENK[e], rank, world)
            got = result["main_grads"][f"weight{e}"]
            assert_close(got, expected, rtol=1e-5, atol=1e-6, what=f"{where} weight{e}.main_grad")


@pytest.mark.parametrize("wrap", ["whole", "parent"])
def test_ddp_trains_router_and_sharded_experts_like_the_fp64_reference(
    runs: Launches, wrap: str
) -> None:
    check_ddp_trains_like_reference(runs(2), wrap)


def test_ddp_around_a_parent_without_ddp_ignore_sharded_raises_at_the_first_forward(
    runs: Launches,
) -> None:
    check_forgotten_ddp_ignore_raises(runs(2))


def test_ddp_around_the_sharded_layer_itself_reduces_only_its_biases(runs: Launches) -> None:
    check_ddp_around_the_layer_itself(runs(2))


# --- fp32 master weights --------------------------------------------------------------------


def check_master_weights(found: Results, cfg: dict[str, Any]) -> None:
    ranks = found[cfg["name"]]
    reference = ref.adamw_masters(ranks, cfg)
    for rank, result in enumerate(ranks):
        for step, got in enumerate(result["steps"]):
            where = f"{cfg['name']} rank {rank} step {step}"
            assert got["main_grads_zeroed"], f"{where}: main_grad not zeroed after the step"
            for index, name in enumerate(result["names"]):
                master, shard = got["masters"][index], got["shards"][name]
                assert master.dtype == torch.float32, f"{where}: master of {name} is {master.dtype}"
                assert shard.dtype == torch.bfloat16, f"{where}: {name} is {shard.dtype}"
                expected = reference[step][index]
                want = ref.rows(expected, rank, len(ranks))
                assert_close(master, want, rtol=1e-6, atol=1e-7, what=f"{where} master of {name}")
                assert torch.equal(shard, master.bfloat16()), f"{where}: {name} != its master"
                masters = [r["steps"][step]["masters"][index] for r in ranks]
                full = torch.cat(masters, dim=-2).bfloat16()  # every rank's rows, in rank order
                assert torch.equal(got["weights"][name], full), f"{where}: gathered {name}"


@pytest.mark.parametrize("cfg", MASTERS, ids=lambda c: c["name"])
def test_fp32_master_weights_with_adamw_match_the_fp32_reference(
    runs: Launches, cfg: dict[str, Any]
) -> None:
    check_master_weights(runs(2), cfg)


def test_clipping_the_masters_measures_every_ranks_shards(runs: Launches) -> None:
    # Catches: a norm over this rank's shards only (torch.nn.utils.clip_grad_norm_ over
    # masters.parameters()): each rank clipped by another, smaller norm, and the ranks drifted.
    ranks = runs(2)["clip"]
    squares = sum(float(g.double().square().sum()) for r in ranks for g in r["before"])
    want = (squares + float(ranks[0]["router_before"].double().square().sum())) ** 0.5
    scale = min(1.0, CLIP["max_norm"] / (want + 1e-6))
    assert scale < 0.5  # the test clips
    for rank, result in enumerate(ranks):
        assert abs(result["norm"] - want) <= 1e-5 * want, f"rank {rank}: {result['norm']} {want}"
        pairs = [*zip(result["before"], result["after"], strict=True)]
        for before, after in [*pairs, (result["router_before"], result["router_after"])]:
            torch.testing.assert_close(after, before * scale, rtol=1e-5, atol=0)


def test_a_resume_from_masters_state_dict_continues_bit_for_bit(runs: Launches) -> None:
    # Catches: a resume that restarts the fp32 masters from the bf16 shards (the README's
    # recipe was copy_from_model()): the low bits rounding dropped are lost, and the next steps
    # differ from the run that never stopped.
    for rank, result in enumerate(runs(2)["masters-resume"]):
        where = f"rank {rank}"
        saved = result["saved"]
        assert any(  # the masters hold more than the shards: copy_from_model() would lose it
            not torch.equal(m, s.float())
            for m, s in zip(saved["masters"], saved["shards"], strict=True)
        ), where
        for part in ("shards", "masters"):
            for got, want in zip(result["resumed"][part], result["straight"][part], strict=True):
                assert torch.equal(got, want), f"{where}: resumed {part} differ"
        assert re.match(
            rf"state holds rank {1 - rank}'s masters, this is rank {rank}",
            result["other_file_error"],
        ), where


# --- frozen members ---------------------------------------------------------------------------


def check_frozen_members(found: Results, cfg: dict[str, Any]) -> None:
    ranks = found[cfg["name"]]
    world, splits = len(ranks), cfg["splits"]
    init = {n: t.double() for n, t in ranks[0]["init"].items()}
    full_ENK = (
        init["weight"] if cfg["packed"] else torch.stack([init[f"weight{e}"] for e in range(3)])
    )
    wgrad_ENK = ref.mean_wgrads(ranks, splits)
    for rank, result in enumerate(ranks):
        dys = result["dy"].double().split(splits)
        dx = torch.cat([dy @ w for dy, w in zip(dys, full_ENK, strict=True)])
        assert_close(result["dx"], dx, rtol=1e-5, atol=1e-6, what=f"{cfg['name']} rank {rank} dx")
        for param, main_grad in result["main_grads"].items():
            where = f"{cfg['name']} rank {rank} {param}"
            if param in cfg["frozen"]:
                assert result["flags"][param] is False, f"{where}: a frozen member was flagged"
                assert result["grads"][param] is None, f"{where}: a frozen member got a .grad"
                if param == cfg["without_main_grad"]:
                    assert main_grad is None, f"{where}: main_grad was given back"
                else:
                    assert (main_grad == 7.0).all(), f"{where}: the frozen main_grad was written"
                continue
            expected = ref.rows(wgrad_ENK[int(param.removeprefix("weight"))], rank, world)
            assert result["flags"][param] is True, where
            assert_close(main_grad, expected, rtol=1e-5, atol=1e-6, what=f"{where}.main_grad")
            assert not result["grads"][param].any(), f"{where}: the dummy is not zero"


@pytest.mark.parametrize("cfg", FROZEN, ids=lambda c: c["name"])
def test_frozen_members_are_never_written_and_need_no_main_grad(
    runs: Launches, cfg: dict[str, Any]
) -> None:
    check_frozen_members(runs(2), cfg)


# --- checkpoints ------------------------------------------------------------------------------


def _assert_bitwise(got: dict[str, Tensor], truth: dict[str, Tensor], where: str) -> None:
    assert got.keys() == truth.keys(), where
    for name, value in truth.items():
        assert got[name].dtype == value.dtype, f"{where} {name}: {got[name].dtype}"
        assert torch.equal(got[name], value), f"{where} {name}: not bit for bit"


def check_state_dict_format(found: Results) -> None:
    sharded = {*(f"mlp.fc{i}.weight{e}" for i in (1, 2) for e in range(4)), "lin.weight"}
    for rank, result in enumerate(found["checkpoint-save"]):
        for name, kind in result["kinds"].items():
            want = "DTensor" if name in sharded else "Tensor"
            assert kind == want, f"rank {rank} state_dict()[{name!r}] is a {kind}"
        assert result["placements"]["lin.weight"] == "(Shard(dim=1),)"
        assert result["placements"]["mlp.fc1.weight0"] == "(Shard(dim=0),)"
        _assert_bitwise(result["full"], result["truth"], f"rank {rank} full_state_dict")


def check_checkpoint_loads(saved: Results, loaded: Results, world: int) -> None:
    truth = saved["checkpoint-save"][0]["truth"]
    for rank, result in enumerate(loaded["checkpoint-load"]):
        ways = ("dcp", "full_file", *(("own_file",) if world == 2 else ()))
        for way in ways:
            where = f"{world} ranks, rank {rank}, {way}"
            _assert_bitwise(result[way]["full"], truth, where)
            for name, shape in result[way]["shard_shapes"].items():
                full = truth[name].shape
                assert shape == (*full[:-2], full[-2] // world, full[-1]), f"{where} {name}"
                assert result[way]["main_grad_shapes"][name] == shape, f"{where} {name}.main_grad"
        if world == 2:
            error = result["other_file_error"]
            assert error is not None, f"rank {rank} loaded another rank's file without a word"
            assert f"belongs to mesh coordinate ({1 - rank},), but this is rank {rank}" in error
            # below a parent: refused before the modules loaded ahead of it are written
            error = result["other_file_full_error"]
            assert error is not None, f"rank {rank}: load_full_state_dict took another's file"
            assert f"belongs to mesh coordinate ({1 - rank},), but this is rank {rank}" in error
            assert result["router_kept"], f"rank {rank}: the router was loaded before the refusal"


def test_state_dict_gives_dtensors_and_full_state_dict_the_exact_full_weights(
    runs: Launches,
) -> None:
    check_state_dict_format(runs(2))


@pytest.mark.parametrize("world", [2, 4])
def test_checkpoints_saved_on_2_ranks_load_bit_for_bit(runs: Launches, world: int) -> None:
    check_checkpoint_loads(runs(2), runs(world), world)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_full_file_and_dcp_folder_load_into_an_unsharded_model(
    runs: Launches, checkpoint_folder: Path
) -> None:
    truth = runs(2)["checkpoint-save"][0]["truth"]
    model = nn.ModuleDict(
        {
            "mlp": GroupedMLP(4, 8, 12, bias=True),
            "lin": GroupedLinear(
                3, 8, 12, bias=False, dtype=torch.bfloat16, single_grouped_weight=True
            ),
        }
    )
    model.load_state_dict(torch.load(checkpoint_folder / "full.pt"))
    _assert_bitwise({n: t.detach() for n, t in model.state_dict().items()}, truth, "full.pt")
    state = {n: torch.full_like(t, math.nan) for n, t in model.state_dict().items()}
    dcp.load(state, checkpoint_id=checkpoint_folder / "dcp")  # one process, no process group
    _assert_bitwise(state, truth, "the DCP folder in one process")


# --- NCCL -------------------------------------------------------------------------------------


@pytest.mark.gpu(2)
def test_everything_on_two_gpus_with_nccl(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every 2-rank scenario above on 2 GPUs (NCCL; CUTLASS kernels for the bf16 ones)."""
    folder = tmp_path_factory.mktemp("checkpoint-gpu")
    launches = Launches(
        tmp_path_factory, WORKER, {2: _two_rank_scenarios(folder)}, device="cuda", timeout_s=600
    )
    found = launches(2)
    for wrap in ("whole", "parent"):
        check_ddp_trains_like_reference(found, wrap)
    check_forgotten_ddp_ignore_raises(found)
    check_ddp_around_the_layer_itself(found)
    for cfg in MASTERS:
        check_master_weights(found, cfg)
    for cfg in FROZEN:
        check_frozen_members(found, cfg)
    check_state_dict_format(found)
    check_checkpoint_loads(found, found, 2)
