"""A DCP chunk's ``data.pkl`` (its tensor's storage offset, size and stride) is read with a restricted unpickler:
a record naming any other global is refused naming the tensor (nothing it names is looked up or run), and a
layout that is not dense (strides overlapping the storage) is refused naming the tensor, never read as C-order
or as some other permutation."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import arraycheckpoint as acp
from arraycheckpoint.errors import MetadataError


def _saved(path: Path) -> bytes:
    torch.manual_seed(0)
    w = torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": w}, storage_writer=dcp.FileSystemWriter(str(path)))
    (f,) = path.glob("*.distcp")
    return f.read_bytes()


def _tamper(path: Path, old: bytes, new: bytes) -> None:
    (f,) = path.glob("*.distcp")
    data = f.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    f.write_bytes(data.replace(old, new))


def test_intact_record_loads(tmp_path: Path) -> None:
    _saved(tmp_path)
    torch.manual_seed(0)
    want = torch.randn(4, 3, 3, 3)
    assert torch.equal(acp.load(str(tmp_path), {"w": torch.zeros(4, 3, 3, 3)}, allow_pickle=True)["w"], want)


def test_a_foreign_global_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    _saved(tmp_path)
    _tamper(tmp_path, b"torch._utils\n_rebuild_tensor_v2", b"torch._utils\n_rebuild_tensor_v3")
    with pytest.raises(
        MetadataError, match=r"tensor 'w'.*data\.pkl is not a plain tensor's record.*_rebuild_tensor_v3"
    ):
        acp.load(str(tmp_path), {"w": torch.zeros(4, 3, 3, 3)}, allow_pickle=True)


def test_overlapping_strides_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    _saved(tmp_path)
    _tamper(tmp_path, b"K\x1bK\x01K\tK\x03t", b"K\x1bK\x01K\tK\x00t")  # stride (27, 1, 9, 0)
    with pytest.raises(MetadataError, match=r"tensor 'w'.*stride \[27, 1, 9, 0\]: not a dense layout"):
        acp.load(str(tmp_path), {"w": torch.zeros(4, 3, 3, 3)}, allow_pickle=True)
