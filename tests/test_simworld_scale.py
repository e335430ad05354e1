"""The data plane at the world sizes users run: real saves by 64 (slow: 256) simulated ranks, read back.

Every rank of a :class:`simworld.SimWorld` runs ``acp.save`` in its own thread with its own communicator, so
the checkpoint has the files a 64-rank job writes (a pack per rank, chunk files spread by worst fit); it is
then loaded at 1 rank and at another world size, bit-exactly, verified, and read through the zarr store in a
process allowed fewer descriptors than the checkpoint has packs.
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
from simworld import SimCommunicator, SimWorld, run_ranks

import arraycheckpoint as acp
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.tools.verify import verify

SAVERS, LOADERS = 64, 16
#: small chunk and pack sizes so that a small state makes as many files as a large one at the default sizes
OPTIONS = PlanOptions(
    min_chunk_bytes=32 << 10, max_chunk_bytes=64 << 10, inner_chunk_bytes=16 << 10, pack_array_bytes=8 << 10
)


def _replicated() -> dict[str, np.ndarray]:
    """150 small arrays (packed) and 2 of 256 KiB (cut into chunk files written by different ranks)."""
    rng = np.random.default_rng(7)
    state = {f"s{i}": rng.standard_normal(20 + i % 13).astype(np.float32) for i in range(150)}
    state.update({f"big{i}": rng.standard_normal((128, 512)).astype(np.float32) for i in range(2)})
    return state


def _save(path: Path, world: int) -> dict[str, np.ndarray]:
    state = _replicated()

    def save(comm: SimCommunicator) -> None:
        acp.save(path, {"model": state}, comm=comm, plan_options=OPTIONS)

    run_ranks(world, save)
    return state


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("simworld") / "ck"
    return path, _save(path, SAVERS)


def _zeros(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, -1) for k, v in state.items()}


def _round_trip(path: Path, want: dict[str, np.ndarray], loaders: int) -> None:
    """Load at 1 rank and at ``loaders`` simulated ranks, bit-exactly; verify reads every chunk."""
    got = _zeros(want)
    acp.load(path, {"model": got})
    assert all(np.array_equal(got[k], v) for k, v in want.items())

    def load(comm: SimCommunicator) -> bool:
        mine = _zeros(want)
        acp.load(path, {"model": mine}, comm=comm)
        return all(np.array_equal(mine[k], v) for k, v in want.items())

    assert all(run_ranks(loaders, load))
    report = verify(path)
    assert report.ok, report.problems[:3]
    assert report.tensors == len(want)


def test_saved_by_64_ranks_loads_at_1_and_16(saved: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, want = saved
    packs = {p.name.split(".")[0] for p in (path / ".acp" / "packs").glob("*.zip")}
    assert packs == {str(r) for r in range(SAVERS)}  # every rank wrote small arrays into its own packs
    assert acp.read_metadata(path).world_size == SAVERS
    _round_trip(path, want, LOADERS)


def test_store_and_load_with_fewer_descriptors_than_packs(saved: tuple[Path, dict[str, np.ndarray]]) -> None:
    """In a process allowed 48 descriptors, the zarr store, a load and verify read a checkpoint of 64 packs
    bit-exactly. The store kept up to 64 packs open whatever the process's limit and failed with EMFILE."""
    path, _ = saved
    script = textwrap.dedent(
        f"""
        import resource, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import numpy as np, zarr
        import arraycheckpoint as acp
        from arraycheckpoint.tools.verify import verify
        from arraycheckpoint.zarr import checkpoint_store
        from test_simworld_scale import _replicated
        want = _replicated()
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        store = checkpoint_store({str(path)!r})
        group = zarr.open_group(store, mode="r")
        assert all(np.array_equal(group[f"model/{{k}}"][...], v) for k, v in want.items())
        got = {{k: np.zeros_like(v) for k, v in want.items()}}
        acp.load({str(path)!r}, {{"model": got}})
        assert all(np.array_equal(got[k], v) for k, v in want.items())
        assert verify({str(path)!r}).ok
        print("read")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "read" in out.stdout, out.stderr[-2000:]


@pytest.mark.slow
def test_saved_by_256_ranks_loads_at_1_and_64(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    _round_trip(path, _save(path, 256), 64)


def test_shared_reads_send_each_distinct_request_list_once(
    saved: tuple[Path, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dedup_reads=True`` at 32 ranks: bit-exact, and a rank receives the bytes others read for it plus
    the replicas' (equal) request list once, and parses it once. Every rank received every rank's list (world
    size x regions), and then parsed each of the 32 equal lists again."""
    import threading

    from arraycheckpoint.engine import load as engine_load

    path, want = saved
    world = SimWorld(32)
    lock, made = threading.Lock(), [0]

    class CountedBox(engine_load.Box):  # type: ignore[misc,name-defined]
        def __init__(self, *args: object, **kwargs: object) -> None:
            with lock:
                made[0] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_load, "Box", CountedBox)

    def load(comm: SimCommunicator) -> bool:
        mine = _zeros(want)
        acp.load(path, {"model": mine}, comm=comm, dedup_reads=True)
        return all(np.array_equal(mine[k], v) for k, v in want.items())

    assert all(run_ranks(world.size, load, world=world))
    requests = len(json.dumps([[f"model/{k}", [0] * v.ndim, list(v.shape)] for k, v in want.items()]))
    state = sum(v.nbytes for v in want.values())
    assert max(world.received) <= state + 2 * requests + 64 * world.size, (world.received[:4], requests)
    assert made[0] <= 2 * world.size * len(want), made  # each rank parses the one distinct list once


def test_all_gather_distinct_json_sends_each_value_once() -> None:
    """16 ranks holding 2 distinct values: every rank gets every rank's value, equal ones as one object, and
    receives each distinct value once (plus a digest and a size per rank), not 16 values."""
    world = SimWorld(16)
    values = [{"v": [r % 2] * 100} for r in range(16)]
    got = run_ranks(16, lambda c: c.all_gather_distinct_json(values[c.rank]), world=world)
    assert all(g == values for g in got)
    assert all(g[0] is g[2] is g[14] and g[1] is g[15] and g[1] is not g[0] for g in got)
    distinct = 2 * len(json.dumps(values[0], separators=(",", ":")))
    assert max(world.received) <= 2 * distinct + 32 * 16, world.received
