"""Hunt for a rare crash of a resharded FSDP2 load: save at 2 or 4 gloo ranks, load at 3, many times.

Not a test and not a benchmark: a loop that runs the FSDP2 save/load of ``bench_fsdp.py`` (its ``build``,
``scramble`` and ``digests``) in fresh processes and records how every rank process ended. A SIGABRT was once
seen in 1 of 15 runs of a 3-rank FSDP2 load (issue 22, session 17 note, item 6); ``bench_fsdp.spawn`` ignores a
rank's exit status once it has reported, so a crash at exit would only show on stderr there.

Each run spawns the save world (``--save-worlds``, alternating), saves model + Adam with ``acp.save``, then
spawns 3 ranks that load it in place (``acp.load``), check the SHA-256 of every reassembled tensor against the
save's, and exit, in turn in each of three ways (:data:`MODES`). Every rank's exit code is recorded (a negative one is the signal that killed it); stderr
(with ``PYTHONFAULTHANDLER=1``, set for the ranks here) goes to ``<out>/run<k>.err``. It stops after
``--runs`` runs or ``--minutes`` minutes, and prints one line per run and a summary. Run it gently on a
shared machine::

    nice -n 19 python benchmarks/stress_fsdp_reshard.py --runs 30 --minutes 40 --out /tmp/stress
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue as queue_mod
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

#: how the loading ranks end: ``destroy``: digests of the reassembled tensors (collectives), then
#: ``destroy_process_group()`` (as bench_fsdp.py and tests/dist.py do); ``plain exit``: the same without destroying
#: the group; ``load-and-exit``: ``acp.load`` is the last collective, the interpreter exits with the group alive
MODES = ("destroy", "plain exit", "load-and-exit")


def _worker(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, q: Any, err: str, destroy: bool
) -> None:
    """``bench_fsdp._worker`` with this rank's stderr (faulthandler's dumps included) in the run's file."""
    import faulthandler

    from bench_fsdp import _worker as run_rank

    with contextlib.suppress(OSError):
        fd = os.open(err, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    faulthandler.enable()
    run_rank(rank, world, port, fn, args, q, destroy)


def spawn(
    fn: Callable[..., Any], world: int, args: tuple, err: str, timeout: float, destroy: bool = True
) -> tuple[list[Any], list]:
    """Run ``fn`` on ``world`` gloo ranks; returns (results by rank, exit codes by rank). A rank that dies
    before reporting ends the wait at once (its exit code tells how). ``destroy``: each rank ends with
    ``destroy_process_group()`` (as ``bench_fsdp.py`` and ``tests/dist.py`` do), else the interpreter exits
    with the group alive (a plain user script)."""
    from bench_fsdp import _free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, args, q, err, destroy)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, status, value = q.get(timeout=1.0)
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    return [results.get(r, ("missing", None)) for r in range(world)], [p.exitcode for p in procs]


def _save(rank: int, world: int, path: str, layers: int) -> dict[str, str]:
    import bench_fsdp

    import arraycheckpoint as acp

    model, opt = bench_fsdp.build(world, layers)
    acp.save(path, {"model": model, "optimizer": opt})
    return bench_fsdp.digests(model, opt)


def _load(rank: int, world: int, path: str, layers: int, reference: dict[str, str]) -> bool:
    import bench_fsdp

    import arraycheckpoint as acp

    model, opt = bench_fsdp.build(world, layers)
    bench_fsdp.scramble(model, opt)
    acp.load(path, {"model": model, "optimizer": opt})
    return bench_fsdp.digests(model, opt) == reference


def _local_digests(model: Any, opt: Any) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], str]]:
    """``name -> (global offset, local shape, SHA-256)`` of every local shard, with no collective."""
    import hashlib

    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for n, p in model.named_parameters():
        for name, t in [(n, p)] + [(f"{n}/{k}", v) for k, v in sorted(opt.state.get(p, {}).items())]:
            if hasattr(t, "_local_tensor"):
                shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                local = t._local_tensor
            else:
                shape, offset, local = tuple(t.shape), (0,) * t.ndim, t
            data = local.detach().contiguous().view(-1).view(torch.uint8).numpy()
            out[name] = (tuple(offset), tuple(shape), hashlib.sha256(data).hexdigest())
    return out


