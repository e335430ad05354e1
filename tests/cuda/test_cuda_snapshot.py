"""The GPU snapshot: pinned staging on a side stream, isolation from training's next writes, pool reuse and
budget, bf16/fp8 CUDA tensors, CUDA <-> CPU reshards, pinned loads."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.adapters.torch.device import finish_loads
from arraycheckpoint.runtime.hostpool import shared_pool

DEV = torch.device("cuda", 0)


def _model(width: int = 1024, layers: int = 4, device: torch.device = DEV) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)


def _cpu_twin(model: torch.nn.Module) -> torch.nn.Module:
    twin = _model(model[0].in_features, len(model), device=torch.device("cpu"))
    for p in twin.parameters():
        p.data.fill_(float("nan"))
    return twin


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return (
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)
    )


def test_mutation_right_after_staged_never_leaks_100_iterations():
    model = _model(2048, 4)  # 64 MiB: copies long enough for a race to show
    params = list(model.parameters())
    twin = _cpu_twin(model)
    for i in range(100):
        expected = [p.detach().cpu() for p in params]
        fut = acp.save_async("memory://isolation", {"model": model}, overwrite=True, step=i)
        fut.staged.result()
        with torch.no_grad():
            for p in params:
                p.add_(1.0)  # what the next optimizer step would do, queued right after staged
        fut.result()
        acp.load("memory://isolation", {"model": twin})
        assert all(torch.equal(e, t) for e, t in zip(expected, twin.parameters())), f"iteration {i}"


def test_optimizer_step_without_waiting_for_staged_is_ordered_on_the_device():
    model = _model(2048, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    twin = _cpu_twin(model)
    x = torch.randn(64, 2048, device=DEV)
    for i in range(20):
        model(x).square().mean().backward()
        expected = [p.detach().cpu() for p in model.parameters()]
        fut = acp.save_async("memory://ordered", {"model": model}, overwrite=True)
        opt.step()  # no fut.staged.result(): the step pre-hook orders it after the snapshot's copies
        opt.zero_grad()
        fut.result()
        acp.load("memory://ordered", {"model": twin})
        assert all(torch.equal(e, t) for e, t in zip(expected, twin.parameters())), f"iteration {i}"


def test_save_async_returns_before_the_copies_finish_and_staged_follows():
    big = torch.randn(256 << 20 >> 2, device=DEV)  # 256 MiB
    acp.prepare({"model": {"big": big}})
    fut = acp.save_async("memory://early", {"model": {"big": big}}, overwrite=True)
    fut.staged.result()
    fut.result()
    out = {"model": {"big": torch.empty_like(big)}}
    acp.load("memory://early", out)
    assert torch.equal(out["model"]["big"], big)


def test_pool_buffers_are_pinned_and_reused():
    model = _model(1024, 4)
    state = {"model": model}
    acp.prepare(state)
    pool = shared_pool()
    before = pool.stats()
    assert before["pinned_bytes"] >= sum(p.numel() * 4 for p in model.parameters())
    for _ in range(3):
        acp.save_async("memory://reuse", state, overwrite=True).result()
    after = pool.stats()
    assert after["misses"] == before["misses"]  # every snapshot reused the prepared buffers
    assert after["pinned_bytes"] == before["pinned_bytes"]
    buf = pool.take((1024, 1024), np.float32)
    try:
        assert pool.is_pinned(buf) and torch.from_numpy(buf).is_pinned()
    finally:
        pool.give([buf])


def test_pinned_budget_exceeded_falls_back_to_pageable_and_stays_correct(caplog):
    pool = shared_pool()
    budget = pool.pinned_budget
    finish_loads()
    pool.clear()
    pool._warned = False
    pool.set_pinned_budget(8 << 20)
    try:
        model = _model(2048, 3)  # 48 MiB: most of it pageable
        twin = _cpu_twin(model)
        with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):
            acp.save_async("memory://budget", {"model": model}, overwrite=True).result()
        assert any("pinned host buffer budget" in r.getMessage() for r in caplog.records)
        assert pool.stats()["pinned_bytes"] <= 8 << 20 and pool.stats()["pageable_bytes"] > 0
        acp.load("memory://budget", {"model": twin})
        assert all(torch.equal(a.cpu(), b) for a, b in zip(model.parameters(), twin.parameters()))
    finally:
        pool.set_pinned_budget(budget)
        pool.clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_low_precision_cuda_tensors_round_trip_bit_exact(tmp_path, dtype):
    torch.manual_seed(1)
    src = {
        "w": (torch.randn(333, 517, device=DEV) * 4).to(dtype),
        "v": (torch.randn(7, device=DEV)).to(dtype),
    }
    acp.save(tmp_path / "c", {"model": src})
    on_gpu = {"model": {k: torch.zeros_like(v) for k, v in src.items()}}
    acp.load(tmp_path / "c", on_gpu)
    on_cpu = {"model": {k: torch.zeros_like(v, device="cpu") for k, v in src.items()}}
    acp.load(tmp_path / "c", on_cpu)
    for k in src:
        assert on_gpu["model"][k].is_cuda and _equal(on_gpu["model"][k], src[k])
        assert _equal(on_cpu["model"][k], src[k])


def test_cuda_to_cpu_and_cpu_to_cuda_with_optimizer(tmp_path):
    model = _model(512, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 512, device=DEV)).sum().backward()
    opt.step()
    acp.save(tmp_path / "gpu", {"model": model, "optimizer": opt})

    cpu_model = _model(512, 3, device=torch.device("cpu"))
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-3)
    acp.load(tmp_path / "gpu", {"model": cpu_model, "optimizer": cpu_opt})
    for a, b in zip(model.parameters(), cpu_model.parameters()):
        assert torch.equal(a.cpu(), b)
        sa, sb = opt.state[a], cpu_opt.state[b]
        assert torch.equal(sa["exp_avg"].cpu(), sb["exp_avg"]) and torch.equal(
            sa["exp_avg_sq"].cpu(), sb["exp_avg_sq"]
        )

    with torch.no_grad():
        for p in cpu_model.parameters():
            p.mul_(-3)
    acp.save(tmp_path / "cpu", {"model": cpu_model})
    back = _model(512, 3)
    acp.load(tmp_path / "cpu", {"model": back})
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu_model.parameters(), back.parameters()))


def test_pinned_load_is_bounded_and_returns_buffers(tmp_path):
    tensors = {f"w{i}": torch.randn(64 << 20 >> 2, device=DEV) for i in range(8)}  # 8 x 64 MiB
    acp.save(tmp_path / "c", {"model": tensors})
    pool = shared_pool()
    pool.clear()
    out = {"model": {k: torch.empty_like(v) for k, v in tensors.items()}}
    acp.load(tmp_path / "c", out)
    finish_loads()
    stats = pool.stats()
    assert stats["buffers_in_use"] == 0
    assert stats["pinned_bytes"] > 0  # read into pinned buffers, then copied to the device
    assert all(torch.equal(out["model"][k], v) for k, v in tensors.items())
