"""Which small arrays share a pack file (pure: no I/O).

A checkpoint of thousands of small tensors would otherwise cost the file system three metadata operations per
tensor (the array's directory, its ``zarr.json``, its one chunk file): on a parallel file system or a disk
mounted with ``discard`` those operations, not the bytes, bound the save (docs/benchmarks.md). Arrays small
enough are therefore written into **packs**: uncompressed ZIP files (``.acp/packs/<rank>.<k>.zip``) in which
every member array keeps the exact keys it would have in the checkpoint directory (``<name>/zarr.json``,
``<name>/c.0.0``). A pack is a complete zarr v3 store: zarr-python opens it as ``zarr.storage.ZipStore`` (or
``zip::<url>`` through fsspec) and tensorstore with its ``zip`` key-value driver, so every tensor is still one
standalone zarr v3 array with its global shape; the checkpoint metadata names each array's pack.

An array is packed when one rank writes all of it (its creator writes every chunk), it is uncompressed, every
chunk is whole (the engine encodes those files itself, :mod:`arraycheckpoint.engine.shardfile`), and its stored
bytes are at most ``PlanOptions.pack_array_bytes``. Each rank's packed arrays, in name order, fill packs of
about ``PlanOptions.min_chunk_bytes`` (the target file size), so packs bound the file count like chunks do.
The decision is a function of the plan alone: every rank and the coordinator derive the same packs.
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
PACK_KEY = re.compile(r"^\.acp/packs/(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})\.zip$")
#: Per member: a ZIP local header and central-directory record (zip64 extras included) plus the name twice.
MEMBER_OVERHEAD = 30 + 46 + 2 * 28
#: End-of-central-directory records (zip64 included).
TRAILER_BYTES = 22 + 56 + 20


def pack_key(rank: int, index: int) -> str:
    """The key (relative to the checkpoint root) of ``rank``'s ``index``-th pack."""
    return f"{PACK_DIR}/{rank}.{index}.zip"


def stored_bytes(layout: Any, itemsize: int) -> int:
    """Bytes of ``layout``'s chunk files when written uncompressed (data, crc32c per inner chunk, index)."""
    chunks = chunk_count(layout.shape, layout.chunk_shape)
    inner = math.prod(c // i for c, i in zip(layout.chunk_shape, layout.inner_chunk_shape))
    return chunks * (math.prod(layout.chunk_shape) * itemsize + inner * 20 + 4)


def chunk_count(shape: Iterable[int], chunk_shape: Iterable[int]) -> int:
    """Chunks in the grid (0 for an empty array)."""
    return math.prod(-(-s // max(c, 1)) for s, c in zip(shape, chunk_shape))


def packable(layout: Any, writers: Iterable[int], creator: int, itemsize: int, limit: int) -> bool:
    """Whether the array ``layout`` goes into its creator's pack (see the module docstring)."""
    if limit <= 0 or layout.compression is not None:
        return False
    if any(int(w) != creator for w in writers):
        return False
    if any(s % max(c, 1) for s, c in zip(layout.shape, layout.chunk_shape)):
        return False  # a partial edge chunk: written through tensorstore, which pads it
    return stored_bytes(layout, itemsize) <= limit


def assign_packs(
    decisions: Mapping[str, tuple[Any, tuple[int, ...], int]],
    itemsizes: Mapping[str, int],
    array_limit: int,
    pack_bytes: int,
) -> dict[str, str]:
    """The pack of every packed array: ``name -> pack key``.

    Args:
        decisions: ``name -> (layout, writers per chunk, creator)`` of every array of the save.
        itemsizes: bytes per element of every array.
        array_limit: largest stored array packed (``PlanOptions.pack_array_bytes``; 0 packs nothing).
        pack_bytes: a pack is closed once it holds at least this many bytes.
    """
    out: dict[str, str] = {}
    if array_limit <= 0:
        return out
    filled: dict[int, tuple[int, int]] = defaultdict(lambda: (0, 0))  # rank -> (pack index, bytes in it)
    for name in sorted(decisions):
        layout, writers, creator = decisions[name]
        if not packable(layout, writers, creator, itemsizes[name], array_limit):
            continue
        index, held = filled[creator]
        if held >= pack_bytes:
            index, held = index + 1, 0
        out[name] = pack_key(creator, index)
        filled[creator] = (index, held + stored_bytes(layout, itemsizes[name]) + len(name))
    return out


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
