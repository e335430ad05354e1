"""Failure safety with real processes and real files: a rank killed mid-save, a full disk, corrupted data,
hostile metadata, and two saves racing for one path."""

from __future__ import annotations

import base64
import errno
import json
import os
import pickle
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from dist import free_port, run_distributed
from faults.packtools import (
    LAYOUTS,
    chunk_member,
    delete_member,
    flip_member_byte,
    member_span,
    members,
    pack_key,
    pack_of,
    replace_member,
    save_options,
)
from killing import kill_rank_at, report_outcome, wait_for

import arraycheckpoint as acp
from arraycheckpoint.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MetadataError,
    PickleNotAllowedError,
    SaveFailedError,
    UnsafeNameError,
)
from arraycheckpoint.format.metadata import METADATA_FILE
from arraycheckpoint.manager import CheckpointManager
from arraycheckpoint.storage import LocalStorage, register_scheme
from arraycheckpoint.storage.localnames import lock_path
from arraycheckpoint.testing import chunk_files


def state_for(step: int, rows: int = 64) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(rows, 32, generator=g), "b": torch.randn(32, generator=g)}}


def zeros_like_state(rows: int = 64) -> dict:
    return {"model": {"w": torch.zeros(rows, 32), "b": torch.zeros(32)}}


def assert_equal_state(got: dict, want: dict) -> None:
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------ kill -9 mid-save
class _StepStaging(LocalStorage):
    """Local storage that knows the staging roots of the saves to targets named ``STEP`` (a staging directory
    is named after no step: storage/localnames.py)."""

    STEP = ""
    staged: set[str] = set()

    def staging_root(self, final: str, token: str) -> str:
        staging = super().staging_root(final, token)
        if os.path.basename(final) == self.STEP:
            self.staged.add(staging)
        return staging


class HangingFlush(_StepStaging):
    """Local storage; on the rank named in ACP_HANG_RANK, flushing a step-2 save announces itself in a file
    and then blocks until the process is killed."""

    STEP, staged = "step_00000002", set()

    def normalize(self, url: str) -> str:
        return super().normalize(url.removeprefix("hang://"))

    def flush(self, root: str) -> None:
        if root in self.staged and os.environ.get("RANK") == os.environ.get("ACP_HANG_RANK"):
            Path(os.environ["ACP_SIGNAL_DIR"], f"rank{os.environ['RANK']}-in-flush").touch()
            while True:
                time.sleep(1)
        super().flush(root)


def _kill_rank_main(rank: int, world: int, port: int, root: str, signal_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        ACP_HANG_RANK="1",
        ACP_SIGNAL_DIR=signal_dir,
    )
    torch.set_num_threads(1)
    register_scheme("hang", HangingFlush)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    mgr = CheckpointManager(f"hang://{root}")

    def sharded(step: int) -> dict:
        return {
            "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in state_for(step)["model"].items()}
        }

    mgr.save(1, sharded(1)).result()
    handle = mgr.save(2, sharded(2))
    handle.staged.result()
    Path(signal_dir, f"rank{rank}-staged").touch()
    report_outcome(handle, signal_dir, rank)


def test_kill_one_rank_mid_async_save(tmp_path: Path) -> None:
    root, signals = tmp_path / "run", tmp_path / "signals"
    signals.mkdir()
    port = free_port()
    kill_rank_at(
        _kill_rank_main, 2, lambda r: (r, 2, port, str(root), str(signals)), signals / "rank1-in-flush"
    )
    survivor = signals / "rank0-result"
    if survivor.exists():  # when it reported, the survivor's save failed: nothing was committed
        assert survivor.read_text() != "committed"
    # The previous checkpoint loads, bit-exact; the interrupted one is not loadable.
    loaded = acp.load(root / "step_00000001", zeros_like_state())
    assert_equal_state(loaded, state_for(1))
    with pytest.raises(CheckpointNotFoundError):
        acp.load(root / "step_00000002", zeros_like_state())
    leftovers = sorted(n for n in os.listdir(root) if n != "step_00000001")
    ours = (".acp-staging-", lock_path(root / "step_00000002").name)  # its staging, its lock: no step name
    assert leftovers and all(n.startswith(ours) for n in leftovers), leftovers
    # The next start cleans up; a new save of step 2 then succeeds.
    mgr = CheckpointManager(root)
    assert len(mgr.removed) == len(leftovers)
    assert sorted(os.listdir(root)) == ["step_00000001"]
    assert mgr.all_steps() == [1]
    mgr.save(2, state_for(2)).result()
    assert_equal_state(mgr.restore(state=zeros_like_state()), state_for(2))
    mgr.close()


