"""CheckpointManager: step directories, latest/all steps, restore, retention, the save queue, cleanup."""

from __future__ import annotations

import errno
import os
import threading
import uuid
from pathlib import Path

import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.errors import CheckpointNotFoundError, SaveFailedError
from arraycheckpoint.format.metadata import CONTROL_DIR, METADATA_FILE
from arraycheckpoint.manager import CheckpointManager
from arraycheckpoint.storage import LocalStorage, register_scheme


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)},
        "extra_state": {"step": step},
    }


def empty_state() -> dict:
    return {"model": {"w": torch.zeros(16, 8), "b": torch.zeros(8)}, "extra_state": {}}


def assert_state(loaded: dict, step: int) -> None:
    want = state_for(step)
    for k, v in want["model"].items():
        assert torch.equal(loaded["model"][k], v), (step, k)
    assert loaded["extra_state"] == {"step": step}


class GatedLocal(LocalStorage):
    """Local storage whose flush waits for a gate (makes "a save is still running" deterministic)."""

    gate = threading.Event()
    fail = False

    def normalize(self, url: str) -> str:
        return super().normalize(url.removeprefix("gated://"))

    def flush(self, root: str) -> None:
        assert GatedLocal.gate.wait(120), "gate never opened"
        if GatedLocal.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        super().flush(root)


@pytest.fixture
def gated():
    register_scheme("gated", GatedLocal)
    GatedLocal.gate.set()
    GatedLocal.fail = False
    yield GatedLocal
    GatedLocal.gate.set()
    GatedLocal.fail = False
    register_scheme("gated", None)


def test_steps_latest_and_restore(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "run")
    assert mgr.all_steps() == [] and mgr.latest_step() is None
    with pytest.raises(CheckpointNotFoundError, match="nothing to restore"):
        mgr.restore(state=empty_state())
    for step in (20, 5, 10):
        handle = mgr.save(step, state_for(step))
        handle.staged.result()
        handle.result()
    mgr.close()
    assert sorted(os.listdir(tmp_path / "run")) == ["step_00000005", "step_00000010", "step_00000020"]
    mgr = CheckpointManager(f"file://{tmp_path}/run")
    assert mgr.all_steps() == [5, 10, 20] and mgr.latest_step() == 20
    assert_state(mgr.restore(state=empty_state()), 20)
    assert_state(mgr.restore(10, state=empty_state()), 10)
    assert acp.read_metadata(mgr.step_path(5)).step == 5
    mgr.close()


def test_retention_keep_last_and_keep_every(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2, keep_every=30) as mgr:
        for step in range(10, 70, 10):
            mgr.save(step, state_for(step))
        mgr.wait()
        assert mgr.all_steps() == [30, 50, 60]
    assert sorted(os.listdir(tmp_path)) == ["step_00000030", "step_00000050", "step_00000060"]
    assert_state(acp.load(tmp_path / "step_00000030", empty_state()), 30)


def test_retention_policy_is_pure_and_keeps_newest() -> None:
    mgr = CheckpointManager(f"memory://policy-{uuid.uuid4().hex[:6]}", keep_last=1, keep_every=4)
    assert mgr.steps_to_delete([1, 2, 3, 4, 5, 6]) == [1, 2, 3, 5]
    assert mgr.steps_to_delete([7]) == []
    assert mgr.steps_to_delete([]) == []
    keep_all = CheckpointManager(f"memory://policy-{uuid.uuid4().hex[:6]}")
    assert keep_all.steps_to_delete([1, 2, 3]) == []
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager("memory://x", keep_last=0)


def test_failed_save_keeps_newest_committed(tmp_path: Path, gated) -> None:
    mgr = CheckpointManager(f"gated://{tmp_path}", keep_last=1)
    mgr.save(1, state_for(1)).result()
    mgr.save(2, state_for(2)).result()
    assert mgr.all_steps() == [2]
    gated.fail = True
    with pytest.raises(SaveFailedError, match="No space left"):
        mgr.save(3, state_for(3)).result()
    gated.fail = False
    assert mgr.all_steps() == [2]
    assert sorted(os.listdir(tmp_path)) == ["step_00000002"]  # the failed save's staging was removed
    assert_state(mgr.restore(state=empty_state()), 2)
    mgr.close()


