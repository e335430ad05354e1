"""numpy arrays in torch state: stored as arrays in their own dtype, loaded in place, bit-exactly.

A ``model`` state dict may hold numpy arrays beside its tensors (``{**model.state_dict(), "buf": arr}``): they
are state-dict entries like the tensors (``model/<key>``), filled in place on load, checked for shape and
dtype by name; a numpy target in extra state is filled in place too, and the target's kind (numpy or torch)
decides what comes back. ``tests/fixtures/numpy_model`` (written by 469cb39, which stored such a dict as extra
state) keeps loading.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from fixtures.make_numpy_model import DTYPES, linear_state, numpy_value

import arraycheckpoint as acp
from arraycheckpoint.codecs import SUPPORTED_DTYPES
from arraycheckpoint.errors import StateMismatchError, UnsupportedDTypeError

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "numpy_model")


def _zeros_like(v):
    return np.zeros_like(v) if isinstance(v, np.ndarray) else torch.zeros_like(v)


def _bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    return type(got) is np.ndarray and got.dtype == want.dtype and np.array_equal(_bytes(got), _bytes(want))


def test_numpy_in_a_model_state_dict_loads_in_place_bit_exactly_in_every_dtype(tmp_path):
    arrays = {f"np_{n}": numpy_value(n) for n in SUPPORTED_DTYPES}
    arrays.update(
        scalar=np.array(7, dtype=np.int16),
        empty=np.zeros((0, 3), np.float32),
        strided=np.arange(12, dtype=np.float64).reshape(3, 4).T,  # not contiguous
        big_endian=np.arange(5, dtype=">i4"),
    )
    saved = {**linear_state(), **arrays}
    meta = acp.save(tmp_path / "ck", {"model": saved})
    assert "model" not in meta.objects  # state-dict entries, not extra state
    assert all(meta.tensors[f"model/np_{n}"].dtype == n for n in SUPPORTED_DTYPES)
    assert meta.tensors["model/big_endian"].dtype == "int32"
    target = {k: _zeros_like(v) for k, v in saved.items()}
    target["big_endian"] = np.zeros(5, dtype="<i4")
    kept = dict(target)
    out = acp.load(tmp_path / "ck", {"model": target})["model"]
    for k, v in saved.items():
        assert out[k] is kept[k], k  # in place
        assert _same(out[k], v if k != "big_endian" else v.astype("<i4")), k


def test_state_dict_numpy_and_torch_targets_read_each_other(tmp_path):
    """A module saved loads into a numpy state dict; numpy arrays saved load into a module and tensors."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    acp.save(tmp_path / "m", {"model": model, "ema": model})
    for ns in ("model", "ema"):  # any namespace saved from a module loads into a state dict
        target = {k: np.zeros(tuple(v.shape), np.float32) for k, v in model.state_dict().items()}
        out = acp.load(tmp_path / "m", {ns: target}, strict=False)[ns]
        assert all(out[k] is target[k] and _same(out[k], v.numpy()) for k, v in model.state_dict().items())
    acp.save(tmp_path / "n", {"model": {k: v.detach().numpy() * 2 for k, v in model.state_dict().items()}})
    fresh = torch.nn.Linear(3, 2)
    acp.load(tmp_path / "n", {"model": fresh})
    assert all(torch.equal(fresh.state_dict()[k], v * 2) for k, v in model.state_dict().items())
    tensors = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    acp.load(tmp_path / "n", {"model": tensors})
    assert all(torch.equal(tensors[k], v * 2) for k, v in model.state_dict().items())


