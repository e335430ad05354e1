"""Single-process PyTorch: format round trips, training continuity, extra state, errors (issue 2)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from faults.packtools import LAYOUTS, flip_member_byte, pack_of, save_options

import arraycheckpoint as acp
from arraycheckpoint.format.metadata import COMMIT_MARKER, METADATA_FILE
from arraycheckpoint.testing import chunk_files

DTYPES = [
    torch.float32,
    torch.float16,
    torch.float64,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        # random bit patterns: NaN payloads, -0.0, infinities and subnormals must survive too
        bits = torch.randint(0, 256, (*shape, dtype.itemsize), generator=gen, dtype=torch.uint8)
        return bits.view(dtype).reshape(shape)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool or a.numel() == 0:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    base = _random((6, 10), dtype, gen)
    state = {
        "plain": _random((33, 7), dtype, gen),
        "scalar": _random((), dtype, gen),
        "empty": _random((0, 5), dtype, gen),
        "transposed": base.t(),  # non-contiguous
        "strided": base[::2, 1::3],  # strided view
    }
    acp.save(tmp_path / "ck", {"model": state})
    target = {k: torch.zeros(v.shape, dtype=dtype) for k, v in state.items()}
    acp.load(tmp_path / "ck", {"model": target})
    for k in state:
        assert _bits_equal(state[k].contiguous(), target[k]), k


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3)
    )
    m.register_buffer("counter", torch.zeros((), dtype=torch.int64))
    return m


def _train(model, opt, sched, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 12, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        model.counter += 1
        losses.append(loss.item())
    return losses


def _setup():
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return m, opt, sched


def test_resume_matches_uninterrupted_run_bit_exactly(tmp_path):
    m, opt, sched = _setup()
    reference = _train(m, opt, sched, 3, seed=1) + _train(m, opt, sched, 3, seed=2)
    final = {k: v.clone() for k, v in m.state_dict().items()}

    m, opt, sched = _setup()
    first = _train(m, opt, sched, 3, seed=1)
    acp.save(
        tmp_path / "ck", {"model": m, "optimizer": opt, "extra_state": {"sched": sched.state_dict()}}, step=3
    )

    m2, opt2, sched2 = _setup()
    torch.nn.init.zeros_(m2[0].weight)
    extra: dict = {}
    acp.load(tmp_path / "ck", {"model": m2, "optimizer": opt2, "extra_state": extra})
    sched2.load_state_dict(extra["sched"])
    second = _train(m2, opt2, sched2, 3, seed=2)
    assert first + second == reference
    for k, v in m2.state_dict().items():
        assert torch.equal(v, final[k]), k
    assert acp.read_metadata(tmp_path / "ck").step == 3


def test_optimizer_state_is_keyed_by_fqn(tmp_path):
    m, opt, sched = _setup()
    _train(m, opt, sched, 1, seed=0)
    meta = acp.save(tmp_path / "ck", {"model": m, "optimizer": opt})
    assert {"optimizer/0.weight/exp_avg", "optimizer/0.weight/exp_avg_sq", "optimizer/3.bias/step"} <= set(
        meta.tensors
    )
    groups = meta.objects["optimizer/~param_groups"].value
    assert groups[0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]
    assert groups[0]["lr"] == pytest.approx(1e-2) and groups[0]["weight_decay"] == 0.1


def test_tied_weights_are_stored_once(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    m = Tied()
    meta = acp.save(tmp_path / "ck", {"model": m})
    assert "model/embed.weight" in meta.tensors and "model/head.weight" not in meta.tensors
    assert meta.objects["model/~aliases"].value == {"head.weight": "embed.weight"}
    m2 = Tied()
    acp.load(tmp_path / "ck", {"model": m2})
    assert torch.equal(m2.head.weight, m.embed.weight) and m2.head.weight is m2.embed.weight


def test_extra_state_rng_and_nested_values(tmp_path):
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    extra = {
        "step": 7,
        "name": "run-1",
        "lr": 1.5e-4,
        "nan": float("nan"),
        "nested": {"a": [1, 2, (3, 4)], "b": None},
        "int_keys": {1: "x", 2: "y"},
        "blob": b"\x00\x01",
        "mask": torch.tensor([True, False]),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }
    acp.save(tmp_path / "ck", {"extra_state": extra})
    expected_draws = (torch.rand(3), np.random.rand(3), random.random())
    out: dict = {}
    acp.load(tmp_path / "ck", {"extra_state": out})
    torch.set_rng_state(out["rng"]["torch"])
    np.random.set_state(out["rng"]["numpy"])
    random.setstate(out["rng"]["python"])
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert np.array_equal(np.random.rand(3), expected_draws[1])
    assert random.random() == expected_draws[2]
    assert out["nested"] == {"a": [1, 2, (3, 4)], "b": None} and out["int_keys"] == {1: "x", 2: "y"}
    assert out["blob"] == b"\x00\x01" and np.isnan(out["nan"]) and torch.equal(out["mask"], extra["mask"])


class _Opaque:
    def __init__(self, v):
        self.v = v


def test_pickle_only_with_opt_in(tmp_path):
    with pytest.raises(acp.PickleNotAllowedError, match="extra_state/obj"):
        acp.save(tmp_path / "a", {"extra_state": {"obj": _Opaque(1)}})
    acp.save(tmp_path / "b", {"extra_state": {"obj": _Opaque(2)}}, allow_pickle=True)
    with pytest.raises(acp.PickleNotAllowedError):
        acp.load(tmp_path / "b", {"extra_state": {}})
    out: dict = {}
    acp.load(tmp_path / "b", {"extra_state": out}, allow_pickle=True)
    assert out["obj"].v == 2


def test_strict_load_names_every_mismatch(tmp_path):
    acp.save(tmp_path / "ck", {"model": {"a": torch.ones(2, 3), "b": torch.ones(4), "c": torch.ones(1)}})
    target = {"a": torch.zeros(3, 2), "b": torch.zeros(4, dtype=torch.float64), "d": torch.zeros(1)}
    with pytest.raises(acp.StateMismatchError) as err:
        acp.load(tmp_path / "ck", {"model": target})
    msg = str(err.value)
    assert "model/d" in msg and "model/c" in msg and "model/a" in msg and "model/b" in msg and "dtype" in msg
    report: dict = {}
    target = {"a": torch.zeros(2, 3), "d": torch.zeros(1)}
    acp.load(tmp_path / "ck", {"model": target}, strict=False, report=report)
    assert torch.equal(target["a"], torch.ones(2, 3)) and report["missing"] == ["model/d"]
    cast = {"b": torch.zeros(4, dtype=torch.float64)}
    acp.load(tmp_path / "ck", {"model": cast}, strict=False, allow_cast=True)
    assert torch.equal(cast["b"], torch.ones(4, dtype=torch.float64))


def test_uncommitted_checkpoint_does_not_load(tmp_path):
    acp.save(tmp_path / "ck", {"model": {"w": torch.ones(3)}})
    os.remove(tmp_path / "ck" / COMMIT_MARKER)
    with pytest.raises(acp.CheckpointNotFoundError, match="commit marker"):
        acp.load(tmp_path / "ck", {"model": {"w": torch.zeros(3)}})
    with pytest.raises(acp.CheckpointNotFoundError, match="does not exist"):
        acp.load(tmp_path / "nothing", {"model": {"w": torch.zeros(3)}})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_corrupted_chunk_names_the_tensor(tmp_path, layout):
    acp.save(
        tmp_path / "ck",
        {"model": {"good": torch.randn(50), "bad": torch.randn(64, 64)}},
        **save_options(layout),
    )
    if layout == "packed":  # the chunk is a member of the pack: flip the same byte of it there
        flip_member_byte(pack_of(tmp_path / "ck", "model/bad"), "model/bad/c.0.0", 123)
    else:
        (path,) = chunk_files(tmp_path / "ck" / "model" / "bad")[-1:]
        data = bytearray(open(path, "rb").read())
        data[123] ^= 0x10
        open(path, "wb").write(bytes(data))
    with pytest.raises(acp.CorruptCheckpointError, match="model/bad"):
        acp.load(tmp_path / "ck", {"model": {"good": torch.zeros(50), "bad": torch.zeros(64, 64)}})


@pytest.mark.parametrize("name", ["../evil", "/abs", "a/../../b", "x\\y", ".hidden", "__reserved"])
def test_unsafe_names_refused_on_save(tmp_path, name):
    with pytest.raises(acp.UnsafeNameError):
        acp.save(tmp_path / "ck", {"model": {name: torch.ones(1)}})
    assert not (tmp_path / "evil").exists() and not (tmp_path / "ck").exists()


def test_unsafe_names_refused_on_load(tmp_path):
    acp.save(tmp_path / "ck", {"model": {"w": torch.ones(2)}})
    meta_path = tmp_path / "ck" / METADATA_FILE
    doc = json.loads(meta_path.read_text())
    doc["tensors"]["model/../../escape"] = doc["tensors"].pop("model/w")
    meta_path.write_text(json.dumps(doc))
    with pytest.raises(acp.UnsafeNameError, match="escape"):
        acp.load(tmp_path / "ck", {"model": {"w": torch.zeros(2)}})


def test_async_snapshot_isolates_later_mutation(tmp_path):
    w = torch.arange(1000, dtype=torch.float32)
    fut = acp.save_async(tmp_path / "ck", {"model": {"w": w}})
    fut.staged.result()
    w.add_(1)  # training continues while the write runs
    fut.result()
    out = {"w": torch.zeros(1000)}
    acp.load(tmp_path / "ck", {"model": out})
    assert torch.equal(out["w"], torch.arange(1000, dtype=torch.float32))


def test_refuses_to_overwrite_unless_asked(tmp_path):
    acp.save(tmp_path / "ck", {"model": {"w": torch.ones(2)}})
    with pytest.raises(acp.CheckpointExistsError):
        acp.save(tmp_path / "ck", {"model": {"w": torch.ones(2)}})
    acp.save(tmp_path / "ck", {"model": {"w": torch.full((2,), 5.0)}}, overwrite=True)
    out = {"w": torch.zeros(2)}
    acp.load(tmp_path / "ck", {"model": out})
    assert torch.equal(out["w"], torch.full((2,), 5.0))


def test_memory_url_round_trip():
    state = {"w": torch.randn(100, 3).to(torch.bfloat16)}
    acp.save("memory://unit/ck", {"model": state})
    out = {"w": torch.zeros(100, 3, dtype=torch.bfloat16)}
    acp.load("memory://unit/ck", {"model": out})
    assert torch.equal(out["w"], state["w"])


def test_zstd_compression_round_trip(tmp_path):
    state = {"w": torch.zeros(512, 512)}
    acp.save(tmp_path / "ck", {"model": state}, compression="zstd")
    size = sum(os.path.getsize(p) for p in chunk_files(tmp_path / "ck" / "model" / "w"))
    assert size < 512 * 512 * 4 / 10
    out = {"w": torch.ones(512, 512)}
    acp.load(tmp_path / "ck", {"model": out})
    assert torch.equal(out["w"], state["w"])


_READER = """
import sys, json, numpy as np, tensorstore as ts, zarr
zarr.core.dtype.data_type_registry._lazy_load()  # zarr 3.1.6 does not load dtype entry points by itself
root = sys.argv[1]
with open(f"{root}/.acp/metadata.json") as f:  # plain JSON: where each array is stored
    tensors = json.load(f)["tensors"]
