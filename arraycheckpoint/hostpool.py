"""Host staging buffers for the snapshot: reused from save to save.

The pool hands out host arrays of a given shape and dtype and takes them back when a save's writes are done.
It does no I/O and knows no framework.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable

import numpy as np


class HostBufferPool:
    """Host staging buffers reused from save to save (a save returns them when its writes are done)."""

    def __init__(self) -> None:
        # keyed by the dtype itself: dtype.str is "<V1" for most float8 types, so a float8_e4m3fn buffer
        # would be handed out for float8_e4m3fnuz and the snapshot copy would convert the values
        self._free: dict[tuple[tuple[int, ...], np.dtype], list[np.ndarray]] = defaultdict(list)
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        with self._lock:
            free = self._free.get((shape, np.dtype(dtype)))
            if free:
                return free.pop()
        return np.empty(shape, dtype=dtype)

    def give(self, buffers: Iterable[np.ndarray]) -> None:
        with self._lock:
            for b in buffers:
                self._free[(b.shape, b.dtype)].append(b)
