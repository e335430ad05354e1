"""Hostile control files: format 3's ``.acp/`` node and the root files of format 1 and 2 get the same checks.

Nothing is read through a link (the ``.acp`` directory itself included), a FIFO never blocks a reader, an
oversized metadata file is refused before it is read, and the tools (verify) report the same errors.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from hostile import load_in_subprocess, save_small

import arraycheckpoint as acp
from arraycheckpoint.checks.bounds import MAX_METADATA_BYTES
from arraycheckpoint.errors import CorruptCheckpointError, MetadataError
from arraycheckpoint.format.metadata import CONTROL, CONTROL_DIR, LEGACY_CONTROL
from arraycheckpoint.tools.verify import verify

FORMAT2 = os.path.join(os.path.dirname(__file__), "..", "fixtures", "format2", "fsdp2")


def _target() -> dict:
    return {"model": torch.nn.Linear(64, 32)}


def _two(tmp_path: Path) -> tuple[str, str]:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    save_small(a)
    torch.manual_seed(1)
    acp.save(b, _target())
    return a, b


def test_symlinked_control_directory_is_refused(tmp_path: Path) -> None:
    """``.acp`` -> another checkpoint's ``.acp``: the metadata would be read through the link."""
    a, b = _two(tmp_path)
    shutil.rmtree(os.path.join(a, CONTROL_DIR))
    os.symlink(os.path.join(b, CONTROL_DIR), os.path.join(a, CONTROL_DIR))
    where = re.escape(os.path.join(a, CONTROL_DIR))
    with pytest.raises(CorruptCheckpointError, match=f"{where} is a symlink"):
        acp.load(a, _target())
    with pytest.raises(CorruptCheckpointError, match=f"{where} is a symlink"):
        verify(a)


@pytest.mark.parametrize("key", [CONTROL.committed, CONTROL.metadata])
def test_symlinked_control_file_is_refused(tmp_path: Path, key: str) -> None:
    a, b = _two(tmp_path)
    os.remove(os.path.join(a, key))
    os.symlink(os.path.join(b, key), os.path.join(a, key))
    with pytest.raises(CorruptCheckpointError, match=re.escape(key) + " is a symlink"):
        acp.load(a, _target())


@pytest.mark.parametrize("key", [CONTROL.committed, CONTROL.metadata])
def test_fifo_control_file_is_refused_at_once(tmp_path: Path, key: str) -> None:
    ck = str(tmp_path / "ck")
    save_small(ck)
    os.remove(os.path.join(ck, key))
    os.mkfifo(os.path.join(ck, key))
    out = load_in_subprocess(ck, timeout=60)
    assert out.startswith("RAISED CorruptCheckpointError") and "not a regular file" in out, out


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_control_directory_that_is_no_directory_is_refused(tmp_path: Path, kind: str) -> None:
    ck = str(tmp_path / "ck")
    save_small(ck)
    shutil.rmtree(os.path.join(ck, CONTROL_DIR))
    path = os.path.join(ck, CONTROL_DIR)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        Path(path).write_text("{}")
    out = load_in_subprocess(ck, timeout=60)
    assert out.startswith("RAISED CorruptCheckpointError") and "is not a directory" in out, out


def test_oversized_metadata_is_refused_before_it_is_read(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    save_small(ck)
    with open(os.path.join(ck, CONTROL.metadata), "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: no disk used, the size alone is refused
    with pytest.raises(MetadataError, match="above the limit"):
        acp.load(ck, _target())


def test_legacy_layout_gets_the_same_checks(tmp_path: Path) -> None:
    """A format-2 checkpoint: a symlinked ``.metadata.json`` and a FIFO ``.committed`` are refused."""
    ck = str(tmp_path / "old")
    shutil.copytree(FORMAT2, ck)
    other = str(tmp_path / "other")
    shutil.copytree(FORMAT2, other)
    os.remove(os.path.join(ck, LEGACY_CONTROL.metadata))
    os.symlink(os.path.join(other, LEGACY_CONTROL.metadata), os.path.join(ck, LEGACY_CONTROL.metadata))
    with pytest.raises(CorruptCheckpointError, match=re.escape(LEGACY_CONTROL.metadata) + " is a symlink"):
        acp.read_metadata(ck)
    os.remove(os.path.join(other, LEGACY_CONTROL.committed))
    os.mkfifo(os.path.join(other, LEGACY_CONTROL.committed))
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        acp.read_metadata(other)
