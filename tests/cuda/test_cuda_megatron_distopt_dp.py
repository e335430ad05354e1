"""megatron-core's own DistributedOptimizer, sharded over data-parallel ranks: saved at DP 2 through its
``sharded_state_dict()`` in the two formats megatron-core 0.16.1 can still write (``dp_reshardable``: each
rank's flat bucket shards as 1-D ``ShardedTensor``s of the bucket space, no exchange; ``fully_reshardable``:
gathered over DP into tensors laid out like the parameters), loaded by the real optimizer at DP 4 and DP 1
(``sharded_state_dict(is_loading=True)``, ``acp.load``, ``load_state_dict``: megatron's resume) and checked
bit-exactly on the fp32 main parameters and Adam moments of every rank's flat slice.

CUDA only: megatron-core 0.16.1 cannot build this optimizer without CUDA (checked on CPU over gloo):

* ``DistributedDataParallel(..., ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True))``
  fails in ``_ParamAndGradBuffer.__init__`` (``megatron/core/distributed/param_and_grad_buffer.py``, line 800),
  which allocates ``param_data`` and ``grad_data`` with ``device=torch.cuda.current_device()``: no config
  option chooses another device ("AssertionError: Torch not compiled with CUDA enabled");
* past that (``torch.cuda.current_device`` redirected to the CPU), ``get_megatron_optimizer`` fails in
  ``MixedPrecisionOptimizer.__init__`` (``megatron/core/optimizer/optimizer.py``, line 481:
  ``torch.tensor([0], dtype=torch.int, device='cuda')``), and ``DistributedOptimizer`` only wraps parameters
  whose ``type()`` is ``torch.cuda.{Float,Half,BFloat16}Tensor`` (``distrib_optimizer.py``, lines 361, 420).

Its ``flattened_range`` format (``fully_sharded_model_space``, still the default of ``sharded_state_dict``
when no ``distrib_optim_sharding_type`` is given) cannot be written by megatron-core 0.16.1 on any device:
``ShardedTensor.validate_metadata_integrity`` raises "ShardedTensor.flattened_range is not supported."
(``megatron/core/dist_checkpointing/mapping.py``, line 133; ``tests/megatron/test_megatron_state_dict.py``
checks it on CPU). The adapter's ``flattened_range`` support serves older megatron-core releases.

One GPU is enough: the data-parallel ranks are processes sharing GPU 0 over gloo (megatron's parallel state
on the gloo world). The optimizer's state is created by its inner Adam's first step on this rank's shards (local,
zero gradients, no weight decay: the parameters do not move) and then set to known values; no
``DistributedOptimizer.step()`` runs (its gradient reduce-scatter and parameter all-gather want NCCL). The
one collective on CUDA tensors is ``fully_reshardable``'s all-gather of the state over the DP group (gloo
stages CUDA tensors through the host).

Values: a parameter ``name`` (``named_parameters``) is ``megatron_helpers.value_of`` of its ShardedTensor
(``fill_model``; its fp32 main parameter, a view of it, too), its moment ``m`` ``value_of(f"{m}:{name}")``,
flattened; each rank's slice (megatron's own ``gbuf_ranges``) is set and checked against them, so a slice
loaded from another place cannot compare equal.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from dist import run_distributed

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "megatron"))

MOMENTS = ("exp_avg", "exp_avg_sq")
FORMATS = ("dp_reshardable", "fully_reshardable")


def _distributed_optimizer(seed: int):
    """A GPT (TP 1, PP 1: every other rank is data-parallel) on GPU 0 with known parameter values, wrapped
    in megatron's DDP with the distributed optimizer, and its DistributedOptimizer (Adam) with state."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
    from megatron_helpers import build_gpt, fill_model

    torch.cuda.set_device(0)
    gpt = build_gpt(1, 1, seed=seed, glu=False)
    fill_model(gpt)
    gpt.cuda()
    ddp = DistributedDataParallel(
        config=gpt.config,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
        module=gpt,
    )
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, use_distributed_optimizer=True)
    opt = get_megatron_optimizer(config, [ddp])
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    assert isinstance(inner, DistributedOptimizer), type(inner)
    for (
        group
    ) in inner.optimizer.param_groups:  # the inner Adam's first step: creates its state, moves nothing
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    inner.optimizer.step()
    return gpt, inner


def _slices(gpt, opt):
    """(name, parameter, start, stop) of this rank's flat slice of every parameter (megatron's gbuf_ranges)."""
    names = {id(p): n for n, p in gpt.named_parameters()}
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for param, ranges in bucket["param_map"].items():
                    r = ranges["param"]
                    yield names[id(param)], param, int(r.start), int(r.end)


def _expected(name: str, param, state: str, fills: dict) -> np.ndarray:
    if state == "param":
        return fills[name]
    from megatron_helpers import value_of

    return value_of(f"{state}:{name}", tuple(param.shape)).reshape(-1)


