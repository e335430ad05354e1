"""Modules nested in dict namespaces (issue 13, item 6): EMA and teacher modules are stored like ``model``.

Every tensor comparison is bit-exact; the resharding test runs real gloo processes (2 writers, 3 readers).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.errors import StateMismatchError
from arraycheckpoint.format.metadata import check_name

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "format2")


def _net(seed: int, width: int = 4) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))


def _state(seed: int) -> dict:
    return {
        "model": _net(seed),
        "ema": {"m": _net(seed + 1), "decay": 0.999, "updates": 12},
        "teacher": {"a": _net(seed + 2), "b": {"c": _net(seed + 3, width=5)}, "lst": [_net(seed + 4), 2.5]},
    }


def _modules(state: dict) -> dict[str, torch.nn.Module]:
    return {
        "model": state["model"],
        "ema.m": state["ema"]["m"],
        "teacher.a": state["teacher"]["a"],
        "teacher.b.c": state["teacher"]["b"]["c"],
        "teacher.lst.0": state["teacher"]["lst"][0],
    }


def _assert_same_modules(got: dict, want: dict) -> None:
    for key, module in _modules(want).items():
        target = _modules(got)[key]
        for (n, a), (_, b) in zip(module.state_dict().items(), target.state_dict().items()):
            assert torch.equal(a, b), f"{key}.{n}"


def test_nested_modules_round_trip_in_place_beside_numbers(tmp_path):
    saved = _state(0)
    opt = torch.optim.AdamW(saved["teacher"]["a"].parameters(), lr=0.1)
    saved["teacher"]["a"](torch.randn(2, 3)).sum().backward()
    opt.step()
    meta = acp.save(tmp_path / "ck", {**saved, "optimizer": opt})
    assert "ema/m/0.weight" in meta.tensors and "teacher/b/c/2.bias" in meta.tensors
    assert "teacher/lst/0/0.weight" in meta.tensors and "optimizer/0.weight/exp_avg" in meta.tensors

    target = _state(100)
    target_opt = torch.optim.AdamW(target["teacher"]["a"].parameters(), lr=0.5)
    ema_module = target["ema"]["m"]
    out = acp.load(tmp_path / "ck", {**target, "optimizer": target_opt})
    assert out["ema"]["m"] is ema_module  # loaded in place, not replaced
    _assert_same_modules(target, saved)
    assert out["ema"]["decay"] == 0.999 and type(out["ema"]["updates"]) is int and out["ema"]["updates"] == 12
    assert out["teacher"]["lst"][1] == 2.5
    assert torch.equal(
        target_opt.state[target["teacher"]["a"][0].weight]["exp_avg"],
        opt.state[saved["teacher"]["a"][0].weight]["exp_avg"],
    )


def test_nested_modules_into_an_empty_dict_come_back_as_state_dicts(tmp_path):
    saved = _state(0)
    acp.save(tmp_path / "ck", saved)
    out = acp.load(tmp_path / "ck", {"ema": {}, "teacher": {}})
    assert out["ema"]["decay"] == 0.999
    for name, sd in (("m", out["ema"]["m"]),):
        assert sd.keys() == saved["ema"][name].state_dict().keys()
        assert all(torch.equal(sd[k], v) for k, v in saved["ema"][name].state_dict().items())
    c = out["teacher"]["b"]["c"]
    assert all(torch.equal(c[k], v) for k, v in saved["teacher"]["b"]["c"].state_dict().items())


def test_nested_module_names_are_injective(tmp_path):
    # each pair below would share one stored name without escaping
    saved = {
        "x": {
            "a/b": _net(1),
            "a": {"b": _net(2)},
            "p~sq": _net(3),
            "p/q": _net(4),
            "l.0": _net(5),
            "l": {"0": _net(6)},
            "~modules": _net(7),
            "t": _net(8),
            "t/0.weight": torch.full((4, 3), 9.0),
        }
    }
    meta = acp.save(tmp_path / "ck", saved)
    names = [n for n in meta.tensors if n.startswith("x/")]
    assert len(names) == len(set(names)) == 8 * 4 + 1
    target = {
        "x": {
            "a/b": _net(11),
            "a": {"b": _net(12)},
            "p~sq": _net(13),
            "p/q": _net(14),
            "l.0": _net(15),
            "l": {"0": _net(16)},
            "~modules": _net(17),
            "t": _net(18),
            "t/0.weight": torch.zeros(4, 3),
        }
    }
    out = acp.load(tmp_path / "ck", target)["x"]
    pairs = [
        (out["a/b"], saved["x"]["a/b"]),
        (out["a"]["b"], saved["x"]["a"]["b"]),
        (out["p~sq"], saved["x"]["p~sq"]),
        (out["p/q"], saved["x"]["p/q"]),
        (out["l.0"], saved["x"]["l.0"]),
        (out["l"]["0"], saved["x"]["l"]["0"]),
        (out["~modules"], saved["x"]["~modules"]),
        (out["t"], saved["x"]["t"]),
    ]
    for got, want in pairs:
        for k, v in want.state_dict().items():
            assert torch.equal(got.state_dict()[k], v), k
    assert torch.equal(out["t/0.weight"], torch.full((4, 3), 9.0))


def test_strict_load_checks_nested_modules_name_by_name(tmp_path):
    acp.save(tmp_path / "ck", {"ema": {"m": _net(0), "decay": 0.5}})
    wider = {"ema": {"m": torch.nn.Sequential(_net(1), torch.nn.Linear(2, 2))}}
    with pytest.raises(StateMismatchError) as err:  # stored 0.weight..., target 0.0.weight...
        acp.load(tmp_path / "ck", wider)
    assert "missing" in str(err.value) and "ema/m/0.0.weight" in str(err.value)
    assert "unexpected" in str(err.value) and "ema/m/2.bias" in str(err.value)
    smaller = {"ema": {"m": torch.nn.Sequential(torch.nn.Linear(3, 4))}}
    with pytest.raises(StateMismatchError, match="ema/m/2.weight"):
        acp.load(tmp_path / "ck", smaller)
    out = acp.load(tmp_path / "ck", smaller, strict=False)
    assert torch.equal(smaller["ema"]["m"][0].weight, _net(0)[0].weight) and out["ema"]["decay"] == 0.5


def test_meta_nested_module_materialises_from_the_checkpoint(tmp_path):
    saved = {"ema": {"m": _net(0)}}
    acp.save(tmp_path / "ck", saved)
    with torch.device("meta"):
        target = {"ema": {"m": _net(1)}}
    acp.load(tmp_path / "ck", target, device="cpu")
    for k, v in saved["ema"]["m"].state_dict().items():
        assert torch.equal(target["ema"]["m"].state_dict()[k], v), k


def test_release_checkpoint_with_a_dunder_module_key_loads_as_a_dict(tmp_path):
    from fixtures.make_format2_extra import extra_state

    path = tmp_path / "extra_dunder"
    shutil.copytree(os.path.join(FIXTURES, "extra_dunder"), path)
    want = extra_state()
    out = acp.load(path, {"extra_state": {}})["extra_state"]
    assert out["cls"] == {"__module__": "ema/m"} and out["step"] == 7 and out["ema"]["decay"] == 0.999
    assert torch.equal(out["ema"]["w"], want["ema"]["w"])
    # and a dict with that key written today still comes back as the user's dict
    acp.save(tmp_path / "new", {"extra_state": want})
    again = acp.load(tmp_path / "new", {"extra_state": {}})["extra_state"]
    assert again["cls"] == {"__module__": "ema/m"}


# ------------------------------------------------------------------------- resharding: 2 writers, 3 readers
def _fsdp2_nested(world: int, seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = _state(seed)
    for key, module in _modules(state).items():
        if key != "teacher.lst.0":  # one stays a plain replicated module
            for layer in (module[0], module[2], module):
                fully_shard(layer, mesh=mesh)
    torch.manual_seed(seed + 50)
    state["ema"]["dt"] = distribute_tensor(torch.randn(7, 3), mesh, [Shard(0 if world == 2 else 1)])
    return state


def _full(state: dict) -> dict:
    """Every full tensor as numpy (numpy pickles by value: torch tensors would cross as shared memory)."""
    out = {}
    for key, module in _modules(state).items():
        for n, v in module.state_dict().items():
            out[f"{key}.{n}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().numpy().copy()
    out["ema.dt"] = state["ema"]["dt"].full_tensor().numpy().copy()
    if "optimizer" in state:  # the optimizer over the nested teacher.a, by parameter FQN
        names = {id(p): n for n, p in state["teacher"]["a"].named_parameters()}
        for p, st in state["optimizer"].state.items():
            for k, v in st.items():
                if v.ndim:
                    out[f"optimizer.{names[id(p)]}.{k}"] = v.full_tensor().numpy().copy()
    return out


def _save_body(rank, world, root):
    state = _fsdp2_nested(world, 0)
    teacher = state["teacher"]["a"]
    state["optimizer"] = torch.optim.AdamW(teacher.parameters(), lr=0.1)
    teacher(torch.randn(2, 3)).sum().backward()
    state["optimizer"].step()
    acp.save(os.path.join(root, "ck"), state)
    return _full(state)


def _load_body(rank, world, root):
    state = _fsdp2_nested(world, 100)
    state["optimizer"] = torch.optim.AdamW(state["teacher"]["a"].parameters(), lr=0.5)
    out = acp.load(os.path.join(root, "ck"), state)
    assert out["ema"]["decay"] == 0.999 and out["teacher"]["lst"][1] == 2.5
    assert state["optimizer"].param_groups[0]["lr"] == 0.1
    return _full(state)


@pytest.mark.multiprocess
def test_fsdp2_modules_nested_in_dicts_reshard_two_to_three_with_their_optimizer(tmp_path):
    saved = run_distributed(_save_body, world=2, args=(str(tmp_path),))[0]
    loaded = run_distributed(_load_body, world=3, args=(str(tmp_path),))
    assert len(saved) == 5 * 4 + 1 + 4 * 2  # 5 modules, the DTensor, teacher.a's exp_avg and exp_avg_sq
    for rank_view in loaded:
        assert rank_view.keys() == saved.keys()
        for k, v in saved.items():
            assert np.array_equal(rank_view[k], v), k


def test_nested_modules_under_keys_unsafe_as_names_round_trip(tmp_path):
    saved = {"x": {"__hidden": _net(1), "a:b": _net(2), ".dot": [_net(3)]}}
    meta = acp.save(tmp_path / "ck", saved)
    assert all(check_name(n) for n in meta.tensors)
    target = {"x": {"__hidden": _net(11), "a:b": _net(12), ".dot": [_net(13)]}}
    out = acp.load(tmp_path / "ck", target)["x"]
    for got, want in (
        (out["__hidden"], saved["x"]["__hidden"]),
        (out["a:b"], saved["x"]["a:b"]),
        (out[".dot"][0], saved["x"][".dot"][0]),
    ):
        for k, v in want.state_dict().items():
            assert torch.equal(got.state_dict()[k], v), k


def test_megatron_framework_checks_nested_torch_modules_too(tmp_path):
    pytest.importorskip("megatron.core")
    acp.save(tmp_path / "ck", {"ema": {"m": _net(0)}})
    smaller = {"ema": {"m": torch.nn.Sequential(torch.nn.Linear(3, 4))}}
    with pytest.raises(StateMismatchError, match="ema/m/2.weight"):
        acp.load(tmp_path / "ck", smaller, framework="megatron")
    acp.load(tmp_path / "ck", smaller, framework="megatron", strict=False)
    assert torch.equal(smaller["ema"]["m"][0].weight, _net(0)[0].weight)


def test_module_beside_per_rank_values_names_the_fix(tmp_path):
    """A module in a namespace that also holds PerRank values is refused with an error naming the fix (its own
    namespace), not a suggestion to pickle it."""
    state = {"extra_state": {"rng": acp.PerRank(3), "ema": torch.nn.Linear(2, 2)}}
    with pytest.raises(acp.ArrayCheckpointError, match="namespace of its own") as info:
        acp.save(tmp_path / "ck", state)
    assert "allow_pickle" not in str(info.value)
