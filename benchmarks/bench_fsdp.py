"""FSDP2 on 4 ranks: arraycheckpoint against DCP and ByteCheckpoint on the same model, in one run.

The model is a stack of ``Linear(hidden, hidden)`` layers (~50M float32 parameters by default: ~600 MiB with
Adam's ``exp_avg`` and ``exp_avg_sq``), each layer and the root wrapped with ``fully_shard`` over a CPU
DeviceMesh, on ``--world`` gloo ranks spawned with ``torch.multiprocessing``; one optimizer step runs first so
Adam state exists. Every round runs every method once, in the order of one row of a Williams design
(interleaved, so a burst of load on a shared machine lands on all of them, and over as many rounds as methods
each method follows each other one once), and each time is the slowest rank's after a barrier:

* save: ``acp.save(path, {"model": model, "optimizer": opt})``; ``get_state_dict`` + ``dcp.save`` (DCP's
  ``FileSystemWriter``); ``bytecheckpoint.save(path, {"model": model, "optimizer": opt}, framework="fsdp2")``;
  the same ``dcp.save`` through ``acp.dcp.Writer`` (compared with DCP's own writer); and the disk's floor,
  each rank's local bytes written as bare 16 MiB files with nothing else (:func:`floor_save`: ``anchor / bare
  write`` is the largest speed-up over that anchor any writer can show on this disk; loaded back by
  :func:`floor_load`, the bare read: the floor of a load);
* async blocking / until durable: ``acp.save_async`` until ``fut.staged`` completes against
  ``get_state_dict`` + ``dcp.async_save`` until it returns;
* load at the same world size: ``acp.load`` in place, ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``,
  ``bytecheckpoint.load(..., framework="fsdp2")``;
* load resharded: a second spawn at ``--reshard-world`` ranks loads the last round's checkpoints.

The report gives each method's median and, per pair, the paired median (the median over rounds of the
anchor's time / ours in the same round), with a line per target. Every save is followed by ``os.sync()``
inside the timed region. Before each load the parameters and optimizer state are overwritten with garbage;
the warm-up round's loads are checked bit-exactly against the saved local shards, and the first resharded
load of each method against SHA-256 digests of every reassembled full tensor.

ByteCheckpoint 0.0.2 (``pip install --no-deps bytecheckpoint``) starts a gRPC coordinator on every save that
listens on all interfaces; :func:`bcp_localhost` binds it to 127.0.0.1 at runtime. A 2-rank probe runs first:
where ByteCheckpoint cannot be imported or cannot save and load FSDP2 on CPU/gloo, the benchmark says why and
goes on without it (``--no-bcp`` leaves it out). Run::

    python benchmarks/bench_fsdp.py                                # ~600 MiB, 4 ranks, reshard to 3
    python benchmarks/bench_fsdp.py --params-m 2 --repeats 1       # quick
"""

from __future__ import annotations

import argparse
import datetime
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

