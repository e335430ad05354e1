"""The metadata's layout groups (format 2 and later): the process grids (meshes) of each declaration and the
ranks that made it, checked as untrusted input before any mesh is expanded to its ranks."""

from __future__ import annotations

from typing import Any

from ..errors import MetadataError


def parse_layout_groups(raw: Any, world_size: int) -> tuple[Any, ...]:
    """Format 2+ layout groups: each a declaration's meshes and the ranks that made it, as ``(Decl, ranks)``.

    Raises:
        MetadataError: a malformed group or mesh, or meshes naming more ranks in all than the limit.
    """
    from ..planning.groupplan import Decl
    from ..planning.rules import MAX_MESH_RANKS, Mesh, decode_ranks

    if not isinstance(raw, list):
        raise MetadataError("metadata: layout_groups must be a list")
    # every mesh is expanded to its rank list: bound the sum over all groups, not only each mesh, before any
    # is built (a few hundred bytes of JSON could otherwise ask for gigabytes); a valid checkpoint holds one
    # mesh per distinct declaration, each at most the world (Megatron at 10,000 ranks: about 1.3M in all)
    total = 0
    for i, g in enumerate(raw):
        if isinstance(g, dict) and isinstance(g.get("meshes"), list):
            total += sum(Mesh.json_size(m) for m in g["meshes"])  # each at most MAX_MESH_RANKS + 1
        if total > MAX_MESH_RANKS:
            raise MetadataError(
                f"metadata: layout_groups[{i}]: the meshes up to it list more than {MAX_MESH_RANKS} ranks in "
                "all; the checkpoint is damaged or hostile"
            )
    out = []
    listed = 0  # ranks over all groups: each rank made one declaration, so the groups share no rank
    for i, g in enumerate(raw):
        try:
            for m in g["meshes"]:
                _check_mesh_json(m)
            decl = Decl.from_json({"meshes": g["meshes"], "tensors": []})
            ranks = decode_ranks(g["ranks"], world_size)
        except Exception as e:  # noqa: BLE001 - any malformed field is the same damage
            raise MetadataError(f"metadata: layout_groups[{i}] is malformed ({e})") from None
        if not ranks:  # every group is a declaration some rank made; its regions name their holders
            raise MetadataError(f"metadata: layout_groups[{i}] lists no rank")
        listed += len(ranks)
        if listed > world_size:  # 8 groups of 20 bytes each naming all 2^22 ranks took 1.3 GB (unbounded)
            raise MetadataError(
                f"metadata: layout_groups[{i}]: the groups up to it list {listed} ranks, more than the world of "
                f"{world_size} (each rank is in one group); the checkpoint is damaged or hostile"
            )
        out.append((decl, ranks))
    return tuple(out)


#: Dimensions of a stored mesh: a process grid has a handful (megatron: TP, CP, DP, PP, EP and a few repeat
#: axes); numpy cannot index more than 64, which a reader's expansion of a mesh rule does.
MAX_MESH_DIMS = 32


def _check_mesh_json(m: Any) -> None:
    """The exact JSON types of a stored mesh, before :meth:`Mesh.from_json` (which converts with ``int()``:
    ``"2"``, ``1.5`` and ``true`` would pass as sizes or ranks) builds it: sizes and ranks are JSON
    integers, at most :data:`MAX_MESH_DIMS` dimensions."""

    def ints(v: Any) -> bool:
        return isinstance(v, list) and all(type(x) is int for x in v)

    if not (isinstance(m, list) and len(m) == 2 and ints(m[0]) and isinstance(m[1], list) and m[1]):
        raise ValueError(f"a mesh must be [sizes, ranks] with integer sizes, not {str(m)[:80]}")
    if len(m[0]) > MAX_MESH_DIMS:
        raise ValueError(f"a mesh of {len(m[0])} dimensions (at most {MAX_MESH_DIMS})")
    kind, rest = m[1][0], m[1][1:]
    if kind == "list" and not (len(rest) == 1 and ints(rest[0])):
        raise ValueError("a mesh's rank list must hold integers")
    if kind == "arange" and not (len(rest) == 1 and type(rest[0]) is int):
        raise ValueError("a mesh's first rank must be an integer")
