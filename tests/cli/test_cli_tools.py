"""``arraycheckpoint`` inspect / verify / import / rename / help, run as a user would (subprocess)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from cli_helpers import REPO, cli, cli_json, flip_byte

import arraycheckpoint as acp
from arraycheckpoint.metadata import COMMIT_MARKER, FORMAT_VERSION, METADATA_FILE
from arraycheckpoint.plan import PlanOptions

SMALL_CHUNKS = PlanOptions(min_chunk_bytes=256, max_chunk_bytes=1024, inner_chunk_bytes=256)


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


@pytest.fixture()
def saved(tmp_path):
    model, opt = _trained()
    path = str(tmp_path / "ckpt")
    acp.save(
        path,
        {"model": model, "optimizer": opt, "extra_state": {"epoch": 3}},
        step=42,
        plan_options=SMALL_CHUNKS,
    )
    return path, model, opt


def test_help_for_every_subcommand():
    top = cli("--help").stdout
    for sub in ("inspect", "verify", "export", "import", "rename", "diff", "metrics"):
        assert sub in top
        assert "usage: arraycheckpoint " + sub in cli(sub, "--help").stdout
    assert cli(check=2).returncode == 2  # no subcommand
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
    assert "no committed checkpoint" in cli("inspect", path + "-missing", check=2).stderr


def test_verify_ok_then_flipped_byte_then_missing_chunk(saved):
    path, _, _ = saved
    out = cli("verify", path).stdout
    assert out.startswith("OK")
    chunk = os.path.join(path, "model", "0.weight", "c.1.0")
    assert os.path.exists(chunk)
    flip_byte(chunk, 3)  # a data byte of the first inner chunk
    proc = cli("verify", path, check=1)
    bad = [line for line in proc.stdout.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and "model/0.weight chunk 1/0" in bad[0], proc.stdout
    flip_byte(chunk, 3)
    assert cli("verify", path).stdout.startswith("OK")

    flip_byte(chunk, os.path.getsize(chunk) - 1)  # the shard index checksum
    assert "model/0.weight chunk 1/0" in cli("verify", path, check=1).stdout
    flip_byte(chunk, os.path.getsize(chunk) - 1)

    other = os.path.join(path, "model", "2.weight", "c.0.0")
    os.unlink(other)
    doc = json.loads(cli("verify", path, "--json", check=1).stdout)
    assert doc["ok"] is False
    assert any("model/2.weight chunk 0/0" in p and "missing" in p for p in doc["problems"]), doc


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


def test_import_bad_source(tmp_path):
    (tmp_path / "empty").mkdir()
    assert cli("import", str(tmp_path / "empty"), str(tmp_path / "c"), check=2).stderr
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    assert "weights_only" in cli("import", str(junk), str(tmp_path / "c"), check=2).stderr


def test_rename_then_load_model_and_optimizer(saved, tmp_path):
    from collections import OrderedDict

    path, model, opt = saved
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
    assert os.path.isdir(os.path.join(path, "model", "inp.weight"))
    assert not os.path.exists(os.path.join(path, "optimizer", "0.weight"))
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


def test_rename_resumes_an_interrupted_journal(saved, tmp_path):
    """Simulate a crash after the journal was written and the first directory moved."""
    from arraycheckpoint.metadata import CheckpointMetadata
    from arraycheckpoint.tools.rename import JOURNAL, TMP_DIR, plan_rename

    path, model, _ = saved
    meta = CheckpointMetadata.from_json(open(os.path.join(path, METADATA_FILE)).read())
    new_meta, result = plan_rename(meta, {"2.bias": "head.bias"})
    doc = {"tensors": result.tensors, "objects": result.objects, "metadata": new_meta.to_json()}
    with open(os.path.join(path, JOURNAL), "w") as f:
        json.dump(doc, f)
    os.unlink(os.path.join(path, COMMIT_MARKER))
    os.makedirs(os.path.join(path, TMP_DIR))
    moves = sorted(result.tensors.items())
    os.rename(os.path.join(path, moves[0][0]), os.path.join(path, TMP_DIR, "0"))
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
