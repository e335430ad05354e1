"""A megatron (TP=2) checkpoint into single-process plain PyTorch modules: renames and unstacked layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.adapters.torch.megatron_convert import (  # noqa: E402
    StoredSlice,
    load_unstacked,
    stacked_axes,
    unstack_map,
)
from arraycheckpoint.errors import StateMismatchError  # noqa: E402


def plain_module(shapes: dict[str, tuple[int, ...]]) -> torch.nn.Module:
    """A nested ``nn.Module`` with a NaN-filled parameter at every dotted name."""
    root = torch.nn.Module()
    for fqn, shape in shapes.items():
        *path, leaf = fqn.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, float("nan"))))
    return root


def test_unstack_every_layer_into_plain_module(tp2_checkpoint: tuple) -> None:
    path, model, _ = tp2_checkpoint
    meta = acp.read_metadata(path)
    stacked = stacked_axes(meta)
    assert stacked["model/decoder.layers.mlp.linear_fc1.weight"] == 1
    assert "model/embedding.word_embeddings.weight" not in stacked
    # every stacked tensor listed, by the main replica of its origin only (TP rank 1 holds none: it sends none)
    assert set(stacked) == {n for n in meta.tensors if n.startswith("model/decoder.layers.")}
    assert sorted(meta.objects["model/~stacked"].per_rank) == [0]
    mapping = unstack_map(meta, rename=lambda k: "gpt." + k)
    assert mapping["gpt.decoder.layers.3.mlp.linear_fc2.weight"] == StoredSlice(
        "model/decoder.layers.mlp.linear_fc2.weight", (3,)
    )
    shapes = {fqn: meta.tensors[s.name].shape[len(s.index) :] for fqn, s in mapping.items()}
    plain = plain_module(shapes)
    assert plain.get_parameter("gpt.decoder.layers.2.mlp.linear_fc1.weight").shape == (
        256,
        32,
    )  # SwiGLU halves, both TP ranks
    report = load_unstacked(path, plain, mapping)
    assert report == {"missing": [], "mismatched": [], "unused": []}
    state = plain.state_dict()
    assert len(state) == 4 * 12 + 5
    for fqn, src in mapping.items():
        key = src.name.split("/", 1)[1]
        want = model[key][src.index] if src.index else model[key]
        assert np.array_equal(state[fqn].numpy(), want), fqn


def test_unstack_optimizer_state(tp2_checkpoint: tuple) -> None:
    path, _, optim = tp2_checkpoint
    meta = acp.read_metadata(path)
    mapping = unstack_map(meta, ns="optimizer")
    wanted = {k: v for k, v in mapping.items() if k.endswith("/exp_avg_sq") and ".layers." in k}
    target = {k: torch.zeros(meta.tensors[s.name].shape[len(s.index) :]) for k, s in wanted.items()}
    load_unstacked(path, target, wanted)
    qkv = target["decoder.layers.1.self_attention.linear_qkv.weight/exp_avg_sq"]
    assert np.array_equal(qkv.numpy(), optim["decoder.layers.self_attention.linear_qkv.weight/exp_avg_sq"][1])


def test_rename_through_key_map_and_strict_errors(tp2_checkpoint: tuple) -> None:
    path, model, _ = tp2_checkpoint
    plain = torch.nn.Module()
    plain.embed = torch.nn.Embedding(128, 32)
    plain.norm = torch.nn.LayerNorm(32)
    names = {
        "model/embed.weight": "model/embedding.word_embeddings.weight",
        "model/norm.weight": "model/decoder.final_layernorm.weight",
        "model/norm.bias": "model/decoder.final_layernorm.bias",
    }
    report: dict = {}
    acp.load(path, {"model": plain}, framework="torch", key_map=names, strict=False, report=report)
    assert report["missing"] == [] and report["mismatched"] == []
    assert torch.equal(plain.embed.weight, torch.from_numpy(model["embedding.word_embeddings.weight"]))
    assert torch.equal(plain.norm.bias, torch.from_numpy(model["decoder.final_layernorm.bias"]))
    wrong = plain_module({"w": (96, 32)})
    with pytest.raises(StateMismatchError, match="linear_qkv.weight"):
        load_unstacked(
            path, wrong, {"w": StoredSlice("model/decoder.layers.self_attention.linear_qkv.weight")}
        )
    with pytest.raises(StateMismatchError, match="missing"):
        load_unstacked(path, wrong, {})
