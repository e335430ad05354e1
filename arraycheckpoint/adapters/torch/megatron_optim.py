"""Optimizer state of megatron models from a standard torch optimizer, keyed by ShardedTensor keys.

megatron-core's ``DistributedOptimizer`` needs CUDA; a plain ``torch.optim`` optimizer (Adam, AdamW, SGD, ...)
over the module's parameters works everywhere. Its per-parameter state is stored as

* ``optimizer/<key>/<state>`` with the parameter's ShardedTensor layout when the state tensor has the
  parameter's shape (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``): it reshards like the parameter;
* ``optimizer/<key>/<state>`` of shape ``stack + state.shape`` for other tensors (Adam's scalar ``step``),
  where ``stack`` are the prepended stacked-layer axes of the parameter (one value per layer);
* JSON objects for non-tensor state, and ``optimizer/~param_groups`` (hyper-parameters, per group index).

Factories (e.g. the SwiGLU ``linear_fc1`` split) apply to the state like to the parameter. Every
replica is declared; the planner writes each region once, by one of its replicas (worst fit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...errors import ArrayCheckpointError
from ...planning.regions import Box
from ..base import Expected
from .megatron_shards import LoadBuilder, SaveBuilder, global_rank, is_main_replica, megatron_mapping, walk
from .tensors import torch_dtype


def _param_entries(trees: Mapping[str, Any]) -> dict[int, Any]:
    """``id(parameter) -> ShardedTensor | ShardedTensorFactory`` over every megatron tree in the state."""
    m = megatron_mapping()
    out: dict[int, Any] = {}
    for tree in trees.values():
        for _, leaf in walk(tree):
            if isinstance(leaf, (m.ShardedTensor, m.ShardedTensorFactory)) and isinstance(
                leaf.data, torch.Tensor
            ):
                out.setdefault(id(leaf.data), leaf)
    return out


def _entry_of(entries: dict[int, Any], p: torch.Tensor, ns: str) -> Any:
    entry = entries.get(id(p))
    if entry is None:
        raise ArrayCheckpointError(
            f"rank {global_rank()}: optimizer {ns!r} holds a parameter of shape {list(p.shape)} that is in no megatron "
            "module's sharded_state_dict(); save the model in the same call, e.g. "
            "acp.save(path, {'model': model, 'optimizer': optimizer}, framework='megatron')"
        )
    return entry


def _stack(entry: Any) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """Stacked-layer axes of a parameter entry: (their global shape, this layer's offsets, main replica)."""
    m = megatron_mapping()
    st = entry
    if isinstance(entry, m.ShardedTensorFactory):
        st = next((x for _, x in walk(entry.build()) if isinstance(x, m.ShardedTensor)), None)
        if st is None:
            return (), (), is_main_replica(entry.replica_id)
    pre = int(st.prepend_axis_num)
    shape = tuple(int(s) for s in st.global_shape[:pre])
    offset = tuple(int(o) for o in st.global_offset[:pre])
    return shape, offset, is_main_replica(st.replica_id)


def _param_shaped(value: Any, p: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(p.shape)


def _with_data(entry: Any, t: torch.Tensor) -> Any:
    m = megatron_mapping()
    if isinstance(entry, m.ShardedTensorFactory):
        return dataclasses.replace(entry, data=t)
    return dataclasses.replace(entry, data=t, dtype=t.dtype)


def save_optimizer(
    ns: str, opt: torch.optim.Optimizer, trees: Mapping[str, Any], builder: SaveBuilder
) -> None:
    """Add ``opt``'s state to ``builder`` under ``<ns>/<ShardedTensor key>/<state>``."""
    from .adapter import _plain

    m = megatron_mapping()
    entries = _param_entries(trees)
    groups = []
    for group in opt.param_groups:
        groups.append({k: _plain(v) for k, v in group.items() if k != "params"})
        for p in group["params"]:
            entry = _entry_of(entries, p, ns)
            for key, value in opt.state.get(p, {}).items():
                if _param_shaped(value, p):
                    sharded = _with_data(entry, value)
                    if isinstance(sharded, m.ShardedTensorFactory):
                        builder.factory(sharded, lambda k, key=key: f"{ns}/{k}/{key}")
                    else:
                        builder.sharded_tensor(f"{ns}/{sharded.key}/{key}", sharded)
                    continue
                stack_shape, stack_offset, main = _stack(entry)
                name = f"{ns}/{entry.key}/{key}"
                if isinstance(value, torch.Tensor):
                    shape = stack_shape + tuple(value.shape)
                    box = Box(stack_offset + (0,) * value.dim(), (1,) * len(stack_shape) + tuple(value.shape))
                    view = value.detach()[(None,) * len(stack_shape)] if stack_shape else value.detach()
                    builder.tensor(name, shape, value.dtype, [(box, view)] if box.volume else [], main)
                else:
                    builder.value(name, value, main)
    builder.value(f"{ns}/~param_groups", groups, global_rank() == 0, scope="global")


def load_optimizer(
    ns: str, opt: torch.optim.Optimizer, trees: Mapping[str, Any], builder: LoadBuilder
) -> Callable[[], None]:
    """Plan loading ``opt``'s state saved by :func:`save_optimizer` under any layout; returns the finish step."""
    from .adapter import _restore_like

    m = megatron_mapping()
    meta = builder.meta
    entries = _param_entries(trees)
    index: dict[str, set[str]] = {}
    prefix = ns + "/"
    for name in list(meta.tensors) + list(meta.objects):
        if name.startswith(prefix) and "~" not in name and "/" in name[len(prefix) :]:
            key, state = name[len(prefix) :].rsplit("/", 1)
            index.setdefault(key, set()).add(state)
    plan: list[tuple[torch.Tensor, str, Callable[[], Any]]] = []
    for group in opt.param_groups:
        for p in group["params"]:
            entry = _entry_of(entries, p, ns)
            current = opt.state.get(p, {})
            built = entry.build() if isinstance(entry, m.ShardedTensorFactory) else entry
            sts = [x for _, x in walk(built) if isinstance(x, m.ShardedTensor)]
            keys = {entry.key} | {st.key for st in sts}
            for state in sorted(set().union(*(index.get(k, set()) for k in keys))):
                plan.append((p, state, _load_state(ns, p, entry, sts, state, current.get(state), builder)))
    groups_getter = builder.value(f"{ns}/~param_groups", None)

    def finish() -> None:
        for p, state, get in plan:
            opt.state.setdefault(p, {})[state] = get()
        stored = groups_getter()
        if isinstance(stored, list) and len(stored) == len(opt.param_groups):
            for group, saved in zip(opt.param_groups, stored):
                for k, v in saved.items():
                    if k != "params":
                        group[k] = _restore_like(group.get(k), v)

    return finish


def _load_state(
    ns: str, p: torch.Tensor, entry: Any, sts: list[Any], state: str, current: Any, builder: LoadBuilder
) -> Callable[[], Any]:
    """Plan one state entry of one parameter; returns the getter of its loaded value."""
    m = megatron_mapping()
    meta = builder.meta
    param_names = [f"{ns}/{st.key}/{state}" for st in sts]
    # laid out like the parameter when stored with the parameter's rank (a different global shape, e.g. other
    # num_layers, is then reported by the strict check); Adam's per-layer "step" has fewer axes
    if param_names and all(
        n in meta.tensors and len(meta.tensors[n].shape) == len(st.global_shape)
        for n, st in zip(param_names, sts)
    ):
        dtype = torch_dtype(_zarr_numpy(meta.tensors[param_names[0]].dtype))
        t = current if _param_shaped(current, p) else torch.zeros_like(p, dtype=dtype)
        sharded = _with_data(entry, t)
        if isinstance(sharded, m.ShardedTensorFactory):
            merged = builder.factory(sharded, lambda k: f"{ns}/{k}/{state}")
            return merged
        builder.sharded_tensor(f"{ns}/{sharded.key}/{state}", sharded)
        return lambda: t
    name = f"{ns}/{entry.key}/{state}"
    tm = meta.tensors.get(name)
    if tm is None:
        return builder.value(name, current)
    stack_shape, stack_offset, _ = _stack(entry)
    if tm.shape[: len(stack_shape)] != stack_shape:  # other num_layers: a strict load reports the shapes
        builder.expected[name] = Expected(stack_shape + tm.shape[len(stack_shape) :], tm.dtype)
        return lambda: current
    shape = tm.shape[len(stack_shape) :]
    dtype = torch_dtype(_zarr_numpy(tm.dtype))
    t = (
        current
        if isinstance(current, torch.Tensor) and tuple(current.shape) == shape
        else torch.zeros(shape, dtype=dtype)
    )
    view = t[(None,) * len(stack_shape)] if stack_shape else t
    box = Box(stack_offset + (0,) * len(shape), (1,) * len(stack_shape) + shape)
    builder.regions(name, tm.shape, t.dtype, [(box, view)] if box.volume else [])
    return lambda: t


def _zarr_numpy(name: str) -> Any:
    from ...codecs import numpy_dtype as zarr_numpy_dtype

    return zarr_numpy_dtype(name)


__all__ = ["load_optimizer", "save_optimizer"]