def test_skip_policy_while_a_save_runs(tmp_path: Path, gated) -> None:
    mgr = CheckpointManager(f"gated://{tmp_path}", if_busy="skip")
    gated.gate.clear()
    first = mgr.save(1, state_for(1))
    first.staged.result()
    assert mgr.save(2, state_for(2)) is None  # skipped: step 1 is still being written
    gated.gate.set()
    first.result()
    mgr.save(3, state_for(3)).result()
    assert mgr.all_steps() == [1, 3]
    mgr.close()


def test_wait_policy_queues_saves(tmp_path: Path, gated) -> None:
    mgr = CheckpointManager(f"gated://{tmp_path}")
    gated.gate.clear()
    first = mgr.save(1, state_for(1))
    first.staged.result()
    second: list = []
    t = threading.Thread(target=lambda: second.append(mgr.save(2, state_for(2))))
    t.start()
    t.join(timeout=1.0)
    assert t.is_alive() and not second, "the second save did not wait for the first commit"
    assert not first.done()
    gated.gate.set()
    t.join(timeout=120)
    assert first.done() and second
    second[0].result()
    assert mgr.all_steps() == [1, 2]
    assert_state(mgr.restore(1, state=empty_state()), 1)
    mgr.close()


def test_cleanup_on_start(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state_for(1)).result()
    (tmp_path / ".step_00000002.acp-staging-dead").mkdir()
    (tmp_path / ".step_00000002.acp-staging-dead" / "junk").write_bytes(b"x" * 100)
    (tmp_path / ".step_00000002.acp-lock").write_text("dead")
    (tmp_path / "step_00000003" / "model").mkdir(parents=True)  # marker-less step directory
    (tmp_path / "step_00000003" / CONTROL_DIR).mkdir()
    (tmp_path / "step_00000003" / METADATA_FILE).write_text("{}")
    (tmp_path / ".step_00000000.acp-trash-1").mkdir()
    (tmp_path / "README.txt").write_text("not ours")
    mgr = CheckpointManager(tmp_path)
    assert len(mgr.removed) == 4
    assert sorted(os.listdir(tmp_path)) == ["README.txt", "step_00000001"]
    assert mgr.all_steps() == [1]
    mgr.save(2, state_for(2)).result()  # the stale lock no longer blocks step 2
    assert mgr.all_steps() == [1, 2]
    mgr.close()


def test_manager_on_memory_marker_backend() -> None:
    root = f"memory://mgr-{uuid.uuid4().hex[:8]}"
    with CheckpointManager(root, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_for(step)).result()
        assert mgr.all_steps() == [2, 3]
        assert_state(mgr.restore(state=empty_state()), 3)
        # a marker-less step (a crashed in-place save) is absent and removed on the next start
        mgr.storage.write(mgr.step_path(4), "model/w/c/0/0", b"partial")
    mgr = CheckpointManager(root, keep_last=2)
    assert mgr.removed == [mgr.step_path(4)] and mgr.all_steps() == [2, 3]
    assert mgr.storage.list(mgr.step_path(4)) == []


def _two_rank_manager(rank: int, world: int, root: str) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    mgr = CheckpointManager(root, keep_last=2)
    for step in (1, 2, 3):
        full = state_for(step)
        sharded = {
            "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full["model"].items()},
            "extra_state": full["extra_state"],
        }
        mgr.save(step, sharded)
    mgr.wait()
    target = {
        "model": {
            k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
            for k, v in state_for(0)["model"].items()
        },
        "extra_state": {},
    }
    mgr.restore(state=target)
    for k, v in state_for(3)["model"].items():
        assert torch.equal(target["model"][k].full_tensor(), v), k
    steps = mgr.all_steps()
    mgr.close()
    return steps


