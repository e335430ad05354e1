"""The state of one save as it moves through the pipeline (shared by the save pipeline and the coordinator)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..planning.groupplan import CompactPlan, Decl
from ..planning.items import SaveRequest
from ..planning.plan import PlanOptions, RankPlan
from ..planning.regions import Box
from ..runtime.collectives import Communicator
from ..runtime.future import CheckpointFuture
from ..runtime.monitoring import PhaseRecorder
from ..storage import Storage
from .common import DEFAULT_INFLIGHT_BYTES


@dataclass(frozen=True)
class SaveOptions:
    """Options of one save (identical on every rank)."""

    overwrite: bool = False
    plan: PlanOptions = field(default_factory=PlanOptions)
    max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES
    # the caller waits for the commit (``save()``): sources may lend their memory instead of being copied
    blocking: bool = False
    # liveness bound of this save's collectives (None: the communicator's default), see ``timeout=``
    liveness_timeout: float | None = None


@dataclass
class CachedPlan:
    rank_plan: RankPlan  # this rank's work
    compact: CompactPlan  # the whole plan (every rank has it; the coordinator writes metadata from it)
    plan_hash: int  # the plan id as a non-negative int64, for the agreement


@dataclass
class SaveJob:
    storage: Storage
    final: str
    staging: str
    token: str
    request: SaveRequest
    comm: Communicator
    options: SaveOptions
    future: CheckpointFuture
    key: str
    decl: Decl | None  # None: this rank could not declare (its error is in ``error``)
    decl_digest: bytes
    cached: CachedPlan | None
    local: dict[str, list[tuple[Box, np.ndarray]]]
    dtypes: dict[str, np.dtype]
    recorder: PhaseRecorder
    error: str | None = None
    mode: str = ""  # agreed by all ranks: "cached", "local", "gather" or "skip" (see Coordinator.agree)
    stack_digest: bytes = b""  # of this rank's stacked per-rank slots (arraycheckpoint.format.perrank)
    unstack: bool = False  # agreed: the ranks' stacked slots differ, every rank saves per-rank arrays
    ranks_per_host: int = 0  # agreed: LOCAL_WORLD_SIZE when every rank reports the same, else 0 (no host map)
    template_digest: bytes = b""  # of this rank's per-rank templates (arraycheckpoint.format.rankdoc)
    untemplate: bool = False  # agreed: the ranks' templates differ, every rank saves per-rank objects
    buffers: list[np.ndarray] = field(default_factory=list)
    fences: list[Any] = field(default_factory=list)  # asynchronous device copies of the snapshot
