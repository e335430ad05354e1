"""``arraycheckpoint export --unstack``: megatron's stacked layers as per-layer safetensors keys, fused
``linear_qkv`` / gated ``linear_fc1`` split into q/k/v and gate/up, bit-exact against a reference split.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron"))

from dist import run_distributed  # noqa: E402
from megatron_helpers import assemble, save_tp2  # noqa: E402

from arraycheckpoint.cli import main  # noqa: E402
from arraycheckpoint.tools.export import FusedSplit  # noqa: E402

HEADS, LAYERS = 4, 4  # megatron_helpers.build_gpt: hidden 32, 4 heads (MHA), SwiGLU


def reference_qkv(w: np.ndarray, heads: int, groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's fused QKV rows are [q (heads/groups heads), k, v] per query group."""
    per = heads // groups
    hd = w.shape[0] // (groups * (per + 2))
    g = w.reshape(groups, per + 2, hd, *w.shape[1:])
    q = g[:, :per].reshape(heads * hd, *w.shape[1:])
    return q, g[:, per].reshape(groups * hd, *w.shape[1:]), g[:, per + 1].reshape(groups * hd, *w.shape[1:])


def test_qkv_rows_match_the_reference_split_for_gqa() -> None:
    heads, groups, hd, hidden = 6, 2, 3, 5
    w = np.arange(groups * (heads // groups + 2) * hd * hidden, dtype=np.float32).reshape(-1, hidden)
    parts = FusedSplit(heads, groups).qkv_rows("w", w.shape[0])
    for got, want in zip(parts.values(), reference_qkv(w, heads, groups)):
        assert np.array_equal(np.concatenate([w[a:b] for a, b in got]), want)
    with pytest.raises(Exception, match="num-heads"):
        FusedSplit(4, 2).qkv_rows("w", 30)


@pytest.fixture(scope="module")
def megatron_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, np.ndarray]]:
    path = str(tmp_path_factory.mktemp("megatron") / "tp2")
    results = run_distributed(save_tp2, 2, (path,))
    return path, assemble([r[0] for r in results])


def _read_dir(out: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    merged: dict[str, np.ndarray] = {}
    for f in sorted(out.glob("*.safetensors")):
        merged.update(load_file(str(f)))
    return merged


@pytest.mark.multiprocess
def test_export_unstack_keeps_fused_and_honours_umask(megatron_ckpt, tmp_path: Path) -> None:
    path, source = megatron_ckpt
    out = tmp_path / "hf"
    old = os.umask(0o022)
    try:
        assert main(["export", path, str(out), "--unstack", "--max-shard-size", "20KB"]) == 0
    finally:
        os.umask(old)
    got = _read_dir(out)
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    stacked = [k for k in source if k.startswith("decoder.layers.")]
    assert stacked
    for key in stacked:
        head, tail = key.rsplit("layers.", 1)
        for i in range(LAYERS):
            assert np.array_equal(got[f"{head}layers.{i}.{tail}"], source[key][i]), (key, i)
    for key in set(source) - set(stacked):
        assert np.array_equal(got[key], source[key]), key
    assert len(got) == len(stacked) * LAYERS + len(source) - len(stacked)


@pytest.mark.multiprocess
def test_export_unstack_splits_qkv_and_fc1_with_rename(megatron_ckpt, tmp_path: Path) -> None:
    path, source = megatron_ckpt
    out = tmp_path / "hf"
    rename = {
        f"decoder.layers.{i}.self_attention.{p}.weight": f"model.layers.{i}.self_attn.{p}.weight"
        for i in range(LAYERS)
        for p in ("q_proj", "k_proj", "v_proj")
    }
    (tmp_path / "rename.json").write_text(json.dumps(rename))
    argv = [
        "export",
        path,
        str(out),
        "--unstack",
        "--num-heads",
        str(HEADS),
        "--rename",
        str(tmp_path / "rename.json"),
    ]
    assert main(argv) == 0
    got = _read_dir(out)
    qkv = source["decoder.layers.self_attention.linear_qkv.weight"]
    fc1 = source["decoder.layers.mlp.linear_fc1.weight"]
    for i in range(LAYERS):
        q, k, v = reference_qkv(qkv[i], HEADS, HEADS)
        for name, want in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            assert np.array_equal(got[f"model.layers.{i}.self_attn.{name}.weight"], want), (i, name)
        half = fc1.shape[1] // 2
        assert np.array_equal(got[f"decoder.layers.{i}.mlp.gate_proj.weight"], fc1[i, :half])
        assert np.array_equal(got[f"decoder.layers.{i}.mlp.up_proj.weight"], fc1[i, half:])
        norm = source["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i]
        assert np.array_equal(got[f"decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight"], norm)
    assert not any("linear_qkv.weight" in k or "linear_fc1.weight" in k for k in got)


@pytest.mark.multiprocess
def test_export_unstack_with_query_groups_and_pattern_rename(megatron_ckpt, tmp_path: Path) -> None:
    """A megatron GPTModel (TP=2) exported to Llama-style names with ``--num-heads --num-query-groups`` and a
    few ``{i}`` / ``re:`` rules instead of one exact rule per layer and tensor (first matching rule wins)."""
    path, source = megatron_ckpt
    out = tmp_path / "hf"
    rules = {
        "decoder.layers.{i}.self_attention.linear_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
        "decoder.layers.{i}.self_attention.{p}_proj.weight": "model.layers.{i}.self_attn.{p}_proj.weight",
        r"re:decoder\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight": r"model.layers.\1.mlp.\2_proj.weight",
        "decoder.layers.{i}.mlp.linear_fc2.weight": "model.layers.{i}.mlp.down_proj.weight",
    }
    (tmp_path / "rename.json").write_text(json.dumps(rules))
    argv = [
        "export",
        path,
        str(out),
        "--unstack",
        "--num-heads",
        str(HEADS),
        "--num-query-groups",
        str(HEADS),
    ]
    assert main([*argv, "--rename", str(tmp_path / "rename.json")]) == 0
    got = _read_dir(out)
    qkv = source["decoder.layers.self_attention.linear_qkv.weight"]
    fc1 = source["decoder.layers.mlp.linear_fc1.weight"]
    half = fc1.shape[1] // 2
    for i in range(LAYERS):
        q, k, v = reference_qkv(qkv[i], HEADS, HEADS)
        for name, want in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            assert np.array_equal(got[f"model.layers.{i}.self_attn.{name}.weight"], want), (i, name)
        assert np.array_equal(got[f"model.layers.{i}.mlp.gate_proj.weight"], fc1[i, :half])
        assert np.array_equal(got[f"model.layers.{i}.mlp.up_proj.weight"], fc1[i, half:])
        fc2 = source["decoder.layers.mlp.linear_fc2.weight"][i]
        assert np.array_equal(got[f"model.layers.{i}.mlp.down_proj.weight"], fc2)
        proj = source["decoder.layers.self_attention.linear_proj.weight"][i]
        assert np.array_equal(got[f"model.layers.{i}.self_attn.o_proj.weight"], proj)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not os.path.isabs(index["metadata"]["source"])
