"""Which chunk files share a pack file (pure: no I/O).

A checkpoint of thousands of small tensors would otherwise cost the file system three metadata operations per
tensor (the array's directory, its ``zarr.json``, its one chunk file): on a parallel file system or a disk
mounted with ``discard`` those operations, not the bytes, bound the save (docs/benchmarks.md). Arrays small
enough are therefore written into **packs**: uncompressed ZIP files (``.acp/packs/<rank>.<k>.zip``) in which
every member array keeps the exact keys it would have in the checkpoint directory (``<name>/zarr.json``,
``<name>/c.0.0``). A pack is a complete zarr v3 store: zarr-python opens it as ``zarr.storage.ZipStore`` (or
``zip::<url>`` through fsspec) and tensorstore with its ``zip`` key-value driver, so every tensor is still one
standalone zarr v3 array with its global shape; the checkpoint metadata names each array's pack.

Format 6 (this release): any chunk file below the target file size (``PlanOptions.min_chunk_bytes``) of an
uncompressed array goes into its **writer's** packs, under its checkpoint key (``<name>/c.i.j``), so one
array's chunks may lie in several ranks' packs and no byte moves between ranks to fill them; the array's
``zarr.json`` goes into its creator's packs. Chunk files at or above the target keep their own files. The
metadata says which arrays are packed (a tensor's ``pack`` is ``.acp/packs/<creator>``) and, through the
writer of every chunk it lists already, whose packs hold each chunk; which of that rank's packs holds it is
found in the packs' central directories (read once per load), so the metadata grows by nothing per chunk.
Each rank fills its packs (``<rank>.0.zip``, ``<rank>.1.zip``, ...) in plan order up to about the target.
Edge chunks are padded to the full chunk shape with the fill value, as zarr does, so every chunk packs.

Format 5 packed only whole small arrays one rank wrote, named by their pack key (still read).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

#: Where packs live: inside the control node, which zarr-python never lists (an empty array node).
PACK_DIR = ".acp/packs"
#: The only pack keys a checkpoint may name (checked on load: nothing else is opened as a pack).
PACK_KEY = re.compile(r"^\.acp/packs/(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})\.zip\Z")
#: Per member: a ZIP local header and central-directory record (zip64 extras included) plus the name twice.
MEMBER_OVERHEAD = 30 + 46 + 2 * 28
#: End-of-central-directory records (zip64 included).
TRAILER_BYTES = 22 + 56 + 20


def pack_key(rank: int, index: int) -> str:
    """The key (relative to the checkpoint root) of ``rank``'s ``index``-th pack."""
    return f"{PACK_DIR}/{rank}.{index}.zip"


#: Format 6: the packs of one rank (``.acp/packs/<rank>@<target>``: the files ``<rank>.<k>.zip``, filled to
#: ``target`` bytes each), what a packed array's ``pack`` names (the rank whose packs hold its ``zarr.json``;
#: chunk ``i`` lies in the packs of ``writers[i]``).
RANK_PACKS = re.compile(r"^\.acp/packs/(0|[1-9][0-9]{0,8})(?:@([1-9][0-9]{0,15}))?\Z")
#: What an array's ``zarr.json`` counts for when a rank fills its packs (its real size varies by release).
DOC_BYTES = 1024


def rank_packs(rank: int, target: int = 0) -> str:
    """Format 6: the name of ``rank``'s packs filled to ``target`` bytes each (what a packed array's ``pack``
    holds when ``rank`` created it); ``target`` 0: unknown (readers then search every pack of the rank)."""
    return f"{PACK_DIR}/{rank}@{target}" if target > 0 else f"{PACK_DIR}/{rank}"


def packs_rank(pack: str | None) -> int | None:
    """The rank of a format-6 ``pack`` entry (:func:`rank_packs`), None for anything else (format 5's pack
    keys, None)."""
    m = RANK_PACKS.match(pack) if isinstance(pack, str) else None
    return int(m.group(1)) if m else None


def packs_target(pack: str | None) -> int:
    """The fill target of a format-6 ``pack`` entry (0: not recorded)."""
    m = RANK_PACKS.match(pack) if isinstance(pack, str) else None
    return int(m.group(2)) if m and m.group(2) else 0


