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
        assert int(common.open_packs_allowed()) == 12
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert int(common.open_packs_allowed()) == min(common.MAX_OPEN_PACKS, max(2, soft // 8))


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


#: saving ranks (a pack each) and arrays split over all of them, for the pack-order tests
SAVERS, SPLIT = 16, 6


def _rows(full: dict[str, np.ndarray], rank: int, world: int, filled: bool) -> dict:
    """Rank ``rank``'s rows of every array of ``full`` as megatron ShardedTensors split ``world`` ways."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for name, f in full.items():
        rows = f.shape[0] // world
        mine = f[rank * rows : (rank + 1) * rows]
        data = torch.from_numpy(mine.copy()) if filled else torch.full(mine.shape, -1.0)
        out[name] = ShardedTensor.from_rank_offsets(name, data, (0, rank, world), replica_id=0)
    return out


@pytest.fixture(scope="module")
def split_arrays(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """``SPLIT`` arrays, each split by rows over ``SAVERS`` simulated saving ranks: every array has a chunk in
    every rank's pack."""
    pytest.importorskip("megatron.core")
    from simworld import run_ranks

    rng = np.random.default_rng(5)
    full = {f"w{i}": rng.standard_normal((SAVERS * 3, 5)).astype(np.float32) for i in range(SPLIT)}
    path = tmp_path_factory.mktemp("pack_order") / "ck"
    run_ranks(SAVERS, lambda c: acp.save(path, {"model": _rows(full, c.rank, SAVERS, True)}, comm=c))
    assert len(list((path / ".acp" / "packs").glob("*.zip"))) == SAVERS
    return path, full


def _count_opens(monkeypatch: pytest.MonkeyPatch, room: int, by: list | None = None) -> dict[str, int]:
    """Pack opens (``PackFile``) counted from now on, and the most open at once, with room for ``room``;
    ``by`` gets (thread, pack) of each open."""
    import threading

    monkeypatch.setattr(packread, "open_packs_allowed", lambda: room)
    count = {"opens": 0, "now": 0, "most": 0}
    by = [] if by is None else by
    lock = threading.Lock()
    real_init, real_close = packread.PackFile.__init__, packread.PackFile.close

    def init(self: packread.PackFile, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        with lock:
            count["opens"] += 1
            count["now"] += 1
            count["most"] = max(count["most"], count["now"])
            by.append((threading.current_thread().name, self.key))

    def close(self: packread.PackFile) -> None:
        if self._fd >= 0:
            with lock:
                count["now"] -= 1
        real_close(self)

    monkeypatch.setattr(packread.PackFile, "__init__", init)
    monkeypatch.setattr(packread.PackFile, "close", close)
    return count


def test_arrays_over_more_packs_than_open_room_open_each_pack_once(
    split_arrays: tuple[Path, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of 6 arrays each spread over 16 packs, with room for 4 open packs, opens each pack once (it
    read array by array and opened every pack again for every array: 96 opens), bit-exactly; so does a
    resharded load at 4 simulated ranks (each reading 4 savers' packs with room for 2)."""
    from simworld import run_ranks

    path, full = split_arrays
    count = _count_opens(monkeypatch, 4)
    whole = {name: np.full_like(f, -1) for name, f in full.items()}
    acp.load(path, {"model": whole})
    assert all(np.array_equal(whole[n], f) for n, f in full.items())
    assert count == {"opens": SAVERS, "now": 0, "most": 4}, count

    opened: list[tuple[str, str]] = []
    count = _count_opens(monkeypatch, 2, opened)

    def load(comm: object) -> bool:
        mine = _rows(full, comm.rank, comm.world_size, False)  # type: ignore[attr-defined]
        acp.load(path, {"model": mine}, comm=comm)
        want = _rows(full, comm.rank, comm.world_size, True)  # type: ignore[attr-defined]
        return all(np.array_equal(mine[n].data.numpy(), want[n].data.numpy()) for n in full)

    assert all(run_ranks(4, load))
    # each loader opens each pack it reads once: its savers' packs (every pack is some loader's), and the
    # packs holding the arrays' zarr.json documents
    assert len(set(opened)) == len(opened) == count["opens"] and count["now"] == 0, opened
    assert {key for _, key in opened} == {f".acp/packs/{p.name}" for p in (path / ".acp" / "packs").iterdir()}


def test_new_buffers_of_packed_reads_stay_within_the_bound(
    split_arrays: tuple[Path, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regions read into new buffers (cast on delivery) are read in batches of at most the in-flight bound:
    with a bound of two arrays, 3 batches, each pack opened once per batch; bit-exact."""
    path, full = split_arrays
    batches: list[int] = []
    real = packread.PackedReader.deliver_many

    def deliver_many(self: packread.PackedReader, tensors: list) -> tuple[int, list]:
        batches.append(sum(s.box.volume * 4 for t in tensors for s in t.shards))
        return real(self, tensors)

    monkeypatch.setattr(packread.PackedReader, "deliver_many", deliver_many)
    count = _count_opens(monkeypatch, 4)
    bound = 2 * next(iter(full.values())).nbytes
    cast = {name: np.zeros(f.shape, np.float64) for name, f in full.items()}
    acp.load(path, {"model": cast}, allow_cast=True, max_inflight_bytes=bound)
    assert all(np.array_equal(cast[n], f.astype(np.float64)) for n, f in full.items())
    assert batches == [bound] * (SPLIT // 2) and count["opens"] == SAVERS * (SPLIT // 2), (batches, count)
