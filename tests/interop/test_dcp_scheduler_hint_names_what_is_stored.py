"""A torchtitan-style scheduler state saved through DCP (``{"lr_scheduler": {"last_epoch": 3}}``: a plain int per
key, each its own entry) loaded by ``acp.load`` into a LambdaLR: the mismatch hint says the checkpoint stores
plain values (never "tensors"), and the advice it gives (an empty dict in the object's place) loads them."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import arraycheckpoint as acp
import arraycheckpoint.dcp  # noqa: F401 - acp.dcp


def _scheduler() -> torch.optim.lr_scheduler.LambdaLR:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)


def _save(path: Path, value: dict) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"lr_scheduler": value}, storage_writer=acp.dcp.Writer(str(path)))
    return str(path)


def _hint(path: str) -> str:
    with pytest.raises(acp.StateMismatchError) as err:
        acp.load(path, {"lr_scheduler": _scheduler()})
    hints = [ln for ln in str(err.value).splitlines() if "hint:" in ln]
    assert len(hints) == 1, str(err.value)
    return hints[0]


def test_plain_values_are_named_as_plain_values(tmp_path: Path) -> None:
    path = _save(tmp_path / "c", {"last_epoch": 3})
    hint = _hint(path)
    assert "plain values (lr_scheduler/last_epoch)" in hint
    assert "tensors" not in hint.split("one object, ", 1)[1]
    assert acp.load(path, {"lr_scheduler": {}}) == {"lr_scheduler": {"last_epoch": 3}}


def test_mixed_entries_are_named_by_kind(tmp_path: Path) -> None:
    path = _save(tmp_path / "c", {"last_epoch": 3, "base": torch.ones(2)})
    hint = _hint(path)
    assert "plain values (lr_scheduler/last_epoch) and tensors (lr_scheduler/base)" in hint


def test_tensors_are_named_as_tensors(tmp_path: Path) -> None:
    path = _save(tmp_path / "c", {"base": torch.ones(2)})
    assert "stores it as tensors (lr_scheduler/base): make the target's entries tensors" in _hint(path)
