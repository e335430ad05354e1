"""Hostile checkpoints on a local file system (issue 12): every case fails cleanly with an error naming the
tensor or path; none crashes, hangs, or reads outside the checkpoint. Cases that used to abort the process
(``std::bad_alloc``) or block forever (a FIFO) run in a subprocess with a time limit."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hostile import UNPACKED, chunk_files, edit_metadata, edit_zarr_json, load_in_subprocess, save_small

import arraycheckpoint as acp
from arraycheckpoint.checks import bounds, limits
from arraycheckpoint.checks import zstd as checks_zstd
from arraycheckpoint.codecs import array_metadata
from arraycheckpoint.errors import CorruptCheckpointError, MetadataError, StorageError
from arraycheckpoint.format.metadata import METADATA_FILE


def _target() -> dict[str, torch.nn.Module]:
    return {"model": torch.nn.Linear(64, 32)}


# Sizes from the metadata --------------------------------------------------------------------------------
def test_chunk_larger_than_shape_is_refused_before_allocation(tmp_path: Path) -> None:
    """chunk [2**45] for a [32] tensor aborted the process with std::bad_alloc in ts.open."""
    ck = str(tmp_path / "ck")
    save_small(ck)
    edit_metadata(
        ck, lambda d: d["tensors"]["model/bias"].update(chunk_shape=[2**45], inner_chunk_shape=[2**45])
    )
    out = load_in_subprocess(ck)
    assert out.startswith("RAISED MetadataError") and "model/bias" in out, out


def test_zarr_json_shape_1e13_with_unknown_preset_is_refused(tmp_path: Path) -> None:
    """codec_preset != 1 makes the loader read zarr.json; a shape of 1e13 there aborted the process."""
    ck = str(tmp_path / "ck")
    save_small(ck)
    edit_metadata(ck, lambda d: d.update(codec_preset=0))

    def huge(doc: dict) -> None:
        doc["shape"] = [10**13]
        doc["chunk_grid"]["configuration"]["chunk_shape"] = [10**13]
        doc["codecs"][0]["configuration"]["chunk_shape"] = [10**13]

    edit_zarr_json(os.path.join(ck, "model/bias"), huge)
    out = load_in_subprocess(ck)
    assert out.startswith("RAISED MetadataError") and "model/bias" in out and "zarr.json" in out, out


def test_extra_state_array_of_shape_1e13_is_refused_naming_the_entry(tmp_path: Path) -> None:
    """An extra_state array declared [1e13] made numpy raise MemoryError while sizing the load buffer."""
    ck = str(tmp_path / "ck")
    save_small(ck, extra={"buf": np.arange(32, dtype=np.int64)})
    name = next(n for n in json.loads((Path(ck) / METADATA_FILE).read_text())["tensors"] if "extra" in n)

    def huge(doc: dict) -> None:
        t = doc["tensors"][name]
        t["shape"] = [10**13]
        t["shards"] = [[[0], [10**13], 0]]

    edit_metadata(ck, huge)
    out = load_in_subprocess(ck, extra='state["extra_state"] = {}')
    # a MetadataError naming the entry: the format-2 parser refuses the writer list (one writer for 3e11
    # chunks), or, where that passes, the on-disk check (InconsistentCheckpointError, also a MetadataError)
    assert out.startswith(("RAISED MetadataError", "RAISED InconsistentCheckpointError")) and name in out, out
    assert issubclass(bounds.InconsistentCheckpointError, MetadataError)


def test_chunk_bytes_are_bounded() -> None:
    with pytest.raises(MetadataError, match="above the limit"):
        limits.check_tensor_layout("t", (2**40,), "float32", (2**31,), (2**20,))
    with pytest.raises(MetadataError, match="exceeds the array dimension"):
        limits.check_tensor_layout("t", (32,), "float32", (64,), (64,))
    with pytest.raises(MetadataError, match="inner chunks"):
        limits.check_tensor_layout("t", (2**30,), "bool", (2**30,), (1,))
    # a zero-length dimension keeps its chunk of 1 (zarr requires chunk dimensions >= 1)
    limits.check_tensor_layout("t", (0, 5), "float32", (1, 5), (1, 5))
    limits.check_tensor_layout("t", (), "float32", (), ())


def test_zero_length_tensors_still_load(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    acp.save(
        ck, {"extra_state": {"empty": np.zeros((0, 3), np.float32), "scalar": np.float64(2.5)}}
    )  # packed
    out = acp.load(ck, {"extra_state": {}})
    assert out["extra_state"]["empty"].shape == (0, 3)


# Links and special files ----------------------------------------------------------------------------------
def _two_checkpoints(tmp_path: Path) -> tuple[str, str]:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    save_small(a)
    torch.manual_seed(1)
    acp.save(b, {"model": torch.nn.Linear(64, 32)}, plan_options=acp.PlanOptions(**UNPACKED))
    return a, b


def test_chunk_file_symlink_is_refused(tmp_path: Path) -> None:
    a, b = _two_checkpoints(tmp_path)
    victim = chunk_files(os.path.join(a, "model/weight"))[0]
    os.remove(victim)
    os.symlink(chunk_files(os.path.join(b, "model/weight"))[0], victim)
    with pytest.raises(CorruptCheckpointError, match="symlink") as e:
        acp.load(a, _target())
    assert victim in str(e.value)


def test_array_directory_symlink_is_refused(tmp_path: Path) -> None:
    a, b = _two_checkpoints(tmp_path)
    shutil.rmtree(os.path.join(a, "model/weight"))
    os.symlink(os.path.join(b, "model/weight"), os.path.join(a, "model/weight"))
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        acp.load(a, _target())


def test_metadata_symlink_is_refused(tmp_path: Path) -> None:
    a, b = _two_checkpoints(tmp_path)
    os.remove(os.path.join(a, METADATA_FILE))
    os.symlink(os.path.join(b, METADATA_FILE), os.path.join(a, METADATA_FILE))
    with pytest.raises(CorruptCheckpointError, match=re.escape(METADATA_FILE) + " is a symlink"):
        acp.load(a, _target())


def test_checkpoint_root_may_be_a_symlink(tmp_path: Path) -> None:
    a, _b = _two_checkpoints(tmp_path)
    link = tmp_path / "latest"
    os.symlink(a, link)
    state = _target()
    acp.load(str(link), state)
    ref = _target()
    acp.load(a, ref)
    assert torch.equal(state["model"].weight, ref["model"].weight)


def test_fifo_chunk_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO in place of a chunk file blocked the load forever."""
    ck = str(tmp_path / "ck")
    save_small(ck)
    victim = chunk_files(os.path.join(ck, "model/weight"))[0]
    os.remove(victim)
    os.mkfifo(victim)
    start = time.monotonic()
    out = load_in_subprocess(ck, timeout=60)
    assert out.startswith("RAISED CorruptCheckpointError") and "not a regular file" in out, out
    assert time.monotonic() - start < 60


