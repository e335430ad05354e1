"""Hostile process grids in a checkpoint's metadata (the meshes that megatron and MoE mesh rules are declared on):
sizes or ranks of the wrong JSON type, infinite sizes, a mesh of thousands of dimensions (of size 1, or of 2: a product of
thousands of digits), a layout group that
lists no rank. Each is refused as damaged metadata naming the layout group, by the load, the zarr store,
``inspect`` (exit 2) and ``verify`` (exit 1): never an OverflowError or a numpy ValueError from deep inside the
expansion (exit 3 from the tools), and never silently read as another mesh (``"2"``, ``1.5`` and ``true`` were
taken through ``int()``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.cli import main
from arraycheckpoint.errors import MetadataError

W = "model/weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grid") / "ck"
    acp.save(path, {"model": {"weight": np.arange(32, dtype=np.float32).reshape(4, 8)}})
    return path


def _hostile(saved: Path, tmp_path: Path, meshes: list, rule: list, ranks: list | None = None) -> Path:
    import shutil

    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    meta = path / ".acp" / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["layout_groups"][0]["meshes"] = meshes
    if ranks is not None:
        doc["layout_groups"][0]["ranks"] = ranks
    doc["tensors"][W]["regions"] = [[0, rule]]
    # Python's json writes Infinity for float("inf"), and reads it back: what an attacker's file may hold
    meta.write_text(json.dumps(doc))
    return path


CASES = {
    "size-infinity": ([[[float("inf")], ["arange", 0]]], ["mesh", 0, [0]], None),
    "size-string": ([[["2"], ["affine", 0, [[1, 0]]]]], ["mesh", 0, [0]], None),
    "size-float": ([[[1.5], ["arange", 0]]], ["mesh", 0, [0]], None),
    "size-bool": ([[[True], ["arange", 0]]], ["mesh", 0, [0]], None),
    "rank-float": ([[[2], ["list", [0.0, 0.9]]]], ["mesh", 0, [0]], None),
    "rank-string": ([[[1], ["list", ["0"]]]], ["mesh", 0, [0]], None),
    "start-bool": ([[[1], ["arange", False]]], ["mesh", 0, [0]], None),
    "5000-dimensions": ([[[1] * 5000, ["arange", 0]]], ["mesh", 0, [-1] * 5000], None),
    # 2^20000: the bound on all meshes' ranks multiplied it out in full (a 6,000-digit number, quadratic time
    # in the dimensions) and then failed to print it: a ValueError, exit 3 (issue 22, attack6)
    "20000-dimensions-of-2": ([[[2] * 20000, ["arange", 0]]], ["mesh", 0, [0]], None),
    "group-without-ranks": ([], ["replica"], []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_grid_is_refused_by_every_reader(
    saved: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _hostile(saved, tmp_path, *CASES[case])
    with pytest.raises(MetadataError, match=r"layout_groups\[0\]"):
        acp.read_metadata(path)
    with pytest.raises(MetadataError, match=r"layout_groups\[0\]"):
        acp.load(path, {"model": {"weight": np.zeros((4, 8), np.float32)}})
    from arraycheckpoint.zarr import checkpoint_store

    with pytest.raises(MetadataError, match=r"layout_groups\[0\]"):
        checkpoint_store(path)
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 2
    assert "layout_groups[0]" in capsys.readouterr().err
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr()
    assert "layout_groups[0]" in out.out + out.err and "internal error" not in out.err


def test_the_same_grid_written_as_a_save_writes_it_loads(saved: Path, tmp_path: Path) -> None:
    """The control: a rank at both positions of a 2-position mesh (a repeat axis), as integers, loads."""
    path = _hostile(saved, tmp_path, [[[2], ["affine", 0, [[1, 0]]]]], ["mesh", 0, [0]])
    got = acp.load(path, {"model": {"weight": np.zeros((4, 8), np.float32)}})
    assert np.array_equal(got["model"]["weight"], np.arange(32, dtype=np.float32).reshape(4, 8))


def test_the_bound_on_mesh_sizes_stops_at_the_limit() -> None:
    """The total of a group's mesh sizes is bounded before any mesh is built: each size is counted up to the
    limit, never multiplied out (600,000 dimensions of 2, 1.8 MB of JSON, took 4 s of CPU)."""
    from arraycheckpoint.planning.rules import MAX_MESH_RANKS, Mesh

    assert Mesh.json_size([[2] * 600_000, ["arange", 0]]) == MAX_MESH_RANKS + 1
    assert Mesh.json_size([[1 << 30, 0], ["arange", 0]]) == MAX_MESH_RANKS + 1
    assert Mesh.json_size([[4, 0, 1 << 30], ["arange", 0]]) == 0  # empty: refused by the parse
    assert Mesh.json_size([[2, 3, 4], ["arange", 0]]) == 24
    assert Mesh.json_size([[2, float("inf")], ["arange", 0]]) == 0  # malformed: refused by the parse


def test_layout_groups_sharing_ranks_are_refused_by_every_reader(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each rank makes one declaration, so the layout groups share no rank and list at most the world in all.
    Groups repeating the world's ranks were each expanded to a tuple of every rank: 8 groups of 20 bytes in a
    world of 2^22 ranks took 1.3 GB, 40 groups more memory than this machine has. Refused at the first group
    past the world, naming it."""
    import shutil

    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    meta = path / ".acp" / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["layout_groups"] += [{"meshes": [], "ranks": [[0, 1, 1]]}] * 3
    meta.write_text(json.dumps(doc))
    with pytest.raises(MetadataError, match=r"layout_groups\[1\].*more than the world of 1"):
        acp.read_metadata(path)
    with pytest.raises(MetadataError, match=r"layout_groups\[1\]"):
        acp.load(path, {"model": {"weight": np.zeros((4, 8), np.float32)}})
    from arraycheckpoint.zarr import checkpoint_store

    with pytest.raises(MetadataError, match=r"layout_groups\[1\]"):
        checkpoint_store(path)
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 2
    assert "layout_groups[1]" in capsys.readouterr().err
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr()
    assert "layout_groups[1]" in out.out + out.err and "internal error" not in out.err
