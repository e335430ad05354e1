"""The CRC32C of the ``crc32c`` codec, extended block by block (hardware CRC32C through ``google_crc32c``).

A reader checks each block of a chunk right after it lands, while the block is still in the core's cache,
instead of reading the whole chunk and then checksumming it from memory a second time:
:func:`extend` carries the checksum from one block to the next.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


def _impl() -> Any:
    import google_crc32c

    return google_crc32c


_CRC = _impl()


def extend(crc: int, block: np.ndarray) -> int:
    """The CRC32C of the bytes checksummed so far (``crc``: 0 before the first block) followed by ``block``
    (a C-contiguous array; read in place, not copied)."""
    try:
        return int(_CRC.extend(crc, block))
    except (TypeError, ValueError, BufferError):  # a buffer the extension does not take: a view of its memory
        if not block.flags.c_contiguous:
            raise
        return int(_CRC.extend(crc, (ctypes.c_char * block.nbytes).from_address(block.ctypes.data)))
