"""A ``jax.Array``'s ``NamedSharding`` as a mesh rule over processes (see :mod:`arraycheckpoint.planning.rules`).

The rule's mesh is the sharding's device mesh with every device replaced by the index of the process that
owns it (a process at several coordinates holds the box of each), its axes reordered so that a dimension
split over several mesh axes (``P(("y", "x"))``) splits them in mesh order, as the rule's nested splits do.
Every process builds the same rule from the same sharding, so identical trees declare identically; the
engine checks the rule against the process's real addressable shards and declares boxes if it differs.
Other shardings (positional, GSPMD, single-device) return None and are declared by their boxes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jax
import numpy as np

from ...planning.rules import Mesh


def sharding_rule(value: Any) -> tuple[Any, ...] | None:
    """``("mesh", Mesh, placements)`` for a ``jax.Array`` with a ``NamedSharding``, else None."""
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    names = tuple(sharding.mesh.axis_names)
    ndim = len(value.shape)
    spec = list(sharding.spec)
    if len(spec) > ndim:
        return None
    split: dict[str, int] = {}  # mesh axis -> the tensor dimension it splits
    order: list[int] = []  # mesh axes in split order (major to minor within a dimension), then the rest
    in_mesh_order = True
    for dim, entry in enumerate(spec):
        axes = entry if isinstance(entry, tuple | list) else (() if entry is None else (entry,))
        for k, a in enumerate(axes):
            if a not in names or a in split:
                return None  # UNCONSTRAINED or a malformed spec: declare boxes
            split[a] = dim
            order.append(names.index(a))
            in_mesh_order &= k == 0 or order[-1] > order[-2]
    if in_mesh_order:
        order = list(range(len(names)))  # the mesh as it is: arrays over one mesh share one rule mesh
    else:
        order += [i for i in range(len(names)) if i not in order]
    mesh = process_mesh(sharding.mesh, tuple(order))
    return ("mesh", mesh, tuple(split.get(names[i], -1) for i in order))


@lru_cache(maxsize=32)
def process_mesh(mesh: jax.sharding.Mesh, order: tuple[int, ...]) -> Mesh:
    """The device mesh, axes in ``order``, with the owning process of each device (built once per mesh)."""
    devices = np.asarray(mesh.devices).transpose(order)
    procs = tuple(int(d.process_index) for d in devices.flat)
    return Mesh(tuple(int(s) for s in devices.shape), procs)