def test_fifo_metadata_is_refused_at_once(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    save_small(ck)
    os.remove(os.path.join(ck, METADATA_FILE))
    os.mkfifo(os.path.join(ck, METADATA_FILE))
    out = load_in_subprocess(ck, timeout=60)
    assert out.startswith("RAISED CorruptCheckpointError") and "regular file" in out, out


# Integrity checks cannot be switched off ----------------------------------------------------------------
def test_checkpoint_cannot_turn_crc32c_off(tmp_path: Path) -> None:
    """codec_preset 0 plus a zarr.json without crc32c and one changed value loaded the wrong data silently."""
    import tensorstore as ts

    ck = str(tmp_path / "ck")
    saved = save_small(ck)
    edit_metadata(ck, lambda d: d.update(codec_preset=0))
    tm = acp.read_metadata(ck).tensors["model/weight"]
    meta = array_metadata(tm.shape, np.float32, tm.chunk_shape, tm.inner_chunk_shape)
    cfg = meta["codecs"][0]["configuration"]
    cfg["codecs"] = [c for c in cfg["codecs"] if c["name"] != "crc32c"]
    cfg["index_codecs"] = [c for c in cfg["index_codecs"] if c["name"] != "crc32c"]
    array_dir = os.path.join(ck, "model/weight")
    shutil.rmtree(array_dir)
    forged = saved["weight"].numpy().copy()
    forged[0, 0] += 1.0
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": array_dir + "/"}, "metadata": meta}
    arr = ts.open(spec, create=True).result()
    arr[...] = forged
    with pytest.raises(MetadataError, match="crc32c") as e:
        acp.load(ck, _target())
    assert "model/weight" in str(e.value)


def _bomb_chunk(tmp_path: Path, decoded_bytes: int) -> bytes:
    """A real tensorstore chunk file: one zstd inner chunk of zeros that inflates to ``decoded_bytes``."""
    import tensorstore as ts

    n = decoded_bytes // 4
    d = tmp_path / "bomb"
    meta = array_metadata((n,), np.float32, (n,), (n,), "zstd", compression_level=19)
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(d) + "/"},
        "metadata": meta,
        "store_data_equal_to_fill_value": True,
    }
    arr = ts.open(spec, create=True).result()
    arr.write(np.zeros(n, np.float32)).result()
    return (d / "c.0").read_bytes()


