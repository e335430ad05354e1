"""CheckpointManager on a root this process may only partly read or write (run as an unprivileged user).

Root reads every directory whatever its mode, so these cases run in a subprocess that drops to uid/gid 65534
(``nobody``) first: the test runs only as root (it skips otherwise; an ordinary user cannot take another
uid). Found so: one step directory the process may not read (mode 000, or its ``.acp``) made the manager
unusable (its construction, ``all_steps``, retention and cleanup all raised); a save into a root the process
may write but not list (mode 0300) committed the checkpoint and then reported it failed and not committed
(the parent's fsync needs a descriptor opened for reading); cleanup reported a leftover it could not remove
as removed. Now an unreadable step is skipped with a warning naming it (never listed, never deleted), an
unreadable root is an error naming it, and nothing committed is lost in any case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.storage import LocalStorage
from arraycheckpoint.storage.localnames import lock_path

SCRIPT = textwrap.dedent(
    """
    import json, logging, os, shutil, sys, tempfile
    import numpy as np
    import arraycheckpoint as acp

    def state(v):
        return {"model": {"w": np.full(4, v, np.float32)}}

    # every module a save, a load and the manager import lazily, imported while the environment (under
    # /root) is still readable
    warm = tempfile.mkdtemp()
    w = acp.CheckpointManager(warm, keep_last=1)
    for s in (1, 2):
        w.save(s, state(0)).result()
    w.restore(state=state(0))
    w.close()
    try:
        acp.save(os.path.join(warm, "step_00000002"), state(0))
    except acp.errors.ArrayCheckpointError:
        pass
    shutil.rmtree(warm)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("arraycheckpoint").addHandler(handler)
    out = {}

    def attempt(label, fn):
        warnings.clear()
        try:
            out[label] = {"value": fn()}
        except Exception as e:
            out[label] = {"error": f"{type(e).__name__}: {e}"}
        out[label]["warnings"] = list(warnings)

    def loads(path, v):
        got = state(-1)
        acp.load(path, got)
        return bool((got["model"]["w"] == v).all())

    base = tempfile.mkdtemp(prefix="acp-nobody-")
    root = os.path.join(base, "run")
    step = lambda s: os.path.join(root, f"step_{s:08d}")
    mgr = acp.CheckpointManager(root)
    for s in (1, 2, 3):
        mgr.save(s, state(s)).result()
    mgr.close()

    os.chmod(step(2), 0)  # a step directory this process may not read
    attempt("unreadable step: construct", lambda: acp.CheckpointManager(root, keep_last=1).removed)
    m = acp.CheckpointManager(root, keep_last=1, cleanup=False)
    attempt("unreadable step: all_steps", m.all_steps)
    attempt("unreadable step: retention", m.apply_retention)
    attempt("unreadable step: restore", lambda: m.restore(state=state(-1))["model"]["w"].tolist())
    os.chmod(step(2), 0o755)
    os.chmod(os.path.join(step(2), ".acp"), 0)  # its control directory only
    attempt("unreadable .acp: all_steps", m.all_steps)
    attempt("unreadable .acp: cleanup", m.cleanup)
    os.chmod(os.path.join(step(2), ".acp"), 0o755)
    attempt("unreadable step: intact", lambda: [sorted(os.listdir(root)), loads(step(2), 2)])

    os.chmod(root, 0o300)  # writable, not listable
    attempt("unreadable root: construct", lambda: acp.CheckpointManager(root))
    attempt("unreadable root: save", lambda: acp.save(step(4), state(4)).step)
    os.chmod(root, 0o500)  # listable, not writable
    m = acp.CheckpointManager(root, keep_last=1)
    attempt("unwritable root: save", lambda: m.save(5, state(5)).result())
    attempt("unwritable root: retention", m.apply_retention)
    m.close()
    os.chmod(root, 0o755)
    attempt("unwritable root: intact", lambda: [sorted(os.listdir(root)), loads(step(2), 2), loads(step(4), 4)])

    elsewhere = os.path.join(base, "elsewhere")
    os.rename(step(3), elsewhere)
    os.symlink(elsewhere, step(3))  # a step directory replaced by a link (to a committed checkpoint)
    shutil.rmtree(step(2))
    with open(step(2), "w") as f:  # and one replaced by a file
        f.write("mine")
    os.makedirs(os.path.join(root, ".step_00000009.acp-staging-x-1", "sub"))
    os.chmod(os.path.join(root, ".step_00000009.acp-staging-x-1"), 0)  # a leftover it cannot remove
    os.makedirs(os.path.join(step(10), "sub"))
    os.chmod(os.path.join(step(10), "sub"), 0)  # an uncommitted step holding what it cannot look at
    attempt("replaced: construct", lambda: acp.CheckpointManager(root, keep_last=1).removed)
    m = acp.CheckpointManager(root, keep_last=1, cleanup=False)
    attempt("replaced: all_steps", m.all_steps)
    attempt("replaced: retention", m.apply_retention)
    attempt("replaced: save over the file", lambda: m.save(2, state(22)).result())
    m.close()
    attempt("replaced: intact", lambda: [
        sorted(os.listdir(root)), open(step(2)).read(), os.readlink(step(3)), loads(elsewhere, 3),
        loads(step(4), 4),
    ])
    os.chmod(os.path.join(root, ".step_00000009.acp-staging-x-1"), 0o755)
    os.chmod(os.path.join(step(10), "sub"), 0o755)
    print(json.dumps({"base": base, "results": out}))
    """
)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to take uid 65534")
def test_manager_on_a_root_it_may_only_partly_read_or_write(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    r, base = doc["results"], doc["base"]
    root = f"{base}/run"
    try:
        unreadable = f"skipping step directory {root}/step_00000002: this process may not read it"
        construct = r["unreadable step: construct"]
        assert construct["value"] == [] and any(unreadable in w for w in construct["warnings"]), construct
        assert r["unreadable step: all_steps"]["value"] == [1, 3]
        assert r["unreadable step: retention"]["value"] == [1]  # never the step it cannot read
        assert r["unreadable step: restore"]["value"] == [3.0] * 4
        assert r["unreadable .acp: all_steps"]["value"] == [3]
        assert any(unreadable in w for w in r["unreadable .acp: all_steps"]["warnings"])
        assert r["unreadable .acp: cleanup"]["value"] == []
        assert r["unreadable step: intact"]["value"] == [["step_00000002", "step_00000003"], True]

        error = r["unreadable root: construct"]["error"]
        assert error.startswith(f"StorageError: {root}: this process may not read the checkpoint root"), error
        # committed: says so (it reported the save failed and not committed), with a warning naming it
        assert r["unreadable root: save"] == {
            "value": None,
            "warnings": [r["unreadable root: save"]["warnings"][0]],
        }, r["unreadable root: save"]
        assert f"{root}/step_00000004 is committed" in r["unreadable root: save"]["warnings"][0]
        assert str(lock_path(f"{root}/step_00000005")) in r["unwritable root: save"]["error"]
        assert "StorageError" in r["unwritable root: retention"]["error"]
        assert f"{root}/step_00000002" in r["unwritable root: retention"]["error"]
        assert r["unwritable root: intact"]["value"] == [
            ["step_00000002", "step_00000003", "step_00000004"],
            True,
            True,
        ]

        kept = r["replaced: construct"]
        assert kept["value"] == [] and any(".step_00000009.acp-staging-x-1" in w for w in kept["warnings"]), (
            kept
        )
        assert r["replaced: all_steps"]["value"] == [4]  # the file and the link are no steps
        assert r["replaced: retention"]["value"] == []
        assert "CheckpointExistsError" in r["replaced: save over the file"]["error"]
        assert f"{root}/step_00000002" in r["replaced: save over the file"]["error"]
        assert any(f"kept {root}/step_00000010" in w and "unreadable" in w for w in kept["warnings"]), kept
        listing, text, link, linked_loads, step4_loads = r["replaced: intact"]["value"]
        assert {".step_00000009.acp-staging-x-1", "step_00000004", "step_00000010"} <= set(listing)
        assert (text, link, linked_loads, step4_loads) == ("mine", f"{base}/elsewhere", True, True)
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_cleanup_puts_back_a_committed_step_a_replacing_save_left_aside(tmp_path: Path) -> None:
    """A save replacing a committed step (``overwrite``) renames the old one to ``<step>.acp-old-*`` before
    moving its own in; after a crash between the two renames the old one is the step's only committed copy.
    Cleanup deleted it with the leftovers; it now puts it back (and still deletes one whose step is there)."""
    acp.save(tmp_path / "step_00000001", {"model": {"w": np.arange(4, dtype=np.float32)}})
    os.rename(tmp_path / "step_00000001", tmp_path / "step_00000001.acp-old-.step_00000001.acp-staging-x")
    acp.save(tmp_path / "step_00000002", {"model": {"w": np.ones(4, np.float32)}})
    os.mkdir(tmp_path / "step_00000002.acp-old-.step_00000002.acp-staging-y")  # its step is there
    mgr = acp.CheckpointManager(tmp_path)
    assert mgr.removed == [str(tmp_path / "step_00000002.acp-old-.step_00000002.acp-staging-y")]
    assert mgr.all_steps() == [1, 2]
    state = {"model": {"w": np.zeros(4, np.float32)}}
    mgr.restore(1, state=state)
    assert np.array_equal(state["model"]["w"], np.arange(4, dtype=np.float32))
    assert LocalStorage().cleanup_leftovers(str(tmp_path)) == []
