"""Checkpoints written by the format-7 code keep loading bit-exactly after format 8 (cyclic writers).

The fixtures under ``tests/fixtures/format7/`` were written by the last code of format_version 7 (commit
c1474e5, see ``tests/fixtures/make_format7.py``): sharded layouts' writers derived (``"writers": "held"``),
replicated chunks' writers listed. They load bit-exactly in one process and into FSDP2 at 3 gloo ranks, and
``verify`` passes them.
"""

from __future__ import annotations

import json
import os

import torch
from fixtures import compat
from fixtures.make_format2 import fsdp_model, full_state

import arraycheckpoint as acp
from arraycheckpoint.cli import main as cli

FIXTURES = compat.fixtures(7)


def test_format7_fixture_derives_writers_and_loads_bit_exactly(tmp_path, capsys) -> None:
    kinds = set()
    for name in ("single", "fsdp2"):
        with open(os.path.join(FIXTURES, name, ".acp", "metadata.json")) as f:
            doc = json.load(f)
        assert doc["format_version"] == 7
        kinds |= {"held" if t["writers"] == "held" else "listed" for t in doc["tensors"].values()}
    assert kinds == {"held", "listed"}, kinds  # both kinds of format-7 writers are read
    model, opt, extra = compat.load_single(compat.copy(tmp_path, FIXTURES, "single"))
    compat.same(full_state(model, opt), compat.expected(FIXTURES, "single"))
    compat.check_single_extra(extra)
    model = fsdp_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    path = compat.copy(tmp_path, FIXTURES, "fsdp2")
    out = acp.load(path, {"model": model, "optimizer": opt, "extra_state": {"step": 0}})
    compat.same(full_state(model, opt), compat.expected(FIXTURES, "fsdp2"))
    assert out["extra_state"]["step"] == 12
    assert cli(["verify", str(path)]) == 0
    assert capsys.readouterr().out.startswith("OK")


def _fsdp2_load_body(rank, world, path, expected_path):
    from fixtures.make_format2 import fsdp2_trained
    from safetensors.numpy import load_file

    model, opt = fsdp2_trained(rank + 7, world)  # other values than the saved ones, optimizer state present
    out = acp.load(path, {"model": model, "optimizer": opt, "extra_state": {"step": 0}})
    compat.same(full_state(model, opt), load_file(expected_path))
    return out["extra_state"]["step"] == 12


def test_format7_fsdp2_checkpoint_loads_into_fsdp2_at_3_ranks(tmp_path) -> None:
    from dist import run_distributed

    path = compat.copy(tmp_path, FIXTURES, "fsdp2")
    expected_path = os.path.join(FIXTURES, "fsdp2.expected.safetensors")
    assert run_distributed(_fsdp2_load_body, world=3, args=(str(path), expected_path)) == [True] * 3
