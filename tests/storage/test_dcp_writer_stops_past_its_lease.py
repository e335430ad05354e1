"""``acp.dcp.Writer`` writes in place only under its coordinator's live lease, as ``acp.save`` does.

Before (review23c D3): the Writer's ranks wrote through a storage of their own that never looked at the lease,
and the coordinator wrote its documents without checking it: a coordinator frozen past its lease between its
plan and its writes (here: the store takes none of its refreshes), whose target another job took over, cleared
and committed meanwhile, still wrote its chunks and ``.metadata`` into that job's committed checkpoint (it then
loaded the frozen save's weights). Now the coordinator's grant travels in the plan, every rank follows the lease
(the coordinator by its own expiry) and checks it before each write, and the coordinator checks it before its
documents: the frozen save writes nothing, and the other job's checkpoint is left as it committed it.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from dist import run_distributed
from lease_helpers import short_leases, take_over_and_commit  # noqa: F401 - a fixture

import arraycheckpoint as acp
from arraycheckpoint.storage import register_scheme, storage_for
from arraycheckpoint.storage.memory import MemoryStorage

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

FROZEN = threading.Event()


class FreezableMemory(MemoryStorage):
    """``memory://`` whose lock refreshes stop reaching the store while :data:`FROZEN` is set."""

    def normalize(self, url: str) -> str:
        return super().normalize(url.replace("freezable://", "memory://", 1))

    def _refresh_lock(self, final: str, body: bytes, generation: bytes) -> bytes:
        if FROZEN.is_set():
            raise OSError("the store is unreachable")
        return super()._refresh_lock(final, body, generation)


class OvertakenAfterPlan(DefaultSavePlanner):
    """Between the coordinator's plan and its writes its host freezes; another job takes the target over and
    commits there (``url``: the same target by its plain name)."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    def finish_plan(self, new_plan):  # type: ignore[no-untyped-def]
        FROZEN.set()
        try:
            take_over_and_commit(self.url, 2)
        finally:
            FROZEN.clear()  # the host runs again
        return super().finish_plan(new_plan)


def test_a_coordinator_frozen_past_its_lease_writes_nothing(short_leases: None) -> None:  # noqa: F811
    register_scheme("freezable", FreezableMemory)
    name = f"dcplease-{uuid.uuid4().hex[:8]}/ckpt"
    storage, final = storage_for(f"memory://{name}")
    with pytest.raises(BaseException, match="stopped"):
        dcp.save(
            {"w": torch.full((8,), 1.0)},
            storage_writer=acp.dcp.Writer(f"freezable://{name}"),
            planner=OvertakenAfterPlan(f"memory://{name}"),
        )
    keys = sorted(storage.list(final))
    assert keys == [".acp/committed", "a/c.0", "a/c.1"], keys  # before: w/c.0, w/zarr.json, .metadata...
    assert storage.read(final, "a/c.0") == b"taker"


def _two_ranks_one_overtaken(rank: int, world: int, endpoint: str, url: str, flag: str) -> None:
    import os
    import time

    os.environ["AWS_ENDPOINT_URL"] = endpoint

    class Planner(DefaultSavePlanner):
        def finish_plan(self, new_plan):  # type: ignore[no-untyped-def]
            if rank == 0:  # the coordinator freezes; the target is taken over and committed meanwhile
                from arraycheckpoint.storage import lease

                real = lease._refresh
                lease._refresh = lambda key, entry: None
                try:
                    take_over_and_commit(url, 2)
                finally:
                    lease._refresh = real
                open(flag, "w").close()
            else:  # rank 1 writes once the other job committed
                while not os.path.exists(flag):
                    time.sleep(0.02)
            return super().finish_plan(new_plan)

    import torch.distributed as dist

    state = {"w": torch.full((4,), float(rank + 1))}
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = DTensor.from_local(state["w"], mesh, [Shard(0)])
    try:
        dcp.save({"w": full}, storage_writer=acp.dcp.Writer(url), planner=Planner())
    except BaseException as e:  # noqa: BLE001 - every rank hears the failure
        assert "stopped" in str(e), str(e)[-2000:]
    else:
        raise AssertionError("the overtaken DCP save returned")
    dist.barrier()


def test_a_rank_writing_under_an_overtaken_lease_writes_nothing(
    s3_server,
    s3_prefix: str,
    tmp_path,
    short_leases: None,  # noqa: F811
) -> None:
    url = f"{s3_prefix}/ckpt"
    run_distributed(
        _two_ranks_one_overtaken, world=2, args=(s3_server.endpoint, url, str(tmp_path / "taken"))
    )
    storage, final = storage_for(url)
    keys = sorted(storage.list(final))
    assert keys == [".acp/committed", "a/c.0", "a/c.1"], keys  # before: rank 1's w/c.1 too
