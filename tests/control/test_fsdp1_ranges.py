"""FSDP1 flat ranges declared as range rules (real FSDP1 over gloo, 3 processes, odd sizes).

Every rank states the same rule for each parameter and each parameter-shaped optimizer state (the flat
parameter's layout: offsets with FSDP's alignment padding, total padded to the world size). A model alone
is then one declaration on every rank: one digest, no planning collective, one rule per tensor in the
metadata. Optimizer state exists only on ranks whose range touches its parameter, so those declarations
differ by which states exist (a few distinct declarations, one per pattern, never one per rank at scale):
they still carry range rules, not boxes. Checkpoints load back bit-exactly into FSDP1 at another world
size and into a plain module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from dist import run_distributed, torch_full_state

import arraycheckpoint as acp

pytestmark = pytest.mark.multiprocess


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 13), torch.nn.Tanh(), torch.nn.Linear(13, 7))


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Parameters and Adam moments, full size, gathered by torch itself (independent of the adapter)."""
    return {k: v for k, v in torch_full_state(model, opt).items() if not k.endswith("/step")}


def _fsdp1(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))


def _save_body(rank, world, root):
    from arraycheckpoint.adapters.base import AdapterOptions
    from arraycheckpoint.adapters.torch import TorchAdapter
    from arraycheckpoint.engine import engine
    from arraycheckpoint.engine.coordinate import declaration_digest, declare
    from arraycheckpoint.engine.job import SaveOptions
    from arraycheckpoint.runtime.collectives import default_communicator

    model = _fsdp1(_model())
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    model(torch.randn(4, 10, generator=gen)).square().mean().backward()
    opt.step()
    out = []
    for name, state in (("model", {"model": model}), ("both", {"model": model, "optimizer": opt})):
        req = TorchAdapter().save_request(state, AdapterOptions())
        decl = declare(req.tensors, rank)
        digest = declaration_digest(decl, default_communicator(), SaveOptions()).hex()
        kinds = {t.name: t.rule[0] for t in decl.tensors}
        acp.save(f"{root}/{name}", state)
        out.append((digest, kinds, engine()._save._last_mode))
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    whole = FSDP(
        _model(),
        use_orig_params=True,
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy.NO_SHARD,
    )
    req = TorchAdapter().save_request({"model": whole}, AdapterOptions())
    out.append({t.name: t.rule[0] for t in declare(req.tensors, rank).tensors})
    return out, _full(model, opt)


def _load_body(rank, world, root):
    model = _fsdp1(torch.nn.Sequential(torch.nn.Linear(10, 13), torch.nn.Tanh(), torch.nn.Linear(13, 7)))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    acp.load(f"{root}/both", {"model": model, "optimizer": opt})
    return _full(model, opt)


def test_fsdp1_ranks_declare_range_rules(tmp_path):
    results = run_distributed(_save_body, world=3, args=(str(tmp_path),), timeout=300)
    model_only = [r[0][0] for r in results]
    assert len({d for d, _k, _m in model_only}) == 1, "ranks declared the model differently"
    assert all(list(k.values()) == ["range"] * 4 for _d, k, _m in model_only)
    assert {m for _d, _k, m in model_only} == {"local"}  # one declaration: each rank planned alone
    meta = acp.read_metadata(tmp_path / "model")
    assert len(meta.layout_groups) == 1
    assert all(t.regions[0][1][0] == "range" and len(t.regions) == 1 for t in meta.tensors.values())
    # the flat slices still cut through rows: the expanded regions are the decomposed boxes of each range
    assert any(len(t.shards) > 3 for t in meta.tensors.values())

    for r in results:  # NO_SHARD: every rank holds every parameter whole, a replica
        assert list(r[0][2].values()) == ["replica"] * 4, r[0][2]
    for _d, kinds, mode in (r[0][1] for r in results):
        assert mode == "gather"
        for name, kind in kinds.items():
            assert kind == ("replica" if name.endswith("/step") else "range"), (name, kind)
    meta = acp.read_metadata(tmp_path / "both")
    assert all(
        rule[0] == "range"
        for n, t in meta.tensors.items()
        if not n.endswith("/step")
        for _g, rule in t.regions
    )

    saved = results[0][1]
    for r in results[1:]:
        assert all(np.array_equal(saved[k], r[1][k]) for k in saved)
    from arraycheckpoint.zarr import checkpoint_store

    # what was written, read by zarr-python (packed arrays through the store's one-hierarchy view)
    stored = zarr.open_group(checkpoint_store(str(tmp_path / "both")), mode="r")
    for k, v in saved.items():
        assert np.array_equal(stored[k][...], v), k
    for loaded in run_distributed(_load_body, world=2, args=(str(tmp_path),), timeout=300):
        assert set(loaded) == set(saved)
        for k in saved:
            assert loaded[k].dtype == saved[k].dtype and np.array_equal(loaded[k], saved[k]), k
    plain = _model()
    acp.load(tmp_path / "model", {"model": plain})
    for k, v in plain.state_dict().items():
        assert np.array_equal(v.numpy(), saved[f"model/{k}"]), k


