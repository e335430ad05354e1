"""Checkpoints written by the format-2 code keep loading bit-exactly, and every tool still reads them.

The fixtures under ``tests/fixtures/format2/`` were written by the last code of format_version 2 (see
``tests/fixtures/make_format2.py``): regions as layout rules, control files (``.metadata.json``,
``.committed``, ``.metrics.json``, ``.metrics-load.json``) in the checkpoint root. The expected tensors
beside them were written by safetensors.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from fixtures.make_format2 import fsdp_model, full_state
from safetensors.numpy import load_file

import arraycheckpoint as acp
from arraycheckpoint.cli import main as cli

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "format2")
#: The control files of format 2 (literal on purpose: this is the old layout, not today's constants).
FORMAT2_FILES = (".metadata.json", ".committed", ".metrics.json")


def _copy(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    return dst


def _expected(name: str) -> dict[str, np.ndarray]:
    return load_file(os.path.join(FIXTURES, f"{name}.expected.safetensors"))


def _same(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert np.array_equal(got[k], v), k


def test_format2_fixture_is_format2_in_the_old_layout() -> None:
    for name in ("single", "fsdp2"):
        root = os.path.join(FIXTURES, name)
        for f in FORMAT2_FILES:
            assert os.path.isfile(os.path.join(root, f)), (name, f)
        with open(os.path.join(root, ".metadata.json")) as f:
            assert json.load(f)["format_version"] == 2
    meta = acp.read_metadata(os.path.join(FIXTURES, "fsdp2"))
    assert meta.format_version == 2 and meta.step == 12 and meta.layout_groups
    assert len(meta.tensors["model/0.weight"].shards) == 2


def test_format2_single_process_loads_bit_exactly(tmp_path) -> None:
    from fixtures.make_format1 import Tied

    path = _copy(tmp_path, "single")
    expected = _expected("single")
    torch.manual_seed(123)  # different values than the saved ones
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    extra = {"step": 0, "cfg": {}, "a": {"b": torch.zeros(2, 3, dtype=torch.int64)}, "arr": None}
    out = acp.load(path, {"model": model, "optimizer": opt, "extra_state": extra})
    _same(full_state(model, opt), expected)
    assert model.head.weight is model.emb.weight
    assert opt.param_groups[0]["lr"] == 0.01
    es = out["extra_state"]
    assert es["step"] == 3 and es["cfg"]["betas"] == [0.9, 0.999]
    assert torch.equal(es["a"]["b"], torch.arange(6).reshape(2, 3))
    assert np.array_equal(np.asarray(es["arr"]), np.linspace(0, 1, 7, dtype=np.float32))


def test_format2_fsdp2_checkpoint_loads_into_plain_model(tmp_path) -> None:
    path = _copy(tmp_path, "fsdp2")
    expected = _expected("fsdp2")
    model = fsdp_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    out = acp.load(path, {"model": model, "optimizer": opt, "extra_state": {"step": 0}})
    _same(full_state(model, opt), expected)
    assert out["extra_state"]["step"] == 12


def _fsdp2_load_body(rank, world, path, expected_path):
    from fixtures.make_format2 import fsdp2_trained

    model, opt = fsdp2_trained(rank + 7, world)  # other values than the saved ones, optimizer state present
    acp.load(path, {"model": model, "optimizer": opt, "extra_state": {"step": 0}})
    _same(full_state(model, opt), load_file(expected_path))
    return True


def test_format2_fsdp2_checkpoint_loads_into_fsdp2_on_two_ranks(tmp_path) -> None:
    from dist import run_distributed

    path = _copy(tmp_path, "fsdp2")
    expected_path = os.path.join(FIXTURES, "fsdp2.expected.safetensors")
    assert run_distributed(_fsdp2_load_body, world=2, args=(str(path), expected_path)) == [True, True]


def test_format2_tools_read_it(tmp_path, capsys) -> None:
    """verify, inspect, metrics, diff and export read a format-2 checkpoint."""
    path = str(_copy(tmp_path, "fsdp2"))
    single = str(_copy(tmp_path, "single"))
    assert cli(["verify", path]) == 0
    capsys.readouterr()
    assert cli(["inspect", "--json", path]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["committed"] is True and doc["format_version"] == 2 and doc["step"] == 12
    assert cli(["metrics", "--json", path]) == 0
    assert cli(["metrics", "--json", "--kind", "load", single]) == 0
    capsys.readouterr()
    assert cli(["diff", path, os.path.join(FIXTURES, "fsdp2")]) == 0
    assert cli(["export", path, str(tmp_path / "out")]) == 0
    exported = load_file(str(tmp_path / "out" / "model-00001-of-00001.safetensors"))
    expected = {k[len("model/") :]: v for k, v in _expected("fsdp2").items() if k.startswith("model/")}
    assert sorted(exported) == sorted(expected)
    for k, v in expected.items():
        assert np.array_equal(exported[k], v), k


def test_format2_rename_keeps_it_format2_in_its_layout(tmp_path) -> None:
    """A tool that rewrites metadata keeps an old checkpoint in its own format and its own file layout."""
    from arraycheckpoint.tools.rename import rename_checkpoint

    path = _copy(tmp_path, "fsdp2")
    before = sorted(os.listdir(path))
    rename_checkpoint(path, {"0.weight": "first.weight"})
    assert sorted(os.listdir(path)) == before
    with open(os.path.join(path, ".metadata.json")) as f:
        assert json.load(f)["format_version"] == 2
    meta = acp.read_metadata(path)
    assert meta.format_version == 2 and "model/first.weight" in meta.tensors
    assert "optimizer/first.weight/exp_avg" in meta.tensors
    expected = _expected("fsdp2")
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    acp.load(path, {"model": model}, key_map={"model/0.weight": "model/first.weight"})
    assert np.array_equal(model[0].weight.detach().numpy(), expected["model/0.weight"])


def test_format2_load_record_stays_in_its_layout(tmp_path) -> None:
    """A recorded load of an old checkpoint writes beside its metadata: no ``.acp`` appears in it."""
    from arraycheckpoint.tools.common import open_checkpoint
    from arraycheckpoint.tools.metrics import recorded_metrics

    path = _copy(tmp_path, "fsdp2")
    assert not os.path.exists(path / ".metrics-load.json")
    acp.load(path, {"model": fsdp_model()}, strict=False, record_metrics=True)
    assert os.path.isfile(path / ".metrics-load.json") and not os.path.exists(path / ".acp")
    ckpt = open_checkpoint(path)
    records = recorded_metrics(ckpt.storage, ckpt.root, ckpt.meta)
    assert "load" in records and "save" in records


def test_manager_lists_restores_and_retires_format2_steps(tmp_path) -> None:
    """A manager root holding format-2 steps: they count as committed, restore, and retention removes them."""
    from arraycheckpoint.manager import CheckpointManager

    root = tmp_path / "run"
    root.mkdir()
    shutil.copytree(os.path.join(FIXTURES, "fsdp2"), root / "step_00000001")
    shutil.copytree(os.path.join(FIXTURES, "fsdp2"), root / "step_00000002")
    with CheckpointManager(root, keep_last=2) as mgr:  # cleanup on start must keep the old steps
        assert mgr.all_steps() == [1, 2]
        model = fsdp_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.5)
        mgr.restore(2, state={"model": model, "optimizer": opt, "extra_state": {"step": 0}})
        _same(full_state(model, opt), _expected("fsdp2"))
        mgr.save(3, {"model": model}).result()
        assert mgr.all_steps() == [2, 3]
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000003"]


def test_roles_of_both_formats_are_found(tmp_path) -> None:
    """A roles root with a format-2 role and a format-3 role: both listed, and named by the not-found error."""
    from arraycheckpoint.format.metadata import marker_owner
    from arraycheckpoint.stateful import list_roles

    assert marker_owner(".acp/committed") == "" and marker_owner(".committed") == ""
    assert marker_owner("actor/.acp/committed") == "actor" and marker_owner("a/b/.committed") == "a/b"
    assert marker_owner("actor/.acp/metadata.json") is None and marker_owner("x/committed") is None
    root = tmp_path / "roles"
    shutil.copytree(os.path.join(FIXTURES, "fsdp2"), root / "old")
    acp.save(root / "new", {"model": fsdp_model()})
    assert list_roles(root) == ["new", "old"]
    with pytest.raises(acp.CheckpointNotFoundError, match="new, old"):
        acp.load(root, {"model": fsdp_model()})
