"""zstd frames: a chunk's frame header is checked against the declared chunk size before it is inflated.

:func:`check_zstd_frame` reads a frame's header (content size, window, block sizes) so that a zstd bomb is
refused before tensorstore inflates it; :func:`_max_file_bytes` bounds a chunk file's stored size.
"""

from __future__ import annotations

import math

from ..errors import (
    CorruptCheckpointError,
)

#: zstd block size limit (RFC 8878): no block decodes to more than this.
_ZSTD_BLOCK_MAX = 128 << 10
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _max_file_bytes(chunk: tuple[int, ...], inner: tuple[int, ...], itemsize: int) -> int:
    """Upper bound of one stored chunk file: data, per inner chunk crc + zstd worst-case overhead, index."""
    n_inner = math.prod(c // i for c, i in zip(chunk, inner))
    inner_bytes = math.prod(inner) * itemsize
    zstd_overhead = 32 + 3 * (inner_bytes // _ZSTD_BLOCK_MAX + 1)
    return n_inner * (inner_bytes + zstd_overhead + 4 + 16) + 4


def check_zstd_frame(frame: bytes | memoryview, expected: int, what: str) -> None:
    """Refuse a zstd frame that does not decode to exactly ``expected`` bytes, from its headers alone.

    The frame must be one zstd frame that declares its content size (tensorstore and zarr-python write it),
    equal to ``expected``, whose blocks cannot decode to more than ``expected`` plus one block, and which
    ends where the data ends. This bounds what the decoder allocates, whatever the bytes say.

    Raises:
        CorruptCheckpointError: naming ``what`` and the declared sizes.
    """
    data = bytes(frame)

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{what}: zstd frame {why} (an inner chunk decodes to {expected} bytes); refused before "
            "decompression: the checkpoint is damaged or hostile"
        )

    if len(data) < 6 or data[:4] != _ZSTD_MAGIC:
        raise bad("has no zstd magic number")
    fhd = data[4]
    fcs_flag, single, reserved, has_checksum, dict_flag = (
        fhd >> 6,
        (fhd >> 5) & 1,
        (fhd >> 3) & 1,
        (fhd >> 2) & 1,
        fhd & 3,
    )
    if reserved:
        raise bad("sets a reserved header bit")
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if fcs_size == 0:
        raise bad("does not declare its content size")
    if pos + fcs_size > len(data):
        raise bad("is truncated")
    content = int.from_bytes(data[pos : pos + fcs_size], "little") + (256 if fcs_size == 2 else 0)
    if content != expected:
        raise bad(f"declares {content} decoded bytes")
    pos += fcs_size
    blocks = 0
    literal = 0
    limit = max(1, -(-expected // _ZSTD_BLOCK_MAX))
    while True:
        if pos + 3 > len(data):
            raise bad("is truncated")
        header = int.from_bytes(data[pos : pos + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        pos += 3
        blocks += 1
        if blocks > limit or size > _ZSTD_BLOCK_MAX:
            raise bad(f"has more or larger blocks than {expected} bytes need")
        if kind == 0:  # raw
            literal += size
            pos += size
        elif kind == 1:  # RLE: one byte repeated `size` times
            literal += size
            pos += 1
        elif kind == 2:  # compressed: decodes to at most one block
            pos += size
        else:
            raise bad("uses the reserved block type")
        if literal > expected:
            raise bad(f"holds blocks decoding to more than {expected} bytes")
        if last:
            break
    pos += 4 if has_checksum else 0
    if pos != len(data):
        raise bad("is followed by other data (a second frame or garbage)")
