"""Checkpoints written by earlier releases keep loading bit-exactly (format_version 1 fixtures).

The fixtures under ``tests/fixtures/format1/`` were written by arraycheckpoint 0.1.0 (see
``tests/fixtures/make_format1.py``); the expected tensors beside them were written by safetensors.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import arraycheckpoint as acp

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "format1")


def _copy(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    return dst


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def test_format1_metadata_reads() -> None:
    meta = acp.read_metadata(os.path.join(FIXTURES, "single"))
    assert meta.step == 3
    assert "model/emb.weight" in meta.tensors


def test_format1_single_process_loads_bit_exactly(tmp_path) -> None:
    from fixtures.make_format1 import Tied

    path = _copy(tmp_path, "single")
    expected = load_file(os.path.join(FIXTURES, "single.expected.safetensors"))
    torch.manual_seed(123)  # different values than the saved ones
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    extra = {"step": 0, "cfg": {}, "a": {"b": torch.zeros(2, 3, dtype=torch.int64)}, "arr": None}
    out = acp.load(path, {"model": model, "optimizer": opt, "extra_state": extra})
    for k, v in model.state_dict().items():
        assert np.array_equal(_np(v), expected[f"model/{k}"]), k
    assert model.head.weight is model.emb.weight
    names = {id(p): n for n, p in model.named_parameters()}
    seen = 0
    for p, st in opt.state.items():
        for key, v in st.items():
            if torch.is_tensor(v) and v.ndim:
                assert np.array_equal(_np(v), expected[f"optimizer/{names[id(p)]}/{key}"]), key
                seen += 1
    assert seen == sum(1 for k in expected if k.startswith("optimizer/"))
    assert opt.param_groups[0]["lr"] == 0.01
    es = out["extra_state"]
    assert es["step"] == 3 and es["cfg"]["betas"] == [0.9, 0.999]
    assert torch.equal(es["a"]["b"], torch.arange(6).reshape(2, 3))
    assert np.array_equal(np.asarray(es["arr"]), np.linspace(0, 1, 7, dtype=np.float32))


@pytest.mark.parametrize("world", [1])
def test_format1_fsdp2_checkpoint_loads_into_plain_model(tmp_path, world) -> None:
    path = _copy(tmp_path, "fsdp2")
    expected = load_file(os.path.join(FIXTURES, "fsdp2.expected.safetensors"))
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    out = acp.load(path, {"model": model, "extra_state": {"step": 0}})
    for k, v in model.state_dict().items():
        assert np.array_equal(v.numpy(), expected[f"model/{k}"]), k
    assert out["extra_state"]["step"] == 12


def test_format1_tied_checkpoint_loads_untied_on_the_meta_device(tmp_path) -> None:
    """Issue 13 read paths on a format-1 checkpoint: stored aliases resolved for an untied target, optimizer
    state following each parameter, materialisation from the meta device, numpy-free extra state."""
    from fixtures.make_format1 import Tied

    path = _copy(tmp_path, "single")
    expected = load_file(os.path.join(FIXTURES, "single.expected.safetensors"))
    with torch.device("meta"):
        model = Tied()
        model.head.weight = torch.nn.Parameter(torch.empty(11, 6))  # untied
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    acp.load(path, {"model": model, "optimizer": opt}, device="cpu")
    assert model.head.weight is not model.emb.weight
    assert np.array_equal(_np(model.head.weight), expected["model/emb.weight"])
    for k, v in model.state_dict().items():
        if k != "head.weight":
            assert np.array_equal(_np(v), expected[f"model/{k}"]), k
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        stored = "emb.weight" if names[id(p)] == "head.weight" else names[id(p)]
        for key, v in st.items():
            if torch.is_tensor(v) and v.ndim:
                assert np.array_equal(_np(v), expected[f"optimizer/{stored}/{key}"]), (names[id(p)], key)
    assert len(opt.state) == 6


def test_format1_metadata_rewritten_by_tools_stays_format1(tmp_path) -> None:
    """Tools that rewrite metadata (rename) keep an old checkpoint in its own format."""
    from arraycheckpoint.format.metadata import CheckpointMetadata

    meta = acp.read_metadata(os.path.join(FIXTURES, "fsdp2"))
    again = CheckpointMetadata.from_json(meta.to_json())
    assert again.format_version == 1
    assert again.tensors["model/0.weight"].shards == meta.tensors["model/0.weight"].shards
    assert len(meta.tensors["model/0.weight"].shards) == 2
