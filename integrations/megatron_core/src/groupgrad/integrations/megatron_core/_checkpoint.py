"""Distributed-checkpoint entries of groupgrad experts, in Megatron's expert layout.

Megatron's ``SequentialMLP`` and ``TEGroupedMLP`` write the same checkpoint
(Megatron calls them interchangeable): in the default mode
(``singleton_local_shards`` off) every expert's fc1 weight is one slice of a
global ``{prefix}experts.linear_fc1.weight`` of shape ``(E_global, 2F, H)``
— cut by :func:`~megatron.core.transformer.mlp.apply_swiglu_sharded_factory`
into the gate half (offset ``0``) and the up half (offset ``F``) along the
second axis when the MLP is gated — fc2's weight a slice of
``{prefix}experts.linear_fc2.weight`` ``(E_global, H, F)``, biases likewise,
and an empty ``_extra_state`` object per expert and layer; the replica id's
data-parallel entry is the rank in the expert data-parallel group. With
``singleton_local_shards`` each expert is stored under its own key
(``{prefix}experts.{e}.linear_fc1.weight_w`` …).

:func:`grouped_sharded_state_dict` writes one grouped layer's entries the way
Transformer Engine's ``TEGroupedLinear._sharded_state_dict_grouped`` does
(Megatron's ``TEGroupedMLP`` then adds the SwiGLU split and the prefix);
:func:`experts_sharded_state_dict` does both steps for the fused experts,
exactly as ``TEGroupedMLP.sharded_state_dict`` does.

The state-dict keys of the returned dict are the module's own (what
``load_state_dict`` takes back); the checkpoint keys inside are Megatron's.
``E - 1`` of the per-expert ``_extra_state`` entries have no parameter of
their own: :func:`drop_extra_state_copies` removes them before
``load_state_dict`` (Transformer Engine does the same).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from torch import Tensor, nn

from groupgrad.integrations.megatron_core._compat import swiglu_sharded_factory

__all__ = [
    "COLUMN_PARALLEL_AXES",
    "ROW_PARALLEL_AXES",
    "ExpertLayerEntries",
    "drop_extra_state_copies",
    "experts_sharded_state_dict",
    "extra_state_key",
    "grouped_sharded_state_dict",
]

COLUMN_PARALLEL_AXES = {"weight": 0, "bias": 0}
"""Tensor-parallel axis of fc1's weight and bias (Megatron's column-parallel layout)."""

ROW_PARALLEL_AXES = {"weight": 1}
"""Tensor-parallel axis of fc2's weight; its bias is not split (row-parallel layout)."""


def extra_state_key(dict_prefix: str, expert: int) -> str:
    """State-dict key of expert ``expert``'s ``_extra_state`` entry (TE's naming)."""
    return f"{dict_prefix}_extra_state{'' if expert == 0 else expert}"


def grouped_sharded_state_dict(
    weights: Sequence[Tensor],
    biases: Sequence[Tensor],
    *,
    key_prefix: str,
    dict_prefix: str,
    tp_axes: dict[str, int],
    sharded_offsets: tuple[Any, ...],
    metadata: dict[str, Any] | None,
    pg_collection: Any,
) -> dict[str, Any]:
    """One grouped layer's sharded entries, as Transformer Engine's grouped linear writes them.

    Args:
        weights: The ``E`` local experts' weights, expert order.
        biases: Their biases (empty without bias).
        key_prefix: Checkpoint-key prefix (``"linear_fc1."``); the caller
            replaces it with the experts' full prefix.
        dict_prefix: Prefix of the module's own state-dict keys
            (``{dict_prefix}weight{e}``, ``{dict_prefix}bias{e}``).
        tp_axes: :data:`COLUMN_PARALLEL_AXES` or :data:`ROW_PARALLEL_AXES`.
        sharded_offsets: Offsets of the enclosing modules (e.g. the layer axis).
        metadata: Megatron's sharded-state-dict metadata.
        pg_collection: The layer's process groups (``ep``, ``expt_tp``, ``expt_dp``).

    Returns:
        ``ShardedTensor`` / ``ShardedObject`` entries keyed by state-dict key.
    """
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton_local_shards = metadata.get("singleton_local_shards", False)
    num_local = len(weights)
    ep_size, ep_rank = pg_collection.ep.size(), pg_collection.ep.rank()
    num_global = ep_size * num_local
    ep_axis = len(sharded_offsets)
    axis_map = {f"{e}.{name}": axis for e in range(num_local) for name, axis in tp_axes.items()}
    entries: dict[str, Any] = {}
    for e, weight in enumerate(weights):
        global_index = ep_rank * num_local + e
        state: dict[str, Any] = {f"{e}.weight": weight, f"{e}._extra_state": None}
        if biases:
            state[f"{e}.bias"] = biases[e]
        if singleton_local_shards:
            expert_prefix = f"{global_index}.{key_prefix}"
            offsets = tuple(sharded_offsets)
        else:
            expert_prefix = key_prefix
            offsets = (*sharded_offsets, (ep_axis, global_index, num_global))
        sub = make_sharded_tensors_for_checkpoint(
            state,
            "",
            axis_map,
            offsets,
            tp_group=pg_collection.expt_tp,
            dp_cp_group=metadata["dp_cp_group"],
        )
        replace_prefix_for_sharding(sub, f"{e}.", expert_prefix)
        entries[f"{dict_prefix}weight{e}"] = sub[f"{e}.weight"]
        entries[extra_state_key(dict_prefix, e)] = sub[f"{e}._extra_state"]
        if biases:
            entries[f"{dict_prefix}bias{e}"] = sub[f"{e}.bias"]
    expert_dp_rank = pg_collection.expt_dp.rank()
    for entry in entries.values():  # replicas along the expert data-parallel group
        entry.replica_id = (*entry.replica_id[:2], expert_dp_rank)
    return entries


