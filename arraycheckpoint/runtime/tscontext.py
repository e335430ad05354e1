"""The process-wide tensorstore Context shared by the engine and the storage backends.

One context means one set of I/O and copy thread pools, and one in-memory key-value store for ``memory://``
checkpoints. fsync per file is off: durability comes from one batched flush before commit
(:meth:`arraycheckpoint.storage.Storage.flush`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

_lock = threading.Lock()
_context: Any = None


def context() -> Any:
    """The shared ``tensorstore.Context`` (created on first use)."""
    global _context
    with _lock:
        if _context is None:
            import tensorstore as ts

            cpus = os.cpu_count() or 2
            _context = ts.Context(
                {
                    "file_io_sync": False,
                    "cache_pool": {"total_bytes_limit": 0},
                    "data_copy_concurrency": {"limit": max(2, cpus)},
                    "file_io_concurrency": {"limit": max(16, 4 * cpus)},
                }
            )
        return _context
