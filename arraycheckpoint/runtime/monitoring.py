"""Per-rank, per-phase timing and byte counts of saves and loads.

:class:`PhaseRecorder` is used as ``with rec.phase("write", nbytes=n): ...`` (or as a decorator through
:meth:`PhaseRecorder.timed`). The engine stores each rank's record in the checkpoint's metadata under
``metrics`` so ``arraycheckpoint metrics`` can draw heat-maps and timelines afterwards.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class PhaseRecorder:
    """Collects (phase, start, seconds, bytes) records relative to the recorder's creation."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.wall0 = time.time()
        self.phases: list[dict[str, Any]] = []

    @contextmanager
    def phase(self, name: str, nbytes: int = 0) -> Iterator[dict[str, Any]]:
        """Time the body as phase ``name``; the yielded dict's ``bytes`` may be updated inside."""
        rec = {"phase": name, "start": time.perf_counter() - self.t0, "seconds": 0.0, "bytes": nbytes}
        try:
            yield rec
        finally:
            rec["seconds"] = time.perf_counter() - self.t0 - rec["start"]
            self.phases.append(rec)

    def timed(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator form of :meth:`phase`."""

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def inner(*args: Any, **kwargs: Any) -> Any:
                with self.phase(name):
                    return fn(*args, **kwargs)

            return inner

        return wrap

    def seconds(self, name: str) -> float:
        return sum(p["seconds"] for p in self.phases if p["phase"] == name)

    def to_json(self) -> dict[str, Any]:
        return {"wall_start": self.wall0, "phases": [dict(p) for p in self.phases]}
