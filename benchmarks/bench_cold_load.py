"""Cold loads without root: every file of the checkpoint evicted from the page cache before each load.

``posix_fadvise(POSIX_FADV_DONTNEED)`` drops a file's clean, unmapped pages from the page cache, which needs no
privilege (``bench_single.py --cold`` drops the whole cache and needs root). One process, ``--big`` float32
tensors of ``--mib`` MiB each and 50 small ones, saved once by ``acp.save`` and by DCP; then ``--rounds``
interleaved rounds (after a warm-up) of: acp cold, acp warm, DCP cold, DCP warm; medians and the paired
median ratio DCP / acp. TREE is the source tree imported (run it once per tree, alternating, to compare two
revisions on the same checkpoints)::

    python benchmarks/bench_cold_load.py TREE [--big 4] [--mib 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

TREE = sys.argv[1] if len(sys.argv) > 1 else "."
sys.path.insert(0, TREE)


def evict(path: str) -> int:
    """Drop every file under ``path`` from the page cache; returns how many files."""
    n = 0
    for d, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            n += 1
    return n


def main() -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    import arraycheckpoint as acp

    p = argparse.ArgumentParser()
    p.add_argument("tree")
    p.add_argument("--big", type=int, default=4)
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/tmp/acp-bench-cold")
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    state = {f"big{i}": torch.randn(a.mib << 13, 32, generator=g) for i in range(a.big)}
    state.update({f"small{i}": torch.randn(1000, generator=g) for i in range(50)})
    root = f"{a.dir}/b{a.big}-m{a.mib}"
    paths = {"acp": f"{root}/acp", "dcp": f"{root}/dcp"}
    if not os.path.exists(paths["dcp"]):
        os.makedirs(root, exist_ok=True)
        acp.save(paths["acp"], {"model": state})
        dcp.save({"model": state}, checkpoint_id=paths["dcp"])
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    loads = {
        "acp": lambda: acp.load(paths["acp"], {"model": dest}),
        "dcp": lambda: dcp.load({"model": dest}, checkpoint_id=paths["dcp"]),
    }
    times: dict[str, list[float]] = {f"{m} {c}": [] for m in loads for c in ("cold", "warm")}
    for rnd in range(a.rounds + 1):
        for method, load in loads.items():
            for case in ("cold", "warm"):
                if case == "cold":
                    evict(paths[method])
                t0 = time.perf_counter()
                load()
                if rnd:
                    times[f"{method} {case}"].append(time.perf_counter() - t0)
        assert all(torch.equal(dest[k], v) for k, v in state.items())
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    for case in ("cold", "warm"):
        ratios = sorted(d / x for d, x in zip(times[f"dcp {case}"], times[f"acp {case}"]))
        print(
            f"{TREE} {case}: acp {med[f'acp {case}']:.3f}s  dcp {med[f'dcp {case}']:.3f}s  "
            f"paired DCP/acp {ratios[len(ratios) // 2]:.2f}x"
        )


if __name__ == "__main__":
    main()