def test_two_rank_manager(tmp_path: Path) -> None:
    steps = run_distributed(_two_rank_manager, world=2, args=(str(tmp_path / "run"),))
    assert steps == [[2, 3], [2, 3]]
    assert sorted(os.listdir(tmp_path / "run")) == ["step_00000002", "step_00000003"]


def _in_thread(fn, bound: float = 60.0):
    """Run ``fn`` in a daemon thread; its result, or a failure when it is still blocked after ``bound`` s."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(result=fn()), daemon=True)
    t.start()
    t.join(bound)
    assert not t.is_alive(), "blocked (a FIFO opened?)"
    return box["result"]


def test_non_directories_and_foreign_digits_are_no_steps(tmp_path: Path) -> None:
    """A FIFO named like a step used to hang the manager's start-up cleanup (shutil.rmtree opened it); a
    directory named step_٩٩ (Arabic-Indic digits, which int() accepts) was listed as step 99 and chosen as
    the latest. Only directories named exactly as the manager names steps (ASCII, 8 digits) are steps."""
    acp.save(tmp_path / "step_00000002", state_for(2))
    os.mkfifo(tmp_path / "step_00000004")
    (tmp_path / "step_٩٩").mkdir()
    acp.save(tmp_path / "elsewhere", state_for(7))
    os.symlink(tmp_path / "elsewhere", tmp_path / "step_00000007")  # a link is no step either
    (tmp_path / "step_5").mkdir()  # not the manager's own naming (step_00000005)
    mgr = _in_thread(lambda: CheckpointManager(tmp_path))
    assert mgr.removed == [] and mgr.all_steps() == [2] and mgr.latest_step() == 2
    assert_state(_in_thread(lambda: mgr.restore(state=empty_state())), 2)
    assert sorted(os.listdir(tmp_path)) == [
        "elsewhere", "step_00000002", "step_00000004", "step_00000007", "step_5", "step_٩٩"
    ]  # fmt: skip
    mgr.close()


def test_a_step_saved_below_the_kept_ones_survives_its_own_retention(tmp_path: Path) -> None:
    """Saving step 0 after steps 2 and 3 with keep_last=2 committed step 0 and the retention pass right
    after deleted it: ``result()`` returned and the checkpoint was gone. The step just committed is kept."""
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        for step in (2, 3):
            mgr.save(step, state_for(step)).result()
        mgr.save(0, state_for(0)).result()
        assert mgr.all_steps() == [0, 2, 3]
        assert_state(mgr.restore(0, state=empty_state()), 0)
        mgr.save(4, state_for(4)).result()  # a later save applies the policy as usual
        assert mgr.all_steps() == [3, 4]


def test_a_step_with_a_damaged_marker_neither_stops_the_manager_nor_is_deleted(
    tmp_path: Path, caplog
) -> None:
    """A step directory whose ``.acp/committed`` is a FIFO, or whose ``.acp`` is a link, made the manager's
    start-up (and every ``all_steps``, hence retention) raise: one damaged step stopped a job from resuming
    or saving. It is no committed step (a warning names it) and it is kept: nothing is read through it."""
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_for(step)).result()
    fifo_step = tmp_path / "step_00000007"
    (fifo_step / CONTROL_DIR).mkdir(parents=True)
    os.mkfifo(fifo_step / CONTROL_DIR / "committed")
    link_step = tmp_path / "step_00000008"
    link_step.mkdir()
    os.symlink(tmp_path / "step_00000003" / CONTROL_DIR, link_step / CONTROL_DIR)
    with caplog.at_level("WARNING", logger="arraycheckpoint"):
        mgr = _in_thread(lambda: CheckpointManager(tmp_path, keep_last=2))
    assert mgr.removed == [] and mgr.all_steps() == [2, 3] and mgr.latest_step() == 3
    assert str(fifo_step) in caplog.text and str(link_step) in caplog.text
    assert_state(mgr.restore(state=empty_state()), 3)
    mgr.save(4, state_for(4)).result()  # retention still runs
    assert mgr.all_steps() == [3, 4]
    mgr.close()
    assert (fifo_step / CONTROL_DIR / "committed").exists() and os.path.islink(link_step / CONTROL_DIR)
    assert (tmp_path / "step_00000003" / CONTROL_DIR / "committed").is_file()


def test_cleanup_keeps_an_uncommitted_step_holding_what_no_save_writes(tmp_path: Path, caplog) -> None:
    """Start-up cleanup removed every step directory without a commit marker whatever it held: a user's
    ``step_00000007/notes.txt`` (or a copy of a checkpoint still being synced in) was deleted. It removes one
    only when everything in it is what a save writes (the rule a save applies to its target)."""
    ours = tmp_path / "step_00000003"  # a crashed save's own files only: removed
    (ours / "model" / "w").mkdir(parents=True)
    (ours / "model" / "w" / "c.0").write_bytes(b"x")
    (ours / "model" / "w" / "zarr.json").write_text("{}")
    (ours / CONTROL_DIR).mkdir()
    (ours / METADATA_FILE).write_text("{}")
    users = tmp_path / "step_00000007"
    (users / "data").mkdir(parents=True)
    (users / "notes.txt").write_text("keep me")
    (users / "data" / "train.csv").write_text("1,2")
    linked = tmp_path / "step_00000008"
    linked.mkdir()
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "precious").write_text("keep me")
    os.symlink(tmp_path / "victim", linked / "model")
    with caplog.at_level("WARNING", logger="arraycheckpoint"):
        mgr = CheckpointManager(tmp_path)
    assert mgr.removed == [str(ours)]
    assert (users / "notes.txt").read_text() == "keep me" and (users / "data" / "train.csv").exists()
    assert os.path.islink(linked / "model") and (tmp_path / "victim" / "precious").exists()
    assert str(users) in caplog.text and "notes.txt" in caplog.text and str(linked) in caplog.text
    mgr.save(9, state_for(9)).result()  # the manager works beside them
    assert mgr.all_steps() == [9]
    mgr.close()


def test_cleanup_keeps_foreign_objects_under_an_uncommitted_step_on_object_stores() -> None:
    root = f"memory://mgr-{uuid.uuid4().hex[:8]}"
    mgr = CheckpointManager(root)
    mgr.storage.write(mgr.step_path(4), "model/w/c.0", b"partial")  # a crashed in-place save: removed
    mgr.storage.write(mgr.step_path(5), "model/w/c.0", b"partial")
    mgr.storage.write(mgr.step_path(5), "README.md", b"not ours")  # kept, with the chunk beside it
    mgr.close()
    mgr = CheckpointManager(root)
    assert mgr.removed == [mgr.step_path(4)]
    assert mgr.storage.list(mgr.step_path(5)) == ["README.md", "model/w/c.0"]
    mgr.close()


def test_steps_given_as_numpy_or_tensor_integers(tmp_path: Path) -> None:
    """``acp.save(step=np.int64(5))`` worked and ``mgr.save(np.int64(5), ...)`` raised "step must be a
    non-negative integer, got np.int64(5)"; a training loop's step is often a numpy or tensor integer."""
    import numpy as np

    with CheckpointManager(tmp_path, keep_last=1) as mgr:
        mgr.save(np.int64(5), state_for(5)).result()
        mgr.save(torch.tensor(6), state_for(6)).result()
        assert mgr.all_steps() == [6] and mgr.step_path(np.int32(6)).endswith("step_00000006")
        assert_state(mgr.restore(np.int64(6), state=empty_state()), 6)
        for bad in (True, 1.5, -1, torch.tensor(2.0)):
            with pytest.raises(ValueError, match="non-negative integer"):
                mgr.step_path(bad)


def test_a_checkpoint_given_as_the_root_is_refused(tmp_path: Path) -> None:
    """``CheckpointManager("run/step_00000100")`` (a step, not the run) found no steps in it and saved the
    next ones inside that committed checkpoint."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(100, state_for(100)).result()
    with pytest.raises(ValueError, match="itself a committed checkpoint") as e:
        CheckpointManager(tmp_path / "step_00000100")
    assert str(tmp_path) in str(e.value)
    assert not any(n.startswith(("step_", ".step_")) for n in os.listdir(tmp_path / "step_00000100"))
