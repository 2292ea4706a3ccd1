"""Test support shared by every package's tests: written once, like production code.

The root ``conftest.py`` puts this package's folder (``tests/``) on
``sys.path``, so any test imports it, also when one package's tests run alone
(``pytest integrations/megatron_fsdp/tests -m "not gpu"`` from the repository
root). Worker processes get it on ``PYTHONPATH`` from :func:`launch`.

What is here:

* :mod:`.gpu` -- the ``gpu`` marker (``@pytest.mark.gpu``, ``gpu(2)``,
  ``gpu(capability=(9, 0))``): skips with a reason naming what was needed
  and found; the root ``conftest.py`` applies it. :func:`cuda_peak_growth`
  measures what a step adds to the CUDA memory peak.
* :mod:`.launcher` / :mod:`.worker` -- multi-rank tests: :func:`launch`,
  :class:`Launches`, :func:`run_worker`, :class:`Rank`; :func:`torchrun`, the
  command that runs an example or benchmark as ranks under ``torch.distributed.run``.
* :mod:`.results` -- rank results as JSON, tensors exact to the bit.
* :mod:`.numerics` -- :func:`assert_close`, :func:`assert_as_close_as_torch`
  (DESIGN's "at most 2× PyTorch's own error" rule), :func:`assert_within_scale`,
  :func:`max_abs_error`, :func:`assert_compiled_matches_eager`,
  :func:`poisoned` / :func:`poison_` (NaN outputs).
* :mod:`.matrix` -- :class:`Case`, the module-matrix combination;
  :func:`module_flags`, :func:`distribute_fake` / :func:`attach_main_grads` to
  set a module up for one, :func:`experts_fp64` for its fp64 reference;
  :func:`assert_weight_grads`, :func:`assert_main_grads_wait_for_backward_dw`
  and :func:`assert_matrix_close` to check a step,
  :func:`write_into_dummies` to dirty the shared dummy as hooks do.
* :mod:`.atomics` -- :func:`atomic_ops`, which ops whose CUDA kernels add
  atomically (an order changing from run to run) a block of code dispatched.
* :mod:`.allocations` -- :class:`AllocationRecorder`, the fresh allocations
  of at least a given size that a block of eager code makes, and
  :func:`backward_allocations`, those of one ``backward``.
* :mod:`.cpu_streams` -- :func:`stub_streams`, CUDA streams and events that do
  nothing, for the Megatron suites' test-only CPU shims.
* :mod:`.imports` -- :func:`load_sibling`, a helper module beside a test.
* :mod:`.calls` -- :func:`record_calls`, which of a module's functions (its
  custom ops) a block of code called.
* :mod:`.offload` -- :func:`offloaded_saved_tensors`, what autograd saves in a
  block, copied out as an activation offloader would.
* :mod:`.gemms` -- ``GEMMS``, the kernels' public grouped GEMMs and their
  ``*_ref`` twins, and :func:`public_kernel_names` (imports ``groupgrad.kernels``:
  import it by its module name).
* :mod:`.experts` -- :func:`run_experts`, one forward and backward of a
  Hugging Face-style experts module, every gradient by name.

Writing a multi-rank test
-------------------------

Two files. The worker script runs in every rank; it receives each scenario
(a JSON mapping the test chose) and returns that rank's result::

    # my_worker.py
    import torch
    import torch.distributed as dist
    from groupgrad_testsupport import Rank, run_worker

    def run_scenario(scenario: dict, rank: Rank) -> dict:
        torch.manual_seed(scenario["seed"] + rank.rank)
        x = torch.randn(scenario["size"], device=rank.device)
        total = x.clone()
        dist.all_reduce(total)
        return {"x": x, "total": total}  # plain data and tensors

    if __name__ == "__main__":
        run_worker(run_scenario)

The test launches it (gloo on CPU; ``device="cuda"`` for NCCL) and compares
every rank's result with a single-process reference::

    # test_my_integration.py
    from pathlib import Path
    from groupgrad_testsupport import Launches, assert_close

    WORKER = Path(__file__).with_name("my_worker.py")
    SCENARIOS = [{"name": "small", "seed": 1, "size": 8}]

    @pytest.fixture(scope="module")
    def runs(tmp_path_factory):
        return Launches(tmp_path_factory, WORKER, {2: SCENARIOS})

    def test_all_reduce_sums(runs):
        ranks = runs(2)["small"]  # one result per rank, tensors decoded
        expected = sum(r["x"].double() for r in ranks)
        for rank, result in enumerate(ranks):
            assert_close(result["total"], expected, rtol=1e-6, atol=1e-6, what=f"rank {rank}")

Results travel as JSON (:mod:`.results`): tensors come back on the CPU, exact
to the bit, tuples as tuples. A rank that raises fails the launch at once
with every rank's log tail; the worker exits through a clean shutdown
(barrier, ``destroy_process_group``, ``os._exit``; :mod:`.worker` says why).
On GPUs mark the test ``@pytest.mark.gpu(2)`` and pass ``device="cuda"``
(``Launches(..., device="cuda")``). A test-only shim goes in ``setup``:
``run_worker(run_scenario, setup=install_shim)``.
"""

from __future__ import annotations

from groupgrad_testsupport.allocations import AllocationRecorder, backward_allocations
from groupgrad_testsupport.atomics import atomic_ops
from groupgrad_testsupport.calls import record_calls
from groupgrad_testsupport.gpu import GpuNeed, cuda_peak_growth, mark_unavailable
from groupgrad_testsupport.imports import load_sibling
from groupgrad_testsupport.launcher import LaunchError, Launches, launch, run_command, torchrun
from groupgrad_testsupport.matrix import (
    Case,
    assert_group_backward_ran_once,
    assert_main_grads_wait_for_backward_dw,
    assert_matrix_close,
    assert_weight_grads,
    attach_main_grads,
    distribute_fake,
    experts_fp64,
    module_flags,
    write_into_dummies,
)
from groupgrad_testsupport.numerics import (
    assert_as_close_as_torch,
    assert_close,
    assert_compiled_matches_eager,
    assert_within_scale,
    max_abs_error,
    poison_,
    poisoned,
)
from groupgrad_testsupport.worker import Rank, run_worker

__all__ = [
    "AllocationRecorder",
    "Case",
    "GpuNeed",
    "LaunchError",
    "Launches",
    "Rank",
    "assert_as_close_as_torch",
    "assert_close",
    "assert_compiled_matches_eager",
    "assert_group_backward_ran_once",
    "assert_main_grads_wait_for_backward_dw",
    "assert_matrix_close",
    "assert_weight_grads",
    "assert_within_scale",
    "atomic_ops",
    "attach_main_grads",
    "backward_allocations",
    "cuda_peak_growth",
    "distribute_fake",
    "experts_fp64",
    "launch",
    "load_sibling",
    "mark_unavailable",
    "max_abs_error",
    "module_flags",
    "poison_",
    "poisoned",
    "record_calls",
    "run_command",
    "run_worker",
    "torchrun",
    "write_into_dummies",
]
