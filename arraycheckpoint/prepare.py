"""Warm-up before the first save: the staging buffers of a state, allocated, prefaulted and pinned up front.

A process's first :func:`~arraycheckpoint.save_async` would otherwise allocate its host buffers on the
blocking path (and page-lock them when the state lives on a GPU): seconds for a few GiB, against a fraction
of that for every later save. :func:`prepare` moves that cost to start-up. It only fills the process-wide
buffer pool; it writes nothing and runs no collective, so ranks may call it independently.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import InvalidArgumentError


def prepare(
    state: Mapping[str, Any],
    *,
    framework: str | None = None,
    pinned_bytes: int | None = None,
) -> dict[str, Any]:
    """Get the snapshot buffers of ``state`` ready, so that the first ``save_async`` blocks no longer than later ones.

    Call once after the model and optimizer exist (their state allocated: after a first optimizer step for
    optimizers that create their state lazily), with the ``state`` you will save. Idempotent: buffers the
    pool already holds are reused.

    Args:
        state: the mapping you pass to :func:`arraycheckpoint.save_async`.
        framework: as for ``save_async``; detected when omitted.
        pinned_bytes: bound on page-locked host memory (default: ``ARRAYCHECKPOINT_PINNED_BYTES`` or half the
            physical memory); staging past it falls back to pageable memory with a logged warning.

    Returns:
        ``{"buffers", "bytes", "pinned_bytes", "pageable_bytes", "seconds"}`` of the pool after the warm-up.

    Example:
        >>> acp.prepare({"model": model, "optimizer": opt})
        >>> fut = acp.save_async("ckpt/step_100", {"model": model, "optimizer": opt}, step=100)
    """
    from . import stateful
    from ._validate import check_state
    from .adapters.base import AdapterOptions
    from .api import _adapter, detect_framework
    from .engine import engine
    from .runtime.hostpool import shared_pool
    from .runtime.tscontext import context

    check_state(state, framework)
    if pinned_bytes is not None and (
        isinstance(pinned_bytes, bool) or not isinstance(pinned_bytes, numbers.Integral) or pinned_bytes < 0
    ):
        raise InvalidArgumentError(
            f"pinned_bytes must be a number of bytes >= 0 or None, got {pinned_bytes!r}"
        )
    start = time.perf_counter()
    pool = shared_pool()
    if pinned_bytes is not None:
        pool.set_pinned_budget(pinned_bytes)
    _special, state = stateful.split(state)  # dataloader and per-rank values: small, staged as they come
    framework = framework or detect_framework(state)
    request = _adapter(framework).save_request(state, AdapterOptions(allow_pickle=True))
    sizes: list[tuple[tuple[int, ...], np.dtype]] = []
    for t in request.tensors:
        for shard in t.shards:
            if shard.box.volume == 0:
                continue
            stable = getattr(shard.source, "stable_view", None)
            if stable is not None and stable() is not None:
                continue  # written from its own memory, never staged
            sizes.append((shard.box.lengths, np.dtype(t.dtype)))
    pool.reserve(sizes)
    engine()  # the background thread pool
    context()  # tensorstore's shared context
    stats = pool.stats()
    return {
        "buffers": len(sizes),
        "bytes": sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in sizes),
        "pinned_bytes": stats["pinned_bytes"],
        "pageable_bytes": stats["pageable_bytes"],
        "seconds": time.perf_counter() - start,
    }
