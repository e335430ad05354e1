"""The host buffer pool on CPU: reuse, alignment, slabs, the pinned budget and its pageable fallback (with a
fake pinner), prepare(), and the engine waiting on asynchronous snapshot copies (fences)."""

from __future__ import annotations

import logging
import threading

import ml_dtypes
import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.engine import Engine
from arraycheckpoint.planning.items import SaveRequest, SaveShard, SaveTensor
from arraycheckpoint.planning.regions import Box
from arraycheckpoint.runtime.collectives import SingleProcessCommunicator
from arraycheckpoint.runtime.hostpool import ALIGN, SMALL_BYTES, HostBufferPool


class FakePinner:
    def __init__(self, refuse: bool = False) -> None:
        self.pinned: dict[int, int] = {}
        self.refuse = refuse

    def pin(self, address: int, nbytes: int) -> bool:
        if self.refuse:
            return False
        self.pinned[address] = nbytes
        return True

    def unpin(self, address: int) -> None:
        self.pinned.pop(address)


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_take_give_reuses_memory_and_aligns():
    pool = HostBufferPool(pinned_budget=0)
    a = pool.take((1000, 1000), np.float32)
    assert a.shape == (1000, 1000) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    assert _addr(a) % ALIGN == 0
    b = pool.take((1000, 1000), np.float32)
    assert _addr(a) != _addr(b)  # both in use: distinct memory
    a[...] = 1
    b[...] = 2
    assert (a == 1).all()
    address = _addr(a)
    pool.give([a, b])
    c = pool.take((1000, 1000), np.float32)
    assert _addr(c) in (address, _addr(b))
    assert pool.stats()["hits"] == 1 and pool.stats()["misses"] == 2


def test_same_size_other_dtype_keeps_its_dtype():
    pool = HostBufferPool(pinned_budget=0)
    a = pool.take((64,), ml_dtypes.float8_e4m3fn)
    pool.give([a])
    b = pool.take((64,), ml_dtypes.float8_e5m2)
    assert _addr(a) == _addr(b) and b.dtype == np.dtype(ml_dtypes.float8_e5m2)  # a byte view, re-typed


def test_small_buffers_share_slabs():
    pool = HostBufferPool(pinned_budget=0)
    bufs = [pool.take((256,), np.float32) for _ in range(100)]
    assert pool.stats()["pageable_bytes"] < 64 << 20  # one slab, not 100 mappings
    assert len({_addr(b) for b in bufs}) == 100
    assert all(_addr(b) % ALIGN == 0 for b in bufs)


def test_give_ignores_foreign_arrays():
    pool = HostBufferPool(pinned_budget=0)
    pool.give([np.zeros(10)])
    assert pool.stats()["buffers_idle"] == 0


def test_pinned_within_budget_then_pageable_with_one_warning(caplog):
    pinner = FakePinner()
    big = 4 * SMALL_BYTES
    pool = HostBufferPool(pinned_budget=2 * big, pinner=pinner)
    with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):
        bufs = [pool.take((big,), np.uint8) for _ in range(4)]
    assert [pool.is_pinned(b) for b in bufs] == [True, True, False, False]
    stats = pool.stats()
    assert stats["pinned_bytes"] == 2 * big and stats["pageable_bytes"] == 2 * big
    assert sum(pinner.pinned.values()) == 2 * big
    warnings = [r for r in caplog.records if "pinned host buffer budget" in r.getMessage()]
    assert len(warnings) == 1 and "ARRAYCHECKPOINT_PINNED_BYTES" in warnings[0].getMessage()


