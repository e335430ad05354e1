"""FSDP2 loads only: ``acp.load`` against DCP's load of checkpoints saved once (by whichever tree runs first).

``bench_fsdp.py``'s model, ``acp_load`` and ``dcp_load``; 5 interleaved rounds after a warm-up, the slowest
rank's wall and CPU seconds, paired medians. TREE is the source tree imported (to compare two revisions on
the same checkpoints, run it once per tree, alternating)::

    python benchmarks/bench_fsdp_load.py TREE --world 2 --rounds 5 [--save-world 4] [--profile out.prof]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

TREE = sys.argv[1]
sys.path.insert(0, TREE)
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import bench_fsdp as B  # noqa: E402


def _max(x: float) -> float:
    return B._max_over_ranks(x)


def work(rank: int, world: int, root: str, layers: int, rounds: int, profile: str | None) -> dict:
    import torch.distributed as dist

    model, opt = B.build(world, layers)
    paths = {"acp": f"{root}/acp", "dcp": f"{root}/dcp"}
    res: dict[str, list[tuple[float, float]]] = {"acp": [], "dcp": []}
    for rnd in range(rounds + 1):
        for kind in B.rotated(["acp", "dcp"], rnd):
            load = B.METHODS[kind][2]
            B.scramble(model, opt)
            B.settle(0.2)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            load(paths[kind], model, opt)
            w, c = time.perf_counter() - t0, time.process_time() - c0
            w, c = _max(w), _max(c)
            if rnd > 0:
                res[kind].append((w, c))
    if profile:
        import cProfile

        pr = cProfile.Profile()
        for _ in range(3):
            B.scramble(model, opt)
            dist.barrier()
            pr.enable()
            B.acp_load(paths["acp"], model, opt)
            pr.disable()
        pr.dump_stats(f"{profile}.{rank}")
    return res


def save(rank: int, world: int, root: str, layers: int) -> None:
    model, opt = B.build(world, layers)
    B.acp_save(f"{root}/acp", model, opt)
    B.dcp_save(f"{root}/dcp", model, opt)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("tree")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--save-world", type=int, default=None)
    p.add_argument("--params-m", type=float, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/tmp/acp-bench-fsdp-load")
    p.add_argument("--profile", default=None)
    a = p.parse_args()
    layers = max(1, round(a.params_m * 1e6 / (B.HIDDEN * B.HIDDEN + B.HIDDEN)))
    sw = a.save_world or a.world
    root = f"{a.dir}/w{sw}-l{layers}"
    if not os.path.exists(f"{root}/dcp"):
        os.makedirs(root, exist_ok=True)
        B.spawn(save, sw, (root, layers))
    res = B.spawn(work, a.world, (root, layers, a.rounds, a.profile))[0]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    aw, ac = med([x[0] for x in res["acp"]]), med([x[1] for x in res["acp"]])
    dw, dc = med([x[0] for x in res["dcp"]]), med([x[1] for x in res["dcp"]])
    pw = med([d[0] / x[0] for x, d in zip(res["acp"], res["dcp"])])
    pc = med([d[1] / x[1] for x, d in zip(res["acp"], res["dcp"])])
    print(
        f"{TREE} {sw}->{a.world}: acp {aw:.3f}s ({ac:.3f} cpu)  dcp {dw:.3f}s ({dc:.3f} cpu)  "
        f"paired wall {pw:.2f}x cpu {pc:.2f}x"
    )


if __name__ == "__main__":
    main()