def _load_and_exit(rank: int, world: int, path: str, layers: int) -> dict:
    """A plain script's end: ``acp.load`` is the last collective before the process exits (checked after, by
    the parent, from each rank's local shards)."""
    import bench_fsdp

    import arraycheckpoint as acp

    model, opt = bench_fsdp.build(world, layers)
    bench_fsdp.scramble(model, opt)
    acp.load(path, {"model": model, "optimizer": opt})
    return _local_digests(model, opt)


def _check_local(path: str, layers: int, reference: dict[str, str], ranks: list[dict]) -> bool:
    """The ranks' local shards are the slices of the checkpoint's full tensors, which match the save."""
    import hashlib

    import bench_fsdp

    import arraycheckpoint as acp

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(bench_fsdp.HIDDEN, bench_fsdp.HIDDEN) for _ in range(layers)]
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, bench_fsdp.HIDDEN)).sum().backward()
    opt.step()
    acp.load(path, {"model": model, "optimizer": opt})
    if bench_fsdp.digests(model, opt) != reference:
        return False
    full = {n: p for n, p in model.named_parameters()}
    full.update({f"{n}/{k}": v for n, p in model.named_parameters() for k, v in opt.state[p].items()})
    for local in ranks:
        for name, (offset, shape, sha) in local.items():
            t = full[name].detach()[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            if hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest() != sha:
                return False
    return True


def one_run(k: int, save_world: int, layers: int, out: Path, timeout: float, mode: str) -> tuple[bool, str]:
    """One save at ``save_world`` and load at 3 ending as ``mode`` says (see :data:`MODES`); (all good,
    one-line description)."""
    destroy = mode == "destroy"
    err = str(out / f"run{k}.err")
    root = tempfile.mkdtemp(prefix=f"acp-stress{k}-")
    try:
        path = os.path.join(root, "ck")
        saved, save_codes = spawn(_save, save_world, (path, layers), err, timeout, destroy)
        line = f"run {k} ({mode}): save@{save_world} exit {save_codes}"
        if any(s != "ok" for s, _ in saved) or any(c != 0 for c in save_codes):
            return False, line + f" status {[s for s, _ in saved]}"
        reference = saved[0][1]
        if mode == "load-and-exit":
            loaded, load_codes = spawn(_load_and_exit, 3, (path, layers), err, timeout, False)
            ok = all(s == "ok" for s, _ in loaded) and _check_local(
                path, layers, reference, [v for _, v in loaded]
            )
            loaded = [(s, ok) for s, _ in loaded]
        else:
            loaded, load_codes = spawn(_load, 3, (path, layers, reference), err, timeout, destroy)
        line += f"; load@3 exit {load_codes} verified {[v for _, v in loaded]}"
        good = all(s == "ok" and v is True for s, v in loaded) and all(c == 0 for c in load_codes)
        return good, line
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--minutes", type=float, default=40.0)
    ap.add_argument("--save-worlds", default="2,4", help="save world sizes, used in turn")
    ap.add_argument("--layers", type=int, default=2, help="Linear(2048, 2048) layers (48 MiB each with Adam)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one spawn may take")
    ap.add_argument("--out", default="/tmp/stress_fsdp_reshard")
    args = ap.parse_args(argv)
    os.environ["PYTHONFAULTHANDLER"] = "1"  # the spawned ranks inherit it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    worlds = [int(w) for w in args.save_worlds.split(",")]
    import arraycheckpoint

    print(f"arraycheckpoint from {os.path.dirname(arraycheckpoint.__file__)}", flush=True)
    stop = time.monotonic() + args.minutes * 60
    bad = []
    done = 0
    for k in range(args.runs):
        if time.monotonic() > stop:
            break
        t0 = time.monotonic()
        mode = MODES[(k // len(worlds)) % len(MODES)]  # every save world with every mode, in turn
        good, line = one_run(k, worlds[k % len(worlds)], args.layers, out, args.timeout, mode)
        done += 1
        print(f"{line} ({time.monotonic() - t0:.0f} s){'' if good else '  <-- FAILED'}", flush=True)
        if not good:
            bad.append(k)
    print(f"{done} runs, {len(bad)} failed: {bad}; stderr of each run in {out}/run<k>.err", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