def test_numpy_state_dict_entries_are_checked_by_name(tmp_path):
    acp.save(tmp_path / "ck", {"model": {**linear_state(), "buf": np.arange(4), "extra": np.ones(2)}})
    base = {k: torch.zeros_like(v) for k, v in linear_state().items()}
    with pytest.raises(StateMismatchError) as e:  # was: unexpected "model" and "model/buf"
        acp.load(tmp_path / "ck", {"model": {**base, "buf": np.zeros(4, np.int64)}})
    assert "unexpected (1): model/extra\n" in str(e.value)
    with pytest.raises(StateMismatchError) as e:
        acp.load(tmp_path / "ck", {"model": {**base, "buf": np.zeros(5, np.int64), "extra": np.ones(2)}})
    assert "model/buf: checkpoint shape [4] != target shape [5]" in str(e.value)
    with pytest.raises(StateMismatchError) as e:
        acp.load(tmp_path / "ck", {"model": {**base, "buf": np.zeros(4, np.int32), "extra": np.ones(2)}})
    assert "model/buf: checkpoint dtype int64 != target dtype int32 (pass allow_cast=True" in str(e.value)
    with pytest.raises(UnsupportedDTypeError, match="model/buf: numpy dtype <U1 cannot be stored"):
        acp.load(tmp_path / "ck", {"model": {**base, "buf": np.zeros(4, "U1"), "extra": np.ones(2)}})
    with pytest.raises(UnsupportedDTypeError, match="model/s: numpy dtype <U1 cannot be stored"):
        acp.save(tmp_path / "bad", {"model": {"s": np.array(["a"])}})
    # strict=False: the mismatched array is left as it was, the rest loads; allow_cast converts
    buf, extra, report = np.full(4, 9, np.int32), np.zeros(2), {}
    acp.load(tmp_path / "ck", {"model": {**base, "buf": buf, "extra": extra}}, strict=False, report=report)
    assert np.array_equal(buf, np.full(4, 9)) and np.array_equal(extra, np.ones(2))
    assert report["mismatched"] == [
        "model/buf: checkpoint dtype int64 != target dtype int32 (pass allow_cast=True to convert)"
    ]
    acp.load(tmp_path / "ck", {"model": {**base, "buf": buf, "extra": extra}}, allow_cast=True)
    assert buf.dtype == np.int32 and np.array_equal(buf, np.arange(4))


def test_a_read_only_numpy_target_is_replaced_in_its_dict(tmp_path):
    acp.save(tmp_path / "ck", {"model": {"buf": np.arange(4.0)}})
    ro = np.zeros(4)
    ro.flags.writeable = False
    target = {"buf": ro}
    acp.load(tmp_path / "ck", {"model": target})
    assert target["buf"] is not ro and _same(target["buf"], np.arange(4.0)) and not ro.any()


def test_numpy_in_extra_state_loads_in_place_and_the_target_kind_decides(tmp_path):
    arr, t = np.arange(6, dtype=np.float32).reshape(2, 3), torch.arange(4)
    acp.save(tmp_path / "ck", {"extra": {"arr": arr, "t": t, "e3m4": numpy_value("float8_e3m4")}})
    # same kinds: both in place
    a_target, t_target = np.zeros_like(arr), torch.zeros_like(t)
    out = acp.load(tmp_path / "ck", {"extra": {"arr": a_target, "t": t_target, "e3m4": None}})["extra"]
    assert (
        out["arr"] is a_target and _same(a_target, arr) and out["t"] is t_target and torch.equal(t_target, t)
    )
    assert _same(out["e3m4"], numpy_value("float8_e3m4"))
    # crossed: a numpy target of a saved tensor comes back numpy (was: a tensor), and the other way round
    a_target, t_target = np.zeros(4, np.int64), torch.zeros(2, 3)
    out = acp.load(tmp_path / "ck", {"extra": {"arr": t_target, "t": a_target, "e3m4": None}})["extra"]
    assert out["t"] is a_target and _same(a_target, t.numpy())
    assert out["arr"] is t_target and torch.equal(t_target, torch.from_numpy(arr))
    # a numpy target of another shape is replaced, as a tensor target is, and stays numpy
    out = acp.load(tmp_path / "ck", {"extra": {"arr": arr, "t": np.zeros(9), "e3m4": None}})["extra"]
    assert _same(out["t"], t.numpy())


@pytest.mark.parametrize("dtype", ["float8_e3m4", "float8_e4m3b11fnuz"])
def test_numpy_dtypes_torch_lacks_are_saved_from_torch_state(tmp_path, dtype):
    """Were a KeyError: numpy arrays were saved through a torch view."""
    arr = numpy_value(dtype)
    acp.save(tmp_path / "ck", {"model": {"a": arr}, "extra": {"a": arr}})
    target = np.zeros_like(arr)
    out = acp.load(tmp_path / "ck", {"model": {"a": target}, "extra": {}})
    assert out["model"]["a"] is target and _same(target, arr) and _same(out["extra"]["a"], arr)


