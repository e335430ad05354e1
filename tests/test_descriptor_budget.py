"""The readers and writers of packs share one descriptor budget per process.

Each load, save and ``acp.checkpoint_store`` took an eighth of ``RLIMIT_NOFILE`` for itself, so several of them
at once (two open stores, an async save and a load) could together hold more pack descriptors than any one was
allowed, and with a few more exhaust the process's descriptors. They now hold shares of one budget
(:mod:`arraycheckpoint.runtime.descriptors`): split among the live users, a newcomer given what the others
leave until their next opens shrink them to their share.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.runtime import descriptors

TENSORS = 40


def test_shares_split_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone, a share gets min(cap, budget); others joining shrink it to its part at its next read; a
    newcomer gets what the others leave (1 while they hold everything); a small cap leaves the rest to the
    others; a share collected or released leaves the budget."""
    monkeypatch.setattr(descriptors, "process_budget", lambda: 12)
    monkeypatch.setattr(descriptors, "_BUDGET", descriptors._Budget())  # no share another test left open
    a = descriptors.descriptor_share(64)
    assert int(a) == 12 and a.granted == 12 and a.limit() == 12
    b = descriptors.descriptor_share(1024)
    assert int(b) == 1  # a still may hold 12
    assert int(a) == 6 and int(b) == 6  # a shrank at its next read: b gets the rest of its part
    c = descriptors.descriptor_share(2)
    assert int(c) == 1 and int(a) == 5 and int(b) == 5 and int(c) == 2  # c's cap leaves 10 to a and b
    c.release()
    assert int(a) == 6 and int(b) == 6
    del b
    assert int(a) == 12 and descriptors.live_shares() == 1
    monkeypatch.setattr(descriptors, "process_budget", lambda: None)
    assert int(a) == 64  # no limit: the cap


def _state(value: int) -> dict[str, dict[str, np.ndarray]]:
    return {"model": {f"t{i}": np.full(4, value * 1000 + i, np.float32) for i in range(TENSORS)}}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_stores_a_save_and_a_load_together_stay_within_the_budget(tmp_path: Path) -> None:
    """In a process allowed 64 descriptors (a budget of 8 pack descriptors), two open zarr stores read a
    checkpoint of 40 packs on a thread while an async save writes 40 packs and a load reads 40: every read is
    bit-exact, and at every pack open the process holds at most the budget plus one pack descriptor (the
    newcomer's before the others' next opens; each user alone took 8: 32 together)."""
    ck = tmp_path / "a"
    acp.save(ck, _state(1), plan_options=PlanOptions(min_chunk_bytes=1 << 10))
    assert len(list((ck / ".acp" / "packs").glob("*.zip"))) >= TENSORS
    out = subprocess.run(
        [sys.executable, "-c", _script(ck, tmp_path / "b")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    most, budget, live = int(words[1]), int(words[3]), int(words[5])
    # a store opens its next pack before it closes its least recently used one (+1 each), and a newcomer
    # gets 1 until the others' next opens (+1): each user with an eighth of its own held 25 here
    assert budget == 8 and 0 < most <= budget + 3, out.stdout
    assert live == 2  # the two stores; the save's and the loads' shares left with them


def _script(ck: Path, other: Path) -> str:
    """Two stores reading ``ck`` on a thread, an async save to ``other`` and a load of ``ck``; prints the most
    pack descriptors open at once, the budget and the live shares at the end."""
    return textwrap.dedent(
        f"""
        import os, resource, threading
        import numpy as np, zarr
        import arraycheckpoint as acp
        from arraycheckpoint.planning.plan import PlanOptions
        from arraycheckpoint.runtime import descriptors
        from arraycheckpoint.zarr import checkpoint_store

        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        budget = descriptors.process_budget()
        most = [0]
        real_open = os.open

        def pack_fds():
            n = 0
            for fd in os.listdir("/proc/self/fd"):
                try:
                    n += "/.acp/packs/" in os.readlink(f"/proc/self/fd/{{fd}}")
                except OSError:
                    pass
            return n

        def counted_open(*args, **kwargs):  # the peak is right after an open
            fd = real_open(*args, **kwargs)
            most[0] = max(most[0], pack_fds())
            return fd

        os.open = counted_open
        want = lambda v: {{f"t{{i}}": np.full(4, v * 1000 + i, np.float32) for i in range({TENSORS})}}
        groups = [zarr.open_group(checkpoint_store({str(ck)!r}), mode="r") for _ in range(2)]
        bad = []

        def read_stores():
            for _ in range(3):
                for i in range({TENSORS}):
                    for g in groups:
                        if not np.array_equal(g[f"model/t{{i}}"][...], want(1)[f"t{{i}}"]):
                            bad.append(i)

        reader = threading.Thread(target=read_stores)
        reader.start()
        fut = acp.save_async({str(other)!r}, {{"model": want(2)}},
                             plan_options=PlanOptions(min_chunk_bytes=1 << 10))
        got = {{k: np.zeros_like(v) for k, v in want(0).items()}}
        acp.load({str(ck)!r}, {{"model": got}})
        fut.result()
        reader.join()
        assert not bad, bad
        assert all(np.array_equal(got[k], v) for k, v in want(1).items())
        acp.load({str(other)!r}, {{"model": got}})
        assert all(np.array_equal(got[k], v) for k, v in want(2).items())
        print("most", most[0], "budget", budget, "live", descriptors.live_shares())
        """
    )


def test_idle_stores_give_packs_back_to_a_later_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two zarr stores read once and then idle (a notebook, an evaluation) kept their grants and their packs
    open: a load started afterwards could keep one pack open for its whole run (a resharded load then reopens
    a pack for nearly every chunk). The budget now asks idle stores to close packs nobody reads: the load
    gets its even part, and the packs open at once stay within the budget."""
    import zarr

    from arraycheckpoint.engine import common
    from arraycheckpoint.zarr import checkpoint_store

    monkeypatch.setattr(descriptors, "process_budget", lambda: 16)
    monkeypatch.setattr(descriptors, "_BUDGET", descriptors._Budget())
    acp.save(
        tmp_path / "ck", {"model": _state(1)["model"]}, plan_options=PlanOptions(min_chunk_bytes=1 << 10)
    )
    stores = [checkpoint_store(str(tmp_path / "ck")) for _ in range(2)]
    groups = [zarr.open_group(s, mode="r") for s in stores]
    for g in groups:
        for i in range(TENSORS):
            assert g[f"model/t{i}"][0] == 1000 + i
    share = common.open_packs_allowed()  # what the next acp.load's pack reader gets
    assert int(share) >= 16 // 3, int(share)  # its even part (it got 1)
    held = sum(s.granted for s in descriptors._BUDGET.live())
    assert held <= 16, held
    for g in groups:  # the stores still read (they reopen what they gave back)
        assert g[f"model/t{TENSORS - 1}"][0] == 1000 + TENSORS - 1