def test_idle_pinned_buffers_make_room_for_new_sizes():
    pinner = FakePinner()
    size = 4 * SMALL_BYTES
    pool = HostBufferPool(pinned_budget=size, pinner=pinner)
    a = pool.take((size,), np.uint8)
    pool.give([a])
    del a
    b = pool.take((size // 2,), np.uint8)  # another structure: the idle buffer is released, this one pinned
    assert pool.is_pinned(b)
    assert pool.stats()["pinned_bytes"] == size // 2
    import gc

    gc.collect()
    assert sum(pinner.pinned.values()) == size // 2  # the released region was unpinned


def test_refused_pin_falls_back_to_pageable():
    pool = HostBufferPool(pinned_budget=1 << 40, pinner=FakePinner(refuse=True))
    a = pool.take((SMALL_BYTES,), np.uint8)
    assert not pool.is_pinned(a) and pool.stats()["pageable_bytes"] == SMALL_BYTES


def test_reserve_makes_later_takes_hits():
    pool = HostBufferPool(pinned_budget=0)
    pool.reserve([((100, 100), np.float32), ((100, 100), np.float32), ((7,), np.int64)])
    misses = pool.stats()["misses"]
    bufs = [pool.take((100, 100), np.float32), pool.take((100, 100), np.float32), pool.take((7,), np.int64)]
    assert pool.stats()["misses"] == misses and len({_addr(b) for b in bufs}) == 3


def test_take_idle_hands_out_only_reserved_sizes_and_never_allocates():
    pool = HostBufferPool(pinned_budget=1 << 30)
    assert pool.take_idle((64, 64), np.float32) is None  # nothing reserved
    pool.give([pool.take((64, 64), np.float32)])
    assert pool.take_idle((64, 64), np.float32) is None  # idle, but not of a size reserve() prepared
    pool.reserve([((32, 32), np.dtype(np.float32))])
    misses = pool.stats()["misses"]
    buf = pool.take_idle((32, 32), np.float32)
    assert buf is not None and buf.shape == (32, 32) and buf.dtype == np.float32
    assert pool.take_idle((32, 32), np.float32) is None  # the one reserved buffer is in use
    pool.give([buf])
    assert pool.take_idle((32, 32), np.float32) is not None
    assert pool.stats()["misses"] == misses


def test_prepare_fills_the_pool_for_the_first_save(tmp_path):
    torch = pytest.importorskip("torch")
    from arraycheckpoint.runtime.hostpool import shared_pool

    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 300)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    report = acp.prepare(state)
    assert report["buffers"] >= 4 * 3 and report["bytes"] >= (300 * 200 + 200 * 10) * 4 * 3
    misses = shared_pool().stats()["misses"]
    fut = acp.save_async(tmp_path / "c", state)
    fut.result()
    assert shared_pool().stats()["misses"] == misses  # every staging buffer was ready
    twin = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
    acp.load(tmp_path / "c", {"model": twin})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


class _Fence:
    def __init__(self) -> None:
        self.released = threading.Event()  # the test lets the copy run
        self.landed = threading.Event()  # the copy's bytes are in the buffer
        self.waited = False

    def wait(self) -> None:
        assert self.landed.wait(10)
        self.waited = True


class _AsyncSource:
    """Fills its buffer only when the test releases the fence: a device copy still in flight."""

    def __init__(self, value: np.ndarray, fence: _Fence) -> None:
        self.value = value
        self.fence = fence

    def copy_into(self, out: np.ndarray) -> _Fence:
        def land() -> None:
            self.fence.released.wait(10)
            out[...] = self.value
            self.fence.landed.set()

        threading.Thread(target=land, daemon=True).start()
        return self.fence


def test_engine_waits_for_fences_before_staged_and_writes(tmp_path):
    fence = _Fence()
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    tensor = SaveTensor(
        "model/w", (8, 8), np.dtype(np.float32), [SaveShard(Box.full((8, 8)), _AsyncSource(value, fence))]
    )
    request = SaveRequest([tensor], [], framework="torch")
    fut = Engine().save_async(str(tmp_path / "c"), request, SingleProcessCommunicator())
    assert not fut.staged.done()
    fence.released.set()
    fut.staged.result(timeout=10)
    fut.result(timeout=30)
    assert fence.waited
    from readers import ts_read

    np.testing.assert_array_equal(ts_read(str(tmp_path / "c"), "model/w"), value)
