"""Shared helpers of the megatron tests: real megatron-core GPT models on CPU over gloo, distinctive weights,
and reassembly of every rank's local shards into full global tensors (in the test process).

Weights are a deterministic function of (ShardedTensor key, global element index), exact in float32, so a
tensor loaded into the wrong place, layer, TP slice or SwiGLU half cannot compare equal.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

VOCAB = 128
SEQ = 16


def init_parallel(tp: int, pp: int) -> None:
    """(Re)initialise megatron's model-parallel groups for this layout on the running gloo world."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def build_gpt(
    tp: int, pp: int, seed: int, num_layers: int = 4, glu: bool = True, post_process: bool | None = None
) -> Any:
    """A small megatron-core GPTModel for this rank's TP/PP position (CPU initialisation); ``post_process``
    (default: on the last pipeline stage) builds the output layer and final norm."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_parallel(tp, pp)
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        gated_linear_unit=glu,
        pipeline_dtype=torch.float32,
    )
    return GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage() if post_process is None else post_process,
    )


def value_of(key: str, shape: Sequence[int], salt: int = 0) -> np.ndarray:
    """The distinctive full tensor of ``key``: integers below 2**23 (exact in float32), unique per element."""
    base = (zlib.crc32(f"{salt}:{key}".encode()) % 1021) * 8192
    n = int(np.prod(shape)) if len(shape) else 1
    return ((base + np.arange(n, dtype=np.int64)) % (1 << 23)).astype(np.float32).reshape(tuple(shape))


def sharded_tensors(model: Any) -> list[Any]:
    """Every ShardedTensor of the model's sharded_state_dict, factories built (views of the parameters)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for v in model.sharded_state_dict().values():
        if isinstance(v, ShardedTensorFactory):  # a list, or (GroupedMLP) a tensor or nested dicts of them
            built = v.build()
            built = [built] if isinstance(built, ShardedTensor) else nested_values(built)
            out.extend(x for x in built if isinstance(x, ShardedTensor))
        elif isinstance(v, ShardedTensor):
            out.append(v)
    return out


def fill_model(model: Any, salt: int = 0) -> None:
    """Set every parameter to :func:`value_of` of its global position (through its ShardedTensor views)."""
    import torch

    with torch.no_grad():
        for st in sharded_tensors(model):
            full = value_of(st.key, st.global_shape, salt)
            st.data.copy_(torch.from_numpy(np.ascontiguousarray(full[st.global_slice()])))


def local_shards(model: Any) -> list[tuple[str, tuple, tuple, tuple, np.ndarray]]:
    """(key, global_shape, offsets, lengths, data) of every local shard (all replicas), data copied to numpy."""
    out = []
    for st in sharded_tensors(model):
        pre = st.prepend_axis_num
        lengths = (1,) * pre + tuple(st.local_shape)
        data = st.data.detach().clone().numpy().reshape(lengths)
        out.append((st.key, tuple(st.global_shape), tuple(st.global_offset), lengths, data))
    return out


def assemble(per_rank: Sequence[Sequence[tuple]], replicas_agree: bool = True) -> dict[str, np.ndarray]:
    """Full global tensors from every rank's :func:`local_shards`; replicas must agree, coverage must be total.

    ``replicas_agree=False`` for freshly initialised models, whose replicas were seeded per rank.
    """
    full: dict[str, np.ndarray] = {}
    seen: dict[str, np.ndarray] = {}
    for shards in per_rank:
        for key, shape, offsets, lengths, data in shards:
            if key not in full:
                full[key] = np.zeros(shape, dtype=data.dtype)
                seen[key] = np.zeros(shape, dtype=bool)
            sl = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
            region, mask = full[key][sl], seen[key][sl]
            if replicas_agree:
                assert np.array_equal(region[mask], data[mask]), f"{key}: replicas disagree at {offsets}"
            region[...] = data
            mask[...] = True
    for key, mask in seen.items():
        assert mask.all(), f"{key}: the ranks do not cover the global tensor"
    return full


