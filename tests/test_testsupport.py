"""The shared test support itself: result encoding, launcher failures, gpu marker, numerics, matrix.

The launcher's success path is exercised by the integration suites (every
multi-rank test goes through it); here its failure paths, with workers that
mostly do not even import torch, so they cost little.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from groupgrad_testsupport import (
    Case,
    GpuNeed,
    LaunchError,
    assert_as_close_as_torch,
    assert_close,
    atomic_ops,
    cuda_peak_growth,
    launch,
    load_sibling,
    poison_,
    poisoned,
    results,
    run_command,
)
from groupgrad_testsupport import gpu as gpu_support

# ---------------------------------------------------------------- results


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.reshape(-1).view(view), b.reshape(-1).view(view))


def test_results_round_trip_exactly(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-40, 3.0])
    tensors = {
        "bf16": torch.randn(3, 5, generator=gen).bfloat16(),
        "f16": torch.randn(4, generator=gen).half(),
        "f32_special": special,
        "f64": torch.randn(2, 2, dtype=torch.float64, generator=gen),
        "i64": torch.tensor([2**62, -(2**62), 0]),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 7),
        "strided": torch.arange(12.0).reshape(3, 4).t()[1:],
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    value = {
        "tensors": tensors,
        "shape": (3, 4),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "nested": [{"a": None, "b": (1, [2.5, "x"]), "nan": math.nan}],
    }
    results.dump(value, tmp_path / "r.json")
    back = results.load(tmp_path / "r.json")
    for name, tensor in tensors.items():
        assert _bits_equal(back["tensors"][name], tensor.detach()), name
        assert not back["tensors"][name].requires_grad
    assert back["shape"] == (3, 4)
    assert back["size"] == (2, 3)
    assert back["dtype"] is torch.bfloat16
    assert back["nested"][0]["b"] == (1, [2.5, "x"])
    assert math.isnan(back["nested"][0]["nan"])
    assert results.decode(results.encode(value))["shape"] == (3, 4)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"ok": [1, {"bad": object()}]}, r"result\['ok'\]\[1\]\['bad'\] is a object"),
        ({1: "x"}, r"result has non-str keys \[1\]"),
        ({"__tuple__": 1}, r"reserved for the encoding"),
    ],
)
def test_results_refuse_what_json_cannot_hold(value: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        results.encode(value)


# ---------------------------------------------------------------- launcher failures


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_first_failing_rank_kills_the_others_and_every_log_is_shown(tmp_path: Path) -> None:
    worker = _script(
        tmp_path,
        """
        import os, pathlib, sys, time
        print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} started")
        if os.environ["RANK"] == "1":  # once the others have started (the logs are in the cwd)
            while not all("started" in pathlib.Path(f"rank{r}.log").read_text() for r in (0, 2)):
                time.sleep(0.01)
            sys.exit("rank one gives up")
        time.sleep(60)
        """,
    )
    with pytest.raises(LaunchError) as failure:
        launch(worker, [{"name": "s"}], world_size=3, workdir=tmp_path / "run", timeout_s=30)
    message = str(failure.value)
    assert "worker ranks failed: rank 1 exit 1; killed ranks [0, 2]" in message
    assert "rank one gives up" in message
    for rank in range(3):
        assert f"rank {rank} of 3 started" in message
    assert "--- rank 0 (killed by SIGKILL) ---" in message


def test_a_launch_past_its_timeout_is_killed(tmp_path: Path) -> None:
    worker = _script(tmp_path, "import time\ntime.sleep(60)\n")
    with pytest.raises(LaunchError, match=r"worker ranks \[0, 1\] still running after 0.5 s"):
        launch(worker, [{"name": "s"}], world_size=2, workdir=tmp_path / "run", timeout_s=0.5)


def test_a_rank_that_leaves_no_result_fails_the_launch(tmp_path: Path) -> None:
    worker = _script(tmp_path, "pass\n")
    with pytest.raises(LaunchError, match=r"scenario 'first' left no result on ranks \[0, 1\]"):
        launch(worker, [{"name": "first"}], world_size=2, workdir=tmp_path / "run")


@pytest.mark.parametrize(
    ("scenarios", "message"),
    [([{"name": "a"}, {"name": "a"}], "repeat"), ([{"name": "a b"}], "letters"), ([{}], "letters")],
)
def test_scenario_names_are_checked(tmp_path: Path, scenarios: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        launch(tmp_path / "unused.py", scenarios, world_size=1, workdir=tmp_path)


def test_a_raising_scenario_exits_with_its_traceback_while_peers_wait(tmp_path: Path) -> None:
    """Through run_worker on gloo: rank 1 raises, rank 0 waits in the scenario's barrier, killed."""
    worker = _script(
        tmp_path,
        """
        from groupgrad_testsupport import run_worker

        def run_scenario(scenario, rank):
            if rank.rank == 1:
                raise ValueError(f"bad input in {scenario['name']}")
            return {"rank": rank.rank}

        run_worker(run_scenario)
        """,
    )
    with pytest.raises(LaunchError) as failure:
        launch(worker, [{"name": "only"}], world_size=2, workdir=tmp_path / "run", timeout_s=60)
    message = str(failure.value)
    assert re.search(r"worker ranks failed: (rank 0 exit 1, )?rank 1 exit 1", message), message
    assert "rank 1: scenario only failed" in message
    assert "ValueError: bad input in only" in message


