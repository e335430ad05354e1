"""megatron-core's grouped-GEMM experts (GroupedMLP) saved and loaded through the megatron adapter.

GroupedMLP keeps a layer's local experts in two parameters (``weight1``: hidden x local experts' fc1 rows,
``weight2``) and states them in ``sharded_state_dict`` as ``ShardedTensorFactory``s that build the same
per-expert ``ShardedTensor``s as SequentialMLP (``decoder.layers.mlp.experts.experts.linear_fc1.weight``,
stacked layer and expert axes, both SwiGLU halves of the TP split). Saved by a real GroupedMLP GPT at TP 2 x
EP 2 (4 gloo ranks) and loaded into SequentialMLP experts at TP 1 x EP 4, and back into GroupedMLP at TP 1 x
EP 4: every parameter bit-identical. (GroupedMLP's forward needs the ``grouped_gemm`` CUDA kernels: see
:func:`megatron_helpers.build_moe`.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from dist import run_distributed  # noqa: E402
from megatron_helpers import assemble, assert_equal_tensors, build_moe, fill_model, local_shards  # noqa: E402


def save_grouped(rank: int, world: int, path: str) -> list:
    import arraycheckpoint as acp

    model = build_moe(2, 2, seed=rank, grouped=True)
    assert type(model.decoder.layers[0].mlp.experts).__name__ == "GroupedMLP"
    fill_model(model)
    acp.save(path, {"model": model}, framework="megatron")
    return local_shards(model)


def load_both(rank: int, world: int, path: str) -> tuple:
    import arraycheckpoint as acp

    out = []
    for grouped in (False, True):
        model = build_moe(1, 4, seed=50 + rank, grouped=grouped)
        acp.load(path, {"model": model})
        out.append(local_shards(model))
    return tuple(out)


def test_grouped_experts_saved_at_tp2_ep2_load_into_sequential_and_grouped_at_ep4(tmp_path) -> None:
    import arraycheckpoint as acp

    path = str(tmp_path / "grouped")
    want = assemble(run_distributed(save_grouped, 4, (path,)))
    assert any("experts.experts.linear_fc1" in k for k in want)
    meta = acp.read_metadata(path)
    assert len(meta.layout_groups) == 1  # the factories' tensors declared as rules too
    experts = [n for n in meta.tensors if "experts.experts" in n]
    assert experts and all({r[0] for _g, r in meta.tensors[n].regions} == {"mesh"} for n in experts)
    got = run_distributed(load_both, 4, (path,))
    assert_equal_tensors(assemble([s for s, _g in got]), want)
    assert_equal_tensors(assemble([g for _s, g in got]), want)
