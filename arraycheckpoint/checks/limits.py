"""Layout limits: a declared array is possible before anything is sized from it.

:func:`check_tensor_layout` refuses a chunk larger than its shape, chunk bytes or inner chunk counts no
storage holds, so tensorstore never sizes a buffer from a hostile number; :func:`check_layouts` runs it for
every array of a checkpoint's metadata (pure, before any I/O).
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import (
    MetadataError,
)
from .bounds import MAX_CHUNK_BYTES, MAX_CHUNKS_PER_ARRAY, MAX_INNER_CHUNKS, MAX_PACKED_CHUNKS


# Layouts ---------------------------------------------------------------------------------------------------
def check_tensor_layout(
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    chunk_shape: tuple[int, ...],
    inner_chunk_shape: tuple[int, ...],
) -> None:
    """Refuse a declared array no valid checkpoint holds, before anything is sized from it.

    Every chunk dimension is >= 1 and at most the array dimension (a chunk of 1 on a zero-length dimension,
    as zarr requires); the inner chunk divides the chunk; one chunk decodes to at most
    :data:`MAX_CHUNK_BYTES`; a chunk holds at most :data:`MAX_INNER_CHUNKS` inner chunks.

    Raises:
        MetadataError: naming the tensor and the offending numbers.
    """
    from ..codecs import numpy_dtype

    def bad(why: str) -> MetadataError:
        return MetadataError(
            f"tensor {name!r}: {why} (shape {list(shape)}, chunk {list(chunk_shape)}, inner chunk "
            f"{list(inner_chunk_shape)}); the checkpoint's metadata is damaged or hostile"
        )

    ndim = len(shape)
    if len(chunk_shape) != ndim or len(inner_chunk_shape) != ndim:
        raise bad("chunk and shape ranks differ")
    for s, c, i in zip(shape, chunk_shape, inner_chunk_shape):
        if c < 1 or i < 1:
            raise bad("a chunk dimension is below 1")
        if c > max(s, 1):
            raise bad("a chunk dimension exceeds the array dimension")
        if c % i:
            raise bad("the inner chunk does not divide the chunk")
    try:
        itemsize = numpy_dtype(dtype).itemsize
    except ValueError as e:
        raise bad(str(e)) from None
    nbytes = math.prod(chunk_shape) * itemsize
    if nbytes > MAX_CHUNK_BYTES:
        raise bad(f"one chunk decodes to {nbytes} bytes, above the limit of {MAX_CHUNK_BYTES}")
    inner = math.prod(c // i for c, i in zip(chunk_shape, inner_chunk_shape))
    if inner > MAX_INNER_CHUNKS:
        raise bad(f"one chunk holds {inner} inner chunks, above the limit of {MAX_INNER_CHUNKS}")
    chunks = chunk_count(shape, chunk_shape)
    if chunks > MAX_CHUNKS_PER_ARRAY:
        raise bad(f"the array has {chunks} chunks, more than any storage holds ({MAX_CHUNKS_PER_ARRAY})")


def chunk_count(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> int:
    """Chunks in the regular grid (0 for an empty array, 1 for a 0-d one)."""
    return math.prod(-(-s // c) for s, c in zip(shape, chunk_shape))


def check_layouts(meta: Any) -> None:
    """Every tensor's declared layout passes :func:`check_tensor_layout` (pure: no I/O), each distinct layout
    checked once (the first tensor of a layout that fails is named).

    Raises:
        MetadataError: a layout no valid checkpoint has.
    """
    checked: set[tuple[Any, ...]] = set()  # each distinct layout once (many tensors share one)
    for name, t in meta.tensors.items():
        layout = (
            tuple(t.shape),
            t.dtype,
            tuple(t.chunk_shape),
            tuple(t.inner_chunk_shape),
            t.pack is not None,
        )
        if layout in checked:
            continue
        check_tensor_layout(name, t.shape, t.dtype, t.chunk_shape, t.inner_chunk_shape)
        chunks = chunk_count(t.shape, t.chunk_shape)
        checked.add(layout)
        if t.pack is not None and chunks > MAX_PACKED_CHUNKS:
            raise MetadataError(
                f"tensor {name!r}: packed in {t.pack} as {chunks} chunks of {list(t.chunk_shape)} (shape "
                f"{list(t.shape)}), more than any pack holds ({MAX_PACKED_CHUNKS}); the checkpoint's metadata "
                "is damaged or hostile"
            )
