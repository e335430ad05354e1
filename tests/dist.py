"""Run a test body on N real processes with torch.distributed (gloo, CPU).

Usage in a test::

    def body(rank, world, tmp):       # module-level function (spawn pickles it by reference)
        ...
    run_distributed(body, world=4, args=(str(tmp_path),))

Every rank's exception is re-raised in the test process with the rank named; return values come back as a
list in rank order.

Workers are spawned (no fork), so each has its own torch state, and they are **kept** between calls: a pool of
``world`` processes with their gloo group already initialised runs one body after another (spawning four
processes that import torch costs about 8 CPU-seconds, and the suite calls this more than a hundred times). A
pool is only reused while nothing went wrong: a body that raised on any rank, a timeout, or a rank that died
retires the whole pool (a rank may be stuck in a collective), and the next call spawns a fresh one. Each body
runs with the caller's ``sys.path``, working directory and environment (a pool is keyed by the environment, so a
test that sets a variable before the call gets workers spawned with it; ``SIDE_EFFECT_VARS`` aside); what a body changes in ``os.environ``
or the working directory is undone after it. ``ACP_TEST_POOL=0`` spawns fresh processes for every call.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue as queue_mod
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

POOLS_KEPT = 3  # pools alive at once (one per world size in practice); each worker holds torch in memory
JOBS_PER_POOL = 60  # a pool is renewed after this many bodies (bounds what leaks between bodies)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(rank: int, world: int, job: bytes) -> tuple[str, Any]:
    """Unpickle and run one body in the caller's sys.path, cwd and environment; restore them afterwards."""
    path, cwd, env, payload = pickle.loads(job)
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    sys.path[:] = path
    try:
        os.environ.clear()
        os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        os.environ.update({k: saved_env[k] for k in ("MASTER_ADDR", "MASTER_PORT")})
        os.chdir(cwd)
        fn, args = pickle.loads(payload)
        return "ok", fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - ship every failure to the parent
        return "error", traceback.format_exc()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)


def _worker(rank: int, world: int, port: int, jobs: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    except BaseException:  # noqa: BLE001
        results.put((rank, -1, "error", traceback.format_exc()))
        return
    try:
        while True:
            item = jobs.get()
            if item is None:
                break
            number, job = item
            status, value = _run_job(rank, world, job)
            try:
                results.put((rank, number, status, value))
            except Exception:  # noqa: BLE001 - an unpicklable result
                results.put((rank, number, "error", traceback.format_exc()))
            if status != "ok":
                break  # the parent retires this pool: other ranks may be stuck in a collective
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Pool:
    """``world`` spawned gloo workers that run bodies one at a time."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, port, self.jobs[r], self.results))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.used = 0

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> tuple[dict[int, Any], list[str]]:
        self.used += 1
        number = self.used
        job = pickle.dumps((list(sys.path), os.getcwd(), dict(os.environ), pickle.dumps((fn, args))))
        for q in self.jobs:
            q.put((number, job))
        results: dict[int, Any] = {}
        errors: list[str] = []
        while len(results) < self.world and not errors:
            try:
                rank, got, status, value = self.results.get(timeout=timeout)
            except queue_mod.Empty:
                errors.append(f"no rank reported within {timeout} s")
                break
            if got != number and got != -1:
                continue  # a late answer of an earlier body (cannot happen while pools retire on error)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        return results, errors

    def close(self, grace: float = 5.0) -> None:
        for q in self.jobs:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_pools: dict[tuple[int, frozenset[tuple[str, str]]], _Pool] = {}


def _close_all() -> None:
    while _pools:
        _pools.popitem()[1].close(grace=2.0)


atexit.register(_close_all)


#: Variables a process sets in its own environment as a side effect (arraycheckpoint's S3 storage on first use,
#: torch's inductor at import): a worker sets them alike, and every body gets the caller's environment anyway.
#: Keyed on, the first S3 test of the suite orphaned every pool (all respawned, the old ones kept until evicted).
SIDE_EFFECT_VARS = frozenset(
    {
        "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS",
        "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES",
        "TORCHINDUCTOR_CACHE_DIR",
    }
)


def env_key(env: dict[str, str]) -> frozenset[tuple[str, str]]:
    """What of ``env`` a kept worker process was started with must match to run a body under ``env``."""
    return frozenset(
        (k, v) for k, v in env.items() if not k.startswith("PYTEST_") and k not in SIDE_EFFECT_VARS
    )


def _pool_for(world: int) -> _Pool:
    key = (world, env_key(dict(os.environ)))
    pool = _pools.pop(key, None)
    if pool is not None and (not pool.alive() or pool.used >= JOBS_PER_POOL):
        pool.close()
        pool = None
    if pool is None:
        while len(_pools) >= POOLS_KEPT:
            _pools.pop(next(iter(_pools))).close()  # the least recently used
        pool = _Pool(world)
    _pools[key] = pool  # most recently used last
    return pool


def run_distributed(fn: Callable[..., Any], world: int, args: tuple = (), timeout: float = 300) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; return results in rank order."""
    if os.environ.get("ACP_TEST_POOL", "1") == "0":
        pool, results, errors = _Pool(world), {}, ["the body did not run"]
        try:
            results, errors = pool.run(fn, args, timeout)
        finally:
            pool.close(grace=5 if errors else 60)
    else:
        pool = _pool_for(world)
        results, errors = pool.run(fn, args, timeout)
        if errors or len(results) != world:
            _pools.pop(next(k for k, v in _pools.items() if v is pool))
            pool.close()
    if errors or len(results) != world:
        raise AssertionError("distributed test failed:\n" + "\n".join(errors or ["a rank did not report"]))
    return [results[r] for r in range(world)]


def torch_full_state(model: Any, opt: Any) -> dict[str, Any]:
    """Full model and optimizer state as numpy arrays (``model/<fqn>``, ``optimizer/<fqn>/<key>``), gathered
    by torch's own ``get_state_dict`` (collective: every rank calls), independently of arraycheckpoint's
    adapters, so a test comparing against it fails if the adapter's view of a sharded layout is wrong."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": v.detach().clone().numpy() for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        out.update({f"optimizer/{fqn}/{k}": v.detach().clone().numpy() for k, v in state.items()})
    return out


def snapshot_copied(meta, world: int) -> list[int]:
    """Bytes each rank's snapshot copied (its ``snapshot`` phase's ``copied``, from the save's metrics)."""
    out = []
    for r in range(world):
        (snap,) = [p for p in meta.metrics["save"][str(r)]["phases"] if p["phase"] == "snapshot"]
        out.append(snap["copied"])
    return out


def written_bytes(meta, world: int) -> list[int]:
    """Bytes of the stored chunks each rank wrote, from the metadata's per-chunk writers."""
    import itertools
    import math

    from arraycheckpoint.codecs import numpy_dtype

    out = [0] * world
    for tm in meta.tensors.values():
        item = numpy_dtype(tm.dtype).itemsize
        grid = itertools.product(*(range(0, s, c) for s, c in zip(tm.shape, tm.chunk_shape)))
        for writer, origin in zip(tm.writers, grid):
            out[writer] += item * math.prod(
                min(c, s - o) for o, c, s in zip(origin, tm.chunk_shape, tm.shape)
            )
    return out
