"""``arraycheckpoint`` inspect / verify / import / rename / help, run as a user would (subprocess)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
import zarr
from cli_helpers import REPO, chunk_span, cli, cli_json, cli_process, flip_chunk_byte, remove_chunk

import arraycheckpoint as acp
from arraycheckpoint.format.metadata import COMMIT_MARKER, FORMAT_VERSION, METADATA_FILE
from arraycheckpoint.planning.plan import PlanOptions

SMALL_CHUNKS = PlanOptions(min_chunk_bytes=256, max_chunk_bytes=1024, inner_chunk_bytes=256)
#: the arrays' two stored layouts: chunk files in packs (format 6: below the 64 KiB target size), or each
#: array in its directory
LAYOUTS = {
    "packed": dataclasses.replace(SMALL_CHUNKS, min_chunk_bytes=64 << 10),
    "dirs": dataclasses.replace(SMALL_CHUNKS, pack_array_bytes=0),
}


def _model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 5)).to(dtype)


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 32)).sum().backward()
    opt.step()
    return model, opt


def _assert_same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _save(path: str, options: PlanOptions) -> tuple[str, torch.nn.Module, torch.optim.Optimizer]:
    model, opt = _trained()
    acp.save(
        path,
        {"model": model, "optimizer": opt, "extra_state": {"epoch": 3}},
        step=42,
        plan_options=options,
    )
    return path, model, opt


@pytest.fixture()
def saved(tmp_path):
    return _save(str(tmp_path / "ckpt"), SMALL_CHUNKS)


@pytest.fixture(params=sorted(LAYOUTS))
def saved_in(request, tmp_path):
    """``saved`` in each stored layout, with the layout's name; the tests damage or move specific files."""
    path, model, opt = _save(str(tmp_path / "ckpt"), LAYOUTS[request.param])
    packed = {n for n, t in acp.read_metadata(path).tensors.items() if t.pack is not None}
    if request.param == "packed":  # the arrays the tests touch are packed, or the test proves nothing
        assert {"model/0.weight", "model/0.bias", "model/2.bias", "optimizer/0.weight/exp_avg"} <= packed
    else:
        assert not packed
    return path, model, opt, request.param


def test_help_for_every_subcommand():
    top = cli_process("--help").stdout  # a new interpreter, as a user starts it
    for sub in ("inspect", "verify", "export", "import", "rename", "diff", "metrics"):
        assert sub in top
        assert "usage: arraycheckpoint " + sub in cli(sub, "--help").stdout
    assert cli_process(check=2).returncode == 2  # no subcommand
    assert cli("frobnicate", check=2).returncode == 2


