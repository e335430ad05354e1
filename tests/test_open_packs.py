"""A load holds a bounded number of packs open, whatever the number of packs it reads.

A resharded load reads from the packs of every saving rank: thousands at a few thousand ranks, more than a
process may hold descriptors for (1,024 by default on many systems). The load kept every pack it had read
open until it finished and failed with ``EMFILE`` ("Too many open files"); it now keeps at most
``packread.MAX_OPEN_PACKS`` (an eighth of the process's limit where that is fewer) and opens a pack again,
with every check, when it is read again.
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
from arraycheckpoint.engine import common, packread
from arraycheckpoint.planning.plan import PlanOptions

TENSORS = 300


def _state(fill: bool) -> dict[str, dict[str, np.ndarray]]:
    return {"model": {f"t{i}": np.full(4, i if fill else -1, np.float32) for i in range(TENSORS)}}


@pytest.fixture(scope="module")
def many_packs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``TENSORS`` small arrays, one pack each (a 1 KiB fill target)."""
    path = tmp_path_factory.mktemp("open_packs") / "ck"
    acp.save(path, _state(True), plan_options=PlanOptions(min_chunk_bytes=1 << 10))
    assert len(list((path / ".acp" / "packs").glob("*.zip"))) >= TENSORS // 2
    return path


