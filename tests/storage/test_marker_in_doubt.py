"""A commit marker whose write timed out but is stored later (a server answering after the client gave up).
The save failed and its abort deleted every object; the late marker then made a committed checkpoint without
metadata: ``latest_step()`` chose it and ``restore()`` failed. Now the abort keeps the objects while the
marker's outcome is unknown, so a late marker commits a whole checkpoint, and one that never lands leaves an
uncommitted leftover that the manager's cleanup removes."""

from __future__ import annotations

import numpy as np
import pytest

from arraycheckpoint import CheckpointManager, storage
from arraycheckpoint.errors import SaveFailedError, StorageError
from arraycheckpoint.format.metadata import COMMIT_MARKER
from arraycheckpoint.storage import storage_for


@pytest.fixture(params=["memory", "s3"])
def root(request) -> str:
    if request.param == "memory":
        return f"memory://marker-in-doubt/{request.node.name}"
    return request.getfixturevalue("s3_prefix")


@pytest.mark.parametrize("lands", [True, False])
def test_a_marker_write_in_doubt_never_commits_a_partial_checkpoint(root: str, lands: bool) -> None:
    backend = type(storage_for(root)[0])
    scheme = root.split("://", 1)[0]
    late: list[tuple[str, bytes]] = []

    class MarkerTimesOut(backend):  # type: ignore[misc, valid-type]
        armed = False

        def write(self, root_: str, key: str, data: bytes) -> None:
            if key == COMMIT_MARKER and MarkerTimesOut.armed:
                late.append((root_, data))  # sent; its answer never came
                raise StorageError(f"storage write of {root_}/{key} failed (gave up)") from TimeoutError(
                    "no answer"
                )
            super().write(root_, key, data)

    w = np.arange(32, dtype=np.float32)
    storage.register_scheme(scheme, MarkerTimesOut)
    try:
        mgr = CheckpointManager(root)
        mgr.save(1, {"w": w}).result()
        MarkerTimesOut.armed = True
        with pytest.raises(SaveFailedError, match="not committed"):
            mgr.save(2, {"w": w + 1}).result()
        MarkerTimesOut.armed = False
        if lands:  # the server stores the request late, after the abort
            plain, _ = storage_for(late[0][0])
            plain.write(late[0][0], COMMIT_MARKER, late[0][1])
        mgr.close()
        mgr = CheckpointManager(root)  # a restart: cleanup, then the newest committed step
        assert mgr.latest_step() == (2 if lands else 1)
        out = {"w": np.zeros(32, np.float32)}
        mgr.restore(state=out)  # raised MetadataError: committed but no .acp/metadata.json
        assert np.array_equal(out["w"], w + 1 if lands else w)
        assert mgr.storage.children(mgr.root) == (
            ["step_00000001", "step_00000002"] if lands else ["step_00000001"]
        )
        mgr.close()
    finally:
        storage.register_scheme(scheme, None)


def test_the_doubt_is_one_saves_not_the_storage_objects(monkeypatch) -> None:
    """A storage object that served a save whose marker was in doubt kept every later save's objects on
    abort (session 20 review): the doubt now belongs to the save whose marker it was."""
    from arraycheckpoint.errors import StorageError
    from arraycheckpoint.storage import storage_for

    storage, root = storage_for("memory://doubt-per-save/ck")
    real = type(storage).write
    calls = {"n": 0}

    def flaky(self, r, key, data):
        calls["n"] += 1
        if calls["n"] == 1:
            raise StorageError("write failed") from TimeoutError("no answer")
        return real(self, r, key, data)

    monkeypatch.setattr(type(storage), "write", flaky)
    with pytest.raises(StorageError):
        storage.commit(root + "/a", root + "/a", False)  # save A: its marker in doubt
    storage.acquire(root + "/c", "c-0")  # save C starts, writes, fails before its commit
    storage.write(root + "/c", "w/c/0", b"partial")
    storage.abort(root + "/c", root + "/c")
    assert [k for k in storage.list(root + "/c") if not k.endswith("acp-lock")] == []