def _overlap_body(rank, world, root):
    """One FSDP1 save with the writers and the fragment exchange instrumented: whether this rank had started
    writing when its exchange began, and how many fragment bytes it received."""
    import threading

    from arraycheckpoint.engine import exchange, shardfile

    torch.manual_seed(0)
    model = _fsdp1(torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 40)))
    wrote = threading.Event()
    seen: dict[str, object] = {}
    saved = {
        (cls, m): getattr(cls, m)
        for cls in (shardfile.FileWriter, shardfile.KvWriter)
        for m in ("write", "write_pack", "open_pack")
        if hasattr(cls, m)
    }
    fragments = exchange.exchange_fragments

    def exchange_fragments(job, plan):
        seen["writing"] = wrote.wait(10)  # before: the exchange ran alone, ahead of every write
        out = fragments(job, plan)
        seen["received"] = sum(int(a.nbytes) for a in out.values())
        return out

    try:
        for (cls, m), orig in saved.items():

            def wrapped(self, *a, _orig=orig, **k):
                wrote.set()
                return _orig(self, *a, **k)

            setattr(cls, m, wrapped)
        exchange.exchange_fragments = exchange_fragments
        # chunk files of their own (no packs): a pack holding a fragment-built chunk would wait for it
        acp.save(f"{root}/overlap", {"model": model}, plan_options=acp.PlanOptions(min_chunk_bytes=64))
    finally:  # pool workers are reused by other tests
        for (cls, m), orig in saved.items():
            setattr(cls, m, orig)
        exchange.exchange_fragments = fragments
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return seen, {f"model/{k}": v.detach().clone().numpy() for k, v in full.items()}


def test_fsdp1_fragment_exchange_runs_beside_the_writes(tmp_path):
    """FSDP1's straddling chunks travel on a thread of their own while each rank writes the chunks it holds
    whole (issue 22 item 1): every rank is writing when its all-to-all starts, and the result is bit-exact."""
    results = run_distributed(_overlap_body, world=3, args=(str(tmp_path),), timeout=300)
    assert any(seen.get("received", 0) > 0 for seen, _ in results), "no fragment travelled: nothing tested"
    assert all(seen.get("writing") for seen, _ in results), [seen for seen, _ in results]
    plain = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 40))
    acp.load(tmp_path / "overlap", {"model": plain})
    for k, v in plain.state_dict().items():
        assert np.array_equal(v.numpy(), results[0][1][f"model/{k}"]), k


RUNS = dict(min_chunk_bytes=1 << 12, max_chunk_bytes=1 << 14, range_move_share=0.002)


def _runs_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 40))


def _runs_save_body(rank, world, root):
    """FSDP1 + Adam saved with a small ``range_move_share``: the rank boundaries cut rows of 64 and 96
    elements, so the grid is sub-row runs; returns the fragment bytes this rank received and the state."""
    from arraycheckpoint.engine import exchange

    model = _fsdp1(_runs_model())
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    model(torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    opt.step()
    fragments, got = exchange.exchange_fragments, []

    def counted(job, plan):
        out = fragments(job, plan)
        got.append(sum(int(a.nbytes) for a in out.values()))
        return out

    exchange.exchange_fragments = counted
    try:
        acp.save(f"{root}/runs", {"model": model, "optimizer": opt}, plan_options=acp.PlanOptions(**RUNS))
    finally:  # pool workers are reused by other tests
        exchange.exchange_fragments = fragments
    return sum(got), _full(model, opt)


def _runs_load_body(rank, world, root):
    model = _fsdp1(_runs_model())
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    acp.load(f"{root}/runs", {"model": model, "optimizer": opt})
    return _full(model, opt)


def test_fsdp1_sub_row_runs_move_at_most_the_share_and_reload_bit_exactly(tmp_path):
    """Issue 22 (A): flat ranges get flat-run chunks, here shorter than a row, so that at most
    ``range_move_share`` of the save's bytes travel; the writers are derived from the layout (format 7, not
    listed) and name the rank whose packs hold each chunk; the state reloads bit-exactly into FSDP1 at
    another world size and into a plain module, and zarr-python reads every array."""
    results = run_distributed(_runs_save_body, world=3, args=(str(tmp_path),), timeout=300)
    saved = results[0][1]
    meta = acp.read_metadata(tmp_path / "runs")
    flat = {n: t for n, t in meta.tensors.items() if t.regions and t.regions[0][1][0] == "range"}
    assert flat and all(t.writers.derived for t in flat.values())
    assert any(t.chunk_shape[0] == 1 and t.chunk_shape[-1] < t.shape[-1] for t in flat.values()), {
        n: t.chunk_shape for n, t in flat.items()
    }
    total = sum(t.nbytes for t in meta.tensors.values())
    moved = sum(m for m, _s in results)
    assert 0 < moved <= RUNS["range_move_share"] * total, (moved, total)
    for loaded in run_distributed(_runs_load_body, world=2, args=(str(tmp_path),), timeout=300):
        for k in saved:
            assert loaded[k].dtype == saved[k].dtype and np.array_equal(loaded[k], saved[k]), k
    from arraycheckpoint.zarr import checkpoint_store

    stored = zarr.open_group(checkpoint_store(str(tmp_path / "runs")), mode="r")
    for k, v in saved.items():
        assert np.array_equal(stored[k][...], v), k
    plain = _runs_model()
    acp.load(tmp_path / "runs", {"model": plain}, strict=False)
    for k, v in plain.state_dict().items():
        assert np.array_equal(v.numpy(), saved[f"model/{k}"]), k