def test_load_under_a_low_descriptor_limit(many_packs: Path) -> None:
    """In a process allowed 64 descriptors, a load reading 300 packs succeeds, bit-exactly (it failed with
    EMFILE)."""
    script = textwrap.dedent(
        f"""
        import resource
        import numpy as np
        import arraycheckpoint as acp
        state = {{"model": {{f"t{{i}}": np.full(4, -1, np.float32) for i in range({TENSORS})}}}}
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        acp.load({str(many_packs)!r}, state)
        assert all((state["model"][f"t{{i}}"] == i).all() for i in range({TENSORS}))
        print("loaded")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-2000:]


def test_packs_closed_and_opened_again(many_packs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for two open packs, every pack is still read (and checked) and at most two are open."""
    monkeypatch.setattr(packread, "open_packs_allowed", lambda: 2)
    opened = {"now": 0, "most": 0, "opens": 0}
    real_init, real_close = packread.PackFile.__init__, packread.PackFile.close

    def init(self: packread.PackFile, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        opened["now"] += 1
        opened["opens"] += 1
        opened["most"] = max(opened["most"], opened["now"])

    def close(self: packread.PackFile) -> None:
        if self._fd >= 0:
            opened["now"] -= 1
        real_close(self)

    monkeypatch.setattr(packread.PackFile, "__init__", init)
    monkeypatch.setattr(packread.PackFile, "close", close)
    from arraycheckpoint.checks import files

    calls = {"open_directory": 0, "open_regular_at": 0}
    for name in calls:
        real = getattr(files, name)

        def counted(*args: object, _real: object = real, _name: str = name, **kwargs: object) -> object:
            calls[_name] += 1
            return _real(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(files, name, counted)
    state = _state(False)
    acp.load(many_packs, state)
    assert all((state["model"][f"t{i}"] == i).all() for i in range(TENSORS))
    packs = len(list((many_packs / ".acp" / "packs").glob("*.zip")))
    assert opened["opens"] >= packs and opened["most"] == 2 and opened["now"] == 0
    # the packs' directory is opened once; each pack (again) with one openat below it, not a walk from the root
    assert calls == {"open_directory": 1, "open_regular_at": opened["opens"]}, calls


def test_limit_follows_the_process_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eighth of the process's descriptor limit where that is below MAX_OPEN_PACKS, at least two (for a
    reader alone: :mod:`arraycheckpoint.runtime.descriptors` splits it among the live ones)."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not os.path.isdir("/proc/self/fd") or len(os.listdir("/proc/self/fd")) > 80:
        pytest.skip("no /proc/self/fd, or too many descriptors held to lower the limit to 100")
    from arraycheckpoint.runtime import descriptors

    monkeypatch.setattr(
        descriptors, "_BUDGET", descriptors._Budget()
    )  # no share a test left open to split with
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, hard))
        assert common.open_packs_allowed() == 12
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert common.open_packs_allowed() == min(common.MAX_OPEN_PACKS, max(2, soft // 8))


def _save_script(path: Path) -> str:
    return textwrap.dedent(
        f"""
        import resource
        import numpy as np
        import arraycheckpoint as acp
        from arraycheckpoint.planning.plan import PlanOptions
        state = {{"model": {{f"t{{i}}": np.full(4, i, np.float32) for i in range({TENSORS})}}}}
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        acp.save({str(path)!r}, state, plan_options=PlanOptions(min_chunk_bytes=1 << 10))
        print("saved")
        """
    )


def test_save_under_a_low_descriptor_limit(tmp_path: Path) -> None:
    """In a process allowed 64 descriptors, a save filling 300 packs succeeds (it opened every pack before
    the first was written and failed with EMFILE); the checkpoint loads bit-exactly."""
    path = tmp_path / "ck"
    out = subprocess.run(
        [sys.executable, "-c", _save_script(path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "saved" in out.stdout, out.stderr[-2000:]
    assert len(list((path / ".acp" / "packs").glob("*.zip"))) >= TENSORS // 2
    state = _state(False)
    acp.load(path, state)
    assert all((state["model"][f"t{i}"] == i).all() for i in range(TENSORS))


def test_save_holds_a_bounded_number_of_packs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for two open packs, a save of 300 packs never holds more than two open at once."""
    from arraycheckpoint.engine import packstream, packwrite

    monkeypatch.setattr(packwrite, "open_packs_allowed", lambda: 2)
    made: list[packstream.StreamedPack] = []
    most = 0
    real_init = packstream.StreamedPack.__init__

    def init(self: packstream.StreamedPack, *args: object, **kwargs: object) -> None:
        nonlocal most
        most = max(most, 1 + sum(not p.closed for p in made))
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(packstream.StreamedPack, "__init__", init)
    acp.save(tmp_path / "ck", _state(True), plan_options=PlanOptions(min_chunk_bytes=1 << 10))
    assert len(made) >= TENSORS // 2 and most == 2 and all(p.closed for p in made)
    state = _state(False)
    acp.load(tmp_path / "ck", state)
    assert all((state["model"][f"t{i}"] == i).all() for i in range(TENSORS))


def test_save_counts_packs_the_write_back_thread_has_yet_to_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pack of at least 1 MiB is closed on the write-back thread after its write-back starts; with that
    thread behind (a busy device, NFS whose close flushes), the bound still holds: the save waits for those
    closes too (it counted such packs closed: 50 descriptors open at once for a bound of 2)."""
    import threading
    import time

    from arraycheckpoint.engine import packstream, packwrite, shardfile

    monkeypatch.setattr(packwrite, "open_packs_allowed", lambda: 2)
    lock = threading.Lock()
    packs: set[int] = set()
    now = most = made = 0
    real_init, real_close = packstream.StreamedPack.__init__, shardfile._close

    def init(self: packstream.StreamedPack, *args: object, **kwargs: object) -> None:
        nonlocal now, most, made
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        with lock:
            packs.add(self._fd)  # type: ignore[arg-type]
            now, made = now + 1, made + 1
            most = max(most, now)

    def close(fd: int) -> None:
        nonlocal now
        time.sleep(0.02)  # the write-back thread behind
        with lock:
            if fd in packs:
                packs.discard(fd)
                now -= 1
        real_close(fd)

    monkeypatch.setattr(packstream.StreamedPack, "__init__", init)
    monkeypatch.setattr(shardfile, "_close", close)
    rng = np.random.default_rng(0)
    state = {"model": {f"t{i}": rng.random(1 << 16, dtype=np.float32) for i in range(40)}}
    acp.save(tmp_path / "ck", state, plan_options=PlanOptions(min_chunk_bytes=1 << 20))
    assert made >= 8 and most <= 2 and now == 0, (made, most, now)
    back = {"model": {k: np.zeros_like(v) for k, v in state["model"].items()}}
    acp.load(tmp_path / "ck", back)
    assert all(np.array_equal(back["model"][k], v) for k, v in state["model"].items())
