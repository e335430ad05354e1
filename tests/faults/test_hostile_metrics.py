"""The metrics sidecars are checkpoint input too (issue 12): a hostile ``.metrics.json`` /
``.metrics-load.json`` (deep nesting, huge, a symlink, a FIFO, not an object) is a MetadataError naming its
path, never a RecursionError, an unbounded read, a file read through a link, or a reader blocked forever."""

from __future__ import annotations

import json
import os

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.checks.bounds import MAX_METADATA_BYTES
from arraycheckpoint.format.metadata import LOAD_METRICS_FILE, METRICS_FILE
from arraycheckpoint.tools.common import open_checkpoint
from arraycheckpoint.tools.metrics import phase_table, recorded_metrics


def _plant(path: str, kind: str, elsewhere: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.remove(path)
    if kind == "deep":
        with open(path, "w") as f:
            f.write('{"save": ' + "[" * 5000 + "]" * 5000 + "}")
    elif kind == "huge":  # sparse: refused by size before a byte is read
        with open(path, "wb") as f:
            f.truncate(MAX_METADATA_BYTES + 1)
    elif kind == "symlink":
        os.symlink(elsewhere, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "not_object":
        with open(path, "w") as f:
            f.write("[1, 2, 3]")


@pytest.mark.parametrize("sidecar", [METRICS_FILE, LOAD_METRICS_FILE])
@pytest.mark.parametrize("kind", ["deep", "huge", "symlink", "fifo", "not_object"])
def test_hostile_metrics_file_is_a_metadata_error_naming_it(tmp_path, kind, sidecar) -> None:
    root = str(tmp_path / "ck")
    acp.save(root, {"model": torch.nn.Linear(4, 2)})
    ckpt = open_checkpoint(root)  # opened first: the metrics reader itself must refuse what is planted after
    elsewhere = str(
        tmp_path / "other.json"
    )  # a valid record outside the checkpoint: never read through a link
    with open(elsewhere, "w") as f:
        json.dump({"save": {"0": {"wall_start": 0.0, "phases": []}}}, f)
    _plant(os.path.join(root, sidecar), kind, elsewhere)
    with pytest.raises(acp.MetadataError) as info:
        recorded_metrics(ckpt.storage, ckpt.root, ckpt.meta)
    assert os.path.join(root, sidecar) in str(info.value), info.value


def test_valid_metrics_sidecars_are_still_read(tmp_path) -> None:
    root = str(tmp_path / "ck")
    acp.save(root, {"model": torch.nn.Linear(4, 2)})
    ckpt = open_checkpoint(root)
    records = recorded_metrics(ckpt.storage, ckpt.root, ckpt.meta)
    table = phase_table(records, "save")
    assert table.ranks == [0] and "commit" in table.phases  # the sidecar's commit phase was read
