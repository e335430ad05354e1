"""torch and numpy dtypes are stored by name, without pickle: megatron-core's distributed optimizer keys its
``per_bucket_numel`` objects by ``(param dtype, grad dtype)`` (its ``dp_reshardable`` format could only be saved
with ``allow_pickle=True``). A stored dtype name is untrusted: only a torch dtype or a numeric numpy dtype is taken."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.errors import InconsistentCheckpointError, PickleNotAllowedError
from arraycheckpoint.format.extras import decode, encode


def test_dtype_keys_and_values_round_trip_through_a_save(tmp_path):
    extra = {
        "per_bucket_numel": [
            {(torch.float32, torch.bfloat16): [10, 20]},
            {(torch.float16, torch.float32): [3]},
        ],
        "dtypes": [torch.int64, np.dtype("float32"), np.dtype(bool), np.dtype("complex64")],
        "__dtype__": "a user key that is the tag",
        "w": torch.arange(4.0),
    }
    acp.save(tmp_path / "ck", {"opt": extra})
    target = {"opt": {"per_bucket_numel": None, "dtypes": None, "__dtype__": None, "w": torch.zeros(4)}}
    acp.load(tmp_path / "ck", target)
    assert target["opt"]["per_bucket_numel"] == extra["per_bucket_numel"]
    got = target["opt"]["dtypes"]
    assert got == extra["dtypes"] and [type(d) for d in got] == [type(d) for d in extra["dtypes"]]
    assert target["opt"]["__dtype__"] == extra["__dtype__"]
    assert torch.equal(target["opt"]["w"], extra["w"])


def test_megatron_sharded_object_keyed_by_dtypes_saves_without_pickle(tmp_path):
    mapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping")
    key = "optimizer.distributed.dp_group_idx_0.per_bucket_numel"
    numel = [{(torch.float32, torch.float32): [4096, 1024]}]

    def state(value, w):
        obj = mapping.ShardedObject(key, value, (1,), (0,), replica_id=(0, 0, 0))
        return {"optimizer": {"per_bucket_numel": obj, "w": mapping.ShardedTensor.from_rank_offsets("w", w)}}

    acp.save(tmp_path / "ck", state(numel, torch.arange(6.0).reshape(2, 3)), framework="megatron")
    loaded = acp.load(tmp_path / "ck", state(None, torch.zeros(2, 3)), framework="megatron")["optimizer"]
    assert loaded["per_bucket_numel"] == numel
    assert torch.equal(loaded["w"], torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize(
    "name",
    ["torch.nn", "os.system", "torch.", "torch.float32x", "numpy.object_", "numpy.str_", "numpy.V8", "numpy.U3",
     "numpy.datetime64[ns]", "numpy.bfloat16", "builtins.eval", "x" * 65, ""],
)  # fmt: skip
def test_a_stored_name_that_is_no_dtype_is_refused_naming_the_value(name):
    with pytest.raises(InconsistentCheckpointError, match="opt/d.*__dtype__"):
        decode({"d": {"__dtype__": name}}, {}, where="opt")
    with pytest.raises(InconsistentCheckpointError, match="__dtype__"):
        decode({"__dtype__": 7}, {})


@pytest.mark.parametrize("dtype", [np.dtype("datetime64[ns]"), np.dtype("U3"), np.dtype([("a", "f4")])])
def test_a_numpy_dtype_of_no_number_still_needs_pickle(dtype):
    with pytest.raises(PickleNotAllowedError, match="p/d"):
        encode({"d": dtype}, "p", lambda a: False)
    doc, _ = encode({"d": dtype}, "p", lambda a: False, allow_pickle=True)
    assert decode(doc, {}, allow_pickle=True) == {"d": dtype}
