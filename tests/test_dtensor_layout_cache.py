"""A DTensor's local box and its mesh's rule are computed once per mesh, placements and shape
(:func:`arraycheckpoint.adapters.torch.tensors.layout`): the cached values are torch's own, for meshes of
other rank orders, uneven and empty shards, and 2-D meshes, at 2 real gloo ranks."""

from __future__ import annotations

from tests.dist import run_distributed


def _body(rank: int, world: int) -> list[str]:
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor import _utils as dt_utils

    from arraycheckpoint.adapters.torch import tensors
    from arraycheckpoint.adapters.torch.dtensor_rule import dtensor_rule

    calls = []
    real = dt_utils.compute_local_shape_and_global_offset

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dt_utils.compute_local_shape_and_global_offset = counted
    try:
        meshes = {
            "1d": init_device_mesh("cpu", (world,)),
            "reversed": DeviceMesh("cpu", list(reversed(range(world)))),
            "2d": init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp")),
        }
        cases = []
        for mname, mesh in meshes.items():
            one = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(1)]
            for shape in ((5, 3), (1, 4), (8, 6)):
                for placements in (one, [Replicate()] * mesh.ndim):
                    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
                    cases.append((mname, mesh, placements, distribute_tensor(full, mesh, placements)))
        problems = []
        for round_ in range(2):
            calls.clear()
            for mname, mesh, placements, dt in cases:
                _, pieces = tensors.layout(dt)
                local_shape, offset = real(dt.shape, mesh, placements)
                want = (tuple(int(o) for o in offset), tuple(int(s) for s in local_shape))
                got = (pieces[0][0].offsets, pieces[0][0].lengths) if pieces else None
                if (got if pieces else None) != (want if int(torch.Size(local_shape).numel()) else None):
                    problems.append(f"{mname} {placements} {tuple(dt.shape)}: {got} != {want}")
                if pieces and not torch.equal(pieces[0][1], dt.to_local().reshape(pieces[0][1].shape)):
                    problems.append(f"{mname} {placements}: the view is not the local tensor")
                rule = dtensor_rule(dt)
                ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
                if rule is None or rule[1].ranks != ranks or rule[1].shape != tuple(mesh.shape):
                    problems.append(f"{mname}: rule mesh {rule} is not {ranks}")
            if round_ == 1 and calls:
                problems.append(f"the second pass computed {len(calls)} local boxes again")
            if round_ == 0 and not calls:
                problems.append("the first pass computed nothing: nothing tested")
        return problems
    finally:
        dt_utils.compute_local_shape_and_global_offset = real


def test_cached_dtensor_boxes_and_meshes_are_torchs_own() -> None:
    results = run_distributed(_body, 2)
    assert results == [[], []], results


def test_a_process_playing_two_ranks_in_turn_gets_each_ranks_own_box() -> None:
    """Meshes compare equal whatever rank this process is: with rank 0's DTensor (and mesh) still alive, rank
    1's equal mesh must not be handed rank 0's cached box (its tensor would be declared at rank 0's place)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from arraycheckpoint.adapters.torch import tensors

    full = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    alive = []  # the previous rank's state, still referenced
    for r in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,))
            dt = DTensor.from_local(full[4 * r : 4 * (r + 1)].clone(), mesh, [Shard(0)], run_check=False)
            _, [(box, view)] = tensors.layout(dt)
            assert box.offsets == (4 * r, 0), (r, box)
            assert torch.equal(full[box.slices()], view)
            alive.append(dt)
        finally:
            dist.destroy_process_group()
