"""The tools on packed checkpoints (format 6): chunk files stored as members of ``.acp/packs/<rank>.<k>.zip``.

Each test would fail if a tool ignored packs: verify reads and checks pack members (on a local path and on an
object store), rename rewrites packs so that plain zarr-python reads them under the new names (and survives a
crash at every step), export, diff and inspect include packed tensors bit-exactly.
"""

from __future__ import annotations

import glob
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from cli_helpers import cli, cli_json, flip_chunk_byte, remove_chunk
from safetensors.torch import load_file

import arraycheckpoint as acp
from arraycheckpoint.errors import CheckpointNotFoundError
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.storage import storage_for
from arraycheckpoint.tools import rename as rename_mod
from arraycheckpoint.tools.rename import JOURNAL, TMP_DIR, rename_checkpoint
from arraycheckpoint.tools.verify import verify


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "extra_state": {"t": torch.arange(5.0) * (seed + 1)}}


def _save(path: Path | str, seed: int = 0, **options: int) -> dict:
    state = _state(seed)
    acp.save(path, state, plan_options=PlanOptions(**options) if options else None)
    return state


def _all_packed(path: Path | str) -> dict[str, str]:
    """name -> pack of every tensor, after checking that every tensor is packed (else the test is void)."""
    packs = {n: t.pack for n, t in acp.read_metadata(path).tensors.items()}
    assert packs and all(p is not None for p in packs.values()), packs
    return packs  # type: ignore[return-value]


def _pack_file(path: Path | str, name: str) -> str:
    """The pack file holding ``name``'s ``zarr.json`` (format 6: one of its creator's packs)."""
    from faults.packtools import pack_key

    return os.path.join(path, *pack_key(path, name).split("/"))