def _state_of(gpt, opt, fills: dict, write: bool) -> tuple[int, int]:
    """Set (``write``) or check bit-exactly this rank's main parameters and moments; (slices, cut ones)."""
    count = cut = 0
    for name, param, start, stop in _slices(gpt, opt):
        tensors = opt._get_main_param_and_optimizer_states(param)
        for state in ("param", *MOMENTS):
            want = _expected(name, param, state, fills)[start:stop]
            if write:
                with torch.no_grad():
                    tensors[state].copy_(torch.from_numpy(np.ascontiguousarray(want)))
            else:
                got = tensors[state].detach().cpu().numpy()
                assert got.dtype == np.float32 and np.array_equal(got, want), (name, state, start, stop)
        count += 1
        cut += stop - start < param.numel()
    return count, cut


def _check_whole(gpt, opt, param_state, fills: dict) -> int:
    """``fully_reshardable``'s loaded state: per parameter (in ``param_index_map`` order, as megatron's
    loader reads it) whole ``fp32_param`` / moment tensors, compared bit-exactly with their values."""
    names = {id(p): n for n, p in gpt.named_parameters()}
    index = -1
    for buffer in opt.buffers:
        for param in buffer.param_index_map:
            index += 1
            entry = param_state[index]
            for state in ("param", *MOMENTS):
                got = entry["fp32_param" if state == "param" and "fp32_param" in entry else state]
                got = got.detach().cpu().numpy().reshape(-1)
                want = _expected(names[id(param)], param, state, fills)
                assert got.dtype == np.float32 and np.array_equal(got, want), (names[id(param)], state)
    return index + 1


def _fills(gpt) -> dict:
    return {n: p.detach().cpu().numpy().reshape(-1).copy() for n, p in gpt.named_parameters()}


def _metadata(fmt: str) -> dict:
    return {"distrib_optim_sharding_type": fmt}


def _save_dp2_body(rank: int, world: int, path: str, fmt: str) -> tuple[int, int]:
    import arraycheckpoint as acp

    gpt, opt = _distributed_optimizer(seed=rank)
    done = _state_of(gpt, opt, _fills(gpt), write=True)
    opt_sd = opt.sharded_state_dict(gpt.sharded_state_dict(), metadata=_metadata(fmt))
    assert opt_sd["param_state_sharding_type"] == fmt
    acp.save(path, {"optimizer": opt_sd}, framework="megatron")
    return done


def _load_dp_body(rank: int, world: int, path: str, fmt: str) -> tuple[int, int]:
    """The real optimizer at DP ``world``, every main parameter and moment poisoned, then megatron's resume:
    its own ``sharded_state_dict(is_loading=True)`` loaded by acp, handed to ``load_state_dict``."""
    import arraycheckpoint as acp

    gpt, opt = _distributed_optimizer(seed=100 + rank)
    fills = _fills(gpt)
    for _name, param, _start, _stop in _slices(gpt, opt):
        with torch.no_grad():
            for state, t in opt._get_main_param_and_optimizer_states(param).items():
                if state != "step":
                    t.fill_(float("nan"))
    opt_sd = opt.sharded_state_dict(gpt.sharded_state_dict(), is_loading=True, metadata=_metadata(fmt))
    loaded = acp.load(path, {"optimizer": opt_sd}, framework="megatron")["optimizer"]
    if fmt == "fully_reshardable":
        # megatron-core 0.16.1's own loader of this format fails with torch's Adam (no Transformer Engine or
        # apex): ``_set_main_param_and_optimizer_states`` copies every key of the inner optimizer's
        # per-parameter state, ``step`` included, which the loader leaves out (KeyError: 'step'). Each rank
        # loads whole parameter-shaped tensors here: checked whole, in the loader's parameter order
        return _check_whole(gpt, opt, loaded["param_state"], fills), 0
    with torch.no_grad():  # fp32 main parameters are views of the parameters (leaves that require grad)
        opt.load_state_dict(loaded)
    return _state_of(gpt, opt, fills, write=False)


@pytest.fixture(scope="module", params=FORMATS)
def dp2_checkpoint(request, tmp_path_factory) -> tuple[str, str]:
    fmt = request.param
    path = str(tmp_path_factory.mktemp("distopt") / fmt)
    done = run_distributed(_save_dp2_body, 2, (path, fmt))
    assert all(count > 0 for count, _cut in done)
    assert sum(cut for _count, cut in done) > 0, "no parameter was split between the two DP ranks"
    return path, fmt


@pytest.mark.parametrize("dp", [4, 1])
def test_distributed_optimizer_saved_at_dp2_loads_at_another_dp(dp2_checkpoint, dp: int) -> None:
    path, fmt = dp2_checkpoint
    results = run_distributed(_load_dp_body, dp, (path, fmt))
    assert all(count > 0 for count, _cut in results)
    if dp > 1 and fmt == "dp_reshardable":  # DP 4 cuts parameters where DP 2 did not
        assert sum(cut for _count, cut in results) > 0
