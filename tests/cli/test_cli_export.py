"""``arraycheckpoint export`` / ``metrics`` / ``diff`` on a checkpoint saved by 4 FSDP2 ranks."""

from __future__ import annotations

import glob
import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from cli_helpers import cli, cli_json, make_mlp
from safetensors.torch import load_file

pytestmark = pytest.mark.multiprocess


def _load_dir(out: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(out, "*.safetensors"))):
        part = load_file(f)
        assert not set(part) & set(merged), "a key appears in two files"
        merged.update(part)
    return merged


def test_export_safetensors_sharded_loads_into_fresh_model(fsdp2_ckpt, tmp_path):
    path, expected = fsdp2_ckpt
    out = str(tmp_path / "hf")
    cap = 1000  # bytes: forces several files; 0.weight (1248 B) is larger than the cap and goes alone
    cli("export", path, out, "--max-shard-size", str(cap))
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(out, "*.safetensors")))
    n = len(files)
    assert n >= 3
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(expected["model"])
    assert set(index["weight_map"].values()) == set(files)
    # a second export into the same directory is refused; --overwrite replaces every old file
    assert "--overwrite" in cli("export", path, out, check=2).stderr
    cli("export", path, out, "--max-shard-size", "1MB", "--overwrite")
    assert sorted(os.listdir(out)) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    cli("export", path, out, "--max-shard-size", str(cap), "--overwrite")
    tensors = _load_dir(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for f in files:  # every file respects the cap unless it holds one oversized tensor
        part = load_file(os.path.join(out, f))
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= cap or len(part) == 1, (f, size)

    torch.manual_seed(123)  # different init: the load must overwrite everything
    fresh = make_mlp()
    fresh.load_state_dict(tensors, strict=True)
    for name, ref in expected["model"].items():
        assert torch.equal(fresh.state_dict()[name], torch.from_numpy(ref)), name


def test_export_all_dtype_rename_and_torch_format(fsdp2_ckpt, tmp_path):
    path, expected = fsdp2_ckpt
    rename = tmp_path / "rename.json"
    rename.write_text(json.dumps({"0.weight": "embed.weight"}))
    out = str(tmp_path / "all")
    cli("export", path, out, "--what", "all", "--dtype", "bfloat16", "--rename", str(rename))
    got = _load_dir(out)
    want = {**expected["model"], **expected["optimizer"]}
    want["embed.weight"] = want.pop("0.weight")
    assert set(got) == set(want)
    for key, ref in want.items():
        cast = ref.astype(ml_dtypes.bfloat16)
        assert got[key].dtype == torch.bfloat16, key
        assert np.array_equal(got[key].view(torch.int16).numpy(), cast.view(np.int16)), key

    pt = str(tmp_path / "model.pt")
    cli("export", path, pt, "--format", "torch")
    state = torch.load(pt, weights_only=True)
    assert set(state) == set(expected["model"])
    for key, ref in expected["model"].items():
        assert torch.equal(state[key], torch.from_numpy(ref)), key


def test_export_usage_errors(fsdp2_ckpt, tmp_path):
    path, _ = fsdp2_ckpt
    assert cli("export", path, str(tmp_path / "x"), "--max-shard-size", "lots", check=2).stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"no.such.key": "x"}))
    err = cli("export", path, str(tmp_path / "x"), "--rename", str(bad), check=2).stderr
    assert "no.such.key" in err
    assert (
        "the path does not exist"
        in cli("export", str(tmp_path / "nothing"), str(tmp_path / "y"), check=2).stderr
    )
    # an output that exists and is no directory (a file, a FIFO): a clear error, never a traceback (exit 3)
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    for out in ("file", "fifo"):
        err = cli("export", path, str(tmp_path / out), check=2).stderr
        assert "exists and is not a directory" in err and "Traceback" not in err, err


def test_metrics_table_json_and_plot(fsdp2_ckpt, tmp_path):
    path, _ = fsdp2_ckpt
    table = cli("metrics", path).stdout
    for r in range(4):
        assert f"\n   {r} " in table or f"\n{r} " in table
    doc = cli_json("metrics", path)
    assert doc["ranks"] == [0, 1, 2, 3]
    assert {"snapshot", "write"} <= set(doc["phases"])
    assert all(len(row) == len(doc["phases"]) for row in doc["seconds"])
    assert all(row[doc["phases"].index("write")] > 0 for row in doc["seconds"])
    png = tmp_path / "metrics.png"
    cli("metrics", path, "--plot", str(png))
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 400 and img.shape[1] > 600
    assert img[..., :3].std() > 0.05  # not a blank canvas


def test_diff_across_layouts(fsdp2_ckpt, tmp_path):
    """The 4-rank FSDP2 checkpoint against a 1-process import of its own export: equal; then one change."""
    path, expected = fsdp2_ckpt
    out = str(tmp_path / "hf")
    cli("export", path, out, "--what", "all")
    single = str(tmp_path / "single")
    cli("import", out, single)
    same = cli("diff", path, single, "--tensors-only")
    assert "identical" in same.stdout
    # objects (optimizer param groups) exist only in the original: that is a difference without a filter
    assert "~param_groups" in cli("diff", path, single, check=1).stdout
    assert "identical" in cli("diff", path, single, "--namespace", "model").stdout

    tensors = _load_dir(out)
    tensors["2.bias"] = tensors["2.bias"].clone()
    tensors["2.bias"][3] += 0.5
    from safetensors.torch import save_file

    changed_src = str(tmp_path / "changed.safetensors")
    save_file(tensors, changed_src)
    changed = str(tmp_path / "changed")
    cli("import", changed_src, changed)
    proc = cli("diff", path, changed, "--namespace", "model", "--json", check=1)
    doc = json.loads(proc.stdout)
    bad = [t for t in doc["tensors"] if t["status"] != "equal"]
    assert [t["name"] for t in bad] == ["model/2.bias"]
    ref = expected["model"]["2.bias"]
    assert bad[0]["max_abs_diff"] == pytest.approx(float(abs((ref[3] + np.float32(0.5)) - ref[3])))
    assert bad[0]["differing"] == 1
