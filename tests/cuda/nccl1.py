"""Run a body in a fresh process that holds a world-size-1 ``cpu:gloo,cuda:nccl`` group on GPU 0.

One GPU allows one NCCL rank; the body runs beside an NCCL default group as a real job's would.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

from dist import free_port


def _worker(port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
        queue.put(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - shipped to the test process
        queue.put(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_nccl_world1(fn: Callable[..., Any], *args: Any, timeout: float = 300) -> Any:
    """``fn(*args)`` in a spawned process with the NCCL group initialised; its return value, or raise."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(free_port(), fn, args, queue))
    proc.start()
    try:
        status, value = queue.get(timeout=timeout)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", value
    return value
