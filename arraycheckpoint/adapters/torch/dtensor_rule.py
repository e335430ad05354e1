"""A DTensor's layout as a rule every rank of its mesh shares (see :mod:`arraycheckpoint.planning.rules`).

Only plain ``Shard(d)`` and ``Replicate()`` placements become a rule; anything else (strided shards from
nested FSDP+TP, ``Partial``) returns None and the tensor is declared by its boxes. The engine also checks
the rule against the box this rank actually holds before trusting it.
"""

from __future__ import annotations

from typing import Any

from .tensors import is_dtensor, mesh_of


def dtensor_rule(t: Any) -> tuple[Any, ...] | None:
    """``("mesh", Mesh, placements)`` for a DTensor with Shard/Replicate placements, else None."""
    if not is_dtensor(t):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = []
    for p in t.placements:
        if type(p) is Shard:
            placements.append(int(p.dim))
        elif type(p) is Replicate:
            placements.append(-1)
        else:
            return None
    return ("mesh", mesh_of(t.device_mesh), tuple(placements))
