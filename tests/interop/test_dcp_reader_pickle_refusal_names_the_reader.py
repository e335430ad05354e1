"""A FileSystemWriter directory read by ``dcp.load`` through ``acp.dcp.Reader(dir)`` without allow_pickle: the
refusal names the call to change (``acp.dcp.Reader(path, allow_pickle=True)``, not only ``acp.load``) and DCP
reports it once (no per-rank retry repeating it), and nothing is unpickled."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import arraycheckpoint as acp
import arraycheckpoint.dcp  # noqa: F401 - acp.dcp


def test_refusal_names_the_reader_once(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
        target = {"w": torch.zeros(2)}
        with pytest.raises(BaseException) as err:  # noqa: PT011 - DCP wraps it in CheckpointException (a BaseException)
            dcp.load(target, storage_reader=acp.dcp.Reader(str(tmp_path)))
    text = str(err.value)
    assert "acp.dcp.Reader(path, allow_pickle=True)" in text
    assert text.count("is a torch.distributed.checkpoint directory") == 1, text
    assert torch.equal(target["w"], torch.zeros(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=acp.dcp.Reader(str(tmp_path), allow_pickle=True))
    assert torch.equal(target["w"], torch.ones(2))


def test_acp_load_refusal_names_acp_load(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    with pytest.raises(
        acp.errors.PickleNotAllowedError, match=r"acp\.load\(path, state, allow_pickle=True\)"
    ):
        acp.load(str(tmp_path), {"w": torch.zeros(2)})