@dataclass(frozen=True)
class ExpertLayerEntries:
    """One of the fused experts' two layers, as :func:`experts_sharded_state_dict` sees it.

    Attributes:
        megatron_name: ``"linear_fc1"`` or ``"linear_fc2"`` (the checkpoint's name).
        dict_prefix: The layer's state-dict prefix inside the experts module.
        weights: The layer's per-expert weights.
        biases: Their biases (empty without bias).
        tp_axes: :data:`COLUMN_PARALLEL_AXES` or :data:`ROW_PARALLEL_AXES`.
    """

    megatron_name: str
    dict_prefix: str
    weights: Sequence[Tensor]
    biases: Sequence[Tensor]
    tp_axes: dict[str, int]


def experts_sharded_state_dict(
    layers: Sequence[ExpertLayerEntries],
    *,
    gated: bool,
    prefix: str,
    sharded_offsets: tuple[Any, ...],
    metadata: dict[str, Any] | None,
    pg_collection: Any,
) -> dict[str, Any]:
    """An experts module's sharded entries, as Megatron's ``TEGroupedMLP.sharded_state_dict`` writes them.

    Each layer's grouped entries (:func:`grouped_sharded_state_dict`); with
    ``gated``, fc1's weights and biases split into gate and up halves by
    Megatron's SwiGLU factory; checkpoint keys under ``{prefix}experts.``.
    """
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton_local_shards = metadata.get("singleton_local_shards", False)
    ep_size, ep_rank = pg_collection.ep.size(), pg_collection.ep.rank()
    entries: dict[str, Any] = {}
    for layer in layers:
        name = layer.megatron_name
        sub = grouped_sharded_state_dict(
            layer.weights,
            layer.biases,
            key_prefix=f"{name}.",
            dict_prefix=layer.dict_prefix,
            tp_axes=layer.tp_axes,
            sharded_offsets=sharded_offsets,
            metadata=metadata,
            pg_collection=pg_collection,
        )
        if gated and name == "linear_fc1":
            num_local = len(layer.weights)
            for e in range(num_local):
                offsets = tuple(sharded_offsets)
                if not singleton_local_shards:
                    global_index = ep_rank * num_local + e
                    offsets = (*offsets, (len(sharded_offsets), global_index, ep_size * num_local))
                for key in (f"{layer.dict_prefix}weight{e}", f"{layer.dict_prefix}bias{e}"):
                    if key in sub:
                        sub[key] = swiglu_sharded_factory(
                            sub[key],
                            offsets,
                            singleton_local_shards,
                            pg_collection.expt_tp,
                            metadata["dp_cp_group"],
                        )
        if singleton_local_shards:
            replace_prefix_for_sharding(sub, "", f"{prefix}experts.")
        else:
            replace_prefix_for_sharding(sub, f"{name}.", f"{prefix}experts.{name}.")
        entries.update({f"{prefix}{key}": value for key, value in sub.items()})
    return entries


def drop_extra_state_copies(dict_prefixes: Sequence[str], keep_first: bool) -> Callable[..., None]:
    """A ``load_state_dict`` pre-hook removing the per-expert ``_extra_state`` entries.

    Args:
        dict_prefixes: The layers' state-dict prefixes inside the module.
        keep_first: Keep ``{dict_prefix}_extra_state`` (the module has a real
            extra state) and drop only ``_extra_state1`` …; else drop all.

    Returns:
        A hook for ``nn.Module._register_load_state_dict_pre_hook(hook,
        with_module=True)``.
    """
    suffix = r"\d+" if keep_first else r"\d*"
    patterns = [re.compile(re.escape(f"{p}_extra_state") + suffix + "$") for p in dict_prefixes]

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for key in list(state_dict):
            if key.startswith(prefix) and any(p.match(key[len(prefix) :]) for p in patterns):
                del state_dict[key]

    return hook
