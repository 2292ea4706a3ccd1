"""The distributed-checkpoint layout of Megatron's ``TEGroupedMLP``, written down from its source.

Transformer Engine is not installed here (nor on the GPU machine), so
``TEGroupedMLP`` cannot be built with its own grouped linears. This is what
megatron-core 0.16.1 / 0.19.2 produce for it, read off
``TEGroupedLinear._sharded_state_dict_grouped`` (``extensions/transformer_engine.py``),
``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear.sharded_state_dict``
(tensor-parallel axis 0 for fc1, 1 for fc2), ``TEGroupedMLP.sharded_state_dict``
(``transformer/moe/experts.py``: the SwiGLU split of fc1 by
``apply_swiglu_sharded_factory`` in ``transformer/mlp.py``, then the
``experts.`` prefix) and ``make_sharded_object_for_checkpoint``
(``transformer/utils.py``), for expert tensor parallelism 1, no bias, a gated
MLP, one layer without layer offsets:

default mode (``singleton_local_shards`` off), local expert ``e`` on
expert-parallel rank ``r`` (global index ``g = r·E_local + e``, ``E = ep·E_local``):

=====================================  ==============================================================
state-dict key                          checkpoint entries
=====================================  ==============================================================
``{P}linear_fc1.weight{e}``             two tensors ``{P}experts.linear_fc1.weight``: local ``(F, H)``,
                                        global ``(E, 2F, H)``, offsets ``(g, 0, 0)`` (gate) and
                                        ``(g, F, 0)`` (up), fragmentation ``(E, 2, 1)``
``{P}linear_fc1._extra_state[e]``       object ``{P}experts.linear_fc1._extra_state``, global
                                        ``(E,)``, offset ``(g,)`` (suffix ``e`` only for ``e > 0``)
``{P}linear_fc2.weight{e}``             tensor ``{P}experts.linear_fc2.weight``: local ``(H, F)``,
                                        global ``(E, H, F)``, offset ``(g, 0, 0)``, fragmentation
                                        ``(E, 1, 1)``
``{P}linear_fc2._extra_state[e]``       as for fc1
=====================================  ==============================================================

singleton mode: every entry under ``{P}experts.{g}.linear_fc1.weight_w`` /
``_v`` (local = global ``(F, H)``), ``{P}experts.{g}.linear_fc2.weight``
``(H, F)`` and ``{P}experts.{g}.linear_fc{1,2}._extra_state`` (global
``(1,)``, offset ``(0,)``). Every replica id is ``(0, 0, expert data-parallel
rank)``. ``P`` is the prefix the MoE layer gives its experts (``mlp.experts.``
under ``layer.sharded_state_dict(prefix="mlp.")``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["checkpoint_facts", "expected_te_layout"]


def _tensor(key: str, local: tuple, global_: tuple, offset: tuple, frag: tuple, rid: tuple) -> dict:
    return {
        "type": "tensor",
        "key": key,
        "local_shape": local,
        "global_shape": global_,
        "global_offset": offset,
        "axis_fragmentations": frag,
        "replica_id": rid,
    }


def _object(key: str, global_: tuple, offset: tuple, rid: tuple) -> dict:
    return {
        "type": "object",
        "key": key,
        "global_shape": global_,
        "global_offset": offset,
        "replica_id": rid,
    }


def expected_te_layout(
    prefix: str,
    *,
    ep_rank: int,
    ep_size: int,
    local_experts: int,
    hidden: int,
    ffn: int,
    expert_dp_rank: int,
    singleton: bool,
) -> dict[str, list[dict[str, Any]]]:
    """``TEGroupedMLP``'s entries: state-dict key → checkpoint facts (see the module docstring)."""
    H, F, E = hidden, ffn, ep_size * local_experts
    rid = (0, 0, expert_dp_rank)
    entries: dict[str, list[dict[str, Any]]] = {}
    for e in range(local_experts):
        g = ep_rank * local_experts + e
        extra = "" if e == 0 else str(e)
        if singleton:
            base = f"{prefix}experts.{g}."
            fc1 = [
                _tensor(f"{base}linear_fc1.weight_{half}", (F, H), (F, H), (0, 0), (1, 1), rid)
                for half in ("w", "v")
            ]
            fc2 = [_tensor(f"{base}linear_fc2.weight", (H, F), (H, F), (0, 0), (1, 1), rid)]
            objects = {
                fc: _object(f"{base}linear_{fc}._extra_state", (1,), (0,), rid)
                for fc in ("fc1", "fc2")
            }
        else:
            base = f"{prefix}experts."
            fc1 = [
                _tensor(
                    f"{base}linear_fc1.weight",
                    (F, H),
                    (E, 2 * F, H),
                    (g, offset, 0),
                    (E, 2, 1),
                    rid,
                )
                for offset in (0, F)
            ]
            fc2 = [
                _tensor(f"{base}linear_fc2.weight", (H, F), (E, H, F), (g, 0, 0), (E, 1, 1), rid)
            ]
            objects = {
                fc: _object(f"{base}linear_{fc}._extra_state", (E,), (g,), rid)
                for fc in ("fc1", "fc2")
            }
        entries[f"{prefix}linear_fc1.weight{e}"] = fc1
        entries[f"{prefix}linear_fc2.weight{e}"] = fc2
        for fc in ("fc1", "fc2"):
            entries[f"{prefix}linear_{fc}._extra_state{extra}"] = [objects[fc]]
    return entries


def checkpoint_facts(entries: dict[str, list[dict[str, Any]]]) -> list[tuple]:
    """The checkpoint-level facts of all entries, sorted (state-dict keys and data dropped)."""
    facts = []
    for parts in entries.values():
        for fact in parts:
            facts.append(tuple(sorted((k, v) for k, v in fact.items() if k != "data")))
    return sorted(facts)
