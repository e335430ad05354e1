"""FSDP2 on 4 ranks: arraycheckpoint against torch.distributed.checkpoint (DCP) on the same model.

The model is a stack of ``Linear(hidden, hidden)`` layers (~50M float32 parameters by default: ~600 MiB with
Adam's ``exp_avg`` and ``exp_avg_sq``), each layer and the root wrapped with ``fully_shard`` over a CPU
DeviceMesh, on ``--world`` gloo ranks spawned with ``torch.multiprocessing``; one optimizer step runs first so
Adam state exists. Measured, per round, as the slowest rank's time after a barrier:

* save: ``acp.save(path, {"model": model, "optimizer": opt})`` against ``get_state_dict`` + ``dcp.save``;
* async blocking: ``acp.save_async`` until ``fut.staged`` completes against ``get_state_dict`` +
  ``dcp.async_save`` until it returns;
* load at the same world size: ``acp.load`` in place against ``get_state_dict`` + ``dcp.load`` +
  ``set_state_dict``;
* load resharded: a second spawn at ``--reshard-world`` ranks loads both checkpoints of the last round.

Every save is followed by ``os.sync()`` inside the timed region (DCP also fsyncs each of its files). Before
each load the parameters and optimizer state are overwritten with garbage, and the first load of each kind is
checked bit-exactly against the saved state (SHA-256 of every reassembled full tensor). Run::

    python benchmarks/bench_fsdp.py                    # ~600 MiB, 4 ranks, reshard to 3
    python benchmarks/bench_fsdp.py --params-m 5       # quick
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    MiB,
    fmt_ratio,
    fmt_seconds,
    machine_description,
    markdown_table,
    median,
    ratio,
    remove,
    settle,
    sync,
    tree_bytes,
    verdict,
)

HIDDEN = 2048


# ---------------------------------------------------------------------------------------------- workers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, args: tuple, timeout: float = 3600) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


# ---------------------------------------------------------------------------------------------- model
def build(world: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The FSDP2 model and its Adam optimizer after one step (same initial values at any world size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _local_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every local shard this rank holds: parameters, then optimizer state tensors."""
    out = []
    for p in model.parameters():
        out.append(p._local_tensor if hasattr(p, "_local_tensor") else p.data)
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                out.append(v._local_tensor if hasattr(v, "_local_tensor") else v)
    return out