# ---------------------------------------------------------------- gpu marker


@pytest.mark.parametrize(
    ("mark", "need"),
    [
        (pytest.mark.gpu, GpuNeed(1)),
        (pytest.mark.gpu(2), GpuNeed(2)),
        (pytest.mark.gpu(count=4), GpuNeed(4)),
        (pytest.mark.gpu(capability=(9, 0)), GpuNeed(1, (9, 0))),
    ],
)
def test_gpu_marker_forms(mark: pytest.MarkDecorator, need: GpuNeed) -> None:
    assert GpuNeed.of(mark.mark) == need


@pytest.mark.parametrize(
    "mark", [pytest.mark.gpu(0), pytest.mark.gpu(True), pytest.mark.gpu(1, 2), pytest.mark.gpu(n=2)]
)
def test_gpu_marker_rejects_bad_arguments(mark: pytest.MarkDecorator) -> None:
    with pytest.raises(TypeError, match="gpu marker"):
        GpuNeed.of(mark.mark)


def test_gpu_skip_reasons_say_what_was_needed_and_found(monkeypatch: pytest.MonkeyPatch) -> None:
    reason = gpu_support.unmet_reason.__wrapped__  # uncached
    monkeypatch.setattr(
        gpu_support, "cuda_device_count", lambda: (0, "CUDA_VISIBLE_DEVICES is empty")
    )
    assert reason(GpuNeed(1)) == "needs 1 CUDA device, found 0 (CUDA_VISIBLE_DEVICES is empty)"
    monkeypatch.setattr(gpu_support, "cuda_device_count", lambda: (1, ""))
    assert reason(GpuNeed(2)) == "needs 2 CUDA devices, found 1"
    assert reason(GpuNeed(1)) is None


@pytest.mark.gpu
def test_cuda_peak_growth_sees_a_temporary_allocation() -> None:
    kept = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # allocated before: not counted
    grown = cuda_peak_growth(lambda: torch.empty(4 << 20, dtype=torch.uint8, device="cuda"))
    assert 4 << 20 <= grown < 5 << 20, grown
    del kept


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")
def test_atomic_ops_sees_atomic_ops_and_tells_order_free_reductions_apart() -> None:
    index, ones = torch.tensor([0, 0, 2]), torch.ones(3, 2)

    def step() -> None:
        torch.zeros(3, 2).index_add_(0, index, ones)
        torch.zeros(3, 2).scatter_reduce_(0, index[:, None].expand(3, 2), ones, "amax")
        torch.zeros(3, 2).scatter_reduce(0, index[:, None].expand(3, 2), ones, "sum")
        leaf = torch.ones(3, 2, requires_grad=True)
        leaf.index_select(0, index).sum().backward()  # its backward is an index_add
        torch.zeros(3, 2).scatter_(0, index[:, None].expand(3, 2), ones, reduce="add")
        torch.zeros(3, 2).scatter_(0, index[:, None].expand(3, 2), ones)  # no reduction
        torch.bincount(index, weights=torch.ones(3))
        torch.bincount(index)  # integer counts: exact in any order
        torch.ones(3).cumsum(0)
        index.cumsum(0)

    assert atomic_ops(step) == {
        "aten::index_add_",
        "aten::index_add",
        "aten::scatter_reduce(sum)",
        "aten::scatter_(add)",
        "aten::bincount(weights)",
        "aten::cumsum(floating)",
    }


# ---------------------------------------------------------------- numerics


