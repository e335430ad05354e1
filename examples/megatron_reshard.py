"""Save a megatron-core GPT at tensor-parallel size 2 (2 processes), load it on 1 process, check every weight.

Runs on CPU over gloo (megatron-core 0.16.x builds GPTModel with ``use_cpu_initialization=True``)::

    python examples/megatron_reshard.py [checkpoint_dir]

Every weight is set to a known function of its global position before saving, so the single-process load
can check each full tensor bit-exactly.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

warnings.filterwarnings("ignore")


def build_gpt(tp: int, seed: int) -> torch.nn.Module:
    """A 2-layer GPT for this rank's tensor-parallel position."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        gated_linear_unit=True,
    )
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32)


def pattern(key: str, shape: tuple[int, ...]) -> np.ndarray:
    """The full tensor every weight is set to: distinct integers (exact in float32) per key and element."""
    base = (zlib.crc32(key.encode()) % 1021) * 8192
    return ((base + np.arange(int(np.prod(shape)))) % (1 << 23)).astype(np.float32).reshape(shape)


def sharded_tensors(model: torch.nn.Module) -> list:
    """The model's ShardedTensors (factories such as the SwiGLU split built), views of its parameters."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for v in model.sharded_state_dict().values():
        if isinstance(v, ShardedTensorFactory):
            out += [x for x in v.build() if isinstance(x, ShardedTensor)]
        elif isinstance(v, ShardedTensor):
            out.append(v)
    return out


def save_rank(rank: int, world: int, port: int, path: str) -> None:
    import arraycheckpoint as acp

    _init(rank, world, port)
    model = build_gpt(tp=2, seed=rank)
    with torch.no_grad():
        for st in sharded_tensors(model):
            st.data.copy_(
                torch.from_numpy(np.ascontiguousarray(pattern(st.key, st.global_shape)[st.global_slice()]))
            )
    acp.save(path, {"model": model}, framework="megatron")
    dist.destroy_process_group()


def load_rank(rank: int, world: int, port: int, path: str) -> None:
    import arraycheckpoint as acp

    _init(rank, world, port)
    model = build_gpt(tp=1, seed=1234)
    acp.load(path, {"model": model})
    tensors = sharded_tensors(model)
    ok = [
        np.array_equal(st.data.detach().numpy(), pattern(st.key, st.global_shape)[st.global_slice()])
        for st in tensors
    ]
    meta = acp.read_metadata(path)
    print(f"checkpoint saved by {meta.world_size} ranks (TP=2), loaded on 1 process (TP=1)")
    print(f"{sum(ok)}/{len(ok)} tensors match bit-exactly: {'match' if all(ok) else 'MISMATCH'}")
    dist.destroy_process_group()
    if not all(ok):
        sys.exit(1)


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(fn, world: int, path: str) -> None:
    mp.spawn(fn, args=(world, _free_port(), path), nprocs=world, join=True)


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="acp-megatron-")
    ckpt = os.path.join(root, "gpt_tp2")
    _run(save_rank, 2, ckpt)
    _run(load_rank, 1, ckpt)