# ---------------------------------------------------------------------------------------- disk full
class FullDisk(_StepStaging):
    """Local storage whose flush fails with ENOSPC on rank 1 for step-2 saves (the injected disk-full seam)."""

    STEP, staged = "step_2", set()

    def normalize(self, url: str) -> str:
        return super().normalize(url.removeprefix("fulldisk://"))

    def flush(self, root: str) -> None:
        if root in self.staged and os.environ.get("RANK") == "1":
            raise OSError(errno.ENOSPC, "No space left on device", root)
        super().flush(root)


def _disk_full_body(rank: int, world: int, root: str, big_rows: int, scheme: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    register_scheme("fulldisk", FullDisk)
    mesh = init_device_mesh("cpu", (world,))

    def sharded(step: int, rows: int) -> dict:
        return {
            "model": {
                k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in state_for(step, rows)["model"].items()
            }
        }

    acp.save(f"{scheme}{root}/step_1", sharded(1, 64))
    fut = acp.save_async(f"{scheme}{root}/step_2", sharded(2, big_rows))
    fut.staged.result()
    try:
        fut.result()
    except SaveFailedError as e:
        return str(e)
    return "committed"


def _check_disk_full_outcome(root: Path, messages: list[str], object_store: bool = False) -> None:
    """Nothing committed, nothing left (an object store may leave empty directories: no objects), and
    the previous step loads bit-exactly."""
    assert len(messages) == 2
    for rank, msg in enumerate(messages):
        assert msg != "committed", f"rank {rank} saw a commit on a full disk"
        assert "not committed" in msg and ("No space left" in msg or "ENOSPC" in msg or "space" in msg), msg
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())
    assert all(p.startswith("step_1/") for p in left), f"the failed save left files behind: {left}"
    if not object_store:
        assert sorted(os.listdir(root)) == ["step_1"], "the failed save left directories behind"
    with pytest.raises(CheckpointNotFoundError):
        acp.read_metadata(root / "step_2")
    assert_equal_state(acp.load(root / "step_1", zeros_like_state()), state_for(1))


def test_disk_full_injected_at_storage_seam(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    messages = run_distributed(_disk_full_body, world=2, args=(str(root), 64, "fulldisk://"))
    assert all("rank 1" in m for m in messages), messages
    _check_disk_full_outcome(root, messages)


@pytest.mark.parametrize("scheme", ["", "local://"], ids=["local", "fsspec"])
def test_disk_full_on_a_small_tmpfs(tmp_path: Path, scheme: str) -> None:
    """A real full file system, through the local backend and through fsspec's (``local://``, which uploads
    from memory at flush). S3 (moto) and memory:// have no size quota to fill: docs/security.md."""
    root = tmp_path / "ck"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(root)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}); the injected test covers it"
        )
    try:
        # step 1 (~8 KiB) fits; step 2 (32768 x 32 float32 = 4 MiB) cannot fit in 2 MiB
        messages = run_distributed(_disk_full_body, world=2, args=(str(root), 32768, scheme))
        _check_disk_full_outcome(root, messages, object_store=bool(scheme))
        assert os.statvfs(root).f_bfree * os.statvfs(root).f_bsize > 1 << 20, (
            "the failed save's bytes were not freed"
        )
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