def test_zstd_bomb_is_refused_before_inflating(tmp_path: Path) -> None:
    """A 2 KB chunk that inflates to 64 MiB (512 MiB in the report) in place of an 8 KB chunk."""
    ck = str(tmp_path / "ck")
    save_small(ck, compression="zstd")
    bomb = _bomb_chunk(tmp_path, 64 << 20)
    assert len(bomb) < 64 << 10
    victim = chunk_files(os.path.join(ck, "model/weight"))[0]
    Path(victim).write_bytes(bomb)
    with pytest.raises(CorruptCheckpointError, match="zstd frame declares 67108864") as e:
        acp.load(ck, _target())
    assert "model/weight" in str(e.value)


def test_oversized_chunk_file_is_refused(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    save_small(ck)
    victim = chunk_files(os.path.join(ck, "model/bias"))[0]
    Path(victim).write_bytes(b"\0" * 4096)
    with pytest.raises(CorruptCheckpointError, match="larger than any encoding"):
        acp.load(ck, _target())


def test_zstd_frame_checks() -> None:
    def frame(fcs: int, blocks: list[bytes], single: bool = True) -> bytes:
        fhd = (3 << 6 if not single else 3 << 6) | (1 << 5 if single else 0)
        return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + fcs.to_bytes(8, "little") + b"".join(blocks)

    def rle(size: int, last: bool) -> bytes:
        return ((size << 3) | (1 << 1) | int(last)).to_bytes(3, "little") + b"\x00"

    checks_zstd.check_zstd_frame(frame(1000, [rle(1000, True)]), 1000, "t")
    with pytest.raises(CorruptCheckpointError, match="declares 2000"):
        checks_zstd.check_zstd_frame(frame(2000, [rle(2000, True)]), 1000, "t")
    with pytest.raises(CorruptCheckpointError, match="more or larger blocks"):  # content size lies
        checks_zstd.check_zstd_frame(frame(1000, [rle(1000, False)] * 40 + [rle(1000, True)]), 1000, "t")
    with pytest.raises(CorruptCheckpointError, match="followed by other data"):
        checks_zstd.check_zstd_frame(frame(1000, [rle(1000, True)]) + b"\x28\xb5\x2f\xfd", 1000, "t")
    no_size = b"\x28\xb5\x2f\xfd\x00\x58" + rle(1000, True)  # window descriptor, no content size
    with pytest.raises(CorruptCheckpointError, match="does not declare its content size"):
        checks_zstd.check_zstd_frame(no_size, 1000, "t")


# JSON --------------------------------------------------------------------------------------------------
def test_deeply_nested_extra_state_is_a_metadata_error(tmp_path: Path) -> None:
    """JSON nested thousands deep raised RecursionError."""
    ck = str(tmp_path / "ck")
    save_small(ck, extra={"step": 1})
    raw = (Path(ck) / METADATA_FILE).read_text()
    deep = "[" * 5000 + "]" * 5000
    raw = raw.replace('"step":1', f'"step":{deep}', 1)
    (Path(ck) / METADATA_FILE).write_text(raw)
    with pytest.raises(MetadataError, match="nests JSON 50.. levels deep"):
        acp.load(ck, {"model": torch.nn.Linear(64, 32), "extra_state": {}})


def test_load_json_bounded() -> None:
    assert bounds.load_json_bounded(b'{"a": ["[[[", {"b": 1}]}', max_bytes=100, what="x") == {
        "a": ["[[[", {"b": 1}]
    }
    assert bounds.json_depth(b'"\\"[[[["') == 0
    with pytest.raises(MetadataError, match="above the limit of 10"):
        bounds.load_json_bounded(b"[" * 11 + b"]" * 11, max_bytes=100, max_depth=10, what="x")
    with pytest.raises(MetadataError, match="bytes, above the limit"):
        bounds.load_json_bounded(b"[1, 2, 3]", max_bytes=4, what="x")
    with pytest.raises(MetadataError, match="not valid JSON"):
        bounds.load_json_bounded(b"\xff[", max_bytes=100, what="x")


# Paths ------------------------------------------------------------------------------------------------
def test_parent_is_a_regular_file_names_the_problem(tmp_path: Path) -> None:
    """Used to report "another save ... is in progress"."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="is a regular file, not a directory") as e:
        acp.save(str(tmp_path / "file" / "ck"), _target())
    assert str(tmp_path / "file") in str(e.value)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_fsspec_local_refuses_links_and_special_files(tmp_path: Path, kind: str) -> None:
    a, b = _two_checkpoints(tmp_path)
    url = f"local://{tmp_path}/f"
    acp.save(url, _target(), plan_options=acp.PlanOptions(**UNPACKED))
    victim = chunk_files(str(tmp_path / "f" / "model" / "weight"))[0]
    os.remove(victim)
    if kind == "symlink":
        os.symlink(chunk_files(os.path.join(b, "model/weight"))[0], victim)
    else:
        os.mkfifo(victim)
    with pytest.raises(
        CorruptCheckpointError, match="symlink" if kind == "symlink" else "not a regular file"
    ):
        acp.load(url, _target())