out = {}
import os, zipfile
where = {}  # format 6: "pack" names the rank whose packs hold the array; one rank wrote it all here
packs = f"{root}/.acp/packs"
for leaf in sorted(os.listdir(packs)) if os.path.isdir(packs) else []:
    where.update(dict.fromkeys(zipfile.ZipFile(f"{packs}/{leaf}").namelist(), f".acp/packs/{leaf}"))
for name in ["model/w_bf16", "model/w_f8", "model/w_f32"]:
    pack = tensors[name].get("pack")
    if pack is not None and not pack.endswith(".zip"):
        pack = where[f"{name}/zarr.json"]
    if pack is None:  # the array's own directory
        a = zarr.open_array(f"{root}/{name}", mode="r")[...]
        kvstore = {"driver": "file", "path": f"{root}/{name}/"}
    else:  # a member of a pack: a ZIP file holding complete zarr v3 arrays
        with zarr.storage.ZipStore(f"{root}/{pack}", mode="r") as store:
            a = zarr.open_array(store, path=name, mode="r")[...]
        kvstore = {"driver": "zip", "base": f"file://{root}/{pack}", "path": f"{name}/"}
    t = ts.open({"driver": "zarr3", "kvstore": kvstore}).result().read().result()
    assert np.array_equal(a.view(np.uint8), t.view(np.uint8)), name
    out[name] = [str(a.dtype), a.view(np.uint8).tobytes().hex(), pack]
