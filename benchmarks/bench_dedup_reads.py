"""Does reading a replicated region once and sharing it over the communicator beat every rank reading it?

Saves a replicated state (DDP-like: every rank needs every full tensor) and loads it at N ranks with
``dedup_reads=False`` and ``True``; prints the median load time of each. Run:
``python benchmarks/bench_dedup_reads.py [--ranks 4] [--size-mib 256] [--repeat 3]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from dist import run_distributed  # noqa: E402

import arraycheckpoint as acp  # noqa: E402


def _state(size_mib: int) -> dict[str, torch.Tensor]:
    n = size_mib * (1 << 20) // 4 // 8
    gen = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(n // 1024, 1024, generator=gen) for i in range(8)}


def _load(rank: int, world: int, path: str, size_mib: int, repeat: int) -> dict[str, float]:
    import torch.distributed as dist

    target = {k: torch.zeros_like(v) for k, v in _state(size_mib).items()}
    out = {}
    for dedup in (False, True, False, True):  # interleaved so neither mode gets a warmer cache
        times = []
        for _ in range(repeat):
            dist.barrier()
            t0 = time.perf_counter()
            acp.load(path, {"model": target}, dedup_reads=dedup)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        out.setdefault(str(dedup), []).extend(times)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="acp-bench-dedup-")
    try:
        path = os.path.join(root, "ck")
        acp.save(path, {"model": _state(args.size_mib)})
        res = run_distributed(_load, args.ranks, (path, args.size_mib, args.repeat), timeout=1800)[0]
        plain, shared = res["False"], res["True"]
        print(f"replicated load of {args.size_mib} MiB at {args.ranks} ranks (median of {2 * args.repeat})")
        print("| mode | seconds | ratio vs every rank reading |")
        print("|---|---:|---:|")
        print(f"| every rank reads everything (default) | {plain:.3f} | 1.00 |")
        print(f"| dedup_reads=True (read once, share over gloo) | {shared:.3f} | {plain / shared:.2f}x |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