def assert_equal_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Same keys, bit-identical full tensors."""
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for key in want:
        assert got[key].shape == want[key].shape, key
        assert got[key].dtype == want[key].dtype, key
        assert np.array_equal(got[key], want[key]), f"{key}: loaded tensor differs from the source"


def make_optimizer(model: Any) -> Any:
    """A standard torch Adam over the module's parameters (megatron's DistributedOptimizer needs CUDA)."""
    import torch

    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _optimizer_sharded(model: Any, opt: Any, state: str) -> list[Any]:
    """ShardedTensors of one optimizer state laid out like each parameter (factories built on the state)."""
    import dataclasses

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for v in model.sharded_state_dict().values():
        if not isinstance(v, (ShardedTensor, ShardedTensorFactory)) or state not in opt.state.get(v.data, {}):
            continue
        t = opt.state[v.data][state]
        if isinstance(v, ShardedTensorFactory):
            out.extend(x for x in dataclasses.replace(v, data=t).build() if isinstance(x, ShardedTensor))
        else:
            out.append(dataclasses.replace(v, data=t))
    return out


def fill_optimizer(model: Any, opt: Any, salt: int) -> None:
    """Create Adam state (one step on zero gradients), then make exp_avg/exp_avg_sq distinctive."""
    import torch

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    with torch.no_grad():
        for state in ("exp_avg", "exp_avg_sq"):
            for st in _optimizer_sharded(model, opt, state):
                full = value_of(f"{st.key}/{state}", st.global_shape, salt)
                st.data.copy_(torch.from_numpy(np.ascontiguousarray(full[st.global_slice()])))


def optimizer_shards(model: Any, opt: Any) -> list[tuple[str, tuple, tuple, tuple, np.ndarray]]:
    """Like :func:`local_shards` for ``exp_avg``/``exp_avg_sq`` (keys ``<key>/<state>``)."""
    out = []
    for state in ("exp_avg", "exp_avg_sq"):
        for st in _optimizer_sharded(model, opt, state):
            lengths = (1,) * st.prepend_axis_num + tuple(st.local_shape)
            data = st.data.detach().clone().numpy().reshape(lengths)
            out.append((f"{st.key}/{state}", tuple(st.global_shape), tuple(st.global_offset), lengths, data))
    return out


def optimizer_steps(opt: Any) -> list[float]:
    """Adam's ``step`` of every parameter that has state."""
    return [float(s["step"]) for s in opt.state.values() if "step" in s]


def save_tp2(rank: int, world: int, path: str) -> tuple:
    """Rank body: a GPT (4 layers, SwiGLU) + Adam at TP=2/PP=1 with distinctive weights, saved to ``path``."""
    import arraycheckpoint as acp

    model = build_gpt(2, 1, seed=rank)
    opt = make_optimizer(model)
    fill_optimizer(model, opt, salt=1)
    fill_model(model)
    acp.save(path, {"model": model, "optimizer": opt, "extra_state": {"iteration": 7}}, framework="megatron")
    return local_shards(model), optimizer_shards(model, opt), optimizer_steps(opt)


def _fresh_parallel(seed: int, **sizes: int) -> None:
    """megatron's parallel state initialised anew with ``sizes``, and the torch seed set."""
    import torch
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(**sizes)
    torch.manual_seed(seed)


def build_moe(
    tp: int, ep: int, seed: int, num_layers: int = 2, experts: int = 4, grouped: bool = False
) -> Any:
    """A small megatron-core mixture-of-experts GPTModel (SequentialMLP experts, or with ``grouped``
    megatron's GroupedMLP; SwiGLU, no biases) for this rank's TP/EP position (PP 1; the rest of the world is
    data-parallel).

    GroupedMLP's weights, ``sharded_state_dict`` and factories are megatron-core's CPU code, but its
    constructor refuses to run without the ``grouped_gemm`` package (CUDA kernels used only by its forward,
    which no test runs; it does not build without CUDA): ``grouped`` marks the package available to that
    check (``grouped_gemm_util.grouped_gemm``), nothing else."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if grouped:
        import types

        from megatron.core.transformer.moe import grouped_gemm_util

        if grouped_gemm_util.grouped_gemm is None:  # the availability check only: no kernel is ever called
            grouped_gemm_util.grouped_gemm = types.ModuleType("grouped_gemm")
    _fresh_parallel(seed, tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    cfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        num_moe_experts=experts,
        moe_router_topk=2,
        gated_linear_unit=True,
        add_bias_linear=False,
        pipeline_dtype=torch.float32,
        moe_grouped_gemm=grouped,
    )
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=grouped)
    return GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=True, post_process=True)


def build_vpp(pp: int, vp: int, seed: int, num_layers: int = 8) -> list[Any]:
    """A small megatron-core GPTModel as interleaved (virtual) pipeline chunks: this rank's ``vp`` model
    chunks (each ``sharded_state_dict`` holds the layers of its chunk, at their global layer numbers)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    _fresh_parallel(seed, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
    cfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32,
    )
    return [
        GPTModel(
            cfg,
            get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
            vp_stage=v,
        )
        for v in range(vp)
    ]
