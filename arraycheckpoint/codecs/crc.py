"""The CRC32C of the ``crc32c`` codec: the one implementation every writer and reader here uses.

Two libraries compute it in hardware: the ``crc32c`` package (three interleaved SSE4.2 / ARMv8 streams:
21 GB/s on a cached block on this 2-core machine; it takes any contiguous buffer, numpy arrays included, and
releases the GIL on large ones) and ``google_crc32c`` (zarr-python's own dependency: 7.6 GB/s here, and its
extension takes only ``bytes`` without copying and holds the GIL). The first is used where it runs in
hardware, the second otherwise (same values).

:func:`extend` carries the checksum from one block to the next, so a reader checks each block of a chunk right
after it lands, while the block is still in the core's cache, and a writer sums each slice of a chunk right
before it writes it, instead of reading the whole chunk from memory a second time.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

#: bytes, or a C-contiguous array (read in place, not copied)
Buffer = bytes | bytearray | memoryview | np.ndarray


def _fast() -> Any:
    """The ``crc32c`` package's function where it computes in hardware, else None."""
    try:
        import crc32c
    except ImportError:  # pragma: no cover - a declared dependency; google_crc32c takes over
        return None
    return crc32c.crc32c if crc32c.hardware_based else None


_FAST = _fast()


def _google() -> Any:
    import google_crc32c

    return google_crc32c


def in_hardware() -> bool:
    """Whether the CRC32C runs in hardware here (else the writers and readers that checksum every byte
    themselves leave the bytes to tensorstore, which checksums them in its own code)."""
    return _FAST is not None or _google().implementation == "c"


def extend(crc: int, block: Buffer) -> int:
    """The CRC32C of the bytes checksummed so far (``crc``: 0 before the first block) followed by ``block``."""
    if _FAST is not None:
        return int(_FAST(block, crc))
    return _google_extend(crc, block)


def crc32c(block: Buffer) -> int:
    """The CRC32C of ``block``."""
    if _FAST is not None:
        return int(_FAST(block))
    return _google_extend(0, block)


def _google_extend(crc: int, block: Buffer) -> int:
    """google_crc32c's: ``bytes`` as they are, any other buffer through a view of its memory."""
    impl = _google()
    if isinstance(block, bytes):
        return int(impl.extend(crc, block))
    if isinstance(block, np.ndarray):  # as bytes: memoryview() refuses dtypes without a buffer format (bf16)
        if not block.flags.c_contiguous:
            raise ValueError("the CRC32C of a buffer that is not C-contiguous")
        block = block.reshape(-1).view(np.uint8)
    view = memoryview(block)
    if not view.c_contiguous:
        raise ValueError("the CRC32C of a buffer that is not C-contiguous")
    if view.nbytes == 0:
        return crc
    if view.readonly:
        return int(impl.extend(crc, view.tobytes()))
    return int(impl.extend(crc, (ctypes.c_char * view.nbytes).from_buffer(view.cast("B"))))
