"""Checkpoints written by the format-6 code keep loading bit-exactly after format 7 (derived writers).

The fixtures under ``tests/fixtures/format6/`` were written by the last code of format_version 6 (commit
07bac1b, see ``tests/fixtures/make_format6.py``): chunk files in their writers' packs, every writer listed.
They load bit-exactly in one process and into FSDP2 at 3 gloo ranks, zarr-python reads every tensor through
:func:`arraycheckpoint.zarr.checkpoint_store`, and ``verify`` passes them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from fixtures import compat
from fixtures.compat import check_single_extra as _check_single_extra
from fixtures.compat import load_single as _load_single
from fixtures.compat import same as _same
from fixtures.make_format2 import fsdp_model, full_state
from safetensors.numpy import load_file

import arraycheckpoint as acp
from arraycheckpoint.cli import main as cli

FIXTURES = compat.fixtures(6)


def _copy(tmp_path, name: str):
    return compat.copy(tmp_path, FIXTURES, name)


def test_format6_fixture_lists_every_writer_and_loads_bit_exactly(tmp_path) -> None:
    for name in ("single", "fsdp2"):
        with open(os.path.join(FIXTURES, name, ".acp", "metadata.json")) as f:
            doc = json.load(f)
        assert doc["format_version"] == 6
        assert all(isinstance(t["writers"], list) for t in doc["tensors"].values())
    assert any(
        len(set(t["writers"])) > 1 for t in doc["tensors"].values()
    )  # fsdp2: chunks in both ranks' packs
    model, opt, extra = _load_single(_copy(tmp_path, "single"))
    _same(full_state(model, opt), compat.expected(FIXTURES, "single"))
    _check_single_extra(extra)
    model = fsdp_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    out = acp.load(_copy(tmp_path, "fsdp2"), {"model": model, "optimizer": opt, "extra_state": {"step": 0}})
    _same(full_state(model, opt), compat.expected(FIXTURES, "fsdp2"))
    assert out["extra_state"]["step"] == 12


def _fsdp2_load_body(rank, world, path, expected_path):
    from fixtures.make_format2 import fsdp2_trained

    model, opt = fsdp2_trained(rank + 7, world)  # other values than the saved ones, optimizer state present
    out = acp.load(path, {"model": model, "optimizer": opt, "extra_state": {"step": 0}})
    _same(full_state(model, opt), load_file(expected_path))
    return out["extra_state"]["step"] == 12


def test_format6_fsdp2_checkpoint_loads_into_fsdp2_at_3_ranks(tmp_path) -> None:
    from dist import run_distributed

    path = _copy(tmp_path, "fsdp2")
    expected_path = os.path.join(FIXTURES, "fsdp2.expected.safetensors")
    assert run_distributed(_fsdp2_load_body, world=3, args=(str(path), expected_path)) == [True] * 3


@pytest.mark.parametrize("name", ["single", "fsdp2"])
def test_format6_readers(tmp_path, capsys, name) -> None:
    """verify passes it, and zarr-python reads every expected tensor bit-exactly through the store."""
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    path = _copy(tmp_path, name)
    assert cli(["verify", str(path)]) == 0
    assert capsys.readouterr().out.startswith("OK")
    root = zarr.open_group(checkpoint_store(path), mode="r")
    for k, v in compat.expected(FIXTURES, name).items():
        if k == "model/head.weight":  # tied: stored once, as the embedding
            k = "model/emb.weight"
        _same({k: root[k][...]}, {k: v})


def test_format6_without_fill_target_loads_from_an_object_store(tmp_path, monkeypatch) -> None:
    """The first format-6 code recorded no fill target in ``pack`` (``.acp/packs/<rank>``): such a checkpoint
    (the fixture with its target taken out) loads bit-exactly from ``memory://`` (tensorstore: the
    object-store branch of every reader) and reads every pack its ranks wrote and none past them: the packs
    are listed once (``audit/packcount.py``); each rank's reader asked for the absent pack after its last."""
    import uuid
    from collections import Counter

    import arraycheckpoint.storage.memory  # noqa: F401 - registers memory://
    from arraycheckpoint.audit import packdir
    from arraycheckpoint.storage import storage_for

    path = _copy(tmp_path, "fsdp2")
    doc_path = os.path.join(path, ".acp", "metadata.json")
    with open(doc_path) as f:
        doc = json.load(f)
    for t in doc["tensors"].values():
        if t.get("pack"):
            t["pack"] = t["pack"].partition("@")[0]
    with open(doc_path, "w") as f:
        json.dump(doc, f)
    url = f"memory://untargeted/{uuid.uuid4().hex[:8]}"
    store, root = storage_for(url)
    for d, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                store.write(root, os.path.relpath(os.path.join(d, name), path).replace(os.sep, "/"), f.read())
    asked: Counter[str] = Counter()
    real = packdir._kv_ranges

    def counted(storage, base, key, want):  # every read of a pack's end, there or not
        asked[key] += 1
        return real(storage, base, key, want)

    monkeypatch.setattr(packdir, "_kv_ranges", counted)
    model = fsdp_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    out = acp.load(url, {"model": model, "optimizer": opt, "extra_state": {"step": 0}})
    _same(full_state(model, opt), compat.expected(FIXTURES, "fsdp2"))
    assert out["extra_state"]["step"] == 12
    assert asked == {".acp/packs/0.0.zip": 1, ".acp/packs/1.0.zip": 1}, asked  # no 0.1.zip, no 1.1.zip
