"""Test-only shim that lets the real megatron-core (0.16 / 0.19) MoE layer, GPT model and DDP run on CPU.

Installed by the CPU worker processes of the tests, the CPU runs of the
example and the benchmark's ``--smoke`` mode — never by library code, and it
refuses to load where CUDA is available. Megatron's token dispatchers are not
patched: the CPU runs use the allgather dispatcher, whose collectives gloo has.
What it patches, and why:

* ``torch.cuda.current_device`` returns ``"cpu"``: Megatron passes it as a
  ``device=`` (the router moves its weight there at its first forward, the
  global memory buffer of the dispatcher allocates there, parameters are
  created there without ``use_cpu_initialization``).
* ``torch.cuda.manual_seed`` / ``torch.cuda.get_rng_state`` and Megatron's
  ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
  use the CPU generator: ``model_parallel_cuda_manual_seed`` and the RNG
  tracker's ``fork()`` (weight initialization on the device path, dropout)
  then save, seed and restore the CPU generator exactly as they do the GPU's.
* ``torch.cuda.Stream``, ``Event``, ``stream``, ``current_stream``,
  ``synchronize`` and ``empty_cache`` do nothing: on a CPU everything runs in
  program order.
* Not a CUDA call: megatron-core 0.16.1 leaves ``te_general_gemm`` undefined
  in ``transformer.moe.moe_utils`` when Transformer Engine is absent, and its
  router's gating reads the name (``NameError``); it is set to ``None``, which
  is what 0.19 does itself.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

# The example and the benchmark load this file by its path, outside pytest: the shared test
# support (``<repository>/tests``) is put on ``sys.path`` here, as the root conftest.py does.
_SUPPORT = str(Path(__file__).resolve().parents[3] / "tests")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)

from groupgrad_testsupport.cpu_streams import stub_streams  # noqa: E402


def _cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def install() -> None:
    """Patch what the module docstring lists; refuses where CUDA is available.

    Call it before building any Megatron module (it imports megatron-core).
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "cpu_shim is for CPU-only processes; CUDA is available here, run on the GPU instead"
        )
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.manual_seed = torch.manual_seed  # type: ignore[assignment]
    torch.cuda.get_rng_state = _cpu_rng_state  # type: ignore[assignment]
    stub_streams()

    import megatron.core.tensor_parallel.random as megatron_random
    import megatron.core.transformer.moe.moe_utils as moe_utils

    megatron_random._get_cuda_rng_state = _cpu_rng_state  # type: ignore[attr-defined]
    megatron_random._set_cuda_rng_state = _set_cpu_rng_state  # type: ignore[attr-defined]
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
