"""Extra state: RNG capture/restore, LR schedulers, per-rank values and the world-size-change rule."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint import rng
from arraycheckpoint.format import rankdoc
from arraycheckpoint.format.perrank import PerRank


def _draws() -> tuple[torch.Tensor, np.ndarray, list[float], list[float]]:
    """The next draws of every global generator (including numpy's cached gaussian and python's gauss)."""
    return (
        torch.rand(5),
        np.random.standard_normal(3),
        [random.random() for _ in range(3)],
        [random.gauss(0, 1) for _ in range(3)],
    )


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2] and a[3] == b[3]


@pytest.mark.parametrize("wrap", [True, False])
def test_rng_round_trip_is_bit_exact(tmp_path, wrap: bool) -> None:
    """torch, numpy, python random: after load + restore the next draws equal the uninterrupted run's."""
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    np.random.standard_normal(1)  # leave a cached gaussian in numpy's legacy state
    random.gauss(0, 1)  # and python's gauss_next
    captured = rng.capture()
    value = PerRank(captured) if wrap else captured
    acp.save(tmp_path / "ck", {"extra_state": {"rng": value, "step": 7}})
    expected = _draws()
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    target = {"extra_state": {"rng": PerRank(None) if wrap else {}, "step": 0}}
    out = acp.load(tmp_path / "ck", target)
    loaded = out["extra_state"]["rng"].value if wrap else out["extra_state"]["rng"]
    assert out["extra_state"]["step"] == 7
    assert rng.restore(loaded) == {}
    assert _same(_draws(), expected)


def test_rng_derive_is_deterministic_and_distinct() -> None:
    torch.manual_seed(3)
    state = rng.capture()
    streams = []
    for r in (0, 1, 1):
        rng.restore(rng.derive(state, r))
        streams.append(_draws())
    assert _same(streams[1], streams[2])
    assert not torch.equal(streams[0][0], streams[1][0]) and streams[0][2] != streams[1][2]
    rng.restore(state)
    original = _draws()
    assert not torch.equal(original[0], streams[0][0])


_JAX_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    import arraycheckpoint as acp
    from arraycheckpoint import rng
    from arraycheckpoint.stateful import PerRank
    root = sys.argv[1]
    keys = {"dropout": jax.random.key(7), "init": jax.random.PRNGKey(9)}
    keys = {k: jax.random.split(v)[0] for k, v in keys.items()}
    acp.save(root, {"extra_state": {"rng": PerRank(rng.capture(jax_keys=keys))}}, framework="torch")
    expect = {k: np.asarray(jax.random.normal(v, (4,))) for k, v in keys.items()}
    out = acp.load(root, {"extra_state": {"rng": PerRank()}}, framework="torch")
    back = rng.restore(out["extra_state"]["rng"].value)
    assert back["init"].dtype == np.uint32 and jax.dtypes.issubdtype(back["dropout"].dtype, jax.dtypes.prng_key)
    for k, v in back.items():
        assert np.array_equal(np.asarray(jax.random.normal(v, (4,))), expect[k]), k
    d1 = rng.derive(out["extra_state"]["rng"].value, 1)["jax"]["dropout"]["data"]
    d2 = rng.derive(out["extra_state"]["rng"].value, 2)["jax"]["dropout"]["data"]
    assert not np.array_equal(d1, d2)
    print("ok")