assert "torch" not in sys.modules
print(json.dumps(out))
"""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_external_readers_open_a_checkpoint_without_arraycheckpoint(tmp_path, layout):
    """zarr-python and tensorstore, with no arraycheckpoint code, read every array bit-exactly: from its own
    directory, or from the pack the plain-JSON metadata names (zarr's ZipStore, tensorstore's zip driver)."""
    gen = torch.Generator().manual_seed(5)
    state = {
        "w_bf16": torch.randn(40, 30, generator=gen).to(torch.bfloat16),
        "w_f8": torch.randn(17, generator=gen).to(torch.float8_e4m3fn),
        "w_f32": torch.randn(3, 5, 7, generator=gen),
    }
    acp.save(tmp_path / "ck", {"model": state}, **save_options(layout))
    res = subprocess.run(
        [sys.executable, "-c", _READER, str(tmp_path / "ck")], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    for key, t in state.items():
        dtype, hexbytes, pack = got[f"model/{key}"]
        assert bytes.fromhex(hexbytes) == t.contiguous().view(torch.uint8).numpy().tobytes()
        assert (pack is None) == (layout == "directory"), (key, pack)
    assert got["model/w_bf16"][0] == "bfloat16"


def test_float8_variants_never_share_staging_buffers(tmp_path):
    """The host buffer pool must key on the dtype itself: float8 types all look like '<V1' to numpy."""
    gen = torch.Generator().manual_seed(9)
    bits = torch.randint(0, 256, (8, 8), generator=gen, dtype=torch.uint8)
    for i, dtype in enumerate(
        [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz]
    ):
        t = bits.view(dtype)
        acp.save_async(tmp_path / f"ck{i}", {"model": {"w": t}}).result()  # async: staged through the pool
        out = {"w": torch.zeros(8, 8, dtype=dtype)}
        acp.load(tmp_path / f"ck{i}", {"model": out})
        assert torch.equal(out["w"].view(torch.uint8), bits), dtype


def test_param_groups_and_plain_state_values_round_trip_exactly(tmp_path):
    """Tuples stay tuples, inf survives the JSON metadata, non-tensor state values come back as saved."""
    m, opt, sched = _setup()
    opt.param_groups[0]["clip"] = float("inf")
    opt.param_groups[0]["schedule"] = {"warmup": (10, 0.5)}
    _train(m, opt, sched, 1, seed=0)
    opt.state[m[0].weight]["note"] = {"seen": (1, 2), "ratio": float("nan")}
    acp.save(tmp_path / "ck", {"model": m, "optimizer": opt})
    m2, opt2, _ = _setup()
    opt2.param_groups[0]["clip"] = 1.0
    acp.load(tmp_path / "ck", {"model": m2, "optimizer": opt2})
    group = opt2.param_groups[0]
    assert group["betas"] == (0.9, 0.999) and isinstance(group["betas"], tuple)
    assert group["clip"] == float("inf") and group["schedule"] == {"warmup": (10, 0.5)}
    note = opt2.state[m2[0].weight]["note"]
    assert note["seen"] == (1, 2) and np.isnan(note["ratio"])


def test_a_namespace_saved_as_tensors_and_loaded_with_a_plain_value_says_why(tmp_path):
    """A dict holding a plain value among its tensors is stored as one object; saved as tensors and loaded
    into such a dict (or the reverse), strict refused with 'missing: model / unexpected: model/n, model/w' and
    no word of why. The error now says which side holds the plain value."""
    acp.save(tmp_path / "a", {"model": {"w": torch.ones(2), "n": torch.tensor(3)}})
    with pytest.raises(acp.StateMismatchError, match=r"(?s)unexpected.*hint: model holds a plain"):
        acp.load(tmp_path / "a", {"model": {"w": torch.zeros(2), "n": 0}})
    acp.save(tmp_path / "b", {"model": {"w": torch.ones(2), "n": 3}})
    with pytest.raises(acp.StateMismatchError, match="hint: the checkpoint stores model as one object"):
        acp.load(tmp_path / "b", {"model": {"w": torch.zeros(2), "n": torch.tensor(0)}})
