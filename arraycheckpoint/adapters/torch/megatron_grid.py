"""The process grids of a megatron-core job, so its boxes can be declared as mesh rules.

megatron-core places ranks on two regular grids (its ``RankGenerator``): the dense one (``tp``, ``cp``,
``dp``, ``pp``) and the expert one (``etp``, ``ep``, ``edp``, ``pp``). :func:`process_grids` rebuilds both
from this rank's process groups (``parallel_state``): each group lists its ranks in coordinate order, so its
stride and this rank's coordinate follow, and the whole grid is the same on every rank. With the grids the
save builder states each tensor's boxes as a mesh rule (:mod:`arraycheckpoint.planning.grids`): every rank
of a TP/PP/DP/EP job then declares the same rules, the save plans without gathering declarations, and the
metadata holds a few affine meshes instead of every rank's boxes.

Without ``parallel_state`` (a sharded dict built by hand), :func:`use_grids` says the grids for the current
thread (also how the simulated-world tests give each simulated rank its own); with neither, the engine's
``declare()`` still states a block that is the rank's ``torch.chunk`` part of the world along one axis as a
rule on the world's 1-D grid, and other boxes as boxes.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ...planning.grids import Grid, GridRules

_RULES: dict[tuple[Any, ...], GridRules] = {}  # per grids: meshes kept between saves (expanded once)
_GRIDS: contextvars.ContextVar[tuple[Grid, ...] | None] = contextvars.ContextVar(
    "acp_megatron_grids", default=None
)


@contextmanager
def use_grids(grids: Sequence[Grid]) -> Iterator[None]:
    """Inside: megatron saves of this thread declare on ``grids`` instead of ``parallel_state``'s."""
    token = _GRIDS.set(tuple(grids))
    try:
        yield
    finally:
        _GRIDS.reset(token)


def grid_rules() -> GridRules | None:
    """The rule finder of this rank's grids (None without grids); one per distinct grids and coordinates,
    kept across saves so each mesh object, and the engine's expansion of it, is made once."""
    grids = process_grids()
    if not grids:
        return None
    key = tuple((g, g.coords) for g in grids)
    got = _RULES.get(key)
    if got is None:
        while len(_RULES) >= 8:
            _RULES.pop(next(iter(_RULES)))
        got = _RULES[key] = GridRules(grids)
    return got


def process_grids() -> tuple[Grid, ...]:
    """The grids of this rank (:func:`use_grids`', else megatron's ``parallel_state``'s; () when unknown)."""
    given = _GRIDS.get()
    if given is not None:
        return given
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
    except ImportError:  # pragma: no cover - megatron-core is what calls this adapter
        return ()
    if not (dist.is_available() and dist.is_initialized() and ps.model_parallel_is_initialized()):
        return ()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for groups in (_dense(ps), _expert(ps)):
        try:
            members = {name: dist.get_process_group_ranks(g()) for name, g in groups}
        except (AssertionError, RuntimeError, ValueError, AttributeError):  # a group megatron did not build
            continue
        grid = Grid.from_groups(rank, world, members)
        if grid is not None and grid not in out:
            out.append(grid)
    return tuple(out)


def _dense(ps: Any) -> list[tuple[str, Any]]:
    return [
        ("tp", ps.get_tensor_model_parallel_group),
        ("cp", ps.get_context_parallel_group),
        ("dp", ps.get_data_parallel_group),
        ("pp", ps.get_pipeline_model_parallel_group),
    ]


def _expert(ps: Any) -> list[tuple[str, Any]]:
    return [
        ("etp", ps.get_expert_tensor_parallel_group),
        ("ep", ps.get_expert_model_parallel_group),
        ("edp", ps.get_expert_data_parallel_group),
        ("pp", ps.get_pipeline_model_parallel_group),
    ]
