"""A real megatron-core GPT saved as interleaved (virtual) pipeline chunks on CPU over gloo.

PP 2 x virtual PP 2 with 8 layers: each rank holds two chunks of two layers, non-contiguous along the stacked
layer axis (rank 0 layers 0, 1, 4, 5; rank 1 layers 2, 3, 6, 7). Those boxes are a mesh rule on megatron's
pipeline grid (a repeat over the virtual stages, the stage, a repeat over a chunk's layers), so the layers
are declared alike on both stages and the metadata holds no boxes. Loaded at TP 2 without pipelining, every
parameter is bit-identical to the source.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from dist import run_distributed  # noqa: E402
from megatron_helpers import (  # noqa: E402
    assemble,
    assert_equal_tensors,
    build_gpt,
    build_vpp,
    fill_model,
    local_shards,
)


def save_vpp(rank: int, world: int, path: str) -> list:
    import arraycheckpoint as acp

    chunks = build_vpp(2, 2, seed=rank)
    for chunk in chunks:
        fill_model(chunk)
    acp.save(path, {"model": chunks}, framework="megatron")
    return [s for chunk in chunks for s in local_shards(chunk)]


def load_tp2(rank: int, world: int, path: str) -> tuple:
    import arraycheckpoint as acp

    model = build_gpt(2, 1, seed=50 + rank, num_layers=8, glu=False)
    before = local_shards(model)
    acp.load(path, {"model": model})
    return before, local_shards(model)


def test_virtual_pipeline_chunks_save_as_rules_and_load_without_pipelining(tmp_path) -> None:
    import arraycheckpoint as acp

    path = str(tmp_path / "vpp")
    want = assemble(run_distributed(save_vpp, 2, (path,)))
    meta = acp.read_metadata(path)
    # one declaration per stage (the first holds the embedding, the last the output layer), each its rules
    assert len(meta.layout_groups) == 2
    layers = {n: {r[0] for _g, r in t.regions} for n, t in meta.tensors.items() if "decoder.layers" in n}
    assert layers and all(k == {"mesh"} for k in layers.values()), layers
    assert not any("boxes" in k for t in meta.tensors.values() for k in {r[0] for _g, r in t.regions})
    got = run_distributed(load_tp2, 2, (path,))
    assert assemble([b for b, _a in got], replicas_agree=False).keys() == want.keys()
    assert_equal_tensors(assemble([a for _b, a in got]), want)
