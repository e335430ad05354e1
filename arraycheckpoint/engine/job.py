"""The state of one save as it moves through the pipeline (shared by the save pipeline and the coordinator)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..collectives import Communicator
from ..future import CheckpointFuture
from ..items import SaveRequest
from ..monitoring import PhaseRecorder
from ..plan import GlobalPlan, PlanOptions, RankPlan, TensorDecl
from ..regions import Box
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


@dataclass
class CachedPlan:
    rank_plan: RankPlan
    global_plan: GlobalPlan | None  # coordinator only


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
    decls: list[TensorDecl]
    cached: CachedPlan | None
    local: dict[str, list[tuple[Box, np.ndarray]]]
    dtypes: dict[str, np.dtype]
    recorder: PhaseRecorder
    error: str | None = None
    buffers: list[np.ndarray] = field(default_factory=list)