# ------------------------------------------------------------------------------------- corrupt data
# Both layouts: model/w (64 x 32) and model/b in their own directories (pack_array_bytes=0), or as members of
# one pack (format 5's default for small arrays), where the damage hits the member inside the ZIP file.
@pytest.fixture(params=LAYOUTS)
def saved(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    path = tmp_path / "ck"
    acp.save(path, state_for(5), **save_options(request.param))
    assert (pack_key(path, "model/w") is None) == (request.param == "directory")
    return path


def assert_verify_names(path: Path, tensor: str) -> None:
    from arraycheckpoint.tools.verify import verify

    report = verify(path)
    assert not report.ok
    assert any(p.tensor == tensor for p in report.problems), [str(p) for p in report.problems]
    assert all(p.tensor == tensor for p in report.problems), [str(p) for p in report.problems]


def _data_file(path: Path) -> Path:
    files = chunk_files(path / "model" / "w")
    assert len(files) == 1
    return files[0]


def _packed(path: Path) -> bool:
    return pack_key(path, "model/w") is not None


W_CHUNK = chunk_member("model/w")


@pytest.mark.parametrize("where", ["start", "middle", "index"])
def test_flipped_byte_is_detected_and_names_the_tensor(saved: Path, where: str) -> None:
    if _packed(saved):  # the same byte of the chunk, inside the pack
        size = member_span(pack_of(saved, "model/w"), W_CHUNK)[1]
        flip_member_byte(
            pack_of(saved, "model/w"), W_CHUNK, {"start": 0, "middle": size // 2, "index": size - 6}[where]
        )
    else:
        data = _data_file(saved)
        raw = bytearray(data.read_bytes())
        pos = {"start": 0, "middle": len(raw) // 2, "index": len(raw) - 6}[where]
        raw[pos] ^= 0x10
        data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="model/w"):
        acp.load(saved, zeros_like_state())
    assert_verify_names(saved, "model/w")
    # the untouched tensor still loads on its own (from the same pack, in the packed layout)
    part = acp.load(saved, {"model": {"b": torch.zeros(32)}}, strict=False)
    assert torch.equal(part["model"]["b"], state_for(5)["model"]["b"])


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_truncated_data_file_names_the_tensor(saved: Path, keep: float) -> None:
    if _packed(saved):  # the member cut short inside a consistent archive (what a rewriting tool leaves)
        pack = pack_of(saved, "model/w")
        raw = dict(members(pack))[W_CHUNK]
        replace_member(pack, W_CHUNK, raw[: int(len(raw) * keep)])
    else:
        data = _data_file(saved)
        raw = data.read_bytes()
        data.write_bytes(raw[: int(len(raw) * keep)])
    with pytest.raises(CorruptCheckpointError, match="model/w"):
        acp.load(saved, zeros_like_state())
    assert_verify_names(saved, "model/w")


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_pack_names_its_tensors_and_the_pack(tmp_path: Path, keep: float) -> None:
    """The pack file itself cut short (its central directory lost): every array of the pack is refused,
    naming the tensors and the pack; verify reports each of them."""
    from arraycheckpoint.tools.verify import verify

    path = tmp_path / "ck"
    acp.save(path, state_for(5))
    pack = pack_of(path, "model/w")
    raw = pack.read_bytes()
    pack.write_bytes(raw[: int(len(raw) * keep)])
    with pytest.raises(CorruptCheckpointError, match="'model/w'") as info:
        acp.load(path, zeros_like_state())
    assert str(pack) in str(info.value) and "'model/b'" in str(info.value)
    report = verify(path)
    assert {p.tensor for p in report.problems} == {"model/w", "model/b"}, [str(p) for p in report.problems]


def _delete_data_file(path: Path) -> None:
    if _packed(path):
        delete_member(pack_of(path, "model/w"), W_CHUNK)
    else:
        _data_file(path).unlink()


def test_deleted_data_file_is_reported_by_verify(saved: Path) -> None:
    _delete_data_file(saved)
    assert_verify_names(saved, "model/w")


def test_deleted_data_file_names_the_tensor(saved: Path) -> None:
    _delete_data_file(saved)
    with pytest.raises(CorruptCheckpointError, match="model/w"):
        acp.load(saved, zeros_like_state())


# --------------------------------------------------------------------------------- hostile metadata
class Payload:
    """Unpickling this creates the file ``path``: proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _metadata_variants(doc: dict, text: str, sentinel: str) -> dict[str, bytes]:
    def mutate(fn) -> bytes:
        d = json.loads(text)
        fn(d)
        return json.dumps(d).encode()

    w = "model/w"
    return {
        "truncated": text[: len(text) // 2].encode(),
        "empty": b"",
        "not-an-object": b"[1, 2, 3]",
        "shape-is-a-string": mutate(lambda d: d["tensors"][w].update(shape="64x32")),
        "negative-dim": mutate(lambda d: d["tensors"][w].update(shape=[-1, 32])),
        "bool-dim": mutate(lambda d: d["tensors"][w].update(shape=[True, 32])),
        "absurd-shape": mutate(
            lambda d: d["tensors"][w].update(
                shape=[2**40, 2**40], chunk_shape=[1, 1], inner_chunk_shape=[1, 1]
            )
        ),
        "too-many-dims": mutate(lambda d: d["tensors"][w].update(shape=[1] * 100)),
        "shard-out-of-bounds": mutate(
            lambda d: d["tensors"][w].update(regions=[[0, ["boxes", [[[0, 0], [65, 32]]]]]])
        ),
        "unknown-dtype": mutate(lambda d: d["tensors"][w].update(dtype="object")),
        "world-size-string": mutate(lambda d: d.update(world_size="2")),
        "tensors-is-a-list": mutate(lambda d: d.update(tensors=[])),
        "future-format": mutate(lambda d: d.update(format_version=99)),
        "dotdot-name": mutate(lambda d: d["tensors"].update({"../../escape": d["tensors"].pop(w)})),
        "dotdot-inner": mutate(lambda d: d["tensors"].update({"model/../../../escape": d["tensors"].pop(w)})),
        "absolute-name": mutate(lambda d: d["tensors"].update({"/etc/escape": d["tensors"].pop(w)})),
        "dotdot-object": mutate(lambda d: d["objects"].update({"../x": {"scope": "global", "value": 1}})),
        "pickle": pickle.dumps(Payload(sentinel)),
        "pickle-protocol-0-ascii": pickle.dumps(Payload(sentinel), protocol=0),
    }


def test_malformed_metadata_is_refused_without_running_code(tmp_path: Path) -> None:
    path = tmp_path / "inner" / "ck"
    acp.save(path, state_for(3))
    meta_file = path / METADATA_FILE
    text = meta_file.read_text()
    sentinel = tmp_path / "PWNED"
    variants = _metadata_variants(json.loads(text), text, str(sentinel))
    before = files_under(tmp_path)
    for name, payload in variants.items():
        meta_file.write_bytes(payload)
        for attempt in (lambda: acp.read_metadata(path), lambda: acp.load(path, zeros_like_state())):
            with pytest.raises((MetadataError, UnsafeNameError), match=".") as info:
                attempt()
            assert (
                "checkpoint" in str(info.value) or "metadata" in str(info.value) or "name" in str(info.value)
            ), name
        assert not sentinel.exists(), f"{name}: code ran while loading"
    # A pickle smuggled into a JSON value is an opaque string: it loads as data or is refused, never run.
    doc = json.loads(text)
    doc["framework"] = pickle.dumps(Payload(str(sentinel)), protocol=0).decode()
    meta_file.write_text(json.dumps(doc))
    with pytest.raises(Exception):  # noqa: B017 - any refusal is fine; the point is the sentinel below
        acp.load(path, {**zeros_like_state(), "extra_state": {}}, framework=doc["framework"])
    assert acp.read_metadata(path).framework == doc["framework"]
    doc["framework"] = json.loads(text)["framework"]
    doc["objects"]["extra_state"] = {
        "scope": "global",
        "value": {"__pickle__": base64.b64encode(pickle.dumps(Payload(str(sentinel)))).decode()},
    }
    meta_file.write_text(json.dumps(doc))
    with pytest.raises(PickleNotAllowedError):
        acp.load(path, {**zeros_like_state(), "extra_state": {}})
    assert not sentinel.exists(), "a pickled value was unpickled without allow_pickle=True"
    meta_file.write_text(text)
    after = files_under(tmp_path)
    assert after == before, "loading hostile metadata wrote or changed files"
    assert_equal_state(acp.load(path, zeros_like_state()), state_for(3))
    # The payload is live: unpickling it (what a pickle-based format would do) creates the file.
    pickle.loads(variants["pickle"])
    assert sentinel.exists()


UNSAFE_SAVE = """
import sys, torch, arraycheckpoint as acp
from arraycheckpoint.errors import UnsafeNameError
root = sys.argv[1]
try:
    acp.save(root + "/ck", {"model": {"../../evil": torch.ones(2)}})
    raise SystemExit("an unsafe name was accepted")
except UnsafeNameError:
    pass
acp.save(root + "/ok", {"model": {"w": torch.ones(2)}})  # the engine must still take saves
print("OK")
"""


def test_unsafe_names_are_refused_at_save(tmp_path: Path) -> None:
    # In a subprocess: a refused save must not wedge the process-wide engine for later saves.
    try:
        proc = subprocess.run(
            [sys.executable, "-c", UNSAFE_SAVE, str(tmp_path)], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            "the save after a refused unsafe name hung: engine.save_async left its previous future "
            "pending when _declare raised"
        )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr
    assert not (tmp_path / "evil").exists() and not (tmp_path.parent / "evil").exists()
    assert sorted(os.listdir(tmp_path)) == ["ok"]


# ------------------------------------------------------------------------------- concurrent saves
class GateFile(LocalStorage):
    """Local storage whose flush waits until the file named by ACP_GATE exists."""

    def normalize(self, url: str) -> str:
        return super().normalize(url.removeprefix("gatefile://"))

    def flush(self, root: str) -> None:
        gate = Path(os.environ["ACP_GATE"])
        Path(str(gate) + ".waiting").touch()
        deadline = time.monotonic() + 120
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        super().flush(root)


def _slow_saver(path: str, gate: str) -> None:
    os.environ["ACP_GATE"] = gate
    register_scheme("gatefile", GateFile)
    acp.save(f"gatefile://{path}", state_for(7))


def test_concurrent_save_to_same_path_is_refused(tmp_path: Path) -> None:
    import multiprocessing as mp

    target, gate = tmp_path / "ck", tmp_path / "gate"
    proc = mp.get_context("spawn").Process(target=_slow_saver, args=(str(target), str(gate)))
    proc.start()
    try:
        wait_for(Path(str(gate) + ".waiting"), 120, [proc])
        with pytest.raises(CheckpointExistsError, match="in progress"):
            acp.save(target, state_for(8))
        gate.touch()
        proc.join(120)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    assert_equal_state(acp.load(target, zeros_like_state()), state_for(7))
    with pytest.raises(CheckpointExistsError, match="already exists"):
        acp.save(target, state_for(8))
    assert sorted(os.listdir(tmp_path)) == ["ck", "gate", "gate.waiting"]


def test_concurrent_saves_in_one_process_never_interleave(tmp_path: Path) -> None:
    first = acp.save_async(tmp_path / "ck", state_for(1))
    with pytest.raises(CheckpointExistsError):
        acp.save_async(tmp_path / "ck", state_for(2)).result()
    first.result()
    assert_equal_state(acp.load(tmp_path / "ck", zeros_like_state()), state_for(1))
    assert np.array_equal(acp.read_metadata(tmp_path / "ck").tensors["model/w"].shape, (64, 32))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
