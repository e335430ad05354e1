"""Megatron checkpoints into plain PyTorch modules: renames and unstacking of stacked layers.

megatron-core stores the layers of a transformer block stacked: ``model/decoder.layers.mlp.linear_fc2.weight``
has shape ``[num_layers, hidden, ffn]``; a plain module has ``decoder.layers.3.mlp.linear_fc2.weight`` of
shape ``[hidden, ffn]``. Renames alone go through :func:`arraycheckpoint.load`'s ``key_map``; unstacking needs
a sub-box of the stored array, which :func:`load_unstacked` reads directly (each target reads only its layer):

>>> meta = acp.read_metadata(path)
>>> mapping = unstack_map(meta, rename=lambda k: k.replace("decoder.", ""))   # target FQN -> StoredSlice
>>> report = load_unstacked(path, plain_module, mapping)

Export to safetensors is provided by the tools (command line) part of arraycheckpoint; it reads the same
arrays, so an unstacked export uses the same :func:`unstack_map`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ...errors import StateMismatchError
from ...format.metadata import CheckpointMetadata
from ...planning.items import LoadTensor
from ...planning.regions import Box
from .megatron import STACKED
from .tensors import load_shard


@dataclass(frozen=True)
class StoredSlice:
    """A stored tensor, or the sub-tensor at leading ``index`` (one layer of a stacked tensor)."""

    name: str
    index: tuple[int, ...] = ()


def stacked_axes(meta: CheckpointMetadata, ns: str = "model") -> dict[str, int]:
    """``{stored name: number of stacked-layer axes}`` recorded by the megatron adapter for namespace ``ns``."""
    obj = meta.objects.get(f"{ns}/{STACKED}")
    out: dict[str, int] = {}
    if obj is None:
        return out
    values = [obj.value] if obj.scope == "global" else list(obj.per_rank.values())
    for v in values:
        out.update({str(k): int(n) for k, n in (v or {}).items()})
    return out


def split_layer_key(key: str) -> tuple[str, str]:
    """Where megatron's stacked layer index goes: ``decoder.layers.mlp.w`` -> (``decoder.layers.``, ``mlp.w``)."""
    head, sep, tail = key.rpartition("layers.")
    if not sep:
        raise ValueError(f"cannot place the layer index in {key!r}: pass split= to unstack_map")
    return head + sep, tail


def unstack_map(
    meta: CheckpointMetadata,
    ns: str = "model",
    rename: Callable[[str], str | None] | None = None,
    split: Callable[[str], tuple[str, str]] = split_layer_key,
) -> dict[str, StoredSlice]:
    """Target FQN -> :class:`StoredSlice` for every tensor of ``ns``, stacked layers split per index.

    A stacked key ``decoder.layers.mlp.linear_fc2.weight`` of shape ``[L, ...]`` yields
    ``decoder.layers.{i}.mlp.linear_fc2.weight`` for ``i < L`` (several stacked axes: ``{i}.{j}``); other
    keys map to themselves. ``rename`` then maps each such megatron-style name to the target module's FQN
    (``None`` drops it). Optimizer namespaces (``optimizer/<key>/<state>``) unstack the same way.
    """
    stacked = stacked_axes(meta, ns)
    prefix = ns + "/"
    out: dict[str, StoredSlice] = {}
    for name, tm in meta.tensors.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :]
        n = stacked.get(name, 0)
        if n == 0:
            items = [(key, ())]
        else:
            head, tail = split(key)
            items = [
                (head + ".".join(map(str, idx)) + "." + tail, tuple(idx))
                for idx in itertools.product(*(range(s) for s in tm.shape[:n]))
            ]
        for target, index in items:
            renamed = rename(target) if rename else target
            if renamed is not None:
                out[renamed] = StoredSlice(name, index)
    return out


def _named_tensors(target: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(target, torch.nn.Module):
        return dict(target.state_dict(keep_vars=True))
    return dict(target)


def load_unstacked(
    path: str | os.PathLike[str],
    target: torch.nn.Module | Mapping[str, torch.Tensor],
    mapping: Mapping[str, StoredSlice | str] | Callable[[str], StoredSlice | str | None],
    *,
    strict: bool = True,
) -> dict[str, list[str]]:
    """Load stored tensors (or single layers of stacked ones) into ``target``'s tensors, in place, one process.

    Args:
        path: a committed checkpoint (any framework; typically saved with ``framework="megatron"``).
        target: a plain module (its ``state_dict`` tensors) or a ``{name: tensor}`` dict.
        mapping: target FQN -> stored name or :class:`StoredSlice` (see :func:`unstack_map`); a callable may
            return ``None`` to skip a tensor.
        strict: raise :class:`StateMismatchError` when a target tensor has no stored source, a shape differs,
            or a stored tensor of the mapping is not used; otherwise load the rest and report.

    Returns:
        ``{"missing": [...], "mismatched": [...], "unused": [...]}``.
    """
    from ...engine import engine

    eng = engine()
    storage, root, meta = eng.read_metadata(os.fspath(path))
    lookup = mapping if callable(mapping) else mapping.get
    missing: list[str] = []
    mismatched: list[str] = []
    used: set[str] = set()
    targets: list[LoadTensor] = []
    for fqn, t in _named_tensors(target).items():
        src = lookup(fqn)
        if src is None:
            missing.append(fqn)
            continue
        src = StoredSlice(src) if isinstance(src, str) else src
        tm = meta.tensors.get(src.name)
        if tm is None:
            missing.append(f"{fqn} (stored {src.name!r} absent)")
            continue
        k = len(src.index)
        shape = tuple(t.shape)
        if tm.shape[k:] != shape or any(not 0 <= i < s for i, s in zip(src.index, tm.shape)):
            mismatched.append(
                f"{fqn}: stored {src.name}{list(src.index)} of {list(tm.shape)} vs target {list(shape)}"
            )
            continue
        used.add(src.name)
        box = Box(tuple(src.index) + (0,) * len(shape), (1,) * k + shape)
        view = t.detach()[(None,) * k] if k else t.detach()
        targets.append(LoadTensor(src.name, [load_shard(box, view)] if box.volume else []))
    names = (
        {v.name if isinstance(v, StoredSlice) else v for v in mapping.values()}
        if isinstance(mapping, Mapping)
        else set()
    )
    unused = sorted(names - used)
    report = {"missing": sorted(missing), "mismatched": mismatched, "unused": unused}
    if strict and any(report.values()):
        lines = [f"{k} ({len(v)}): " + ", ".join(v[:50]) for k, v in report.items() if v]
        raise StateMismatchError(
            "megatron checkpoint does not match the plain module:\n  "
            + "\n  ".join(lines)
            + "\n(fix the mapping, or pass strict=False to load the intersection)"
        )
    eng.load(storage, root, meta, targets)
    return report


__all__ = ["StoredSlice", "load_unstacked", "split_layer_key", "stacked_axes", "unstack_map"]
