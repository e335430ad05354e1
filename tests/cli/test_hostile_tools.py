"""Hostile input at the command's entry points (issue 24): every tool answers exit 2 naming the bad input,
never a traceback; a planted rename journal moves nothing outside the checkpoint; a save refuses, before
writing anything, every name a load refuses. Run in process (``cli.main``), on tiny checkpoints."""

from __future__ import annotations

import itertools
import json
import os
import random
import struct

import numpy as np
import pytest
import torch
from cli_helpers import run_main

import arraycheckpoint as acp
from arraycheckpoint.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from arraycheckpoint.errors import UnsafeNameError
from arraycheckpoint.format.metadata import ShardMeta, TensorMeta
from arraycheckpoint.tools.verify import uncovered

JOURNAL = ".acp-rename.json"


_run = run_main


@pytest.fixture
def ckpt(tmp_path):
    """A committed checkpoint of one small model, and the model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    path = tmp_path / "ck"
    acp.save(path, {"model": model})
    return path, model


def _assert_loads(path, model) -> None:
    dst = torch.nn.Linear(3, 2)
    acp.load(path, {"model": dst})
    assert torch.equal(dst.weight, model.weight) and torch.equal(dst.bias, model.bias)


def _victim(tmp_path):
    victim = tmp_path / "victim" / "tree"
    victim.mkdir(parents=True)
    (victim / "precious").write_text("keep me")
    return victim


# rename journal ------------------------------------------------------------------------------------------
def test_planted_journal_naming_a_directory_outside_moves_nothing(ckpt, tmp_path, capsys):
    path, model = ckpt
    victim = _victim(tmp_path)
    meta = (path / ".acp" / "metadata.json").read_text()
    doc = {"tensors": {"../victim/tree": "model/x"}, "objects": {}, "packs": {}, "metadata": meta}
    (path / JOURNAL).write_text(json.dumps(doc))
    code, _, err = _run(capsys, "rename", path)
    assert code == EXIT_USAGE and JOURNAL in err and "../victim/tree" in err
    assert (victim / "precious").read_text() == "keep me" and sorted(os.listdir(victim)) == ["precious"]
    assert not (path / "model" / "x").exists()
    _assert_loads(path, model)  # still committed: the journal was refused before anything was done


def test_planted_journal_moving_through_a_link_moves_nothing(ckpt, tmp_path, capsys):
    path, model = ckpt
    victim = _victim(tmp_path)
    (path / "model").mkdir(exist_ok=True)
    os.symlink(victim, path / "model" / "x")  # an entry name that is valid, but a link out of the checkpoint
    meta = json.loads((path / ".acp" / "metadata.json").read_text())
    meta["tensors"]["model/y"] = meta["tensors"].pop("model/weight")  # a journal consistent in itself
    doc = {"tensors": {"model/x": "model/y"}, "objects": {}, "packs": {}, "metadata": json.dumps(meta)}
    (path / JOURNAL).write_text(json.dumps(doc))
    code, _, err = _run(capsys, "rename", path)
    assert code == EXIT_USAGE and JOURNAL in err and "symlink" in err
    assert (victim / "precious").read_text() == "keep me"
    assert os.path.islink(path / "model" / "x") and not (path / "model" / "y").exists()
    _assert_loads(path, model)


def test_rename_of_an_array_directory_that_is_a_link_touches_nothing(tmp_path, capsys):
    import shutil

    from arraycheckpoint.planning.plan import PlanOptions

    path = tmp_path / "ck"
    acp.save(path, {"model": torch.nn.Linear(3, 2)}, plan_options=PlanOptions(pack_array_bytes=0))
    victim = tmp_path / "victim"
    shutil.move(path / "model" / "weight", victim)  # the array now lives outside, reached through a link
    os.symlink(victim, path / "model" / "weight")
    before = sorted(os.listdir(victim))
    (tmp_path / "map.json").write_text(json.dumps({"model/weight": "model/w2"}))
    code, _, err = _run(capsys, "rename", path, "--map", tmp_path / "map.json")
    assert code == EXIT_USAGE and "symlink" in err and str(path / "model" / "weight") in err
    assert sorted(os.listdir(victim)) == before and os.path.islink(path / "model" / "weight")
    assert not (path / JOURNAL).exists() and not (path / "model" / "w2").exists()
    assert (path / ".acp" / "committed").exists()


@pytest.mark.parametrize(
    "content, why",
    [
        (b"[" * 200_000, "levels deep"),
        (b'{"tensors": "\xff"}', "not valid JSON"),
        (b"[]", "not an object"),
        (b'{"tensors": {"model/w": 3}, "objects": {}, "metadata": "{}"}', "'tensors'"),
        (b'{"tensors": {}, "objects": {}, "metadata": 7}', "'metadata'"),
        (
            b'{"tensors": {}, "objects": {}, "packs": {"../../x.zip": ".acp/packs/0.1.zip"}, "metadata": ""}',
            "pack",
        ),
        ("fifo", "not a regular file"),
        ("link", "symlink"),
    ],
    ids=["deep", "non-utf8", "list", "wrong-type", "metadata-type", "pack-key", "fifo", "link"],
)
def test_hostile_journal_is_refused_naming_it(ckpt, tmp_path, capsys, content, why):
    path, model = ckpt
    journal = path / JOURNAL
    if content == "fifo":
        os.mkfifo(journal)  # read non-blocking: never waits for a writer
    elif content == "link":
        (tmp_path / "elsewhere.json").write_text("{}")
        os.symlink(tmp_path / "elsewhere.json", journal)
    else:
        journal.write_bytes(content)
    code, _, err = _run(capsys, "rename", path)
    assert code == EXIT_USAGE and str(journal) in err and why in err, err
    _assert_loads(path, model)


# map files -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content, why",
    [(b"[" * 200_000, "levels deep"), (b'{"\xff": "x"}', "not valid JSON")],
    ids=["deep", "non-utf8"],
)
def test_hostile_mapping_files_are_refused_naming_them(ckpt, tmp_path, capsys, content, why):
    path, model = ckpt
    bad = tmp_path / "map.json"
    bad.write_bytes(content)
    for args in (("export", path, tmp_path / "out", "--rename", bad), ("rename", path, "--map", bad)):
        code, _, err = _run(capsys, *args)
        assert code == EXIT_USAGE and f"mapping file {bad}" in err and why in err, err
    assert not (tmp_path / "out").exists()
    _assert_loads(path, model)


# metrics -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "records, why",
    [
        ({"rank0": {"phases": []}}, "not a rank number"),
        ({"٣": {"phases": []}}, "not a rank number"),
        ({"0": []}, "not a JSON object"),
        ({"0": {"phases": {"phase": "write"}}}, "'phases' is not a list"),
        ({"0": {"phases": [{"phase": 3}]}}, "string 'phase'"),
        ({"0": {"phases": [{"phase": "write", "seconds": "1"}]}}, "'seconds'"),
        ({"0": {"phases": [{"phase": "write", "bytes": -4}]}}, "'bytes'"),
        ({"0": {"wall_start": [1], "phases": []}}, "'wall_start'"),
        ({"0": {"phases": [{"phase": "write", "start": 1e400}]}}, "'start'"),
    ],
)
def test_metrics_records_of_the_wrong_type_are_refused_naming_them(ckpt, capsys, records, why):
    path, _ = ckpt
    (path / ".acp" / "metrics.json").write_text(json.dumps({"save": records}).replace("Infinity", "1e400"))
    code, _, err = _run(capsys, "metrics", path)
    assert code == EXIT_USAGE and "'save' metrics record" in err and why in err, err


# import --------------------------------------------------------------------------------------------------
def _header_file(tmp_path, name: str, data: bytes):
    p = tmp_path / f"{name}.safetensors"
    p.write_bytes(data)
    return p


@pytest.mark.parametrize(
    "data",
    [
        struct.pack("<Q", 100_000) + b"[" * 100_000,  # a header of deep JSON
        b"\x01\x02",  # 2 bytes
        struct.pack("<Q", 10**6) + b"{}",  # a header reaching past the end of the file
    ],
    ids=["deep-header", "two-bytes", "header-past-eof"],
)
def test_import_of_a_broken_safetensors_file_is_refused_naming_it(tmp_path, capsys, data):
    src = _header_file(tmp_path, "bad", data)
    code, _, err = _run(capsys, "import", src, tmp_path / "c")
    assert code == EXIT_USAGE and str(src) in err and "not a readable safetensors file" in err
    assert not (tmp_path / "c").exists()


def _hf_dir(tmp_path):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    tensors = {"a": torch.arange(15.0).reshape(3, 5), "b": torch.ones(7)}
    save_file(tensors, str(hf / "model.safetensors"))
    return hf, tensors


@pytest.mark.parametrize("shard", ["../outside.safetensors", "fifo.safetensors", "link.safetensors"])
def test_import_of_an_index_naming_an_unsafe_shard_is_refused(tmp_path, capsys, shard):
    hf, _ = _hf_dir(tmp_path)
    (tmp_path / "outside.safetensors").write_bytes((hf / "model.safetensors").read_bytes())
    if shard == "fifo.safetensors":
        os.mkfifo(hf / shard)
    elif shard == "link.safetensors":
        os.symlink(tmp_path / "outside.safetensors", hf / shard)
    index = {"metadata": {}, "weight_map": {"a": shard, "b": "model.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = _run(capsys, "import", hf, tmp_path / "c")
    assert code == EXIT_USAGE and shard.split("/")[-1] in err, err
    assert not (tmp_path / "c").exists()


def test_inspect_and_metrics_of_a_hugging_face_directory(tmp_path, capsys):
    hf, tensors = _hf_dir(tmp_path)
    code, out, _ = _run(capsys, "inspect", hf)
    assert code == EXIT_OK and "safetensors" in out and "model/a" in out and "model/b" in out
    code, out, _ = _run(capsys, "inspect", hf, "--json")
    summary = json.loads(out)
    assert code == EXIT_OK and summary["source"] == "safetensors" and summary["committed"] is None
    assert {t["name"]: t["shape"] for t in summary["tensors"]} == {"model/a": [3, 5], "model/b": [7]}
    code, _, err = _run(capsys, "metrics", hf)
    assert (
        code == EXIT_USAGE and str(hf) in err and "safetensors checkpoint" in err and "no save metrics" in err
    )


# verify: coverage by sweep -------------------------------------------------------------------------------
def _tm(shape, boxes):
    return TensorMeta("t", shape, "float32", shape, shape, None, tuple(ShardMeta(o, n, 0) for o, n in boxes))


def test_uncovered_sweep_matches_a_cell_by_cell_check_on_random_overlapping_regions():
    rng = random.Random(0)
    for trial in range(60):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 4)))
        boxes = []
        for _ in range(rng.randint(0, 6)):
            o = tuple(rng.randrange(n) for n in shape)
            boxes.append((o, tuple(rng.randint(1, n - x) for x, n in zip(o, shape))))
        covered = np.zeros(shape, dtype=bool)
        for o, n in boxes:
            covered[tuple(slice(a, a + b) for a, b in zip(o, n))] = True
        holes = uncovered(_tm(shape, boxes))
        found = np.zeros(shape, dtype=bool)
        for h in holes:
            region = tuple(slice(a, a + b) for a, b in zip(h.offsets, h.lengths))
            assert not found[region].any(), (trial, "holes overlap")
            found[region] = True
        assert np.array_equal(found, ~covered), (trial, shape, boxes, holes)


def _tangled_checkpoint(path, dims: int, n: int = 401, size: int = 1600):
    """13 KB of metadata: ``n`` overlapping regions (one covering all) of a [size]^dims tensor, no data."""
    rng = random.Random(1)
    boxes = [[[0] * dims, [size] * dims]]
    for _ in range(n - 1):
        o = [rng.randrange(size - 1) for _ in range(dims)]
        boxes.append([o, [rng.randrange(1, size - x + 1) for x in o]])
    tensor = {
        "shape": [size] * dims,
        "dtype": "float32",
        "chunk_shape": [400] * dims,
        "inner_chunk_shape": [400] * dims,
        "compression": None,
        "regions": [[0, ["boxes", boxes]]],
        "writers": [],
        "pack": None,
    }
    meta = {
        "format_version": 5,
        "framework": "torch",
        "world_size": 1,
        "topology": {},
        "layout_groups": [{"meshes": [], "ranks": [[0, 1, 1]]}],
        "tensors": {"model/w": tensor},
        "objects": {},
    }
    (path / ".acp").mkdir(parents=True)
    (path / ".acp" / "metadata.json").write_text(json.dumps(meta))
    (path / ".acp" / "committed").write_text("committed\n")
    return path


def test_verify_no_data_of_401_overlapping_regions_of_a_1600_cubed_tensor(tmp_path, capsys):
    """Was killed after 120 s (every cell of the regions' grid tested against every region)."""
    path = _tangled_checkpoint(tmp_path / "ck", dims=3)
    assert (path / ".acp" / "metadata.json").stat().st_size < 20_000
    code, out, _ = _run(capsys, "verify", path, "--no-data")
    # covered (one region spans the tensor): the only problems are the chunk files this forgery lacks
    assert code == EXIT_FAILED and "covered by no saved shard" not in out
    assert out.count("stored chunk file") == 64, out


def test_verify_reports_regions_too_tangled_to_check(tmp_path, capsys, monkeypatch):
    from arraycheckpoint.tools import verify

    monkeypatch.setattr(verify, "MAX_COVER_WORK", 10_000)  # the bound, scaled down to this small forgery
    path = _tangled_checkpoint(tmp_path / "ck", dims=3)
    code, out, _ = _run(capsys, "verify", path, "--no-data")
    assert code == EXIT_FAILED and "saved regions overlap so much" in out and "damaged or hostile" in out


# save-time refusal of names a load refuses ---------------------------------------------------------------
@pytest.mark.parametrize(
    "key",
    [
        "nl\nx",
        "tab\tx",
        "del\x7fx",
        "c1\x85x",
        "nul\x00x",
        "sur\udcffx",
        "..",
        ".hidden",
        "__x",
        "a:b",
        "a\\b",
        "zarr.json",
    ],
)
def test_save_refuses_every_name_the_loader_refuses_before_writing(tmp_path, key):
    path = tmp_path / "ck"
    with pytest.raises(UnsafeNameError, match="unsafe component|clashes"):
        acp.save(path, {"model": {key: torch.ones(2), "ok": torch.ones(2)}})
    assert not path.exists()


def test_save_refuses_an_array_inside_an_array_naming_both(tmp_path):
    path = tmp_path / "ck"
    with pytest.raises(UnsafeNameError, match=r"'model/a/b' would be stored inside tensor 'model/a'"):
        acp.save(path, {"model": {"a": torch.ones(2), "a/b": torch.ones(3)}})
    assert not path.exists()
    acp.save(path, {"model": {"a": torch.ones(2), "ab/b": torch.ones(3)}})  # a prefix of the text is fine
    out = {"a": torch.zeros(2), "ab/b": torch.zeros(3)}
    acp.load(path, {"model": out})
    assert torch.equal(out["a"], torch.ones(2)) and torch.equal(out["ab/b"], torch.ones(3))


@pytest.mark.parametrize("names", [["model/nl\nx"], ["model/a", "model/a/b"]])
def test_the_loader_refuses_the_same_names_from_metadata(tmp_path, capsys, names):
    path = tmp_path / "ck"
    acp.save(path, {"model": {f"t{i}": torch.ones(2) for i in range(len(names))}})
    meta_file = path / ".acp" / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["tensors"] = {n: t for n, t in zip(names, meta["tensors"].values())}
    meta_file.write_text(json.dumps(meta))
    code, _, err = _run(capsys, "inspect", path)
    assert code == EXIT_USAGE and repr(names[-1]) in err, err


def test_name_validator_accepts_ordinary_unicode_and_refuses_every_control_character():
    from arraycheckpoint.format.metadata import check_name

    for name in ("model/é ü", "model/层.0.w", "model/a b", "model/x\u200by"):
        assert check_name(name) == name
    for c in map(chr, itertools.chain(range(0x20), range(0x7F, 0xA0), range(0xD800, 0xE000, 0x101))):
        with pytest.raises(UnsafeNameError):
            check_name(f"model/x{c}y")
