"""``rename`` of a tensor that an object's document refers to keeps the checkpoint loadable (bit-exact).

Saved state beside a model (``extra_state``: plain values, tensors, ``PerRank`` values) is a JSON document
whose array references name stored tensors. Renaming such a tensor used to move the array but leave the
reference, and every later load failed with "array ... is referenced but not stored".
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.tools.rename import rename_checkpoint


def _state(scale: float) -> dict:
    return {
        "model": torch.nn.Linear(3, 2),
        "extra_state": {
            "rng": acp.PerRank({"a": torch.arange(4.0) * scale, "k": int(3 * scale)}),
            "t": torch.ones(2) * scale,
            "n": int(5 * scale),
        },
    }


@pytest.mark.parametrize("pack_array_bytes", [None, 0], ids=["packed", "dirs"])
def test_renamed_document_arrays_still_load(tmp_path: Path, pack_array_bytes: int | None) -> None:
    ck = tmp_path / "ck"
    saved = _state(1.0)
    options = None if pack_array_bytes is None else PlanOptions(pack_array_bytes=pack_array_bytes)
    acp.save(ck, saved, plan_options=options)
    packed = {n for n, t in acp.read_metadata(ck).tensors.items() if t.pack is not None}
    assert ("extra_state/t" in packed) == (pack_array_bytes is None)
    result = rename_checkpoint(
        ck, {"extra_state/t": "extra_state/u", "extra_state/~rows/0/a": "extra_state/~rows/0/b"}
    )
    assert result.tensors == {
        "extra_state/t": "extra_state/u",
        "extra_state/~rows/0/a": "extra_state/~rows/0/b",
    }
    meta = acp.read_metadata(ck)
    assert "extra_state/t" not in meta.tensors and "extra_state/u" in meta.tensors
    target = _state(0.0)
    acp.load(ck, target)
    # the document's keys keep their names; their values come from the moved arrays
    assert torch.equal(target["extra_state"]["t"], saved["extra_state"]["t"])
    assert target["extra_state"]["n"] == 5
    assert torch.equal(target["extra_state"]["rng"].value["a"], torch.arange(4.0))
    assert target["extra_state"]["rng"].value["k"] == 3
    for k, v in saved["model"].state_dict().items():
        assert torch.equal(target["model"].state_dict()[k], v)