def test_installed_console_script(saved):
    path, _model_, _ = saved
    exe = shutil.which("arraycheckpoint")
    assert exe, "the arraycheckpoint console script is not installed (pip install -e .)"
    proc = subprocess.run(
        [exe, "inspect", path, "--json"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["step"] == 42


def test_inspect_table_and_json(saved):
    path, model, _ = saved
    doc = cli_json("inspect", path)
    assert doc["step"] == 42 and doc["format_version"] == FORMAT_VERSION and doc["world_size"] == 1
    assert doc["committed"] is True
    rows = {r["name"]: r for r in doc["tensors"]}
    w = rows["model/0.weight"]
    assert w["shape"] == [64, 32] and w["dtype"] == "float32" and w["bytes"] == 64 * 32 * 4
    assert w["regions"] == 1 and w["ranks"] == 1 and w["chunks"] > 1
    assert "optimizer/0.weight/exp_avg" in rows
    assert doc["totals"]["bytes"] == sum(r["bytes"] for r in doc["tensors"])
    assert doc["totals"]["namespaces"]["model"]["bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert "extra_state" in doc["objects"]
    text = cli("inspect", path).stdout
    assert "model/0.weight" in text and "64x32" in text and "step 42" in text
    assert "the path does not exist" in cli("inspect", path + "-missing", check=2).stderr


def test_verify_ok_then_flipped_byte_then_missing_chunk(saved_in):
    path, _, _, layout = saved_in
    out = cli("verify", path).stdout
    assert out.startswith("OK")
    where = ".acp/packs/" if layout == "packed" else ""
    assert chunk_span(path, "model/0.weight", "c.1.0")[0].endswith(".zip") == (layout == "packed")
    flip_chunk_byte(path, "model/0.weight", "c.1.0", 3)  # a data byte of the first inner chunk
    proc = cli("verify", path, check=1)
    bad = [line for line in proc.stdout.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and "model/0.weight chunk 1/0" in bad[0] and where in bad[0], proc.stdout
    flip_chunk_byte(path, "model/0.weight", "c.1.0", 3)
    assert cli("verify", path).stdout.startswith("OK")

    flip_chunk_byte(path, "model/0.weight", "c.1.0", -1)  # the shard index checksum
    bad = [line for line in cli("verify", path, check=1).stdout.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and "model/0.weight chunk 1/0" in bad[0] and where in bad[0], bad
    flip_chunk_byte(path, "model/0.weight", "c.1.0", -1)
    assert cli("verify", path).stdout.startswith("OK")

    remove_chunk(path, "model/2.weight", "c.0.0")  # an array with a partial edge chunk (packed, padded, in 6)
    remove_chunk(path, "model/0.bias", "c.0")
    doc = json.loads(cli("verify", path, "--json", check=1).stdout)
    assert doc["ok"] is False
    if layout == "packed":  # format 6: the member missing from its writer's packs, named with its tensor
        for name, key in (("model/2.weight", "c.0.0"), ("model/0.bias", "c.0")):
            missing = [p for p in doc["problems"] if p.startswith(f"{name}:") and "missing" in p]
            assert len(missing) == 1 and f"{name}/{key}" in missing[0] and where in missing[0], doc
        return
    assert any("model/2.weight chunk 0/0" in p and "missing" in p for p in doc["problems"]), doc
    missing = [p for p in doc["problems"] if "model/0.bias chunk 0:" in p and "missing" in p]
    assert len(missing) == 1 and where in missing[0], doc


def test_verify_uncommitted_and_absent(saved, tmp_path):
    path, _, _ = saved
    os.unlink(os.path.join(path, COMMIT_MARKER))
    assert "no commit marker" in cli("verify", path, check=1).stdout
    assert cli("verify", str(tmp_path / "nothing"), check=2).stderr


def test_import_safetensors_file_then_load(tmp_path):
    from safetensors.torch import save_file

    src = _model(1, torch.bfloat16)
    st = str(tmp_path / "m.safetensors")
    save_file(src.state_dict(), st)
    path = str(tmp_path / "ckpt")
    out = cli("import", st, path, "--step", "9").stdout
    assert "imported 4 tensors" in out
    dst = _model(2, torch.bfloat16)
    acp.load(path, {"model": dst})
    _assert_same_model(src, dst)
    assert cli_json("inspect", path)["step"] == 9
    # a second import to the same path is refused unless --overwrite
    assert "already exists" in cli("import", st, path, check=2).stderr
    cli("import", st, path, "--overwrite")


def test_import_torch_save_with_prefix_then_load(tmp_path):
    src = _model(3)
    pt = str(tmp_path / "m.pt")
    torch.save({"module." + k: v for k, v in src.state_dict().items()} | {"note": "hi"}, pt)
    path = str(tmp_path / "ckpt")
    proc = cli("import", pt, path, "--strip-prefix", "module.")
    assert "note" in proc.stderr  # skipped non-tensor value is reported
    dst = _model(4)
    acp.load(path, {"model": dst})
    _assert_same_model(src, dst)


def test_import_dcp_then_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = _model(5)
    dcp_dir = str(tmp_path / "dcp")
    dcp.save(src.state_dict(), checkpoint_id=dcp_dir, no_dist=True)
    path = str(tmp_path / "ckpt")
    cli("import", dcp_dir, path, "--allow-pickle")
    dst = _model(6)
    acp.load(path, {"model": dst})
    _assert_same_model(src, dst)


def test_import_of_a_nested_dcp_state_keeps_its_namespaces(tmp_path):
    """DCP saved as ``{"model": ..., "optimizer": ...}`` (get_state_dict, torchtitan, the README): the keys
    ``model.0.weight`` and ``optimizer.state.0.weight.exp_avg`` become the entries ``acp.load`` reads,
    ``model/0.weight`` and ``optimizer/0.weight/exp_avg``, not ``model/model.0.weight``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    src, opt = _trained(7)
    model_sd, optim_sd = get_state_dict(src, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    path = str(tmp_path / "ckpt")
    assert "param_groups" in cli("import", str(tmp_path / "dcp"), path, "--allow-pickle").stderr  # skipped
    dst = _model(8)
    dopt = torch.optim.Adam(dst.parameters(), lr=0.1)
    acp.load(path, {"model": dst, "optimizer": dopt})
    _assert_same_model(src, dst)
    for p, q in zip(src.parameters(), dst.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], dopt.state[q]["exp_avg"])


def test_import_into_a_users_directory_names_its_files(tmp_path):
    st = str(tmp_path / "w.safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, st)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    for extra in ((), ("--overwrite",)):
        err = cli("import", st, tmp_path / "run", *extra, check=2).stderr
        assert "not a checkpoint" in err and "notes.txt" in err and "--overwrite to replace" not in err, err
    assert os.listdir(tmp_path / "run") == ["notes.txt"]


def test_import_of_an_arraycheckpoint_dcp_writer_checkpoint_says_load_it_as_is(tmp_path):
    """A checkpoint of ``arraycheckpoint.dcp.Writer`` (its ``.metadata`` is JSON, for resume discovery) is
    already ours: import is exit 2 saying so (with and without --allow-pickle; never an unpickling crash),
    writes nothing, and the directory loads bit-exactly as it is."""
    import torch.distributed.checkpoint as dcp

    from arraycheckpoint.dcp import Writer

    src = _model(7)
    written = str(tmp_path / "w")
    dcp.save({"model": src.state_dict()}, storage_writer=Writer(written), no_dist=True)
    for extra in ((), ("--allow-pickle",)):
        err = cli("import", written, tmp_path / "out", *extra, check=2).stderr
        assert "already an arraycheckpoint checkpoint" in err and "acp.load" in err and written in err, err
    assert not (tmp_path / "out").exists()
    dst = _model(8)
    acp.load(written, {"model": dst})
    _assert_same_model(src, dst)
    # without its control files the JSON .metadata is never unpickled: a clear error, not an UnpicklingError
    from arraycheckpoint.errors import MetadataError

    shutil.rmtree(os.path.join(written, ".acp"))
    with pytest.raises(MetadataError, match="is JSON, not DCP's pickle"):
        acp.load(written, {"model": _model(9)}, allow_pickle=True)


def test_import_bad_source(tmp_path):
    (tmp_path / "empty").mkdir()
    assert cli("import", str(tmp_path / "empty"), str(tmp_path / "c"), check=2).stderr
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    assert "weights_only" in cli("import", str(junk), str(tmp_path / "c"), check=2).stderr


def _stored_array(path: str, name: str) -> zarr.Array:
    """The tensor ``name`` opened with plain zarr-python, from its directory or from its pack."""
    pack = acp.read_metadata(path).tensors[name].pack
    if pack is None:
        return zarr.open_array(zarr.storage.LocalStore(path, read_only=True), path=name, mode="r")
    if not pack.endswith(".zip"):  # format 6: the pack of its rank holding it (one rank wrote it all here)
        from readers import _pack_holding

        pack = _pack_holding(path, f"{name}/zarr.json")
    return zarr.open_array(zarr.storage.ZipStore(os.path.join(path, pack), mode="r"), path=name, mode="r")


def test_rename_then_load_model_and_optimizer(saved_in, tmp_path):
    from collections import OrderedDict

    path, model, opt, layout = saved_in
    packs_before = set(os.listdir(os.path.join(path, ".acp", "packs"))) if layout == "packed" else set()
    mapping = tmp_path / "map.json"
    mapping.write_text(
        json.dumps(
            {"0.weight": "inp.weight", "0.bias": "inp.bias", "2.weight": "out.weight", "2.bias": "out.bias"}
        )
    )
    out = cli("rename", path, "--map", str(mapping)).stdout
    assert "model/0.weight -> model/inp.weight" in out
    assert "optimizer/0.weight/exp_avg -> optimizer/inp.weight/exp_avg" in out
    assert not os.path.exists(os.path.join(path, "model", "0.weight"))
    assert not os.path.exists(os.path.join(path, "optimizer", "0.weight"))
    if layout == "dirs":
        assert os.path.isdir(os.path.join(path, "model", "inp.weight"))
    else:  # format 6: every pack holding a renamed array was rewritten in place (same keys)
        assert not os.path.exists(os.path.join(path, "model", "inp.weight"))
        packs_after = set(os.listdir(os.path.join(path, ".acp", "packs")))
        assert packs_after == packs_before
        assert {t.pack_rank for t in acp.read_metadata(path).tensors.values()} - {None} == {0}
    # the renamed arrays are plain zarr arrays under their new names (dimension names included), bit-exact
    sd = model.state_dict()
    params = dict(zip(["0.weight", "0.bias", "2.weight", "2.bias"], model.parameters()))
    for old, new in [("0.weight", "inp.weight"), ("0.bias", "inp.bias"), ("2.weight", "out.weight")]:
        arr = _stored_array(path, f"model/{new}")
        assert np.array_equal(arr[...], sd[old].numpy()), new
        assert arr.metadata.dimension_names == tuple(f"{new}.dim{i}" for i in range(sd[old].ndim))
        exp_avg = _stored_array(path, f"optimizer/{new}/exp_avg")
        assert np.array_equal(exp_avg[...], opt.state[params[old]]["exp_avg"].numpy()), new
    assert cli("verify", path).stdout.startswith("OK")

    torch.manual_seed(7)
    named = torch.nn.Sequential(
        OrderedDict(inp=torch.nn.Linear(32, 64), act=torch.nn.GELU(), out=torch.nn.Linear(64, 5))
    )
    named_opt = torch.optim.Adam(named.parameters(), lr=0.5)
    named(torch.randn(3, 32)).sum().backward()
    named_opt.step()
    acp.load(path, {"model": named, "optimizer": named_opt})
    for (_, a), (_, b) in zip(model.state_dict().items(), named.state_dict().items()):
        assert torch.equal(a, b)
    for pa, pb in zip(model.parameters(), named.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[pa][key], named_opt.state[pb][key]), key
    assert named_opt.param_groups[0]["lr"] == 0.1

    # a swap (a <-> b) goes through the temporary directory; renaming back restores the original names
    swap = tmp_path / "swap.json"
    swap.write_text(json.dumps({"inp.bias": "out.bias", "out.bias": "inp.bias"}))
    cli("rename", path, "--map", str(swap))
    back = {k: v for k, v in named.state_dict().items()}
    check = torch.nn.Sequential(
        OrderedDict(inp=torch.nn.Linear(32, 5), act=torch.nn.GELU(), out=torch.nn.Linear(64, 64))
    )
    check.inp.weight = torch.nn.Parameter(torch.empty(64, 32))
    check.out.weight = torch.nn.Parameter(torch.empty(5, 64))
    acp.load(path, {"model": check})
    assert torch.equal(check.inp.bias, back["out.bias"]) and torch.equal(check.out.bias, back["inp.bias"])


def test_rename_refusals(saved, tmp_path):
    path, _, _ = saved
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"nope.weight": "x"}))
    assert "nope.weight" in cli("rename", path, "--map", str(m), check=2).stderr
    m.write_text(json.dumps({"0.weight": "2.weight"}))
    assert "share one name" in cli("rename", path, "--map", str(m), check=2).stderr
    m.write_text(json.dumps({"0.weight": "../evil"}))
    assert cli("rename", path, "--map", str(m), check=2).stderr
    m.write_text("[1, 2]")
    assert "JSON object" in cli("rename", path, "--map", str(m), check=2).stderr
    assert cli("verify", path).stdout.startswith("OK")  # nothing was touched
    m.write_text(json.dumps({"0.weight": "w"}))
    assert "local file systems only" in cli("rename", "memory://ckpt", "--map", str(m), check=2).stderr


def test_rename_resumes_an_interrupted_journal(saved_in, tmp_path):
    """Simulate a crash after the journal was written and the first array started moving: its directory
    moved aside (directory layout), or its new pack half written (packed layout)."""
    from arraycheckpoint.format.metadata import CheckpointMetadata
    from arraycheckpoint.tools.rename import JOURNAL, TMP_DIR, journal_doc, plan_rename

    path, model, _, layout = saved_in
    meta = CheckpointMetadata.from_json(open(os.path.join(path, METADATA_FILE)).read())
    new_meta, result = plan_rename(meta, {"2.bias": "head.bias"}, root=path)
    assert bool(result.packs) == (layout == "packed")
    with open(os.path.join(path, JOURNAL), "w") as f:
        json.dump(journal_doc(new_meta, result), f)
    os.unlink(os.path.join(path, COMMIT_MARKER))
    os.makedirs(os.path.join(path, TMP_DIR))
    moves = sorted(result.tensors.items())
    if layout == "dirs":
        os.rename(os.path.join(path, moves[0][0]), os.path.join(path, TMP_DIR, "0"))
    else:
        new_pack = sorted(result.packs.values())[0]
        with open(os.path.join(path, TMP_DIR, new_pack.rsplit("/", 1)[-1] + ".part"), "wb") as f:
            f.write(b"PK\x03\x04 a pack cut short by the crash")
    assert cli("inspect", path, check=2).returncode == 2  # invisible mid-rename
    assert "finished an interrupted rename" in cli("rename", path).stdout
    doc = cli_json("inspect", path)
    names = {r["name"] for r in doc["tensors"]}
    assert (
        "model/head.bias" in names and "optimizer/head.bias/exp_avg" in names and "model/2.bias" not in names
    )
    got = {}
    acp.load(path, {"model": {"head.bias": (got.setdefault("b", torch.empty(5)))}}, strict=False)
    assert np.array_equal(got["b"].numpy(), model.state_dict()["2.bias"].numpy())
    assert np.array_equal(_stored_array(path, "model/head.bias")[...], model.state_dict()["2.bias"].numpy())
    assert not os.path.exists(os.path.join(path, TMP_DIR))
    for (
        old,
        new,
    ) in result.packs.items():  # the packs of the old names are gone (format 6: rewritten in place)
        assert os.path.exists(os.path.join(path, old)) == (old == new)
    assert cli("verify", path).stdout.startswith("OK")
