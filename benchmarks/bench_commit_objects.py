"""The coordinator's metadata at commit when every rank sends its own per-rank object (one the template form
cannot hold: a per-rank dataloader state whose keys differ by rank). Simulated in one process: each rank's
commit status as :func:`status_payload` makes it, then :func:`build_metadata` on rank 0. Prints the time and
the peak memory of ``build_metadata`` at each world size.

    PYTHONPATH=$PWD python benchmarks/bench_commit_objects.py 1000 10000
"""

from __future__ import annotations

import json
import sys
import time
import tracemalloc

from arraycheckpoint.engine.coordinate import build_metadata, declare, status_payload
from arraycheckpoint.planning.groupplan import build_compact_plan
from arraycheckpoint.planning.items import SaveObject, SaveRequest
from arraycheckpoint.planning.plan import PlanOptions


def simulate(world: int, names: int = 2) -> tuple[float, float, int]:
    """Seconds and peak MiB of ``build_metadata`` for ``world`` ranks, and the ranks its objects hold."""
    statuses = []
    for r in range(world):
        objs = [
            SaveObject(
                f"dataloader/state{k}", {"epoch": 3, "pos": r * 7 + k, f"worker_{r % 13}": [r, k]}, "rank"
            )
            for k in range(names)
        ]
        payload = status_payload(SaveRequest([], objs, framework="torch"), None, {}, r, world)
        statuses.append(json.loads(payload) if payload else {})
    plan = build_compact_plan([(declare([], 0), tuple(range(world)))], world, PlanOptions())
    request = SaveRequest([], [], framework="torch")
    tracemalloc.start()
    t0 = time.perf_counter()
    meta = build_metadata(plan, request, statuses)
    dt = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    held = sum(len(o.per_rank) for o in meta.objects.values())
    return dt, peak, held


def main() -> None:
    worlds = [int(a) for a in sys.argv[1:]] or [1000, 10_000]
    print("| ranks | build_metadata s | peak MiB | per-rank values |")
    print("|---:|---:|---:|---:|")
    for w in worlds:
        dt, peak, held = simulate(w)
        print(f"| {w:,} | {dt:.3f} | {peak:.1f} | {held:,} |")


if __name__ == "__main__":
    main()
