"""kill -9 of a rank in the middle of a save on the object-store backends (issue 12): S3 (a moto server on
loopback) and fsspec (``local://``). As on local storage (tests/test_failures.py): the previous committed
checkpoint stays loadable bit-exactly, nothing is committed for the killed save, and after the manager's
cleanup the same step saves and restores. Real gloo processes, a real SIGKILL while rank 1 is inside its
save (after its snapshot, before its writes are flushed)."""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import free_port
from flaky import S3Process
from killing import kill_rank_at, report_outcome
from test_failures import assert_equal_state, state_for, zeros_like_state

import arraycheckpoint as acp
from arraycheckpoint import CheckpointManager, storage
from arraycheckpoint.errors import CheckpointNotFoundError
from arraycheckpoint.storage import leftovers, locks
from arraycheckpoint.storage.base import LOCK_KEY

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "acp-test",
    "AWS_SECRET_ACCESS_KEY": "acp-test-secret",
    "AWS_REGION": "us-east-1",
}


def _hanging(backend: str) -> Any:
    """A factory of ``backend``'s storage (``s3`` or fsspec ``local``) under ``hang<backend>://``; on rank 1,
    flushing a step-2 save announces itself in a file and then blocks until the process is killed."""
    if backend == "s3":
        from arraycheckpoint.storage.s3 import S3Storage as base

        args: tuple = ()
    else:
        from arraycheckpoint.storage.fsspec_store import FsspecStorage as base

        args = ("local",)
    real = "s3://" if backend == "s3" else "local://"

    class Hanging(base):  # type: ignore[valid-type,misc]
        def normalize(self, url: str) -> str:
            return super().normalize(real + url.removeprefix(f"hang{backend}://"))

        def flush(self, root: str) -> None:
            if "step_00000002" in root and os.environ.get("RANK") == "1":
                Path(os.environ["ACP_SIGNAL_DIR"], "rank1-in-flush").touch()
                while True:
                    time.sleep(1)
            super().flush(root)

    return lambda: Hanging(*args)


def _main(rank: int, world: int, port: int, backend: str, where: str, env: dict, signal_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        ACP_SIGNAL_DIR=signal_dir,
        ACP_LIVENESS_TIMEOUT="10",  # the survivor need not wait the default bound for its dead peer
        **env,
    )
    torch.set_num_threads(1)
    storage.register_scheme(f"hang{backend}", _hanging(backend))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    mgr = CheckpointManager(f"hang{backend}://{where}")
    mgr.save(1, state_for(1)).result()
    handle = mgr.save(2, state_for(2))
    handle.staged.result()
    report_outcome(handle, signal_dir, rank)


@pytest.mark.parametrize("backend", ["s3", "fsspec"])
def test_kill_one_rank_mid_save_on_object_stores(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = S3Process() if backend == "s3" else None
    try:
        # a lease of 6 s: the killed save's lock (of two ranks) is a crashed save's once it ran out
        leases = {locks.HEARTBEAT_ENV: "2", locks.LEASE_ENV: "3"}
        env = {**S3_ENV, **leases, "AWS_ENDPOINT_URL": server.endpoint} if server else {}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        where = f"{server.bucket}/{uuid.uuid4().hex[:8]}/run" if server else str(tmp_path / "run")
        url = ("s3://" if server else "local://") + where
        signals = tmp_path / "signals"
        signals.mkdir()
        port = free_port()
        kill_rank_at(
            _main, 2, lambda r: (r, 2, port, backend, where, env, str(signals)), signals / "rank1-in-flush"
        )
        survivor = signals / "rank0-result"  # the survivor fails (its peer is gone) and says so: no hang
        assert survivor.exists(), "rank 0 did not finish within 90 s of its peer's death"
        assert survivor.read_text() != "committed", survivor.read_text()
        # the previous checkpoint loads bit-exactly; nothing was committed for the killed save
        assert_equal_state(acp.load(f"{url}/step_00000001", zeros_like_state()), state_for(1))
        with pytest.raises(CheckpointNotFoundError):
            acp.load(f"{url}/step_00000002", zeros_like_state())
        if server is not None:  # rank 0 exited holding its lock: a two-rank save's waits out its lease
            (store, step), deadline = storage.storage_for(f"{url}/step_00000002"), time.monotonic() + 60
            while leftovers.crashed(store.read(step, LOCK_KEY)) is None:
                assert time.monotonic() < deadline, "the killed save's lock never ran out"
                time.sleep(0.2)
        mgr = CheckpointManager(url)  # its start removes the killed save's leftovers
        assert mgr.all_steps() == [1]
        mgr.save(2, state_for(2)).result()
        assert mgr.all_steps() == [1, 2]
        assert_equal_state(mgr.restore(state=zeros_like_state()), state_for(2))
        assert_equal_state(mgr.restore(1, state=zeros_like_state()), state_for(1))
        mgr.close()
    finally:
        if server is not None:
            server.stop()


def _fast_writer_body(rank: int, world: int, endpoint: str, bucket: str) -> dict[str, Any]:
    """Rank 1 writes and flushes as early as it can; rank 0 holds its claim of the target (``acquire``) until
    rank 1 has flushed, or 3 s have passed. Before the fix rank 1 wrote first in every save without a plan
    collective, and rank 0's claim emptied the prefix: the committed checkpoint lacked rank 1's chunks."""
    from datetime import timedelta

    import torch.distributed as dist

    from arraycheckpoint.storage.s3 import S3Storage

    os.environ.update(S3_ENV)
    store = dist.distributed_c10d._get_default_store()

    class Ordered(S3Storage):
        def normalize(self, url: str) -> str:
            return super().normalize(url.replace("orderedfast://", "s3://", 1))

        def acquire(self, final: str, token: str) -> None:
            try:
                store.wait([f"flushed{final}"], timedelta(seconds=3))
            except Exception:  # noqa: BLE001, S110 - rank 1 cannot flush before the claim (the fix)
                pass
            super().acquire(final, token)

        def flush(self, root: str) -> None:
            super().flush(root)
            if rank == 1:
                store.set(f"flushed{root}", "1")

    storage.register_scheme("orderedfast", lambda: Ordered(endpoint=endpoint))
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 64)  # replicated: the plan spreads its chunks over both ranks
    same = []
    for name in ("first", "second"):  # the first plans locally, the second reuses the cached plan
        meta = acp.save(f"orderedfast://{bucket}/fast/{name}", {"model": model})
        if rank == 0:
            assert {w for t in meta.tensors.values() for w in t.writers} == {0, 1}
        back = torch.nn.Linear(256, 64)
        acp.load(f"orderedfast://{bucket}/fast/{name}", {"model": back})
        same.append(torch.equal(back.weight, model.weight) and torch.equal(back.bias, model.bias))
        with torch.no_grad():
            model.weight.add_(1.0)
    return {"same": same}


def test_no_rank_writes_in_place_before_rank_0_claims_the_target() -> None:
    from dist import run_distributed

    server = S3Process()
    try:
        results = run_distributed(
            _fast_writer_body, world=2, args=(server.endpoint, server.bucket), timeout=200
        )
    finally:
        server.stop()
    assert all(r["same"] == [True, True] for r in results), results