# verify ------------------------------------------------------------------------------------------------------
def test_verify_names_a_missing_damaged_or_foreign_pack(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _save(ck)
    packs = _all_packed(ck)
    assert verify(ck).ok
    pack = _pack_file(ck, "model/0.weight")
    members = sorted(n for n, p in packs.items() if p == packs["model/0.weight"])
    original = open(pack, "rb").read()

    os.unlink(pack)
    report = verify(ck)
    assert not report.ok
    named = {p.tensor for p in report.problems}
    assert named == set(members), report.problems  # every tensor of the pack, and only those
    assert all(".acp/packs/0" in p.message and "missing" in p.message for p in report.problems), (
        report.problems
    )

    with open(pack, "wb") as f:
        f.write(b"not a zip file at all" * 4)
    report = verify(ck)
    assert {p.tensor for p in report.problems} == set(members)
    assert all("ZIP" in p.message and pack in p.message for p in report.problems), report.problems

    with open(pack, "wb") as f:
        f.write(original)
    remove_chunk(str(ck), "model/0.weight", "zarr.json")  # the array's document, not a chunk
    proc = cli("verify", ck, "--no-data", check=1)
    bad = [line for line in proc.stdout.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and bad[0].startswith("BAD  model/0.weight:"), proc.stdout
    assert "model/0.weight/zarr.json is missing" in bad[0], bad[0]


def test_verify_reads_every_member_of_a_pack(tmp_path: Path) -> None:
    """Each packed array's every chunk is decoded: a flipped byte in any member is found and named."""
    ck = tmp_path / "ck"
    _save(ck, min_chunk_bytes=1 << 20, max_chunk_bytes=64, inner_chunk_bytes=32)
    _all_packed(ck)
    meta = acp.read_metadata(ck)
    multi = [n for n, t in meta.tensors.items() if t.chunk_shape != t.shape]
    assert multi, "no packed tensor of several chunks"
    name = multi[0]
    tm = meta.tensors[name]
    last = tuple(-(-s // c) - 1 for s, c in zip(tm.shape, tm.chunk_shape))
    key = "c." + ".".join(map(str, last))
    flip_chunk_byte(str(ck), name, key, 1)
    report = verify(ck)
    assert [(p.tensor, p.chunk) for p in report.problems] == [(name, last)], report.problems
    assert ".acp/packs/0" in report.problems[0].message and "unreadable" in report.problems[0].message
    assert "crc32c" in report.problems[0].message
    flip_chunk_byte(str(ck), name, key, 1)
    assert verify(ck).ok


def test_verify_packed_checkpoint_on_an_object_store() -> None:
    url = "memory://acp-cli-packs/verify"
    _save(url)
    packs = _all_packed(url)
    report = verify(url)
    assert report.ok and report.tensors == len(packs), report.problems
    storage, root = storage_for(url)
    key = packs["model/0.bias"].partition("@")[0] + ".0.zip"  # format 6: rank 0's first pack
    storage.write(root, key, b"PK not a zip")
    report = verify(url)
    assert {p.tensor for p in report.problems} == {n for n, p in packs.items() if p == packs["model/0.bias"]}
    assert all(f"{root}/{key}" in p.message for p in report.problems), report.problems


# rename ------------------------------------------------------------------------------------------------------
def _zip_array(pack: str, name: str) -> zarr.Array:
    return zarr.open_array(zarr.storage.ZipStore(pack, mode="r"), path=name, mode="r")


def test_rename_rewrites_the_pack_for_zarr_python(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    saved = _save(ck)
    _all_packed(ck)
    before = {f".acp/packs/{f}" for f in os.listdir(ck / ".acp" / "packs")}
    result = rename_checkpoint(ck, {"0.weight": "embed.weight", "extra_state/t": "extra_state/deep/u"})
    assert result.packs == {k: k for k in before}  # format 6: rewritten in place
    weight = saved["model"].state_dict()["0.weight"].numpy()
    pack = _pack_file(ck, "model/embed.weight")
    arr = _zip_array(pack, "model/embed.weight")
    assert np.array_equal(arr[...], weight) and arr.metadata.dimension_names == (
        "embed.weight.dim0",
        "embed.weight.dim1",
    )
    moment = saved["optimizer"].state[saved["model"][0].weight]["exp_avg"].numpy()
    assert np.array_equal(_zip_array(pack, "optimizer/embed.weight/exp_avg")[...], moment)
    deep = _pack_file(ck, "extra_state/deep/u")
    assert np.array_equal(_zip_array(deep, "extra_state/deep/u")[...], np.arange(5.0, dtype=np.float32))
    # the pack is a zarr hierarchy of the new names only (group documents included)
    with zipfile.ZipFile(pack) as zf:
        names = zf.namelist()
    assert not [n for n in names if "0.weight" in n or n.startswith("extra_state/t/")], names
    assert len(names) == len(set(names))
    from arraycheckpoint.zarr import checkpoint_store

    group = zarr.open_group(checkpoint_store(ck), mode="r")
    assert "u" in group["extra_state/deep"]
    with pytest.raises(FileNotFoundError):  # zarr's ArrayNotFoundError
        _zip_array(pack, "model/0.weight")
    assert cli("verify", ck).stdout.startswith("OK")
    target = {"model": {"embed.weight": torch.empty(4, 6)}, "extra_state": {"t": torch.zeros(5)}}
    acp.load(ck, target, strict=False)
    assert np.array_equal(target["model"]["embed.weight"].numpy(), weight)
    assert torch.equal(target["extra_state"]["t"], saved["extra_state"]["t"])


def test_rename_refuses_a_damaged_pack_touching_nothing(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _save(ck)
    packs = _all_packed(ck)
    assert packs["model/0.bias"] == packs["model/0.weight"]  # renaming 0.weight rewrites that pack
    pack = _pack_file(ck, "model/0.bias")
    remove_chunk(str(ck), "model/0.bias", "c.0")
    files = sorted(str(p.relative_to(ck)) for p in ck.rglob("*"))
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"0.weight": "w0"}))
    err = cli("rename", ck, "--map", mapping, check=2).stderr
    assert "model/0.bias" in err and os.path.dirname(pack) in err, err
    assert sorted(str(p.relative_to(ck)) for p in ck.rglob("*")) == files  # no journal, marker kept
    assert "model/0.weight" in acp.read_metadata(ck).tensors


@pytest.mark.parametrize("crash_at", [2, 3], ids=["before-metadata", "before-marker"])
def test_rename_of_packs_resumes_after_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at: int
) -> None:
    """The process dies after the new packs were built (the metadata still names the old ones), or after the
    new metadata was written (the old packs gone or going): ``rename PATH`` finishes either way."""
    ck = tmp_path / "ck"
    saved = _save(ck)
    _all_packed(ck)
    calls = []
    durable = rename_mod._write_durable

    def crashing(path: str, data: bytes) -> None:
        calls.append(path)
        if len(calls) == crash_at:  # 1: the journal, 2: the metadata, 3: the commit marker
            raise KeyboardInterrupt("simulated crash")
        durable(path, data)

    monkeypatch.setattr(rename_mod, "_write_durable", crashing)
    with pytest.raises(KeyboardInterrupt):
        rename_checkpoint(ck, {"0.bias": "1.bias", "1.bias": "0.bias"})  # a swap, inside packs
    monkeypatch.setattr(rename_mod, "_write_durable", durable)
    assert os.path.exists(os.path.join(ck, JOURNAL))
    with pytest.raises(CheckpointNotFoundError):
        acp.read_metadata(ck)  # no commit marker: nothing half-renamed is visible
    assert "finished an interrupted rename" in cli("rename", ck).stdout
    assert not os.path.exists(os.path.join(ck, JOURNAL)) and not os.path.exists(os.path.join(ck, TMP_DIR))
    meta = acp.read_metadata(ck)
    on_disk = {f".acp/packs/{p}" for p in os.listdir(os.path.join(ck, ".acp", "packs"))}
    assert on_disk == {
        f"{t.pack.partition('@')[0]}.0.zip" for t in meta.tensors.values()
    }  # rewritten in place, nothing left
    sd = saved["model"].state_dict()
    for new, old in [("0.bias", "1.bias"), ("1.bias", "0.bias")]:
        arr = _zip_array(_pack_file(ck, f"model/{new}"), f"model/{new}")
        assert np.array_equal(arr[...], sd[old].numpy()) and arr.metadata.dimension_names == (f"{new}.dim0",)
    assert cli("verify", ck).stdout.startswith("OK")


# export / diff / inspect -------------------------------------------------------------------------------------
def test_export_includes_packed_tensors_bit_exact(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    saved = _save(ck)
    _all_packed(ck)
    out = tmp_path / "hf"
    cli("export", ck, out, "--what", "all", "--max-shard-size", "200")
    merged: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(out, "*.safetensors"))):
        merged.update(load_file(f))
    sd = saved["model"].state_dict()
    assert {k for k in merged if "/" not in k} == set(sd)
    for k, v in sd.items():
        assert torch.equal(merged[k], v), k
    params = dict(zip(sd, saved["model"].parameters()))
    for k, p in params.items():
        for key, v in saved["optimizer"].state[p].items():
            assert torch.equal(merged[f"optimizer/{k}/{key}"], v), (k, key)
    assert torch.equal(merged["extra_state/t"], saved["extra_state"]["t"])
    pt = tmp_path / "model.pt"
    cli("export", ck, pt, "--format", "torch")
    exported = torch.load(pt, weights_only=True)
    assert set(exported) == set(sd) and all(torch.equal(exported[k], v) for k, v in sd.items())


def test_diff_and_inspect_see_packed_tensors(tmp_path: Path) -> None:
    packed, dirs, other = tmp_path / "packed", tmp_path / "dirs", tmp_path / "other"
    _save(packed)
    _save(dirs, pack_array_bytes=0)
    _all_packed(packed)
    assert all(t.pack is None for t in acp.read_metadata(dirs).tensors.values())
    assert "identical" in cli("diff", packed, dirs).stdout  # the same state in both layouts
    state = _state(0)
    with torch.no_grad():
        state["model"][1].bias[1] += 0.5
    acp.save(other, state)
    doc = json.loads(cli("diff", packed, other, "--json", check=1).stdout)
    differing = {t["name"]: t for t in doc["tensors"] if t["status"] != "equal"}
    assert set(differing) == {"model/1.bias"}, differing
    assert differing["model/1.bias"]["max_abs_diff"] == pytest.approx(0.5)

    summary = cli_json("inspect", packed)
    rows = {r["name"]: r for r in summary["tensors"]}
    assert set(rows) == set(acp.read_metadata(packed).tensors)
    assert all(r["pack"] and r["pack"].startswith(".acp/packs/") for r in rows.values())
    assert summary["totals"]["packed"] == len(rows) and summary["totals"]["packs"] >= 1
    assert ".acp/packs/" in cli("inspect", packed).stdout
    assert all(r["pack"] is None for r in cli_json("inspect", dirs)["tensors"])