from bench_small import git_revision  # noqa: E402
from common import (  # noqa: E402
    MiB,
    can_drop_page_cache,
    drop_page_cache,
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


def _worker(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any, destroy: bool = True
) -> None:
    """One gloo rank: ``fn(rank, world, *args)``'s result or traceback to ``queue``; ``destroy``: end with
    ``destroy_process_group()`` (else the interpreter exits with the group alive)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("BYTECHECKPOINT_LOGGING_LEVEL", "ERROR")  # it logs every step of every save at INFO
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if destroy and dist.is_initialized():
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


# ---------------------------------------------------------------------------------------------- ByteCheckpoint
#: the only address ByteCheckpoint's per-save gRPC coordinator may listen on in this benchmark
LOCALHOST = "127.0.0.1"


async def _bcp_async_serve_localhost(servicer: Any, async_addr: Any) -> None:
    """``bytecheckpoint.utilities.server.server_lib.async_serve`` bound to 127.0.0.1 instead of ``[::]``."""
    import grpc
    from bytecheckpoint.utilities.server import report_service_pb2_grpc, server_lib

    server = grpc.aio.server(options=server_lib._GRPC_OPTIONS)
    report_service_pb2_grpc.add_ByteCheckpointReportServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{LOCALHOST}:0")
    await server.start()
    async_addr.obj = f"{LOCALHOST}:{port}"
    async_addr.e.set()
    await server.wait_for_termination()


def _bcp_patch_server_lib() -> None:
    from bytecheckpoint.utilities.server import server_lib

    server_lib.async_serve = _bcp_async_serve_localhost
    # its own address lookup opens a UDP socket towards 8.8.8.8; the server only listens on loopback
    server_lib._get_local_ip = lambda: LOCALHOST


def _bcp_serve_in_loop_localhost(world_size: int, conn: Any) -> None:
    """Body of ByteCheckpoint's coordinator process, with the loopback patch applied in that process."""
    from bytecheckpoint.utilities.server import server_lib

    _bcp_patch_server_lib()
    server_lib._serve_in_loop(world_size, conn)


def _bcp_start_server_localhost(world_size: int) -> str:
    """``server_lib.start_server_in_new_process`` whose spawned server binds 127.0.0.1 only."""
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    ctx.Process(target=_bcp_serve_in_loop_localhost, args=(world_size, child_conn), daemon=True).start()
    return str(parent_conn.recv())


def bcp_localhost() -> None:
    """Make every ByteCheckpoint save of this process start its gRPC coordinator on 127.0.0.1.

    ByteCheckpoint 0.0.2 has no setting for this: ``server_lib.async_serve`` binds ``[::]:0`` (all
    interfaces) in a process spawned by ``start_server_in_new_process``, and advertises the address of the
    interface that routes to 8.8.8.8. Both are replaced at runtime (site-packages is not edited).
    """
    from bytecheckpoint.utilities.server import server_lib

    _bcp_patch_server_lib()
    server_lib.start_server_in_new_process = _bcp_start_server_localhost


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


def _timed(fn: Callable[[], Any], pause: bool = True, save: bool = False) -> tuple[float, Any]:
    """Slowest rank's seconds for ``fn`` (every rank starts after a barrier; ``pause``: settle first;
    ``save``: a save, which :func:`fresh_cache` may precede)."""
    import torch.distributed as dist

    if pause:
        settle()
    if save:
        fresh_cache(dist.get_rank())  # after the pause: the pages it frees are not yet given to the host
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return _max_over_ranks(time.perf_counter() - t0), out


def _cpu_seconds(fn: Callable[[], Any]) -> float:
    """CPU seconds of this process (every thread) while ``fn`` runs: blind to the disk's speed, so it compares
    the methods' own work where the device's write throughput varies from one save to the next."""
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


# ---------------------------------------------------------------------------------------------- verbs
Model = torch.nn.Module
Optim = torch.optim.Optimizer


def acp_save(path: str, model: Model, opt: Optim) -> None:
    import arraycheckpoint as acp

    acp.save(path, {"model": model, "optimizer": opt})
    sync()


def dcp_save(path: str, model: Model, opt: Optim) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    sync()


def dcp_acp_writer_save(path: str, model: Model, opt: Optim) -> None:
    """``dcp.save`` of the same state dict as :func:`dcp_save`, through ``acp.dcp.Writer``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import arraycheckpoint as acp

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=acp.dcp.Writer(path))
    sync()


def bcp_save(path: str, model: Model, opt: Optim) -> None:
    import bytecheckpoint as bcp

    bcp.save(path, {"model": model, "optimizer": opt}, framework="fsdp2")
    sync()


#: the bare writer's file size: the planner's target pack size
FLOOR_FILE_BYTES = 16 * MiB
#: bytes per ``pwritev`` of the bare writer (and per ``preadv`` of the bare reader): the save's own write size
#: (one 16 MiB ``writev`` per file took 2x the wall time of 1 MiB writes of the same files in one process on
#: this 2-core VM, 288 MiB until ``syncfs``, with other work running)
FLOOR_IO_BYTES = 1 * MiB


def _floor_files(path: str, model: Model, opt: Optim) -> tuple[str, list[list[memoryview]]]:
    """This rank's directory of the bare write/read, and its local shard bytes (as they lie in memory) cut
    into the files of :data:`FLOOR_FILE_BYTES` and the ``pwritev``/``preadv`` calls of :data:`FLOOR_IO_BYTES`
    within each file."""
    import torch.distributed as dist

    views = [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in _local_tensors(model, opt)]
    files: list[list[memoryview]] = [[]]
    size = 0
    for v in views:
        while len(v):
            take = min(len(v), FLOOR_FILE_BYTES - size)
            files[-1].append(v[:take])
            size += take
            v = v[take:]
            if size == FLOOR_FILE_BYTES:
                files.append([])
                size = 0
    return os.path.join(path, str(dist.get_rank())), [f for f in files if f]


def _io_calls(parts: list[memoryview]) -> list[tuple[int, list[memoryview]]]:
    """``parts`` (one file's bytes in order) as ``(offset, buffers)`` calls of about :data:`FLOOR_IO_BYTES`."""
    calls: list[tuple[int, list[memoryview]]] = []
    offset, held, bufs = 0, 0, []
    for p in parts:
        while len(p):
            take = min(len(p), FLOOR_IO_BYTES - held)
            bufs.append(p[:take])
            held += take
            p = p[take:]
            if held == FLOOR_IO_BYTES:
                calls.append((offset, bufs))
                offset, held, bufs = offset + held, 0, []
    if bufs:
        calls.append((offset, bufs))
    return calls


def floor_save(path: str, model: Model, opt: Optim) -> None:
    """The disk's floor for this save: this rank's local shard bytes written as they lie in memory into files
    of 16 MiB (``pwritev`` calls of 1 MiB), each file's write-back started as soon as it is written, one
    ``syncfs`` at the end; no checksum, metadata, plan or coordination. No checkpoint writer is durable sooner
    on this disk, so ``anchor / bare write`` bounds the speed-up any writer can show over that anchor here."""
    from arraycheckpoint.engine.shardfile import start_writeback
    from arraycheckpoint.storage.local import LocalStorage

    where, files = _floor_files(path, model, opt)
    os.makedirs(where, exist_ok=True)
    for i, parts in enumerate(files):
        fd = os.open(os.path.join(where, f"{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for offset, bufs in _io_calls(parts):
                if os.pwritev(fd, bufs, offset) != sum(
                    len(b) for b in bufs
                ):  # a regular file: all, or an error
                    raise OSError(f"short write to {where}")
            start_writeback(fd)
        finally:
            os.close(fd)
    LocalStorage().flush(where)  # the syncfs a save's flush does
    sync()


def floor_load(path: str, model: Model, opt: Optim) -> None:
    """The floor of a load: the bare write's files read back into this rank's local shards with ``preadv``
    calls of 1 MiB, straight into the tensors; no checksum, metadata, plan or coordination."""
    where, files = _floor_files(path, model, opt)
    for i, parts in enumerate(files):
        fd = os.open(os.path.join(where, f"{i}.bin"), os.O_RDONLY)
        try:
            for offset, bufs in _io_calls(parts):
                if os.preadv(fd, bufs, offset) != sum(len(b) for b in bufs):
                    raise OSError(f"short read from {where}")
        finally:
            os.close(fd)


def acp_load(path: str, model: Model, opt: Optim) -> None:
    import arraycheckpoint as acp

    acp.load(path, {"model": model, "optimizer": opt})


def _dcp_load_with(model: Model, opt: Optim, **where: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, **where)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def dcp_load(path: str, model: Model, opt: Optim) -> None:
    _dcp_load_with(model, opt, checkpoint_id=path)


def dcp_acp_reader_load(path: str, model: Model, opt: Optim) -> None:
    """``dcp.load`` through ``acp.dcp.Reader`` (only checks what ``acp.dcp.Writer`` saved; not timed)."""
    import arraycheckpoint as acp

    _dcp_load_with(model, opt, storage_reader=acp.dcp.Reader(path))


def bcp_load(path: str, model: Model, opt: Optim) -> None:
    import bytecheckpoint as bcp

    bcp.load(path, {"model": model, "optimizer": opt}, framework="fsdp2")


Verb = Callable[[str, Model, Optim], None]
#: every method: (name in the tables, save, load or None where only the save is compared)
METHODS: dict[str, tuple[str, Verb, Verb | None]] = {
    "acp": ("arraycheckpoint", acp_save, acp_load),
    "dcp": ("DCP", dcp_save, dcp_load),
    "bcp": ("ByteCheckpoint", bcp_save, bcp_load),
    "dcp_acpw": ("dcp.save + acp.dcp.Writer", dcp_acp_writer_save, None),
    "floor": ("bare write/read", floor_save, floor_load),
}
#: methods kept after the last round and loaded again at the reshard world size
RESHARDED = ("acp", "dcp", "bcp")


def rotated(names: list[str], rnd: int) -> list[str]:
    """The order of round ``rnd``: row ``rnd`` of a Williams design over ``names``.

    Over ``len(names)`` consecutive rounds every method takes every position once and, for an even count,
    directly follows every other method once (a plain rotation always put the same method after the same
    other one: whatever one save leaves to the next, page cache to reclaim or device write-back in flight,
    landed on one method only). For an odd count, the order is reversed every other ``len(names)`` rounds.
    """
    n = len(names)
    if n < 2:
        return list(names)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        if len(first) % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    order = [names[(j + rnd) % n] for j in first]
    return order[::-1] if n % 2 and (rnd // n) % 2 else order


# ---------------------------------------------------------------------------------------------- ByteCheckpoint probe
def bcp_unavailable() -> str | None:
    """Why ByteCheckpoint cannot be imported with FSDP2 support here (None: it can)."""
    os.environ.setdefault("BYTECHECKPOINT_LOGGING_LEVEL", "ERROR")
    try:
        from bytecheckpoint.api import save as bcp_api_save
    except Exception as e:  # noqa: BLE001 - any import failure is the reason to skip
        return f"`import bytecheckpoint` failed: {type(e).__name__}: {e}"
    if not getattr(bcp_api_save, "FSDP2_ENABLED", True):
        return "bytecheckpoint imported, but its FSDP2Checkpointer did not (bytecheckpoint.api.save.FSDP2_ENABLED)"
    return None


def _bcp_probe(rank: int, world: int, root: str) -> bool:
    """A one-layer FSDP2 save and load through ByteCheckpoint, checked bit-exactly."""
    bcp_localhost()
    model, opt = build(world, 1)
    saved = [t.clone() for t in _local_tensors(model, opt)]
    bcp_save(root, model, opt)
    scramble(model, opt)
    bcp_load(root, model, opt)
    if not all(torch.equal(a, b) for a, b in zip(saved, _local_tensors(model, opt))):
        raise RuntimeError("ByteCheckpoint's load did not restore the saved local shards")
    return True


def bcp_probe(root: Path) -> str | None:
    """Why ByteCheckpoint cannot save and load FSDP2 on 2 CPU gloo ranks here (None: it can)."""
    reason = bcp_unavailable()
    if reason is not None:
        return reason
    try:
        spawn(_bcp_probe, 2, (str(root / "bcp-probe"),), timeout=300)
    except Exception as e:  # noqa: BLE001 - the failure is reported, the benchmark goes on without it
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        what = lines[-1] if lines else f"{type(e).__name__} (no rank answered within 300 s)"
        return f"a 2-rank CPU/gloo FSDP2 save + load failed: {what}"
    finally:
        remove(root / "bcp-probe")
    return None


# ---------------------------------------------------------------------------------------------- rounds
#: ``--fresh-cache``: drop the page cache right before every save (see :func:`fresh_cache`)
FRESH_CACHE = os.environ.get("ACP_BENCH_FRESH_CACHE") == "1"


def fresh_cache(rank: int) -> None:
    """With ``--fresh-cache``, drop the machine's page cache right before a save (rank 0; the timed region's
    barrier follows), so every method writes into memory the kernel has just freed.

    Why (diagnosed on the 2-core Firecracker VM these tables come from): its kernel reports free memory to
    the host after about 3 s (``page_reporting``), and a save that writes into reported pages pays the
    host's page faults in its own system time, 2-3x its wall time, in whichever method follows a save or a
    pause long enough for the reporting. The order of the methods then decides the 2-rank ratios.
    """
    if FRESH_CACHE and rank == 0:
        drop_page_cache()


def warm(path: str) -> None:
    """Read every file under ``path`` once (into the page cache) so a load of it reads warm."""
    for d, _s, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb", buffering=0) as fh:
                while fh.read(16 << 20):
                    pass


def _round(
    rank: int,
    world: int,
    rnd: int,
    paths: dict[str, str],
    model: Any,
    opt: Any,
    group: Any,
    check: list[torch.Tensor] | None,
) -> dict[str, float]:
    """One round of every measurement at the save world size, each method once in an order rotated by
    ``rnd`` (``check``: the saved local tensors, compared after every load of this round)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import arraycheckpoint as acp

    def verify(what: str) -> None:
        if check is not None and not all(
            torch.equal(a, b) for a, b in zip(check, _local_tensors(model, opt))
        ):
            raise RuntimeError(f"rank {rank}: {what} at world {world} did not restore the saved state")

    methods = [m for m in METHODS if m in paths]
    rec: dict[str, float] = {}
    for m in rotated(methods, rnd):
        save = METHODS[m][1]
        rec[f"{m}/save"], cpu = _timed(
            lambda save=save, m=m: _cpu_seconds(lambda: save(paths[m], model, opt)), save=True
        )
        rec[f"{m}/save_cpu"] = _sum_over_ranks(cpu)

    def acp_async() -> Any:
        fut = acp.save_async(paths["acp_async"], {"model": model, "optimizer": opt})
        fut.staged.result()
        return fut

    def dcp_async() -> Any:
        msd, osd = get_state_dict(model, opt)
        return dcp.async_save(
            {"model": msd, "optim": osd}, checkpoint_id=paths["dcp_async"], process_group=group
        )

    for kind in rotated(["acp", "dcp"], rnd):
        start = acp_async if kind == "acp" else dcp_async
        rec[f"{kind}/async_block"], fut = _timed(start, save=True)
        rec[f"{kind}/async_total"], _ = _timed(lambda fut=fut: (fut.result(), sync()), pause=False)
        rec[f"{kind}/async_total"] += rec[f"{kind}/async_block"]

    if FRESH_CACHE and rank == 0:  # the saves' pages were dropped by the next save: every load reads warm
        for m in methods:
            warm(paths[m])
    for m in rotated([m for m in methods if METHODS[m][2] is not None], rnd):
        load = METHODS[m][2]
        scramble(model, opt)
        rec[f"{m}/load"], _ = _timed(lambda load=load, m=m: load(paths[m], model, opt))
        verify(f"{METHODS[m][0]} load")
    if check is not None and "dcp_acpw" in paths:
        scramble(model, opt)
        dcp_acp_reader_load(paths["dcp_acpw"], model, opt)
        verify("dcp.load through acp.dcp.Reader of what acp.dcp.Writer saved")
    return rec


def bench_world(
    rank: int, world: int, root: str, layers: int, repeats: int, methods: list[str]
) -> dict[str, Any]:
    """The measurements at the save world size; rank 0 returns them with the saved state's digests."""
    import torch.distributed as dist

    if "bcp" in methods:
        bcp_localhost()
    model, opt = build(world, layers)
    # DCP's async_save runs collectives in a background thread: give it its own gloo group, as its docs say,
    # so they cannot interleave with this benchmark's barriers on the default group
    group = dist.new_group(backend="gloo")
    reference = digests(model, opt)
    saved = [t.clone() for t in _local_tensors(model, opt)]
    res: dict[str, list[float]] = defaultdict(list)
    sizes: dict[str, tuple[int, int]] = {}
    for rnd in range(repeats + 1):
        paths = {k: f"{root}/{k}-{rnd}" for k in [*methods, "acp_async", "dcp_async"]}
        rec = _round(rank, world, rnd, paths, model, opt, group, saved if rnd == 0 else None)
        dist.barrier()
        if rank == 0:
            for k in methods:
                sizes[k] = (tree_bytes(paths[k]), _files(paths[k]))
            label = "warm-up" if rnd == 0 else f"round {rnd}"
            print(f"world {world} {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in rec.items()), flush=True)
            for k, p in paths.items():
                if not (rnd == repeats and k in RESHARDED):
                    remove(p)
        dist.barrier()
        if rnd > 0:
            for k, v in rec.items():
                res[k].append(v)
    total = int(_sum_over_ranks(sum(t.numel() * t.element_size() for t in saved)))
    kept = {k: f"{root}/{k}-{repeats}" for k in methods if k in RESHARDED}
    return {"results": dict(res), "digests": reference, "bytes": total, "files": sizes, "kept": kept}


def _files(path: str) -> int:
    """Files (not directories) under ``path``."""
    return sum(len(files) for _d, _s, files in os.walk(path))


def _sum_over_ranks(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def bench_reshard(
    rank: int, world: int, kept: dict[str, str], layers: int, repeats: int, reference: dict[str, str]
) -> dict[str, Any]:
    """Load every kept checkpoint at a different world size, methods interleaved and rotated per round;
    the first load of each is checked against the saved state (digests of the reassembled tensors)."""
    if "bcp" in kept:
        bcp_localhost()
    model, opt = build(world, layers)
    res: dict[str, list[float]] = defaultdict(list)
    for rnd in range(repeats + 1):
        for kind in rotated(list(kept), rnd):
            load = METHODS[kind][2]
            assert load is not None
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
def paired(res: dict[str, list[float]], key: str, ours: str, anchor: str) -> float:
    """Median over rounds of ``anchor``'s time / ``ours``'s time in the same round (> 1: ours is faster)."""
    a, b = res.get(f"{ours}/{key}", []), res.get(f"{anchor}/{key}", [])
    return median([ratio(y, x) for x, y in zip(a, b)])


def report(
    res: dict[str, list[float]],
    nbytes: int,
    files: dict[str, tuple[int, int]],
    methods: list[str],
    world: int,
    reshard: int,
    repeats: int,
) -> str:
    """Per method the median seconds; per pair the paired median ratio; one line per target."""
    measures = (
        ("save", "save"),
        ("save: CPU s, all ranks", "save_cpu"),
        ("async save: blocking", "async_block"),
        ("async save: until durable", "async_total"),
        (f"load at {world} ranks", "load"),
        (f"load resharded {world} -> {reshard}", "load_reshard"),
    )
    rows = []
    for what, key in measures:
        cells = [fmt_seconds(median(res.get(f"{m}/{key}", []))) for m in methods]
        rows.append([what, *cells])
    table = markdown_table(["FSDP2, median s", *(METHODS[m][0] for m in methods)], rows)

    pairs: list[tuple[str, str, str, str, float | None]] = [
        ("save", "save", "acp", "dcp", 1.5),
        ("save", "save", "acp", "bcp", 1.5),
        ("save", "save", "dcp_acpw", "dcp", 1.0),
        ("save", "save", "floor", "acp", None),
        ("save", "save", "floor", "bcp", None),
        ("save", "save", "floor", "dcp", None),
        ("save: CPU s, all ranks", "save_cpu", "acp", "dcp", None),
        ("save: CPU s, all ranks", "save_cpu", "acp", "bcp", None),
        ("async save: blocking", "async_block", "acp", "dcp", None),
        ("async save: until durable", "async_total", "acp", "dcp", None),
        (f"load at {world} ranks", "load", "acp", "dcp", 1.5),
        (f"load at {world} ranks", "load", "acp", "bcp", None),
        (f"load at {world} ranks", "load", "floor", "acp", None),
        (f"load at {world} ranks", "load", "floor", "dcp", None),
        (f"load resharded {world} -> {reshard}", "load_reshard", "acp", "dcp", 1.5),
        (f"load resharded {world} -> {reshard}", "load_reshard", "acp", "bcp", None),
    ]
    prow, checks = [], []
    for what, key, ours, anchor, goal in pairs:
        if ours not in methods or anchor not in methods:
            if goal is not None:
                missing = METHODS[anchor if anchor not in methods else ours][0]
                checks.append(
                    f"- {what}: {METHODS[anchor][0]} / {METHODS[ours][0]}: not measured ({missing} skipped)"
                )
            continue
        sp = paired(res, key, ours, anchor)
        name = f"{METHODS[anchor][0]} / {METHODS[ours][0]}"
        prow.append([what, name, fmt_ratio(sp), "-" if goal is None else f">= {goal:g}x"])
        if goal is not None:
            checks.append(f"- {what}: {name} = {fmt_ratio(sp)}, target >= {goal:g}x ({verdict(sp >= goal)})")
    ptable = markdown_table(["measurement", "paired ratio", "median", "target"], prow)
    disk = ", ".join(f"{METHODS[m][0]} {b / MiB:.0f} MiB in {n} files" for m, (b, n) in files.items())
    return (
        f"FSDP2 model + Adam state: {nbytes / MiB:.0f} MiB over {world} ranks; {repeats} interleaved rounds "
        f"(every method once per round, orders from a Williams design) after a warm-up round; slowest rank; saves timed until "
        f"os.sync() returns. On disk: {disk}.\n\n{table}\n\n"
        f"Paired medians (median over rounds of anchor time / our time in the same round; > 1: faster):\n\n"
        f"{ptable}\n\nTargets:\n" + "\n".join(checks)
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-m", type=float, default=50, help="model parameters, millions (default 50)")
    p.add_argument("--world", type=int, default=4, help="ranks that save (default 4)")
    p.add_argument("--reshard-world", type=int, default=3, help="ranks that load resharded (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported (default 3)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir under /tmp)")
    p.add_argument("--no-bcp", action="store_true", help="leave ByteCheckpoint out")
    p.add_argument(
        "--fresh-cache",
        action="store_true",
        help="drop the page cache before every save, read every checkpoint back before the loads (root only)",
    )
    p.add_argument(
        "--settle", type=float, default=None, help="seconds of pause before each timed region (default 0.5)"
    )
    args = p.parse_args(argv)
    if args.settle is not None:  # before the ranks are spawned: they read it at import
        os.environ["ACP_BENCH_SETTLE"] = str(args.settle)
    if args.fresh_cache:
        if not can_drop_page_cache():
            p.error(
                "--fresh-cache drops the page cache: it needs root and a writable /proc/sys/vm/drop_caches"
            )
        os.environ["ACP_BENCH_FRESH_CACHE"] = "1"
    warnings.filterwarnings("ignore")

    layers = max(1, round(args.params_m * 1e6 / (HIDDEN * HIDDEN + HIDDEN)))
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="acp-bench-fsdp-", dir=base))
    print(machine_description(root), flush=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    print(f"date {stamp}, revision {git_revision()}", flush=True)
    print(f"model: {layers} x Linear({HIDDEN}, {HIDDEN}), Adam; checkpoints under {root}", flush=True)
    if args.fresh_cache:
        print("page cache dropped before every save; every checkpoint read back before the loads", flush=True)
    methods = ["acp", "dcp", "bcp", "dcp_acpw", "floor"]
    try:
        why = "--no-bcp" if args.no_bcp else bcp_probe(root)
        if why is not None:
            methods.remove("bcp")
            print(f"ByteCheckpoint skipped: {why}", flush=True)
        else:
            print(
                "ByteCheckpoint: a 2-rank CPU/gloo probe saved and loaded bit-exactly; coordinator on 127.0.0.1",
                flush=True,
            )
        first = spawn(bench_world, args.world, (str(root), layers, args.repeats, methods))[0]
        second = spawn(
            bench_reshard, args.reshard_world, (first["kept"], layers, args.repeats, first["digests"])
        )[0]
    finally:
        remove(root)
    res = {**first["results"], **second["results"]}
    print()
    print(report(res, first["bytes"], first["files"], methods, args.world, args.reshard_world, args.repeats))


if __name__ == "__main__":
    main()
