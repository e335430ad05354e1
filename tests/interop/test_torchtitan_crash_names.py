"""torchtitan's step scan over a folder our saves write into (session 23 review, p6).

torchtitan finds steps by ``re.search(r"step-(\\d+)")`` over every entry of its checkpoint folder, in
``_find_load_step`` (a step counts when ``<entry>/.metadata`` exists) and in ``_purge_stale_checkpoints``
(keep_latest_k: every match counts). Our staging directory was named after the target
(``.step-3.acp-staging-<token>``) and holds DCP's ``.metadata`` before the commit: a job killed inside the
step-3 commit made every restart fail ("load_step=3 not found at .../step-3"), and a save in flight (its lock
and staging) counted as step 3 in a purge, which deleted older, complete steps early. Both run torchtitan's real
``CheckpointManager`` here: after a real SIGKILL inside the commit it resumes from step 2, and its purge keeps
both complete steps while another process's save of step 3 is in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.storage.local import LocalStorage

pytest.importorskip("torchtitan")

HERE = os.path.dirname(os.path.abspath(__file__))

#: steps 1 and 2 committed through acp.dcp.Writer by torchtitan's manager, then stopped inside step 3's
#: storage commit (DCP's ``.metadata`` already in the staging directory) until the test kills it
SAVE_THEN_HANG = """
import os, sys, time, torch, torch.distributed as dist
folder, flag = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{folder}/pg", rank=0, world_size=1)
import test_torchtitan as tt
from torchtitan.components.checkpoint import AsyncMode
from arraycheckpoint.storage.fsspec_store import FsspecStorage
from arraycheckpoint.storage.local import LocalStorage

def hang(self, staging, final, overwrite):
    open(flag, "w").close()
    time.sleep(600)

remote = sys.argv[3] == "1"  # torchtitan's fsspec path (local://): our fsspec backend, written in place
model, opts, lrs, mgr = tt._build(0, "local://" + folder if remote else folder, 1)
for step in (1, 2, 3):
    model(torch.ones(2, 4)).sum().backward(); opts.step(); lrs.step(); opts.zero_grad()
    if step == 3:
        setattr(FsspecStorage if remote else LocalStorage, "commit", hang)
    mgr.dcp_save(mgr._flattened_model_states_sd(), mgr._create_checkpoint_id(step), AsyncMode.DISABLED)
"""

#: a save of step-3 in flight in another process: its lock held, its staging written
HOLD = """
import sys, time
from arraycheckpoint.storage import storage_for
backend, final = storage_for(sys.argv[1])
backend.acquire(final, "inflight-1")
backend.write(backend.staging_root(final, "inflight-1"), ".metadata", b"x")
print("held", flush=True)
time.sleep(300)
"""


def _env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(HERE))
    path = [root, os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def resume_body(rank: int, world: int, folder: str) -> tuple[int, bool]:
    import test_torchtitan as tt

    _model, _opts, _lrs, mgr = tt._build(7, folder, world)
    try:
        return mgr._find_load_step(), mgr.load()
    finally:
        mgr.close()


def purge_body(rank: int, world: int, folder: str) -> list[str]:
    import test_torchtitan as tt
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=2)
    model = tt._model(0)
    mgr = tt.AcpCheckpointManager(
        config, dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
        sd_adapter=None, base_folder=folder,
    )  # fmt: skip
    mgr._purge_stale_checkpoints()
    mgr.close()  # waits for the purge thread
    return sorted(os.listdir(os.path.join(folder, "ckpt")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("remote", [False, True], ids=["local", "fsspec"])
def test_a_job_killed_inside_the_commit_resumes_from_the_last_committed_step(
    tmp_path: Path, remote: bool
) -> None:
    """Local: the staging directory holds ``.metadata`` but is named after no step. fsspec (written in place,
    ``local://``: torchtitan's remote path): ``step-3/`` is there, uncommitted, without ``.metadata`` (the
    Writer adds it after the commit marker; before, step 3 was found and failed to load on every restart)."""
    flag = tmp_path / "in-commit"
    argv = [sys.executable, "-c", SAVE_THEN_HANG, str(tmp_path), str(flag), str(int(remote))]
    proc = subprocess.Popen(argv, env=_env())
    try:
        deadline = time.monotonic() + 240
        while not flag.exists():
            assert proc.poll() is None, f"the saving job exited early ({proc.returncode})"
            assert time.monotonic() < deadline, "the saving job never reached step 3's commit"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    ckpt = tmp_path / "ckpt"
    left = sorted(os.listdir(ckpt))
    if remote:
        assert left == ["step-1", "step-2", "step-3"] and (ckpt / "step-3" / "0.weight").is_dir(), left
        resumed = run_distributed(resume_body, 1, ("local://" + str(tmp_path),))
        assert resumed == [(2, True)]  # was: step 3, whose .metadata the load refused
        assert not (ckpt / "step-3" / ".metadata").exists()
        return
    staged = [n for n in left if ".acp-staging-" in n]
    # the crashed save's staging is there, DCP's discovery file in it: the scan skips it by its name
    assert len(staged) == 1 and (ckpt / staged[0] / ".metadata").is_file(), left
    assert run_distributed(resume_body, 1, (str(tmp_path),)) == [(2, True)]  # was: step 3, not found
    assert [n for n in left if "step-" in n] == ["step-1", "step-2"], left
    removed = LocalStorage().cleanup_leftovers(str(ckpt))  # the crashed save's lock and staging
    assert sorted(os.path.basename(p) for p in removed) == sorted(set(left) - {"step-1", "step-2"})
    assert sorted(os.listdir(ckpt)) == ["step-1", "step-2"]


@pytest.mark.multiprocess
def test_the_purge_never_counts_a_save_in_flight(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    for step in (1, 2):
        acp.save(str(ckpt / f"step-{step}"), {"w": np.arange(3) + step})
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(ckpt / "step-3")], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        in_flight = sorted(set(os.listdir(ckpt)) - {"step-1", "step-2"})
        assert len(in_flight) == 2, in_flight  # its lock and its staging
        left = run_distributed(purge_body, 1, (str(tmp_path),))[0]
    finally:
        holder.kill()
        holder.wait()
    assert left == sorted(["step-1", "step-2", *in_flight]), left  # keep_latest_k=2: both complete steps
    w = {"w": np.zeros(3, dtype=np.int64)}
    acp.load(str(ckpt / "step-1"), w)
    assert np.array_equal(w["w"], np.arange(3) + 1)
