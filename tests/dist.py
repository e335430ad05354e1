"""Run a test body on N real processes with torch.distributed (gloo, CPU).

Usage in a test::

    def body(rank, world, tmp):       # module-level function (spawn pickles it by reference)
        ...
    run_distributed(body, world=4, args=(str(tmp_path),))

Every rank's exception is re-raised in the test process with the rank named; return values come back as a
list in rank order. Workers are spawned fresh (no fork), so each has its own torch state.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
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
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - ship every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world: int, args: tuple = (), timeout: float = 300) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; return results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
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