def test_numpy_model_fixture_of_469cb39_still_loads(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURE, ck)
    saved = {**linear_state(), **{f"np_{n}": numpy_value(n) for n in DTYPES}}
    # numpy and torch targets, filled in place (the numpy entries' document and ~arrays are accounted for)
    target = {k: _zeros_like(v) for k, v in saved.items()}
    target["np_int32"] = torch.zeros(2, 3, dtype=torch.int32)
    kept = dict(target)
    out = acp.load(ck, {"model": target, "extra": {"np": np.zeros(3, np.int64), "n": 0}})
    for k, v in saved.items():
        want = torch.from_numpy(v) if k == "np_int32" else v
        assert out["model"][k] is kept[k] and _same(out["model"][k], want), k
    assert _same(out["extra"]["np"], np.arange(3)) and out["extra"]["n"] == 4
    # into a module: its tensors load; the numpy entries it lacks are unexpected (were silently skipped)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(StateMismatchError, match="unexpected \\(19\\): model/np_bfloat16, model/np_bool"):
        acp.load(ck, {"model": model, "extra": {}})
    report = {}
    acp.load(ck, {"model": model, "extra": {}}, strict=False, report=report)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in linear_state().items())
    assert len(report["unexpected"]) == len(DTYPES)
    # a target missing an entry: named alone (not the document)
    del target["np_int8"]
    with pytest.raises(StateMismatchError, match="unexpected \\(1\\): model/np_int8\n"):
        acp.load(ck, {"model": target, "extra": {}})


# ------------------------------------------------------------------------------- 2 gloo ranks (FSDP2)
def _fsdp2_numpy_save(rank, world, root):
    from fixtures.make_format2 import as_numpy, fsdp2_trained

    import arraycheckpoint as acp

    model, _ = fsdp2_trained(rank, world)
    sd = model.state_dict()
    acp.save(root, {"model": {**sd, "buf": np.arange(6, dtype=np.uint16).reshape(2, 3)}})
    return {k: as_numpy(v) for k, v in sd.items()}


def _fsdp2_numpy_load(rank, world, root, want):
    from fixtures.make_format2 import as_numpy, fsdp2_trained

    import arraycheckpoint as acp

    model, _ = fsdp2_trained(rank + 5, world)  # other values, other shards than the save's
    sd = model.state_dict()
    buf = np.zeros((2, 3), np.uint16)
    acp.load(root, {"model": {**sd, "buf": buf}})
    return all(np.array_equal(as_numpy(v), want[k]) for k, v in sd.items()) and np.array_equal(
        buf, np.arange(6).reshape(2, 3)
    )


def test_numpy_beside_fsdp2_dtensors_reshards(tmp_path):
    from dist import run_distributed

    root = str(tmp_path / "ck")
    want = run_distributed(_fsdp2_numpy_save, world=2, args=(root,))[0]
    # one process: every entry (DTensors saved sharded) into numpy arrays, in place
    target = {k: np.zeros_like(v) for k, v in want.items()}
    target["buf"] = np.zeros((2, 3), np.uint16)
    acp.load(root, {"model": target})
    assert all(np.array_equal(target[k], v) for k, v in want.items())
    assert np.array_equal(target["buf"], np.arange(6).reshape(2, 3))
    assert run_distributed(_fsdp2_numpy_load, world=2, args=(root, want)) == [True, True]


def test_an_async_save_snapshots_numpy_entries(tmp_path):
    arr = np.arange(6.0).reshape(2, 3)
    fut = acp.save_async(tmp_path / "ck", {"model": {"a": arr, "b": numpy_value("float8_e3m4")}})
    fut.staged.result()
    arr[...] = -1
    fut.result()
    out = acp.load(
        tmp_path / "ck", {"model": {"a": np.zeros((2, 3)), "b": np.zeros_like(numpy_value("float8_e3m4"))}}
    )
    assert _same(out["model"]["a"], np.arange(6.0).reshape(2, 3))
    assert _same(out["model"]["b"], numpy_value("float8_e3m4"))