def chunk_file_bytes(layout: Any, itemsize: int) -> int:
    """Bytes of one chunk file of ``layout`` when written uncompressed (edge chunks are padded to the full
    chunk shape, like zarr does): data, a crc32c per inner chunk, the index and its crc32c."""
    inner = math.prod(c // i for c, i in zip(layout.chunk_shape, layout.inner_chunk_shape))
    return math.prod(layout.chunk_shape) * itemsize + inner * 20 + 4


def stored_bytes(layout: Any, itemsize: int) -> int:
    """Bytes of ``layout``'s chunk files when written uncompressed (data, crc32c per inner chunk, index)."""
    return chunk_count(layout.shape, layout.chunk_shape) * chunk_file_bytes(layout, itemsize)


def chunk_count(shape: Iterable[int], chunk_shape: Iterable[int]) -> int:
    """Chunks in the grid (0 for an empty array)."""
    return math.prod(-(-s // max(c, 1)) for s, c in zip(shape, chunk_shape))


def packable(layout: Any, itemsize: int, enabled: int, target: int) -> bool:
    """Whether the chunk files of the array ``layout`` go into their writers' packs: the array is
    uncompressed (the engine encodes its files itself, :mod:`arraycheckpoint.engine.shardfile`) and one chunk
    file is below the target file size ``target``; ``enabled`` (``PlanOptions.pack_array_bytes``) 0 packs
    nothing. Every chunk file of an array has the same size (edge chunks are padded), so an array is packed
    whole or not at all."""
    if enabled <= 0 or layout.compression is not None:
        return False
    return chunk_file_bytes(layout, itemsize) < target


def assign_packs(
    decisions: Mapping[str, tuple[Any, tuple[int, ...], int]],
    itemsizes: Mapping[str, int],
    array_limit: int,
    pack_bytes: int,
) -> dict[str, str]:
    """Which arrays are packed (format 6): ``name -> rank_packs(creator, pack_bytes)`` for every packed array.

    A packed array's ``zarr.json`` goes into its creator's packs, each chunk file into its writer's packs
    (:class:`PackFill` says which of them, from the metadata alone; readers can also find members by key in
    the packs' central directories). The decision is a function of the plan alone (every rank and the
    coordinator derive the same, and it is part of the plan digest); it costs O(arrays), never O(chunks).

    Args:
        decisions: ``name -> (layout, writers per chunk, creator)`` of every array of the save.
        itemsizes: bytes per element of every array.
        array_limit: ``PlanOptions.pack_array_bytes``; 0 packs nothing.
        pack_bytes: the target file size (``PlanOptions.min_chunk_bytes``): chunk files below it are packed,
            and packs are filled to it.
    """
    out: dict[str, str] = {}
    known: dict[tuple[Any, ...], bool] = {}  # per layout but its name: tensors of one shape decide alike
    for name, (layout, _writers, creator) in sorted(decisions.items()):
        what = (layout.chunk_shape, layout.inner_chunk_shape, layout.compression, itemsizes[name])
        packed = known.get(what)
        if packed is None:
            packed = known[what] = packable(layout, itemsizes[name], array_limit, pack_bytes)
        if packed:
            out[name] = rank_packs(creator, pack_bytes)
    return out


def fill_packs(members: Iterable[tuple[str, int]], rank: int, target: int) -> list[tuple[str, list[str]]]:
    """``rank``'s packs: its packed members (``(key, bytes)`` in the order given) filled into packs
    ``<rank>.0.zip``, ``<rank>.1.zip``, ...; a pack is closed once it holds at least ``target`` bytes.

    Returns ``[(pack key, member keys)]``."""
    out: list[tuple[str, list[str]]] = []
    held = target
    for key, nbytes in members:
        if held >= target:
            out.append((pack_key(rank, len(out)), []))
            held = 0
        out[-1][1].append(key)
        held += nbytes
    return out


class PackFill:
    """:func:`fill_packs` in closed form, for runs of equal-sized members: which pack of its rank the ``j``-th
    member of a run gets, without enumerating the members before it. A save fills a rank's packs array by
    array in name order: the array's ``zarr.json`` where the rank created it (:data:`DOC_BYTES`), then the
    chunk files it wrote of it (row-major order), so a reader computes any member's pack from the metadata
    (writers per chunk, the target in ``pack``) and opens that pack only."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.index = -1  # the pack being filled
        self.held = target  # its bytes (a full one: the first member opens pack 0)

    def _first(self, size: int) -> int:
        """Members of ``size`` bytes that still go into the current pack."""
        return -(-(self.target - self.held) // size) if self.held < self.target else 0

    def where(self, j: int, size: int) -> int:
        """The pack index of the ``j``-th (0-based) member of a run of ``size``-byte members added now."""
        first = self._first(size)
        if j < first:
            return self.index
        return self.index + 1 + (j - first) // -(-self.target // size)

    def add(self, count: int, size: int) -> None:
        """Add a run of ``count`` members of ``size`` bytes."""
        if count <= 0:
            return
        first = self._first(size)
        if count <= first:
            self.held += count * size
            return
        per = -(-self.target // size)
        rest = count - first
        full = (rest - 1) // per
        self.index += 1 + full
        self.held = (rest - full * per) * size


def by_pack(packs: Mapping[str, str], names: Iterable[str] | None = None) -> dict[str, tuple[str, ...]]:
    """``pack key -> sorted member arrays`` (of ``names`` only, when given)."""
    grouped: dict[str, list[str]] = defaultdict(list)
    for name in sorted(packs if names is None else (n for n in names if n in packs)):
        grouped[packs[name]].append(name)
    return {k: tuple(v) for k, v in sorted(grouped.items())}


def group_keys(names: Iterable[str]) -> list[str]:
    """The ``zarr.json`` keys of the groups a pack holds: its root and every directory above a member, so
    that ``zarr.open_group`` on the pack lists its arrays like the checkpoint directory would."""
    groups = {""}
    for name in names:
        parts = name.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return [f"{g}/zarr.json" if g else "zarr.json" for g in sorted(groups)]


def max_pack_bytes(member_bytes: Iterable[int], members: int, name_bytes: int) -> int:
    """Upper bound of a valid pack's size: its members' bytes, per-member ZIP records, the names, a trailer."""
    return sum(member_bytes) + members * MEMBER_OVERHEAD + 2 * name_bytes + TRAILER_BYTES