def test_as_close_as_torch_rule() -> None:
    exact = torch.linspace(-1, 1, 64, dtype=torch.float64)
    torch_own = exact + 1e-3
    assert_as_close_as_torch(exact + 1.9e-3, exact, torch_own, atol=0.0)
    assert_as_close_as_torch(exact + 2.4e-3, exact, torch_own, atol=0.0, rtol=5e-4)
    with pytest.raises(AssertionError, match=r"y: max error 0.0021 > 2 × PyTorch's 0.001"):
        assert_as_close_as_torch(exact + 2.1e-3, exact, torch_own, atol=0.0, what="y")
    ours = exact.clone()
    ours[5] = math.nan
    with pytest.raises(AssertionError, match=r"1 non-finite values, first at \(5,\)"):
        assert_as_close_as_torch(ours, exact, torch_own, atol=1.0)


def test_assert_close_names_what_failed_and_never_passes_nan() -> None:
    assert_close(
        torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.float64), rtol=0, atol=0
    )
    with pytest.raises(AssertionError, match=r"w\.main_grad: Tensor-likes are not close"):
        assert_close(torch.zeros(2), torch.ones(2), rtol=0, atol=0.5, what="w.main_grad")
    with pytest.raises(AssertionError):
        assert_close(poisoned((2,)), poisoned((2,)), rtol=1, atol=1)


def test_poison() -> None:
    assert poisoned((2, 3), dtype=torch.bfloat16).isnan().all()
    assert poison_(torch.zeros(4)).isnan().all()
    with pytest.raises(TypeError, match=r"cannot poison a torch\.int64 tensor"):
        poison_(torch.zeros(2, dtype=torch.int64))


# ---------------------------------------------------------------- matrix, imports


def test_case_matrix_covers_every_combination_once() -> None:
    cases = Case.all()
    assert len(cases) == 2 * 2 * 3 * 2 * 2 * 2
    assert len({case.id for case in cases}) == len(cases)
    assert cases[0].id == "per_expert-plain-none-now-keep-nobias"
    assert cases[-1].id == "single-distributed-overwrite-delay-zero_out-bias"


def test_load_sibling_imports_once(tmp_path: Path) -> None:
    (tmp_path / "helper.py").write_text("VALUE = object()\n")
    first = load_sibling(tmp_path / "test_x.py", "helper")
    assert load_sibling(tmp_path / "test_x.py", "helper") is first


_IN_ORDER_SCRIPT = """
import os, tempfile
import torch, torch.distributed as dist
from groupgrad_testsupport.cpu_streams import DoneWork, collectives_in_program_order
store = tempfile.mktemp()
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
collectives_in_program_order()
out, shard = torch.zeros(4), torch.arange(4.0)
work = dist.all_gather_into_tensor(out, shard, async_op=True)
assert isinstance(work, DoneWork), type(work)
assert torch.equal(out, shard), out  # complete before the call returned
total = torch.ones(3)
assert dist.all_reduce(total) is None  # a synchronous call keeps its own result
with dist.distributed_c10d._coalescing_manager(async_ops=True) as manager:
    dist.all_reduce(torch.ones(2))
manager.wait()
print("in order", flush=True)
dist.destroy_process_group()  # gloo's threads stopped now, not torn down at exit (an abort)
os._exit(0)
"""


def test_cpu_collectives_complete_before_returning(tmp_path: Path) -> None:
    """The Megatron CPU shims' collectives: an async one is done when its call returns."""
    support = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(support), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", _IN_ORDER_SCRIPT],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "in order"


_SPAWNS_A_RANK = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(rank.pid, flush=True)
time.sleep(300)
"""


def test_a_timed_out_command_leaves_no_process_behind(tmp_path: Path) -> None:
    """``run_command`` kills the whole tree on a timeout (``subprocess.run`` kills one process)."""
    pid_file = tmp_path / "rank.pid"
    script = _SPAWNS_A_RANK.replace(
        "print(rank.pid, flush=True)", f"open({str(pid_file)!r}, 'w').write(str(rank.pid))"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([sys.executable, "-c", script], timeout=5)
    rank = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _running(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(rank), f"rank {rank} survived its command's timeout"


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_support_imports_without_pytest() -> None:
    # Catches: a support module importing pytest at its top: the examples that load the
    # support from a checkout (examples/train_megatron_core_moe.py) need no pytest installed.
    code = (
        "import sys\n"
        "sys.modules['pytest'] = None  # an import of pytest now fails\n"
        "import groupgrad_testsupport\n"
        "from groupgrad_testsupport.cpu_streams import stub_streams\n"
    )
    support = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(support), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
