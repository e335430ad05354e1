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
import torch
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


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _expected(name: str) -> dict[str, np.ndarray]:
    return load_file(os.path.join(FIXTURES, f"{name}.expected.safetensors"))


def _check_optimizer(
    model: torch.nn.Module, opt: torch.optim.Optimizer, expected: dict[str, np.ndarray]
) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    seen = 0
    for p, st in opt.state.items():
        for key, v in st.items():
            if torch.is_tensor(v) and v.ndim:
                full = v.full_tensor() if hasattr(v, "full_tensor") else v
                assert np.array_equal(_np(full), expected[f"optimizer/{names[id(p)]}/{key}"]), key
                seen += 1
    assert seen == sum(1 for k in expected if k.startswith("optimizer/"))


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
    for k, v in model.state_dict().items():
        assert np.array_equal(_np(v), expected[f"model/{k}"]), k
    assert model.head.weight is model.emb.weight
    _check_optimizer(model, opt, expected)
    assert opt.param_groups[0]["lr"] == 0.01
    es = out["extra_state"]
    assert es["step"] == 3 and es["cfg"]["betas"] == [0.9, 0.999]
    assert torch.equal(es["a"]["b"], torch.arange(6).reshape(2, 3))
    assert np.array_equal(np.asarray(es["arr"]), np.linspace(0, 1, 7, dtype=np.float32))


def test_format2_fsdp2_checkpoint_loads_into_plain_model(tmp_path) -> None:
    from fixtures.make_format2 import fsdp_model

    path = _copy(tmp_path, "fsdp2")
    expected = _expected("fsdp2")
    model = fsdp_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    out = acp.load(path, {"model": model, "optimizer": opt, "extra_state": {"step": 0}})
    for k, v in model.state_dict().items():
        assert np.array_equal(v.numpy(), expected[f"model/{k}"]), k
    _check_optimizer(model, opt, expected)
    assert out["extra_state"]["step"] == 12


def _fsdp2_load_body(rank, world, path, expected_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    expected = load_file(expected_path)
    torch.manual_seed(77)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    acp.load(path, {"model": model, "optimizer": opt, "extra_state": {"step": 0}})
    for k, v in model.state_dict().items():
        assert np.array_equal(v.full_tensor().detach().numpy(), expected[f"model/{k}"]), k
    _check_optimizer(model, opt, expected)
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
