"""CUDA-graph capture of a forward + backward step, replayed with new device splits.

Also the token counts (:data:`STEP_SPLITS`) the modules' GPU tests step through.

The modules' GPU tests capture one step whose ``splits`` is a device tensor,
then replay it with other token counts written into that tensor: the graph
must read them at replay (no host sync, no baked-in sizes)::

    graph = capture(lambda: module(x, splits).backward(dy), grads_of=[x])
    for counts in replay_with_new_splits(graph, splits, refill=[x, dy], main_grads=...):
        ...  # compare x.grad and the main_grads with a reference for ``counts``

Legend: ``E`` experts (eight in :data:`REPLAY_SPLITS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

#: Token counts of the eight-expert GPU module tests' steps: skewed with empty
#: experts, skewed without, uniform.
STEP_SPLITS = ([0, 17, 33, 1, 0, 64, 9, 4], [12, 0, 0, 40, 31, 5, 8, 32], [16] * 8)

#: Token counts of the replays (512 tokens, eight experts): skewed with empty
#: experts, then every token on one expert.
REPLAY_SPLITS = ([0, 100, 12, 200, 0, 100, 50, 50], [512, 0, 0, 0, 0, 0, 0, 0])


def capture(step: Callable[[], object], *, grads_of: Sequence[Tensor]) -> torch.cuda.CUDAGraph:
    """Warm ``step`` up on a side stream, clear the ``.grad`` of ``grads_of``, capture it.

    With ``.grad`` cleared, the captured backward allocates those gradients
    in the graph's pool, and every replay rewrites them.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in grads_of:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def replay_with_new_splits(
    graph: torch.cuda.CUDAGraph,
    static_splits: Tensor,
    *,
    refill: Sequence[Tensor],
    main_grads: Sequence[Tensor],
) -> Iterator[list[int]]:
    """Replay ``graph`` once per entry of :data:`REPLAY_SPLITS`, yielding the counts after each.

    Before each replay the counts go into ``static_splits``, every tensor of
    ``refill`` gets fresh random values of its kind (``rand`` for fp32
    probabilities, ``randn`` otherwise), and every ``main_grad`` is poisoned
    with NaN so that an element the replay leaves unwritten fails.
    """
    for counts in REPLAY_SPLITS:
        static_splits.copy_(torch.tensor(counts))
        with torch.no_grad():
            for t in refill:
                t.copy_(torch.rand_like(t) if t.dtype == torch.float32 else torch.randn_like(t))
        for main_grad in main_grads:
            main_grad.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        yield counts