""")


def test_jax_keys_round_trip(tmp_path) -> None:
    """JAX PRNG keys (typed and raw uint32) come back bit-exactly (in a subprocess: jax stays out of this one)."""
    done = subprocess.run(
        [sys.executable, "-c", _JAX_SCRIPT, str(tmp_path / "ck")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def _scheduled(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kind == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=17, eta_min=1e-5)
    elif kind == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=40)
    else:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    return model, opt, sched


def _train(model, opt, sched, steps: int) -> list[float]:
    lrs = []
    for i in range(steps):
        loss = model(torch.full((2, 4), float(i))).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        lrs.extend(sched.get_last_lr())
    return lrs


@pytest.mark.parametrize("kind", ["cosine", "onecycle", "step"])
@pytest.mark.parametrize("as_object", [False, True])
def test_lr_scheduler_round_trip(tmp_path, kind: str, as_object: bool) -> None:
    """Scheduler state through extra_state (as a state_dict, or the scheduler object itself): next lrs match."""
    model, opt, sched = _scheduled(kind)
    _train(model, opt, sched, 5)
    extra = {"scheduler": sched if as_object else sched.state_dict(), "step": 5}
    acp.save(tmp_path / "ck", {"model": model, "optimizer": opt, "extra_state": extra})
    expected = _train(model, opt, sched, 9)
    expected_w = model.weight.detach().clone()
    model2, opt2, sched2 = _scheduled(kind)
    target = {"scheduler": sched2 if as_object else {}, "step": 0}
    out = acp.load(tmp_path / "ck", {"model": model2, "optimizer": opt2, "extra_state": target})
    if not as_object:
        sched2.load_state_dict(out["extra_state"]["scheduler"])
    else:
        assert out["extra_state"]["scheduler"] is sched2
    assert out["extra_state"]["step"] == 5
    assert _train(model2, opt2, sched2, 9) == expected
    assert torch.equal(model2.weight, expected_w)


def test_missing_per_rank_entry_is_reported(tmp_path) -> None:
    acp.save(tmp_path / "ck", {"extra_state": {"step": 1}})
    with pytest.raises(acp.StateMismatchError, match="missing .*other"):
        acp.load(tmp_path / "ck", {"extra_state": {"step": 0}, "other": {"rng": PerRank()}})


# ------------------------------------------------------------------------------------ multi-process rule
def _save_per_rank(rank: int, world: int, root: str) -> list:
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).view(2, 3))
    state = {
        "model": model,
        "extra_state": {
            "step": 42,
            "sched": {"lr": 0.5},
            "rng": PerRank(rng.capture()),
            "counter": PerRank({"rank": rank, "tokens": torch.full((2,), rank)}),
        },
    }
    acp.save(root, state, step=42)
    return [x.tolist() if hasattr(x, "tolist") else x for x in _draws()]


def _load_per_rank(rank: int, world: int, root: str) -> dict:
    model = torch.nn.Linear(3, 2)

    def tag(value, r, source):
        return {**value, "derived_for": r, "from": source}

    state = {
        "model": model,
        "extra_state": {"step": 0, "sched": {}, "rng": PerRank(), "counter": PerRank(derive=tag)},
    }
    out = acp.load(root, state)
    extra = out["extra_state"]
    rng.restore(extra["rng"].value)
    draws = [x.tolist() if hasattr(x, "tolist") else x for x in _draws()]
    raw = acp.load(
        root,
        {
            "extra_state": {
                "step": 0,
                "sched": {},
                "rng": PerRank(derive=lambda v, r, s: v),
                "counter": PerRank(),
            }
        },
    )["extra_state"]
    rng.restore(rng.derive(raw["rng"].value, rank))
    rederived = [x.tolist() if hasattr(x, "tolist") else x for x in _draws()]
    counter = dict(extra["counter"].value)
    counter["tokens"] = counter["tokens"].tolist()
    return {
        "draws": draws,
        "rederived": rederived,
        "step": extra["step"],
        "sched": extra["sched"],
        "counter": counter,
        "weight": model.weight.detach().tolist(),
    }


def test_per_rank_rule_across_world_sizes(tmp_path) -> None:
    """Saved at world 2; loaded at world 3 (rank 2 derives from saved rank 0) and world 1 (rank 1 dropped)."""
    root = str(tmp_path / "ck")
    saved = run_distributed(_save_per_rank, 2, (root,))
    assert saved[0] != saved[1]
    meta = acp.read_metadata(root)
    assert list(rankdoc.saved_ranks(meta.objects["extra_state/~per_rank"], meta.world_size)) == [0, 1]
    grown = run_distributed(_load_per_rank, 3, (root,))
    for got in grown:
        assert got["step"] == 42 and got["sched"] == {"lr": 0.5}  # global values load everywhere
        assert got["weight"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    for r in (0, 1):  # ranks that existed take their own saved values
        assert grown[r]["draws"] == saved[r]
        assert grown[r]["counter"] == {"rank": r, "tokens": [r, r]}
    # rank 2 had no saved counterpart: saved rank 2 % 2 = 0's value, derived (RNG reseeded, custom derive used)
    assert grown[2]["draws"] == grown[2]["rederived"]
    assert grown[2]["draws"] not in (saved[0], saved[1])
    assert grown[2]["counter"] == {"rank": 0, "tokens": [0, 0], "derived_for": 2, "from": 0}
    # world 1 (this process, no process group): rank 0 takes saved rank 0's values
    out = acp.load(root, {"extra_state": {"step": 0, "sched": {}, "rng": PerRank(), "counter": PerRank()}})
    assert out["extra_state"]["counter"].value["rank"] == 0
    rng.restore(out["extra_state"]["rng"].value)
    assert [x.tolist() if hasattr(x, "tolist") else x for x in _draws()] == saved[0]


def test_zero_dim_tensors_come_back_zero_dim(tmp_path) -> None:
    """A 0-d tensor of extra state (``torch.tensor(100)``) came back as ``tensor([100])`` (shape (1,)):
    the numpy-to-torch view went through ``np.ascontiguousarray``, which makes a 0-d array 1-d. The same
    view wrote ``export --format torch``'s 0-d entries (``num_batches_tracked``, an optimizer's ``step``)."""
    saved = {"step": torch.tensor(100), "lr": torch.tensor(0.5, dtype=torch.bfloat16), "v": torch.arange(3)}
    acp.save(tmp_path / "ck", {"extra_state": saved})
    got = acp.load(tmp_path / "ck", {"extra_state": {}})["extra_state"]
    for k, v in saved.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype and torch.equal(got[k], v), k

    from arraycheckpoint.cli import main

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    acp.save(tmp_path / "bn", {"model": model})
    assert main(["export", str(tmp_path / "bn"), str(tmp_path / "bn.pt"), "--format", "torch"]) == 0
    exported = torch.load(tmp_path / "bn.pt", weights_only=True)
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in model.state_dict().items()}