def scramble(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Overwrite parameters and optimizer state so a load must restore every byte."""
    with torch.no_grad():
        for t in _local_tensors(model, opt):
            t.fill_(7)


def digests(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """SHA-256 of every reassembled full tensor (collective: every rank calls it)."""
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for p, n in names.items():
        items = [(n, p)] + [(f"{n}/{k}", v) for k, v in sorted(opt.state.get(p, {}).items())]
        for name, t in items:
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[name] = hashlib.sha256(
                full.detach().contiguous().view(-1).view(torch.uint8).numpy()
            ).hexdigest()
    return out


def _max_over_ranks(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn: Callable[[], Any], pause: bool = True) -> tuple[float, Any]:
    """Slowest rank's seconds for ``fn`` (every rank starts after a barrier; ``pause``: settle first)."""
    import torch.distributed as dist

    if pause:
        settle()
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return _max_over_ranks(time.perf_counter() - t0), out


# ---------------------------------------------------------------------------------------------- verbs
def acp_save(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import arraycheckpoint as acp

    acp.save(path, {"model": model, "optimizer": opt})
    sync()


def dcp_save(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    sync()


def acp_load(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import arraycheckpoint as acp

    acp.load(path, {"model": model, "optimizer": opt})


def dcp_load(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _round(
    rank: int,
    world: int,
    paths: dict[str, str],
    model: Any,
    opt: Any,
    group: Any,
    check: list[torch.Tensor] | None,
) -> dict[str, float]:
    """One round of every measurement at the save world size (``check``: the saved local tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import arraycheckpoint as acp

    rec: dict[str, float] = {}
    rec["acp/save"], _ = _timed(lambda: acp_save(paths["acp"], model, opt))
    rec["dcp/save"], _ = _timed(lambda: dcp_save(paths["dcp"], model, opt))

    def acp_async() -> Any:
        fut = acp.save_async(paths["acp_async"], {"model": model, "optimizer": opt})
        fut.staged.result()
        return fut

    def dcp_async() -> Any:
        msd, osd = get_state_dict(model, opt)
        return dcp.async_save(
            {"model": msd, "optim": osd}, checkpoint_id=paths["dcp_async"], process_group=group
        )

    rec["acp/async_block"], fut = _timed(acp_async)
    rec["acp/async_total"], _ = _timed(lambda: (fut.result(), sync()), pause=False)
    rec["acp/async_total"] += rec["acp/async_block"]
    rec["dcp/async_block"], dfut = _timed(dcp_async)
    rec["dcp/async_total"], _ = _timed(lambda: (dfut.result(), sync()), pause=False)
    rec["dcp/async_total"] += rec["dcp/async_block"]

    for kind, load in (("acp", acp_load), ("dcp", dcp_load)):
        scramble(model, opt)
        rec[f"{kind}/load"], _ = _timed(lambda load=load, kind=kind: load(paths[kind], model, opt))
        if check is not None and not all(
            torch.equal(a, b) for a, b in zip(check, _local_tensors(model, opt))
        ):
            raise RuntimeError(f"rank {rank}: {kind} load at world {world} did not restore the saved state")
    return rec


def bench_world(rank: int, world: int, root: str, layers: int, repeats: int) -> dict[str, Any]:
    """The measurements at the save world size; rank 0 returns them with the saved state's digests."""
    import torch.distributed as dist

    model, opt = build(world, layers)
    # DCP's async_save runs collectives in a background thread: give it its own gloo group, as its docs say,
    # so they cannot interleave with this benchmark's barriers on the default group
    group = dist.new_group(backend="gloo")
    reference = digests(model, opt)
    saved = [t.clone() for t in _local_tensors(model, opt)]
    res: dict[str, list[float]] = defaultdict(list)
    sizes: dict[str, int] = {}
    for rnd in range(repeats + 1):
        paths = {k: f"{root}/{k}-{rnd}" for k in ("acp", "dcp", "acp_async", "dcp_async")}
        rec = _round(rank, world, paths, model, opt, group, saved if rnd == 0 else None)
        dist.barrier()
        if rank == 0:
            for k in ("acp", "dcp"):
                sizes[k] = tree_bytes(paths[k])
            label = "warm-up" if rnd == 0 else f"round {rnd}"
            print(f"world {world} {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in rec.items()), flush=True)
            for k, p in paths.items():
                if not (rnd == repeats and k in ("acp", "dcp")):
                    remove(p)
        dist.barrier()
        if rnd > 0:
            for k, v in rec.items():
                res[k].append(v)
    total = _sum_over_ranks(sum(t.numel() * t.element_size() for t in saved))
    kept = {k: f"{root}/{k}-{repeats}" for k in ("acp", "dcp")}
    return {"results": dict(res), "digests": reference, "bytes": total, "files": sizes, "kept": kept}


def _sum_over_ranks(x: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def bench_reshard(
    rank: int, world: int, kept: dict[str, str], layers: int, repeats: int, reference: dict[str, str]
) -> dict[str, Any]:
    """Load both checkpoints at a different world size; check the reassembled state against the saved one."""
    model, opt = build(world, layers)
    res: dict[str, list[float]] = defaultdict(list)
    for rnd in range(repeats + 1):
        for kind, load in (("acp", acp_load), ("dcp", dcp_load)):
            scramble(model, opt)
            sec, _ = _timed(lambda load=load, kind=kind: load(kept[kind], model, opt))
            if rnd == 0 and digests(model, opt) != reference:
                raise RuntimeError(f"{kind} load resharded to world {world} differs from the saved state")
            if rnd > 0:
                res[f"{kind}/load_reshard"].append(sec)
            elif rank == 0:
                print(f"world {world} warm-up: {kind}/load_reshard {sec:.3f} (verified)", flush=True)
    return {"results": dict(res)}


# ---------------------------------------------------------------------------------------------- report
def report(
    res: dict[str, list[float]],
    nbytes: int,
    files: dict[str, int],
    world: int,
    reshard: int,
    repeats: int,
    stat: Callable[[list[float]], float] = median,
    label: str = "median",
) -> str:
    med = {k: stat(v) for k, v in res.items()}
    rows = []
    checks = []
    for what, key, goal in (
        ("save", "save", 2.0),
        ("async save: blocking", "async_block", 1.0),
        ("async save: until durable", "async_total", None),
        (f"load at {world} ranks", "load", 2.0),
        (f"load resharded {world} -> {reshard}", "load_reshard", 2.0),
    ):
        a, d = med.get(f"acp/{key}", float("nan")), med.get(f"dcp/{key}", float("nan"))
        sp = ratio(d, a)
        rows.append([what, fmt_seconds(a), fmt_seconds(d), fmt_ratio(sp)])
        if goal is not None:
            checks.append(f"- {what}: {fmt_ratio(sp)} faster, target >= {goal:g}x ({verdict(sp >= goal)})")
    table = markdown_table(["FSDP2", "arraycheckpoint s", "DCP s", "speed-up (DCP / ours)"], rows)
    return (
        f"FSDP2 model + Adam state: {nbytes / MiB:.0f} MiB over {world} ranks; {label} of {repeats} rounds after "
        f"a warm-up round; slowest rank; saves timed until os.sync() returns.\n"
        f"Files on disk (MiB): arraycheckpoint {files.get('acp', 0) / MiB:.0f}, DCP {files.get('dcp', 0) / MiB:.0f}."
        f"\n\n{table}\n\nTargets:\n" + "\n".join(checks)
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-m", type=float, default=50, help="model parameters, millions (default 50)")
    p.add_argument("--world", type=int, default=4, help="ranks that save (default 4)")
    p.add_argument("--reshard-world", type=int, default=3, help="ranks that load resharded (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported (default 3)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir under /tmp)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")

    layers = max(1, round(args.params_m * 1e6 / (HIDDEN * HIDDEN + HIDDEN)))
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="acp-bench-fsdp-", dir=base))
    print(machine_description(root), flush=True)
    print(f"model: {layers} x Linear({HIDDEN}, {HIDDEN}), Adam; checkpoints under {root}", flush=True)
    try:
        first = spawn(bench_world, args.world, (str(root), layers, args.repeats))[0]
        second = spawn(
            bench_reshard, args.reshard_world, (first["kept"], layers, args.repeats, first["digests"])
        )[0]
    finally:
        remove(root)
    res = {**first["results"], **second["results"]}
    print()
    for stat, label in ((median, "median"), (min, "best")):
        print(
            report(
                res, first["bytes"], first["files"], args.world, args.reshard_world, args.repeats, stat, label
            )
        )
        print()


if __name__ == "__main__":
    main()
