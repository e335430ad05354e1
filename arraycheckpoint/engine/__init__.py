"""The engine: the one place where checkpoint bytes move (snapshot, exchange, write, read, commit).

A thin facade over the two pipelines: :mod:`.save` (snapshot, then exchange/write/flush in the background,
coordinated by :mod:`.coordinate`) and :mod:`.load` (metadata, then concurrent region reads). The engine knows
no framework: adapters translate (see :mod:`arraycheckpoint.planning.items`).

Layer ``engine``: may import every layer below it (``errors``, ``codecs``, ``checks``, ``planning``,
``format``, ``runtime``, ``adapters``, ``storage``, ``audit``, ``sources``); never the API, the tools or the
interop surfaces.
"""

from __future__ import annotations

import threading

from ..planning.items import SaveRequest
from ..runtime.collectives import Communicator
from ..runtime.future import CheckpointFuture
from ..runtime.hostpool import shared_pool
from .common import DEFAULT_INFLIGHT_BYTES
from .job import SaveOptions
from .load import LoadPipeline, record_load_metrics
from .save import SavePipeline

__all__ = ["DEFAULT_INFLIGHT_BYTES", "Engine", "SaveOptions", "engine", "record_load_metrics"]


class Engine:
    """Runs saves and loads. One per process (see :func:`engine`); saves run strictly one after another."""

    def __init__(self) -> None:
        self.pool = shared_pool()
        self._save = SavePipeline(self.pool)
        self._load = LoadPipeline(self._save.wait_idle)
        self.read_metadata = self._load.read_metadata
        self.load = self._load.load

    def save_async(
        self, url: str, request: SaveRequest, comm: Communicator, options: SaveOptions | None = None
    ) -> CheckpointFuture:
        """Snapshot ``request`` and write it in the background; returns once the snapshot is taken."""
        return self._save.save_async(url, request, comm, options)

    def wait_idle(self) -> None:
        """Wait (without raising) until the last save has finished with the checkpoint group."""
        self._save.wait_idle()


_engine: Engine | None = None
_engine_lock = threading.Lock()


def engine() -> Engine:
    """The process-wide engine."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = Engine()
        return _engine
