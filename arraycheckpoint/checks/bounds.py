"""Bounded JSON and the size limits of untrusted checkpoint input.

A checkpoint is input other jobs, tools and people write (DESIGN invariant 10). :func:`load_json_bounded`
parses JSON with a size cap and a nesting-depth cap (no ``RecursionError``, no gigabytes of metadata parsed,
containers bounded by the document's size); the module constants are every limit of what a valid checkpoint
can hold, each with its reason.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from ..errors import (
    InconsistentCheckpointError as InconsistentCheckpointError,  # also importable from here (its old home)
)
from ..errors import MetadataError

#: Largest metadata file read (``.acp/metadata.json``; ``.metadata.json`` before format 3), in bytes. Format 1 stores one record per saved region; a 10,000-rank save
#: of a few thousand tensors stays far below this; anything larger is refused before it is read.
MAX_METADATA_BYTES = 256 << 20
#: Largest small JSON document of an array (``zarr.json``) or group.
MAX_ARRAY_JSON_BYTES = 1 << 20
#: JSON nesting limit: the deepest document arraycheckpoint writes is a user's extra state (a few levels);
#: Python's json parser recurses per level and fails near 1,000, so the limit stays well below that.
MAX_JSON_DEPTH = 100
#: JSON containers (arrays and objects) any document may hold regardless of its size: about 64 MiB of
#: parsed dicts at most; user extra state of a million small lists stays under it.
JSON_CONTAINERS_FREE = 1 << 20
#: Bytes of JSON text per further container: a saved metadata document holds about one array or object per
#: 24 bytes (8 per tensor entry of about 190 bytes), empty objects ``{},`` one per 3 bytes.
JSON_BYTES_PER_CONTAINER = 16
#: Block of JSON text scanned at once by :func:`json_shape`.
_SCAN_BLOCK = 1 << 20
#: Largest decoded chunk (one stored file). The planner's default is 64 MiB; a chunk is decoded whole in
#: memory by tensorstore, so this caps what one hostile file can make a reader allocate.
MAX_CHUNK_BYTES = 4 << 30
#: Largest single object a backend downloads whole (a chunk file: data, per inner chunk overheads, index).
MAX_OBJECT_BYTES = MAX_CHUNK_BYTES + (MAX_CHUNK_BYTES >> 4)
#: Most inner chunks per stored file: tensorstore reads a 16-byte index entry per inner chunk at once.
MAX_INNER_CHUNKS = 1 << 22
#: Most chunks (stored files, or pack members) of one array: a file system holds at most 2^32 files (inode
#: numbers of ext4 and xfs), and listing that many objects takes millions of requests.
MAX_CHUNKS_PER_ARRAY = 1 << 32
#: Most chunks of one array whose writers a reader derives from the layout (``"writers": "held"``, one
#: int64 each): a save lists the writers of a larger array instead (a listed writer costs metadata bytes,
#: bounded by MAX_METADATA_BYTES, a derived one costs the reader 8 bytes).
MAX_DERIVED_WRITERS = 1 << 26
#: Most derived writers of one checkpoint, over its distinct layouts: a 40-byte ``"held"`` entry would otherwise
#: make a reader allocate 512 MiB per array, as many times as a hostile metadata repeats it with new shapes
#: (2 GiB at most; 10,000 FSDP1 ranks of the 414 GB benchmark state derive 50.5 M). A save lists the rest.
MAX_DERIVED_WRITERS_TOTAL = 1 << 28
#: Most ranks a reader visits deriving the writers of one checkpoint, over its distinct derived layouts
#: (:func:`arraycheckpoint.planning.rules.rule_visits`: a layout group's ranks and the ranks of its mesh rule,
#: a few microseconds each): a mesh rule of a few bytes names up to 4M ranks, and repeated with new shapes it
#: would keep a reader busy for hours. FSDP2 at 10,000 ranks with 1,000 distinct layouts visits 2 x 10^7.
#: A save lists the writers of the layouts beyond it.
MAX_DERIVED_RANK_VISITS = 1 << 25
#: Most ranks a reader visits expanding the saved regions tools list (``verify``, ``inspect``, the zarr store:
#: every tensor's regions and holders), over a checkpoint's distinct layouts, for the same reason; a save
#: whose plan expanded more would have spent minutes planning (10,000 FSDP2 ranks with 1,000 distinct
#: layouts: 2 x 10^7).
MAX_EXPANDED_RANK_VISITS = 1 << 25
#: Most chunks of one packed array: every member of a pack takes at least 154 bytes (132 of ZIP records, its
#: name twice, 24 bytes of encoding around one element), and a pack is at most 4 x MAX_OBJECT_BYTES.
MAX_PACKED_CHUNKS = 4 * MAX_OBJECT_BYTES // 154
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


# JSON ------------------------------------------------------------------------------------------------------
def json_depth(raw: bytes) -> int:
    """Deepest nesting of arrays/objects in the JSON text ``raw`` (strings ignored); linear, no recursion."""
    return json_shape(raw)[0]


def json_shape(raw: bytes) -> tuple[int, int]:
    """``(deepest nesting, number of arrays and objects)`` of the JSON text ``raw`` (strings ignored).

    Linear and in bounded memory: one copy of the text with its strings emptied, then blocks of
    :data:`_SCAN_BLOCK` bytes (about 9 bytes per byte of one block), never an integer per byte of a document of
    hundreds of MiB. No recursion, nothing parsed.
    """
    if b"\\" not in raw:  # no escape: every quote opens or closes a string (the metadata of plain names)
        shape = _shape_by_quotes(raw)
        if shape is not None:
            return shape
    bare = _STRING.sub(b'""', raw)
    level = deepest = containers = 0
    for start in range(0, len(bare), _SCAN_BLOCK):
        codes = np.frombuffer(bare, dtype=np.uint8, count=min(_SCAN_BLOCK, len(bare) - start), offset=start)
        opens = (codes == ord("[")) | (codes == ord("{"))
        step = opens.view(np.int8) - ((codes == ord("]")) | (codes == ord("}"))).view(np.int8)
        levels = np.cumsum(step, dtype=np.int32)  # within a block: at most _SCAN_BLOCK levels
        deepest = max(deepest, level + int(levels.max()))
        level += int(levels[-1])
        containers += int(np.count_nonzero(opens))
    return deepest, containers


def _shape_by_quotes(raw: bytes) -> tuple[int, int] | None:
    """:func:`json_shape` of a text without backslashes, without copying it: a byte is inside a string when an
    odd number of quotes comes before it (the same strings the regular expression empties, when no escape
    can hide a quote), in blocks of :data:`_SCAN_BLOCK` bytes. None when the quotes do not pair up (an
    unterminated string): the general scan decides then."""
    level = deepest = containers = 0
    odd = 0  # quotes before the block, mod 2
    for start in range(0, len(raw), _SCAN_BLOCK):
        codes = np.frombuffer(raw, dtype=np.uint8, count=min(_SCAN_BLOCK, len(raw) - start), offset=start)
        quotes = codes == ord('"')
        outside = (np.cumsum(quotes, dtype=np.int32) + odd) % 2 == 0
        opens = ((codes == ord("[")) | (codes == ord("{"))) & outside
        step = opens.view(np.int8) - (((codes == ord("]")) | (codes == ord("}"))) & outside).view(np.int8)
        levels = np.cumsum(step, dtype=np.int32)
        deepest = max(deepest, level + int(levels.max()))
        level += int(levels[-1])
        containers += int(np.count_nonzero(opens))
        odd = (odd + int(np.count_nonzero(quotes))) % 2
    return None if odd else (deepest, containers)


def max_json_containers(nbytes: int) -> int:
    """Most arrays and objects a JSON document of ``nbytes`` may hold (:data:`JSON_CONTAINERS_FREE` plus one
    per :data:`JSON_BYTES_PER_CONTAINER` bytes); a parsed container costs 56-64 bytes or more, so this bounds
    what a document can make its reader allocate, whatever its size limit."""
    return JSON_CONTAINERS_FREE + nbytes // JSON_BYTES_PER_CONTAINER


def load_json_bounded(raw: bytes | str, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH, what: str) -> Any:
    """Parse JSON from untrusted bytes with a size cap, a nesting-depth cap and a cap on its containers.

    Args:
        raw: the document.
        max_bytes: refuse a document longer than this.
        max_depth: refuse a document nested deeper than this (arrays and objects).
        what: what the document is (a path or a name), for the error.

    Returns:
        The parsed value.

    Raises:
        MetadataError: too long, too deep, holding more arrays and objects than :func:`max_json_containers`
            allows for its size, or not valid JSON (the message names ``what``). Nothing is parsed before
            the size, depth and container checks pass.
    """
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if len(data) > max_bytes:
        raise MetadataError(
            f"{what} is {len(data)} bytes, above the limit of {max_bytes}: a valid checkpoint's file is far "
            "smaller; the checkpoint is damaged or was not written by arraycheckpoint"
        )
    depth, containers = json_shape(data)
    if depth > max_depth:
        raise MetadataError(
            f"{what} nests JSON {depth} levels deep, above the limit of {max_depth}; the checkpoint is damaged "
            "or hostile (extra state this deep cannot be saved either)"
        )
    if containers > max_json_containers(len(data)):
        raise MetadataError(
            f"{what} holds {containers} JSON arrays and objects in {len(data)} bytes, above the limit of "
            f"{max_json_containers(len(data))} (a valid checkpoint's metadata holds about one per 24 bytes); "
            "refused before parsing: the checkpoint is damaged or hostile"
        )
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise MetadataError(f"{what} is not valid JSON ({e}); the checkpoint is damaged") from None


# Packs -----------------------------------------------------------------------------------------------------
#: Largest ``zarr.json`` member of a pack: what a save writes is about 1 KiB; this caps what one member can
#: make the reader allocate before its bounded parse.
MAX_PACKED_JSON_BYTES = 64 << 10
